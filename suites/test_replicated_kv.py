"""Replicated key/value (``ring_attention(..., replicated_kv=True)``): the query sharded in
``layout`` as usual, key/value the whole sequence, equal on every rank (a cross-attention's text
tokens). Every query row attends to all ``seq_kv`` keys once; dK/dV on each rank are its rows'
contribution and their sum over the ranks is the gradient. Judged against the float64 oracle by
the numerics policy (suites/cases_replicated_kv.py): out, LSE and dQ by the query positions, dK,
dV and the sinks' gradient summed over the ranks.

Cases: W 2, 3, 4 (nightly: every enabled W >= 2), ``contiguous`` and ``head_tail``,
float64/float32/bfloat16, GQA, ``seq_kv`` 1, 5, 13 and 24 (never the query's length), sinks on and
off: a pairwise selection of their product in the quick tier (suites/coverage.py), the product
nightly; ``return_lse`` and backward turned per case (a case with sinks always runs backward);
value's own head dim once. A Hypothesis property draws W 2..4, the layout, the query's and
key/value's lengths, dtype, GQA and sinks.

Failures name the bug classes: the key/value duplicated W-fold (taken for sequence shards, the LSE
off by ``log W``), dK/dV reduced over the group on every rank (their sum over ranks W times the
gradient). Where the schedule is claimed, every rank's collectives must be
``collective_schedule(..., replicated_kv=True)``'s: duplicated copies that no output shows (no
LSE returned, no sinks: equal keys keep the softmax) show there, as the key/value exchanged.

Masked cases (``masks`` with ``mask_mod``): a key padding mask per batch row and query documents
each seeing their own keys, read at (the query's global position, the key's index
``0..seq_kv-1``), in both layouts, with and without sinks.

Capability ``replicated_kv`` (undeclared claims it); ``sinks``, ``lse``, ``backward``, ``gqa``,
``cross_attention``, ``value_head_dim`` and ``masks`` for the cases that use them.
"""

from __future__ import annotations

import pytest
from hypothesis import strategies as st

from suites.cases_replicated_kv import (
    EXCHANGED,
    ReplicatedKVCase,
    diagnose_replicated_kv,
    judge_replicated_kv,
    replicated_kv_case,
)
from suites.coverage import combos
from suites.inputs import SHORT, InputSpec
from suites.matrix import (
    LAYOUTS,
    draw_claimed,
    draw_inputs,
    draw_lse_grad,
    draw_world_size,
    drawn,
    seed_for,
    tier,
    world_sizes,
)

#: The cases' dtypes, key/value heads (of 4 query heads: MHA and GQA) and key/value lengths.
DTYPES = ("float64", "float32", "bfloat16")
HEADS_KV = (4, 2)
SEQ_KV = (1, 5, 13, 24)
#: Query rows per rank (two per chunk in head_tail): seq_q = 4 W, never one of SEQ_KV.
ROWS = 4


def _turned(row: tuple) -> tuple[bool, bool]:
    """(return_lse, backward) of a matrix row: turned by the row itself, so a row's case is the
    same in both tiers; a case with sinks runs backward (their gradient is judged)."""
    t = seed_for(f"lse{row!r}")
    sinks = row[-1]
    return t % 3 != 0, sinks or (t // 7) % 3 != 0


def _case(
    w: int,
    layout: str,
    dtype: str,
    heads_kv: int,
    seq_kv: int,
    sinks: bool,
    *,
    return_lse: bool = True,
    backward: bool = True,
    head_dim_v: int | None = None,
    mask: str | None = None,
) -> ReplicatedKVCase:
    spec = InputSpec(
        batch=2 if seq_kv % 2 else 1,
        heads=4,
        heads_kv=heads_kv,
        seq_q=ROWS * w,
        seq_kv=seq_kv,
        head_dim=16,
        head_dim_v=head_dim_v,
        dtype=dtype,
        # the loss uses the LSE too, on every other case that returns one and runs backward
        lse_grad=return_lse
        and backward
        and seed_for(f"lse-grad {w} {layout} {dtype} {heads_kv} {seq_kv} {sinks} {mask}") % 2 == 1,
    )
    return ReplicatedKVCase(
        spec,
        w,
        layout=layout,
        return_lse=return_lse,
        backward=backward,
        sinks=sinks,
        mask=mask,
    )


def _id(c: ReplicatedKVCase) -> str:
    s = c.inputs
    return "-".join(
        [
            f"W{c.world_size}",
            SHORT[s.dtype],
            c.layout,
            f"kv{s.seq_kv}",
            f"hkv{s.heads_kv}",
            *(() if s.head_dim_v is None else (f"dv{s.head_dim_v}",)),
            *(() if c.mask is None else (c.mask,)),
            *(("sinks",) if c.sinks else ()),
            *(() if c.return_lse else ("nolse",)),
            *(() if c.backward else ("nobw",)),
            *(("lse-grad",) if c.inputs.lse_grad else ()),
        ]
    )


def _cases(config) -> list:
    """``pytest.param`` per case, with its id and a seed from the id."""
    sizes = world_sizes(config, at_least=2, at_most=None if tier(config) == "nightly" else 4)
    cases = [
        _case(*row, return_lse=lse, backward=bw)
        for row in combos(config, sizes, LAYOUTS, DTYPES, HEADS_KV, SEQ_KV, (False, True))
        for lse, bw in [_turned(row)]
    ]
    if 2 in sizes:  # value's own head dim (multi-head latent attention), once
        cases.append(_case(2, "contiguous", "float32", 2, 7, False, head_dim_v=8))
    # masks on (the query's global position, the key's index): a key padding mask per batch row
    # and query documents each seeing their own keys, in both layouts
    masked = [
        (2, "head_tail", "float32", 2, 13, True, "key_padding"),
        (3, "contiguous", "float64", 4, 5, False, "key_padding"),
        (2, "contiguous", "bfloat16", 2, 24, False, "cross_documents"),
        (4, "head_tail", "float64", 4, 13, True, "cross_documents"),
    ]
    cases += [_case(*row[:-1], mask=row[-1]) for row in masked if row[0] in sizes]
    out = []
    for case in cases:
        cid = _id(case)
        out.append(pytest.param(case.with_(inputs=case.inputs.with_(seed=seed_for(cid))), id=cid))
    return out


def pytest_generate_tests(metafunc):
    if "case" in metafunc.fixturenames:
        metafunc.parametrize("case", _cases(metafunc.config))


def _prepare(ring, case: ReplicatedKVCase) -> ReplicatedKVCase:
    __tracebackhide__ = True
    ring.require(
        "replicated_kv",
        why=f"ring_attention(replicated_kv=True): the whole key/value ({case.inputs.seq_kv} "
        "tokens) on every rank",
    )
    if case.sinks:
        ring.require("sinks", why="per-head sink logits")
    if case.return_lse:
        ring.require("lse")
    if case.mask is not None:
        ring.require(
            "masks",
            "mask_mod",
            why=f"a {case.mask} mask on (query position, key index) over the replicated keys",
        )
    return ring.prepare(case)


def _run_and_judge(ring, case: ReplicatedKVCase) -> list:
    __tracebackhide__ = True
    return ring.judged(case, replicated_kv_case, judge_replicated_kv, diagnose_replicated_kv)


def test_replicated_kv_matches_reference(ring, case: ReplicatedKVCase) -> None:
    """out, LSE, dQ of every rank's own rows and dK, dV, dsinks summed over the ranks against the
    float64 oracle; then every rank's collectives against ``collective_schedule(...,
    replicated_kv=True)`` where the schedule is claimed."""
    case = _prepare(ring, case)
    schedule = None
    if ring.caps.claims("collective_schedule"):
        schedule = ring.protocol(
            "collective_schedule", why="a replicated key/value call's collectives are asserted"
        )
        case = case.with_(account=True)
    results = _run_and_judge(ring, case)
    if schedule is not None:
        spec = case.inputs
        value_dim = {} if spec.head_dim_v is None else {"head_dim_v": spec.head_dim_v}
        expected = schedule(
            case.world_size,
            None,  # nothing rotates
            batch=spec.batch,
            heads_kv=spec.heads_kv,
            seq_kv=spec.seq_kv,  # the whole key/value, every rank's
            head_dim=spec.head_dim,
            dtype=spec.torch_dtype,
            compiled=False,
            replicated_kv=True,
            **value_dim,
        )
        ring.check_collectives(
            case,
            expected,
            results,
            headline=f"{EXCHANGED}: collectives differ from collective_schedule(..., "
            "replicated_kv=True), which declares no exchange of it (each rank attends its rows "
            "to the key/value it holds)",
        )


@drawn
def test_any_replicated_kv_matches_reference(ring, pytestconfig, data) -> None:
    """Any W in 2..4, layout, query and key/value lengths (one key included), float64/float32,
    GQA, sinks where claimed."""
    caps = ring.caps
    w = draw_world_size(data, pytestconfig, at_least=2, at_most=4)
    layout = draw_claimed(data, caps, "layouts", LAYOUTS, "layout")
    chunks = w if layout == "contiguous" else 2 * w
    seq_q = chunks * data.draw(st.integers(1, 3), label="rows_per_chunk")
    seq_kv = data.draw(st.integers(1, 24), label="seq_kv")
    spec = draw_inputs(data, caps, seq_q).with_(seq_kv=seq_kv)
    sinks = caps.claims("sinks") and data.draw(st.booleans(), label="sinks")
    spec = spec.with_(lse_grad=draw_lse_grad(data, caps))
    spec = spec.with_(seed=seed_for(f"{spec!r} {layout} {w} {sinks}"))
    case = ReplicatedKVCase(spec, w, layout=layout, sinks=sinks)
    _run_and_judge(ring, _prepare(ring, case))
