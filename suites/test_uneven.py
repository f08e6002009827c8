"""Uneven shards (``ring_attention(..., shard_lengths=[n_0, ..., n_{W-1}])``): rank ``r`` holds
``n_r`` tokens (query, key and value alike) of a sequence of ``S = sum(shard_lengths)`` that no
layout need divide. Judged against the float64 oracle on the global sequence by the numerics
policy (suites/cases_uneven.py), the shards cut by the suite (reference.layout.split_positions).

Splits: a long rank 0 and short others, a rank with one token, a rank with none, the layout's
own split of ``7W - 1`` tokens (``head_tail``: its 2W chunks cut as ``torch.tensor_split``);
``contiguous`` and ``head_tail``; every rotation; float64/float32/bfloat16; GQA; no mask,
``is_causal``, a window, documents, a mask_mod; ``return_lse`` on and off; backward on and off;
W 2, 3, 4 (nightly: every enabled W >= 2, the product of world sizes, splits, masks and dtypes,
rotation, GQA and return_lse turned per case). A Hypothesis property draws the split (zeros
included) at W 2..4.

Failures name the bug classes: padding keys attended, global positions from an even split,
padding rows not trimmed.

Capability ``uneven_shards`` (undeclared claims it); ``masks`` (the mask's kinds), ``lse`` and
``backward`` for the cases that use them.
"""

from __future__ import annotations

import itertools

from hypothesis import strategies as st

from reference.layout import split_lengths
from suites.cases_uneven import (
    MASK_KINDS,
    MASKS,
    SPLITS,
    UnevenCase,
    diagnose_uneven,
    judge_uneven,
    split_for,
    uneven_case,
)
from suites.inputs import InputSpec
from suites.matrix import (
    DTYPES,
    LAYOUTS,
    ROTATIONS,
    draw_claimed,
    draw_inputs,
    draw_lse_grad,
    draw_world_size,
    drawn,
    params,
    seed_for,
    tier,
    world_sizes,
)

#: (split, layout) pairs: head_tail has its own split only.
SPLIT_LAYOUTS = (*((s, "contiguous") for s in SPLITS), ("layout", "head_tail"))


def _case(w, split, layout, mask, dtype, i, *, lse=True, backward=True) -> UnevenCase:
    lengths = split_for(split, w, layout)
    seq = sum(lengths)
    spec = InputSpec(
        batch=2 if i % 3 == 0 else 1,
        heads=4,
        heads_kv=2 if i % 2 else 4,
        seq_q=seq,
        seq_kv=seq,
        head_dim=16,
        dtype=dtype,
        lse_grad=lse and backward and i % 4 in (0, 1),  # the loss uses the LSE too
    )
    return UnevenCase(
        spec,
        w,
        is_causal=mask == "causal",
        layout=layout,
        rotate_method=ROTATIONS[i % 3],
        return_lse=lse,
        backward=backward,
        lengths=lengths,
        split=split,
        mask=mask,
    )


def _cases(config) -> list[UnevenCase]:
    dtypes = DTYPES[:3]
    if tier(config) == "nightly":
        return [
            _case(w, split, layout, mask, dtype, i, lse=i % 4 != 3)
            for i, (w, (split, layout), mask, dtype) in enumerate(
                itertools.product(world_sizes(config, at_least=2), SPLIT_LAYOUTS, MASKS, dtypes)
            )
        ]
    # Quick: every world size, split, layout, mask, rotation, dtype, GQA and return_lse value
    # and backward off, not their product: each (W, split) pair once, the rest turned per case.
    out = []
    sizes = world_sizes(config, at_least=2, at_most=4)
    for i, (w, (split, layout)) in enumerate(itertools.product(sizes, SPLIT_LAYOUTS)):
        mask = MASKS[(i + i // len(SPLIT_LAYOUTS)) % len(MASKS)]  # each split under 3 masks
        dtype = dtypes[(i + i // 3) % 3]  # rotation i % 3: every pair of the two turns apart
        out.append(_case(w, split, layout, mask, dtype, i, lse=i % 4 != 2, backward=i % 7 != 5))
    return out


def _id(c: UnevenCase) -> tuple[str, ...]:
    return (
        c.split,
        "-".join(map(str, c.lengths)),
        *((c.mask,) if c.mask not in ("", "causal") else ()),
        f"hkv{c.inputs.heads_kv}",
        *(() if c.return_lse else ("nolse",)),
        *(() if c.backward else ("nobw",)),
        *(("lse-grad",) if c.inputs.lse_grad else ()),
    )


def pytest_generate_tests(metafunc):
    if "case" in metafunc.fixturenames:
        metafunc.parametrize("case", params(_cases(metafunc.config), id_extra=_id))


def _prepare(ring, case: UnevenCase) -> UnevenCase:
    __tracebackhide__ = True
    ring.require("uneven_shards", why=f"ring_attention(shard_lengths={list(case.lengths)})")
    for kind in MASK_KINDS.get(case.mask, ()):
        ring.require("masks", kind, why=f"mask {case.mask!r}")
    if case.return_lse:
        ring.require("lse")
    return ring.prepare(case)


def _run_and_judge(ring, case: UnevenCase) -> None:
    __tracebackhide__ = True
    ring.judged(case, uneven_case, judge_uneven, diagnose_uneven)


def test_uneven_shards_match_reference(ring, case: UnevenCase) -> None:
    """out, LSE, dQ, dK, dV of every rank's own rows against the float64 oracle."""
    _run_and_judge(ring, _prepare(ring, case))


@drawn
def test_any_split_matches_reference(ring, pytestconfig, data) -> None:
    """Any split at W 2..4 (ranks with no token included; head_tail: its own split of any
    length), causal or not, every rotation, float64/float32, GQA."""
    caps = ring.caps
    w = draw_world_size(data, pytestconfig, at_least=2, at_most=4)
    layout = draw_claimed(data, caps, "layouts", LAYOUTS, "layout")
    if layout == "contiguous":
        lengths = tuple(data.draw(st.lists(st.integers(0, 6), min_size=w, max_size=w), "lengths"))
        if sum(lengths) == 0:
            lengths = (*lengths[:-1], 1)
        split = "drawn"
    else:
        lengths = split_lengths(layout, w, data.draw(st.integers(1, 7 * w), label="seq_len"))
        split = "layout"
    causal = data.draw(st.booleans(), label="is_causal")
    rotate = draw_claimed(data, caps, "rotate_methods", ROTATIONS, "rotate_method")
    dtype = data.draw(st.sampled_from(("float64", "float32")), label="dtype")
    spec = draw_inputs(data, caps, sum(lengths), dtype=dtype)
    spec = spec.with_(lse_grad=draw_lse_grad(data, caps))
    spec = spec.with_(seed=seed_for(f"{spec!r} {lengths}"))
    case = UnevenCase(
        spec,
        w,
        is_causal=causal,
        layout=layout,
        rotate_method=rotate,
        lengths=lengths,
        split=split,
        mask="causal" if causal else "",
    )
    _run_and_judge(ring, _prepare(ring, case))
