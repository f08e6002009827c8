"""The per-head maximum attention logit (``ring_attention(..., return_max_logit=True)``), what
QK-clip optimisers (MuonClip) read: against the float64 oracle on the global score matrix
(reference.attention.max_logit), by the numerics policy (reference.budget.max_logit_scale).

Non-causal and causal, every rotation, both layouts (the causal head_tail layout skips and trims
different blocks on every rank), float64/float32/bfloat16, GQA, ``return_lse`` on and off, W 1..4
(nightly up to 8); the named masks of the mask suite (documents, windows, chunked causal,
prefix-LM, a head-dependent mask_mod, rows that see nothing, a window the halo exchange would
serve), with sinks on some (no part of the max logit); a NaN in a key and in a query (the heads it
reaches are NaN, on every rank); softmax scales <= 0. Every rank must return the same (heads,)
tensor in the compute dtype, without a gradient; the output's backward still runs. With
``collective_schedule`` claimed, the collectives of a call are asserted against
``collective_schedule(..., return_max_logit=True)``. A Hypothesis property draws the world
size, layout, rotation, dtype, shape (GQA, head dim, length), causality or a named mask (with
sinks), the softmax scale and ``return_lse``.

Capability ``max_logit`` (undeclared: claimed); the mask cases also need ``masks`` (their kinds)
and ``sinks``.
"""

from __future__ import annotations

import itertools

from hypothesis import strategies as st

from suites import matrix
from suites.cases_max_logit import MaxLogitCase, diagnose_max_logit, judge_max_logit, max_logit_case
from suites.inputs import InputSpec

#: Named masks of the mask suite run here (suites.cases_masks.mask_spec) and the mask kinds each
#: uses: documents with padding between them (rows that see nothing), a narrow window (the halo
#: exchange's kind), a prefix with a window, per-head windows, chunked causal.
KINDS = {
    "documents_with_gaps": {"document"},
    "window_narrow": {"sliding_window"},
    "prefix_lm_window": {"and", "prefix_lm", "sliding_window"},
    "mask_mod": {"mask_mod"},
    "chunked_causal": {"chunked_causal"},
}
MASKS = tuple(KINDS)


def _cases(config) -> list[MaxLogitCase]:
    nightly = matrix.tier(config) == "nightly"
    dtypes = matrix.DTYPES[:3]
    out = []
    for i, (w, causal, layout) in enumerate(
        itertools.product(matrix.world_sizes(config), (False, True), matrix.LAYOUTS)
    ):
        for j, dtype in enumerate(dtypes if nightly else (dtypes[i % 3],)):
            heads_kv = 2 if (i + j) % 2 else 4
            spec = InputSpec.per_rank(w, heads_kv=heads_kv, dtype=dtype)
            out.append(
                MaxLogitCase(
                    spec,
                    w,
                    is_causal=causal,
                    layout=layout,
                    rotate_method=matrix.ROTATIONS[(i + j) % 3],
                    return_lse=(i + j) % 2 == 0,
                )
            )
    for i, (name, w) in enumerate(
        itertools.product(
            MASKS, matrix.world_sizes(config, at_least=2, at_most=None if nightly else 3)
        )
    ):
        spec = InputSpec.per_rank(
            w, rows=24, batch=1, heads_kv=2 if i % 2 else 4, dtype=dtypes[i % 3]
        )
        out.append(
            MaxLogitCase(
                spec,
                w,
                layout=matrix.LAYOUTS[i % 2] if name != "window_narrow" else "contiguous",
                rotate_method=matrix.ROTATIONS[i % 3],
                mask=name,
                sinks=i % 3 == 0,
            )
        )
    for i, (w, where) in enumerate(
        itertools.product(matrix.world_sizes(config, at_least=2, at_most=3), ("key", "query"))
    ):
        spec = InputSpec.per_rank(w, heads_kv=2, dtype="float32", nan_in=where)
        out.append(
            MaxLogitCase(
                spec,
                w,
                is_causal=where == "key",
                layout=matrix.LAYOUTS[i % 2],
                rotate_method=matrix.ROTATIONS[i % 3],
            )
        )
    # softmax scales <= 0 (a negative temperature is legitimate): the largest logit is then
    # the scale times the smallest score
    for i, (w, scale) in enumerate(
        itertools.product(matrix.world_sizes(config, at_least=2, at_most=3), (-0.3, 0.0))
    ):
        spec = InputSpec.per_rank(w, batch=1, heads_kv=2, scale=scale)
        out.append(
            MaxLogitCase(
                spec,
                w,
                is_causal=True,
                layout=matrix.LAYOUTS[i % 2],
                rotate_method=matrix.ROTATIONS[i % 3],
            )
        )
    return out


def _accounted(config) -> list[MaxLogitCase]:
    out = []
    for i, (w, rotate) in enumerate(
        itertools.product(matrix.world_sizes(config, at_least=2, at_most=4), matrix.ROTATIONS)
    ):
        spec = InputSpec.per_rank(w, heads_kv=2, dtype=("float32", "float64")[i % 2])
        out.append(
            MaxLogitCase(
                spec,
                w,
                is_causal=True,
                layout=matrix.LAYOUTS[i % 2],
                rotate_method=rotate,
                account=True,
            )
        )
    return out


def _id(c: MaxLogitCase) -> tuple[str, ...]:
    return (
        *((c.mask,) if c.mask else ()),
        *(("sinks",) if c.sinks else ()),
        *((f"nan_{c.inputs.nan_in}",) if c.inputs.nan_in else ()),
        *((f"scale{c.inputs.scale:g}",) if c.inputs.scale is not None else ()),
        *(("lse",) if c.return_lse else ()),
        f"hkv{c.inputs.heads_kv}",
    )


def pytest_generate_tests(metafunc):
    if "case" in metafunc.fixturenames:
        cases = (
            _accounted(metafunc.config)
            if "accounted" in metafunc.function.__name__
            else _cases(metafunc.config)
        )
        metafunc.parametrize("case", matrix.params(cases, id_extra=_id))


def _prepare(ring, case: MaxLogitCase) -> MaxLogitCase:
    __tracebackhide__ = True
    ring.require("max_logit", why="ring_attention(return_max_logit=True)")
    if case.mask is not None:
        for kind in sorted(KINDS[case.mask]):
            ring.require("masks", kind, why=f"mask {case.mask!r}")
    if case.sinks:
        ring.require("sinks")
    return ring.prepare(case)


def _run_and_judge(ring, case: MaxLogitCase) -> list[dict]:
    __tracebackhide__ = True
    return ring.judged(case, max_logit_case, judge_max_logit, diagnose_max_logit, baseline=False)


def test_max_logit_matches_reference(ring, case: MaxLogitCase) -> None:
    """The group's per-head max logit against the float64 oracle, the same on every rank."""
    _run_and_judge(ring, _prepare(ring, case))


@matrix.drawn
def test_any_max_logit_matches_reference(ring, pytestconfig, data) -> None:
    """A drawn world size, layout, rotation, dtype, shape (batch, heads, GQA, head dim, tokens
    per rank), causality or a named mask (with sinks), softmax scale (<= 0 included) and
    return_lse: the group's per-head max logit against the float64 oracle, as the named cases."""
    caps = ring.caps
    w = matrix.draw_world_size(data, pytestconfig)
    layout = matrix.draw_claimed(data, caps, "layouts", matrix.LAYOUTS, "layout")
    rotate = matrix.draw_claimed(data, caps, "rotate_methods", matrix.ROTATIONS, "rotate_method")
    # The named masks need room for their documents and windows (24 tokens, as their cases);
    # the narrow window is the halo exchange's, which runs contiguous.
    masks = [
        m
        for m in MASKS
        if all(caps.claims("masks", k) for k in KINDS[m])
        and (layout == "contiguous" or m != "window_narrow")
    ]
    mask = data.draw(st.sampled_from([None, *masks]), label="mask")
    step = 2 if layout == "head_tail" else 1
    least = 1 if mask is None else -(-24 // (w * step))
    seq = data.draw(st.integers(least, least + 6), label="tokens_per_rank") * step * w
    causal = mask is None and data.draw(st.booleans(), label="is_causal")
    sinks = mask is not None and caps.claims("sinks") and data.draw(st.booleans(), label="sinks")
    spec = matrix.draw_inputs(
        data, caps, seq, dtypes=matrix.DTYPES[:3], most_kv=3, head_dims=(8, 16, 40)
    )
    spec = spec.with_(scale=data.draw(st.sampled_from((None, 0.5, -0.3, 0.0)), label="scale"))
    lse = caps.claims("lse") and data.draw(st.booleans(), label="return_lse")
    case = MaxLogitCase(
        spec.with_(seed=matrix.seed_for(f"{spec!r} {mask}")),
        w,
        is_causal=causal,
        layout=layout,
        rotate_method=rotate,
        return_lse=lse,
        mask=mask,
        sinks=sinks,
    )
    _run_and_judge(ring, _prepare(ring, case))


def test_max_logit_collectives_accounted(ring, case: MaxLogitCase) -> None:
    """A call with return_max_logit=True issues exactly the collectives of
    collective_schedule(..., return_max_logit=True)."""
    case = _prepare(ring, case)
    schedule = ring.protocol(
        "collective_schedule", why="the max logit's collectives are asserted against it"
    )
    spec = case.inputs
    expected = case.declared_schedule(
        schedule, heads=spec.heads, seq_q=spec.seq_q // case.world_size, return_max_logit=True
    )
    results = _run_and_judge(ring, case)
    ring.check_collectives(case, expected, results)
