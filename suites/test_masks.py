"""Masks under context parallelism: packed documents (causal and full, uneven, crossing shard
boundaries, one-token documents, padding), sliding windows narrower and wider than a shard, chunked
causal, prefix-LM, documents combined with a window, a prefix with a window, a head-dependent
mask_mod, a mask_mod that differs for every batch row and head (its cases carry two of each), and
attention sinks; every rotation, both built-in layouts and the layouts the implementation's
balancers build for the mask (``document_head_tail``, ``work_aware``: sharded and unsharded by the
runs it returns), W 1..4 (nightly 5..8), float64/float32/bfloat16, GQA, softmax scales <= 0, and
under ``torch.compile(fullgraph=True)`` (capability ``compile``; each after a call with other mask
data in the same compiled function). Every other case's loss uses the returned LSE too (capability
``lse_grad``): its gradient enters every masked block's backward and the sinks' gradient. Judged
against the float64 oracle with the same mask (reference.masks) by the numerics policy; rows that
see nothing must come back as nothing (out 0, LSE -inf). Failures name the mask bug classes the
output matches (suites/cases_masks.py ``diagnose_masked``): the mask dropped and plain causal
attention run in its place, stale documents, tail padding attended, odd lengths rounded down, a
mask_mod evaluated at batch or head 0, sinks applied on some ranks only, hidden rows merged with
the kernel's LSE.

The named masks run under Ulysses and the hybrid too (capability ``strategies``), on the 4-rank
meshes of the strategy suite. Beside the named zoo, a Hypothesis property draws masks (documents of
any lengths with padding anywhere, windows of any extents, chunked causal, prefix-LM, a window
differing per batch row and head, their ``and``/``or``) with any layout, balancer, rotation, world
size, dtype, GQA and sinks, and judges each the same way.

With ``collective_schedule`` claimed, windows, documents and chunks (both layouts, W 2..4) also
have every rank's collectives asserted against the schedule the implementation declares for the
call's mask and that rank: an exchange sized by the mask (a halo) that sends more than it declares
computes the right answer and shows nowhere else.

Capabilities: ``masks`` (the mask kinds of reference.masks the implementation handles), ``sinks``,
``layouts``, ``strategies`` and ``balancers`` (with ``balanced_layout``); undeclared claims them.
"""

from __future__ import annotations

import itertools
import json
from dataclasses import replace

import pytest
from hypothesis import strategies as st

from conformance.specs import MaskSpec
from harness.pytest_plugin import settings_of
from suites import matrix
from suites.cases_balance import BALANCER_LAYOUTS
from suites.cases_masks import (
    BATCH_DEPENDENT,
    MASK_NAMES,
    MaskCase,
    diagnose_masked,
    documents,
    judge_masked,
    mask_spec,
    masked_case,
)
from suites.coverage import combos
from suites.inputs import InputSpec
from suites.meshes import STRATEGY_MESHES

#: The mask kinds (reference.masks) each named mask uses.
KINDS = {
    "causal": {"causal"},
    "documents": {"document"},
    "documents_full": {"document"},
    "documents_with_gaps": {"document"},
    "one_token_documents": {"document"},
    "window_narrow": {"sliding_window"},
    "window_wide": {"sliding_window"},
    "chunked_causal": {"chunked_causal"},
    "prefix_lm": {"prefix_lm"},
    "documents_window": {"and", "document", "sliding_window"},
    "prefix_lm_window": {"and", "prefix_lm", "sliding_window"},
    "mask_mod": {"mask_mod"},
    "mask_mod_batch_head": {"mask_mod"},
}


#: The named masks' dtypes.
DTYPES = ("float64", "float32", "bfloat16")


def _turned(name: str, w: int, layout: str, dtype: str) -> tuple[str, int, bool]:
    """The rotation, key/value heads and sinks of a named mask's case: turned with its mask, W,
    layout and dtype, so each (mask, W, layout) meets every rotation over the dtypes, GQA on
    every other case and sinks on every fifth (5 is prime to 2 and 3: sinks meet every rotation
    and both head counts)."""
    m = MASK_NAMES.index(name) + w + (*matrix.LAYOUTS, *BALANCER_LAYOUTS).index(layout)
    m += DTYPES.index(dtype)
    return matrix.ROTATIONS[m % 3], (4, 2)[m % 2], m % 5 == 0


def _loss_and_memory(name: str, w: int, layout: str, dtype: str) -> dict[str, bool]:
    """The InputSpec fields a named mask's case turns by a hash of its (mask, W, layout, dtype),
    the same in both tiers: a loss that uses the LSE too on about half the cases, shards in a
    (batch, seq, heads, dim) model's memory (transposed views) on a third, a head dim of stride 2
    on a fifth."""
    t = matrix.seed_for(f"loss and memory {name} {w} {layout} {dtype}")
    return {"lse_grad": t % 2 == 1, "noncontiguous": t % 3 == 1, "strided_head_dim": t % 5 == 3}


def _named(name, w, layout, dtype, rotate, heads_kv, sinks) -> bool:
    # A balancer's layout on one rank is the whole sequence: W >= 2 only.
    return (w > 1 or layout in matrix.LAYOUTS) and (rotate, heads_kv, sinks) == _turned(
        name, w, layout, dtype
    )


def _cases(config) -> list:
    nightly = matrix.tier(config) == "nightly"
    sizes = matrix.world_sizes(config) if nightly else matrix.world_sizes(config, at_most=4)
    out = []
    # Nightly: every named mask at every W, layout and dtype (rotation, GQA and sinks turned with
    # them); quick: a selection of those holding every value and pair of values of the seven
    # axes that the nightly cases hold (suites.coverage).
    for name, w, layout, dtype, rotate, heads_kv, sinks in combos(
        config,
        MASK_NAMES,
        sizes,
        (*matrix.LAYOUTS, *BALANCER_LAYOUTS),
        DTYPES,
        matrix.ROTATIONS,
        (4, 2),
        (False, True),
        where=_named,
    ):
        seq = 24 * w
        spec = InputSpec(
            batch=_batch(name),
            heads=4,
            heads_kv=heads_kv,
            seq_q=seq,
            seq_kv=seq,
            head_dim=16,
            dtype=dtype,
            **_loss_and_memory(name, w, layout, dtype),
        )
        out.append(MaskCase(spec, w, layout=layout, rotate_method=rotate, mask=name, sinks=sinks))
    out += (
        _strategy_cases(config)
        + _scale_cases(config)
        + _compile_cases(config)
        + _refill_cases(config)
        + _value_head_dim_cases(config)
    )
    return matrix.params(
        out,
        id_extra=lambda c: (
            *((c.strategy, f"{c.mesh_shape[0]}x{c.mesh_shape[1]}") if c.mesh_shape else ()),
            c.mask,
            *(("sinks",) if c.sinks else ()),
            *(("lse-grad",) if c.inputs.lse_grad else ()),
            *(("bshd-views",) if c.inputs.noncontiguous else ()),
            *(("strided-head-dim",) if c.inputs.strided_head_dim else ()),
            *(
                (f"d{c.inputs.head_dim}-dv{c.inputs.head_dim_v}",)
                if c.inputs.head_dim_v is not None
                else ()
            ),
            *((f"scale{c.inputs.scale:g}",) if c.inputs.scale is not None else ()),
            *(("refilled",) if c.refill else ()),
        ),
    )


def _refill_cases(config) -> list[MaskCase]:
    """Documents whose ids live in an int32 buffer refilled in place between two calls on the
    same mask object (cases_masks.MaskCase.refill): the second call must run the new documents,
    whatever the implementation keeps between calls (converted ids, plans keyed by the ids'
    description)."""
    sizes = matrix.world_sizes(config, at_most=2)
    out = []
    for i, (w, name) in enumerate(itertools.product(sizes, ("documents", "documents_with_gaps"))):
        spec = InputSpec.per_rank(w, rows=24, batch=1, heads=2, heads_kv=2, dtype="float64")
        out.append(
            MaskCase(
                spec,
                w,
                layout=matrix.LAYOUTS[i % 2],
                rotate_method=matrix.ROTATIONS[i % 3],
                mask=name,
                refill=True,
            )
        )
    return out


def _value_head_dim_cases(config) -> list[MaskCase]:
    """Masks with value's own head dim (capability value_head_dim; multi-head latent attention):
    documents on the ring with sinks, a window the halo exchange serves (contiguous), and under
    Ulysses and the hybrid on 4 ranks; value wider and narrower than query and key."""
    out = []
    for i, w in enumerate(matrix.world_sizes(config, at_least=2, at_most=4)):
        for j, (name, layout) in enumerate(
            (("documents", "head_tail"), ("window_narrow", "contiguous"))
        ):
            d, dv = ((16, 24), (24, 8))[(i + j) % 2]
            spec = InputSpec.per_rank(
                w,
                rows=24,
                batch=1,
                heads_kv=2,
                head_dim=d,
                head_dim_v=dv,
                dtype=("float64", "float32")[(i + j) % 2],
            )
            out.append(
                MaskCase(
                    spec,
                    w,
                    layout=layout,
                    rotate_method=matrix.ROTATIONS[(i + j) % 3],
                    mask=name,
                    sinks=j == 0,
                )
            )
    if 4 in settings_of(config).mesh_world_sizes:
        for i, (strategy, mesh) in enumerate(STRATEGY_MESHES):
            spec = InputSpec(
                batch=1,
                heads=4,
                heads_kv=2,
                seq_q=96,
                seq_kv=96,
                head_dim=16,
                head_dim_v=(24, 8)[i % 2],
                dtype="float64",
            )
            out.append(
                MaskCase(
                    spec,
                    4,
                    layout=matrix.LAYOUTS[i % 2],
                    rotate_method=matrix.ROTATIONS[i % 3],
                    mask="documents_window",
                    sinks=i % 2 == 1,
                    strategy=strategy,
                    mesh_shape=mesh,
                )
            )
    return out


def _batch(name: str) -> int:
    """Batch rows of a named mask's cases: 2 where the mask differs between them."""
    return 2 if name in BATCH_DEPENDENT else 1


def _scale_cases(config) -> list[MaskCase]:
    """Softmax scales <= 0 under masks whose visible region has causal pieces (a negative
    temperature is legitimate): a kernel whose causal path returns NaN there (the CPU flash
    kernel) must not get a mask's causal tiles (suites/test_edge_values.py has the is_causal
    case)."""
    sizes = matrix.world_sizes(config, at_least=2, at_most=3)
    out = []
    names = ("causal", "documents", "window_narrow", "documents_window")
    for i, (w, scale, name) in enumerate(itertools.product(sizes, (-0.3, 0.0), names)):
        spec = InputSpec.per_rank(
            w, rows=24, batch=1, heads=2, heads_kv=2, dtype="float32", scale=scale
        )
        out.append(
            MaskCase(
                spec,
                w,
                layout=matrix.LAYOUTS[(i + i // 4) % 2],
                rotate_method=matrix.ROTATIONS[i % 3],
                mask=name,
                sinks=i % 3 == 0,
            )
        )
    return out


def _compile_cases(config) -> list[MaskCase]:
    """The named masks under ``torch.compile(fullgraph=True)`` (capability ``compile``), each
    call after one with the same kind of mask and other data in the same compiled function
    (cases_masks.other_mask_data): a stale plan shows. Quick: ``aot_eager`` at W=2, the layout,
    rotation, dtype and sinks cycled; nightly: ``inductor`` too, at W 2..4. ``mask_mod`` included:
    its function closes over a tensor, which the warm-up call changes."""
    nightly = matrix.tier(config) == "nightly"
    sizes = matrix.world_sizes(config, at_least=2, at_most=4 if nightly else 2)
    backends = ("aot_eager", "inductor") if nightly else ("aot_eager",)
    names = list(MASK_NAMES)
    out = []
    for i, (name, w, backend) in enumerate(itertools.product(names, sizes, backends)):
        j, b = divmod(i, len(backends))  # cycled per (mask, W), turned per backend
        spec = InputSpec.per_rank(
            w,
            rows=24,
            batch=_batch(name),
            heads_kv=2 if (j // 2 + b) % 2 else 4,
            dtype=("float32", "float64")[j % 2],
            lse_grad=(j + b) % 2 == 1,
        )
        out.append(
            MaskCase(
                spec,
                w,
                layout=matrix.LAYOUTS[(j + b) % 2],
                rotate_method=matrix.ROTATIONS[(j + b) % 3],
                mask=name,
                sinks=(j + b) % 3 == 0,
                compile=backend,
            )
        )
    return out


def _strategy_cases(config) -> list[MaskCase]:
    """Every named mask under Ulysses and the hybrid on 4 ranks, the layout and dtype cycled
    (nightly: all of them): each rank attends its heads' whole sequence (Ulysses), or a ring of
    its heads across rows (the hybrid), under the mask on global positions."""
    if 4 not in settings_of(config).mesh_world_sizes:
        return []
    nightly = matrix.tier(config) == "nightly"
    dtypes = ("float64", "float32", "bfloat16")
    out = []
    for i, (name, (strategy, mesh)) in enumerate(itertools.product(MASK_NAMES, STRATEGY_MESHES)):
        # i alternates the strategy: the layout and GQA turn every other pair,
        # so each strategy gets both.
        layouts = matrix.LAYOUTS if nightly else (matrix.LAYOUTS[(i // 2 + i) % 2],)
        for j, layout in enumerate(layouts):
            dtype = dtypes[(i + j) % 3]
            spec = InputSpec(
                batch=_batch(name),
                heads=4,
                heads_kv=2 if (i // 2 + j) % 2 else 4,
                seq_q=96,
                seq_kv=96,
                head_dim=16,
                dtype=dtype,
                lse_grad=(i + j) % 2 == 0,
            )
            out.append(
                MaskCase(
                    spec,
                    4,
                    layout=layout,
                    rotate_method=matrix.ROTATIONS[(i // 2 + j) % 3],
                    mask=name,
                    sinks=(i + j) % 3 == 0,
                    strategy=strategy,
                    mesh_shape=mesh,
                )
            )
    # Under torch.compile(fullgraph=True) (capability compile): quick, one mask per strategy;
    # nightly, every named mask, the strategy alternating.
    names = (
        list(MASK_NAMES)
        if nightly
        else ["documents_window", "prefix_lm", "mask_mod", "mask_mod_batch_head"]
    )
    for i, name in enumerate(names):
        strategy, mesh = STRATEGY_MESHES[i % 2]
        spec = InputSpec(
            batch=_batch(name),
            heads=4,
            heads_kv=2 if i % 3 else 4,
            seq_q=96,
            seq_kv=96,
            head_dim=16,
            dtype=dtypes[i % 2],
        )
        out.append(
            MaskCase(
                spec,
                4,
                layout=matrix.LAYOUTS[(i // 2) % 2],
                rotate_method=matrix.ROTATIONS[i % 3],
                mask=name,
                sinks=i % 2 == 0,
                strategy=strategy,
                mesh_shape=mesh,
                compile="aot_eager",
            )
        )
    return out


#: The masks whose collectives the accounting cases assert: windows narrower and wider than a
#: shard (an exchange may send a window's reach only: ring_impl's halo exchange), documents, a
#: window under a prefix reaching further than the window, chunked causal.
ACCOUNTED_MASKS = (
    "window_narrow",
    "window_wide",
    "documents",
    "prefix_lm_window",
    "chunked_causal",
)


def _accounted_cases(config) -> list:
    """Quick: each of :data:`ACCOUNTED_MASKS` in both built-in layouts, the world size (2..4)
    and the rotation turned with them; nightly: at every world size >= 2."""
    nightly = matrix.tier(config) == "nightly"
    sizes = matrix.world_sizes(config, at_least=2, **({} if nightly else {"at_most": 4}))
    if not sizes:
        return []
    pairs = list(itertools.product(ACCOUNTED_MASKS, matrix.LAYOUTS))
    rows = (
        [(name, layout, w) for (name, layout), w in itertools.product(pairs, sizes)]
        if nightly
        else [(name, layout, sizes[i % len(sizes)]) for i, (name, layout) in enumerate(pairs)]
    )
    out = []
    for i, (name, layout, w) in enumerate(rows):
        seq = 24 * w
        spec = InputSpec(
            batch=1, heads=4, heads_kv=(4, 2)[i % 2], seq_q=seq, seq_kv=seq, head_dim=16
        )
        rotate = matrix.ROTATIONS[i % 3]
        out.append(MaskCase(spec, w, layout=layout, rotate_method=rotate, mask=name, account=True))
    return matrix.params(out, id_extra=lambda c: (c.mask,))


pytest_generate_tests = matrix.generate(case=_cases, accounted_case=_accounted_cases)


def _kinds(data: dict) -> set[str]:
    """The mask kinds (reference.masks) a mask's plain data uses."""
    return {data["kind"], *(k for m in data.get("masks", ()) for k in _kinds(m))}


def _prepare(ring, case: MaskCase) -> MaskCase:
    __tracebackhide__ = True
    op = ring.record_case(case)
    for kind in sorted(KINDS[case.mask] if not case.mask_json else _kinds(case.mask_data())):
        ring.require("masks", kind, why=f"mask {case.mask!r}")
    if case.sinks:
        ring.require("sinks")
    ring.require("lse", why="the masked rows' LSE is part of the contract")
    ring.require_exchange(case)
    ring.require("backward")
    ring.require_inputs(case, op)
    return replace(ring.loss_of(case), impl=ring.impl.spec, op=op)


def test_masked_attention_matches_reference(ring, case: MaskCase) -> None:
    """out, LSE, dQ, dK, dV (and dSinks) under the mask against the float64 oracle."""
    case = _prepare(ring, case)
    assert mask_spec(case.mask, case.inputs.seq_q)["kind"] in KINDS[case.mask]
    _run_and_judge(ring, case)


def test_masked_collectives_match_declared_schedule(ring, accounted_case: MaskCase) -> None:
    """Every rank's collectives of a masked call, forward and backward, against what the
    implementation's ``collective_schedule`` declares for that rank, asked with the call's mask
    (plain data), ``is_causal``, ``layout``, ``rank``, ``heads`` and ``seq_q``: an exchange that
    depends on the mask (a halo of a window's reach, a sparse gather) sends what it declares
    and no more, which no output shows. The result is judged first: a wrong answer is reported
    as such, not as traffic."""
    case = _prepare(ring, accounted_case)
    schedule = ring.protocol(
        "collective_schedule", why="each rank's collectives of a masked call are asserted by it"
    )
    spec, w = case.inputs, case.world_size
    mask = MaskSpec(case.mask_data())
    where = dict(mask=mask, is_causal=False, layout=case.layout, heads=spec.heads)
    try:
        expected = [
            case.declared_schedule(schedule, rank=r, seq_q=spec.seq_q // w, **where)
            for r in range(w)
        ]
    except TypeError as exc:
        pytest.fail(
            f"{ring.impl.name}'s collective_schedule does not take a masked call's keywords "
            f"(mask=, is_causal=, layout=, rank=, heads=, seq_q=; conformance/implementation.py): "
            f"{exc}",
            pytrace=False,
        )
    results = ring.judged(case, masked_case, judge_masked, diagnose_masked)
    headline = "the masked call's collectives are not the schedule declared for its mask"
    ring.check_collectives(case, expected, results, headline=headline)


def _run_and_judge(ring, case: MaskCase) -> None:
    __tracebackhide__ = True
    ring.judged(case, masked_case, judge_masked, diagnose_masked)


# ---------------------------------------------------------------------- drawn masks

#: The leaf kinds the property draws (``and``/``or`` join two of them); ``mask_mod``: a window
#: that differs for every batch row and head (cases_masks.batch_head_window).
_LEAVES = ("causal", "document", "sliding_window", "chunked_causal", "prefix_lm", "mask_mod")


@st.composite
def _leaf(draw, seq: int, kinds: list[str]) -> dict:
    kind = draw(st.sampled_from(kinds))
    if kind == "document":  # lengths up to the whole sequence; negative: a run of padding (-1)
        lengths = draw(
            st.lists(st.one_of(st.integers(1, seq), st.integers(-3, -1)), min_size=1, max_size=8)
        )
        return {
            "kind": "document",
            "doc_ids": documents(seq, lengths),
            "causal": draw(st.booleans()),
        }
    if kind == "sliding_window":  # from 0 keys back to past the whole sequence, either side
        return {
            "kind": "sliding_window",
            "left": draw(st.integers(0, seq + 1)),
            "right": draw(st.integers(0, seq + 1)),
        }
    if kind == "chunked_causal":
        return {"kind": "chunked_causal", "chunk": draw(st.integers(1, seq + 1))}
    if kind == "prefix_lm":
        return {"kind": "prefix_lm", "prefix": draw(st.integers(0, seq))}
    if (
        kind == "mask_mod"
    ):  # plain data for the JSON of the case; MaskCase.mask_data makes the function
        return {"kind": "batch_head_window", "step": draw(st.integers(1, max(1, seq // 4)))}
    return {"kind": "causal"}


def _tokens_per_rank(layout: str) -> st.SearchStrategy[int]:
    """Local lengths a layout takes: head_tail splits a shard in two; the work-aware balancer
    deals 8 equal chunks per rank."""
    if layout == "head_tail":
        return st.integers(1, 6).map(lambda n: 2 * n)
    if layout == "work_aware":
        return st.sampled_from((8, 16))
    return st.integers(1, 12)


@matrix.drawn
def test_any_mask_matches_reference(ring, pytestconfig, data) -> None:
    """A drawn mask, layout (the balancers' included), rotation, world size, dtype, GQA and
    sinks: out, LSE, dQ, dK, dV (and dSinks) against the float64 oracle, as the named cases."""
    caps = ring.caps
    kinds = [k for k in _LEAVES if caps.claims("masks", k)]
    if not kinds:  # N/A, with the declaration's reason
        ring.require(
            "masks",
            _LEAVES[0],
            why=f"it claims none of the mask kinds the property draws ({list(_LEAVES)})",
        )
    sizes = matrix.world_sizes(pytestconfig, at_least=2) or [1]
    w = data.draw(st.sampled_from(sizes), label="world_size")
    layouts = [x for x in matrix.LAYOUTS if caps.claims("layouts", x)]
    if w > 1:
        layouts += [b for b in BALANCER_LAYOUTS if caps.claims("balancers", b)]
    layout = data.draw(st.sampled_from(layouts or list(matrix.LAYOUTS)), label="layout")
    seq = data.draw(_tokens_per_rank(layout), label="tokens_per_rank") * w
    mask = data.draw(_leaf(seq, kinds), label="mask")
    joins = [j for j in ("and", "or") if caps.claims("masks", j)]
    if joins and data.draw(st.booleans(), label="joined"):
        # Per-document head-tail balances one set of documents: two different ones have no layout.
        second = [
            k
            for k in kinds
            if not (layout == "document_head_tail" and k == "document" == mask["kind"])
        ]
        mask = {
            "kind": data.draw(st.sampled_from(joins), label="join"),
            "masks": [mask, data.draw(_leaf(seq, second))],
        }
    per_row = "batch_head_window" in json.dumps(
        mask
    )  # differs between batch rows and heads: 2 of each at least
    pairs = 2 if per_row else None  # 2 batch rows and 2 key/value heads, or drawn
    spec = matrix.draw_inputs(data, caps, seq, heads_kv=pairs, batch=pairs)
    spec = spec.with_(lse_grad=matrix.draw_lse_grad(data, caps))
    rotate = data.draw(
        st.sampled_from(
            [m for m in matrix.ROTATIONS if caps.claims("rotate_methods", m)]
            or list(matrix.ROTATIONS)
        ),
        label="rotate_method",
    )
    sinks = caps.claims("sinks") and data.draw(st.booleans(), label="sinks")
    mask_json = json.dumps(mask, sort_keys=True)
    case = MaskCase(
        spec.with_(seed=matrix.seed_for(repr(spec) + mask_json)),
        w,
        layout=layout,
        rotate_method=rotate,
        mask="drawn",
        sinks=sinks,
        mask_json=mask_json,
    )
    _run_and_judge(ring, _prepare(ring, case))
