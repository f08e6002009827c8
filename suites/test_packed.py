"""Packed (THD) inputs: ``ring_attention(q, k, v, cu_seqlens=...)`` (capability ``packed``).

Each rank passes its shard (in the case's layout, on the token dim) of one global packed
sequence, ``(tokens_local, heads, head_dim)``, and the global cumulative document lengths
``cu_seqlens`` (a list of ints, or a 1-D int32 tensor), equal on every rank; tokens past
``cu_seqlens[-1]`` are padding. The output ``(tokens_local, heads, head_dim_v)``, the LSE
``(heads, tokens_local)`` (with ``return_lse``) and dQ/dK/dV are judged against the float64
oracle under the reference's own document mask of ``cu_seqlens`` by the numerics policy
(suites/cases_packed.py); padding rows must come back as nothing (out 0, LSE -inf).

Axes: world sizes, both built-in layouts, every rotation, every dtype, GQA, causal and full
attention within documents, ``cu_seqlens`` as a list and as an int32 tensor, the document sets
of :data:`suites.cases_packed.DOCUMENTS` (documents crossing shard edges, one-token documents,
a padding tail longer than a shard), ``return_lse`` on and off, forward only and forward with
backward. Quick tier: 12 cases, W 1..4, every axis value at least once; nightly: every world
size x layout x dtype x causal x document set, the other axes drawn per case by a stable hash.
A Hypothesis property draws ``cu_seqlens`` (documents of any lengths, one-token ones often, an
optional padding tail of up to all tokens but one) with every axis above but the dtype's
half-precision values.

Capabilities: ``packed`` (N/A when declared False), ``layouts``, ``rotate_methods``, ``dtypes``,
``gqa``, ``lse``, ``backward``.
"""

from __future__ import annotations

import itertools
from dataclasses import replace

from hypothesis import strategies as st

from suites.cases_packed import (
    DOCUMENTS,
    TOKENS_PER_RANK,
    PackedCase,
    judge_packed,
    packed_case,
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
    generate,
    params,
    seed_for,
    tier,
    world_sizes,
)

HEADS, HEAD_DIM = 4, 8

#: The quick tier: (W, layout, rotation, dtype, GQA, causal, cu_seqlens as, documents,
#: return_lse, backward); every value of every axis at least once.
QUICK = [
    (1, "contiguous", "allgather", "float64", False, True, "list", "crossing", True, True),
    (2, "head_tail", "p2p", "float32", True, True, "int32", "crossing", True, True),
    (2, "contiguous", "alltoall", "float64", False, False, "list", "padding_tail", True, True),
    (3, "head_tail", "allgather", "bfloat16", True, False, "int32", "one_token", True, True),
    (4, "contiguous", "p2p", "float16", False, True, "list", "padding_tail", True, True),
    (4, "head_tail", "alltoall", "float32", True, True, "list", "one_token", False, True),
    (3, "contiguous", "p2p", "float32", False, False, "int32", "crossing", True, False),
    (2, "head_tail", "allgather", "float64", True, True, "list", "padding_tail", False, False),
    (3, "head_tail", "alltoall", "float64", False, True, "int32", "padding_tail", True, True),
    (4, "contiguous", "allgather", "float64", True, False, "int32", "crossing", True, True),
    (2, "contiguous", "alltoall", "bfloat16", False, True, "list", "one_token", True, True),
    (1, "head_tail", "p2p", "float16", True, False, "int32", "one_token", True, True),
]


def _case(w, layout, rotate, dtype, gqa, causal, cu_as, documents, lse, backward) -> PackedCase:
    tokens = TOKENS_PER_RANK * w
    spec = InputSpec(
        batch=1,
        heads=HEADS,
        heads_kv=HEADS // 2 if gqa else HEADS,
        seq_q=tokens,
        seq_kv=tokens,
        head_dim=HEAD_DIM,
        dtype=dtype,
        # the loss uses the LSE too, on every other case that returns one and runs backward
        lse_grad=lse
        and backward
        and seed_for(f"lse-grad {w} {layout} {documents} {cu_as}") % 2 == 1,
    )
    return PackedCase(
        spec,
        w,
        is_causal=causal,
        layout=layout,
        rotate_method=rotate,
        return_lse=lse,
        backward=backward,
        documents=documents,
        cu_as=cu_as,
    )


def _cases(config) -> list:
    if tier(config) != "nightly":
        enabled = set(world_sizes(config, at_most=4))
        cases = [_case(*row) for row in QUICK if row[0] in enabled]
    else:
        cases = []
        # The other axes: one of their combinations per case, drawn by a stable hash of the
        # case (every pairing of values meets across the product; no axis runs in step with
        # another).
        others = list(
            itertools.product(
                ROTATIONS,
                (False, True),
                ("list", "int32"),
                # (return_lse, backward): the whole contract in half the cases
                ((True, True), (True, True), (False, True), (True, False)),
            )
        )
        product = itertools.product(world_sizes(config), LAYOUTS, DTYPES, (True, False), DOCUMENTS)
        for w, layout, dtype, causal, documents in product:
            key = f"{w}-{layout}-{dtype}-{causal}-{documents}"
            rotate, gqa, cu_as, (lse, backward) = others[seed_for(key) % len(others)]
            cases.append(
                _case(w, layout, rotate, dtype, gqa, causal, cu_as, documents, lse, backward)
            )
    return params(
        cases,
        id_extra=lambda c: (
            c.documents,
            c.cu_as,
            *(("gqa",) if c.inputs.heads_kv != c.inputs.heads else ()),
            *(() if c.return_lse else ("nolse",)),
            *(() if c.backward else ("fwd",)),
            *(("lse-grad",) if c.inputs.lse_grad else ()),
        ),
    )


pytest_generate_tests = generate(packed_case_=_cases)


def _prepare(ring, case: PackedCase) -> PackedCase:
    __tracebackhide__ = True
    op = ring.record_case(case)
    ring.require("packed", why="ring_attention(cu_seqlens=...) on packed (THD) shards")
    ring.require_exchange(case)
    if case.return_lse:
        ring.require("lse")
    ring.require_inputs(case, op)
    return replace(ring.loss_of(case), impl=ring.impl.spec, op=op)


def _run_and_judge(ring, case: PackedCase) -> None:
    __tracebackhide__ = True
    ring.judged(case, packed_case, judge_packed)


def test_packed_documents_match_reference(ring, packed_case_: PackedCase) -> None:
    """out (LSE, dQ, dK, dV) of packed shards under cu_seqlens against the float64 oracle."""
    _run_and_judge(ring, _prepare(ring, packed_case_))


def _cuts(data, tokens: int) -> tuple[int, ...]:
    """Drawn ``cu_seqlens`` over ``tokens`` packed tokens: documents of any lengths (one-token
    ones drawn often), then an optional padding tail past ``cu_seqlens[-1]`` (up to all tokens
    but one)."""
    padding = 0
    if data.draw(st.booleans(), label="padding_tail"):
        padding = data.draw(st.integers(1, tokens - 1), label="padding") if tokens > 1 else 0
    used = tokens - padding
    lengths = data.draw(
        st.lists(st.one_of(st.just(1), st.integers(1, used)), min_size=1, max_size=8),
        label="document_lengths",
    )
    # Documents past cu_seqlens[-1] are cut off there; the last one drawn takes what is left.
    cuts = [0]
    for n in lengths:
        if cuts[-1] + n >= used:
            break
        cuts.append(cuts[-1] + n)
    return (*cuts, used)


@drawn
def test_any_cu_seqlens_matches_reference(ring, pytestconfig, data) -> None:
    """Drawn documents (one-token ones, a padding tail of any length) at any world size, layout,
    rotation, float64/float32, GQA, causal or not, cu_seqlens as a list or an int32 tensor,
    return_lse and backward on or off: judged as the named document sets."""
    caps = ring.caps
    ring.require("packed", why="ring_attention(cu_seqlens=...) on packed (THD) shards")
    w = draw_world_size(data, pytestconfig)
    layout = draw_claimed(data, caps, "layouts", LAYOUTS, "layout")
    rotate = draw_claimed(data, caps, "rotate_methods", ROTATIONS, "rotate_method")
    dtypes = [d for d in ("float64", "float32") if caps.claims("dtypes", d)] or ["float64"]
    dtype = data.draw(st.sampled_from(dtypes), label="dtype")
    causal = data.draw(st.booleans(), label="is_causal")
    step = 2 if layout == "head_tail" else 1
    tokens = data.draw(st.integers(1, 8), label="tokens_per_rank") * step * w
    cuts = _cuts(data, tokens)
    cu_as = data.draw(st.sampled_from(("list", "int32")), label="cu_seqlens_as")
    lse = caps.claims("lse") and data.draw(st.booleans(), label="return_lse")
    backward = caps.claims("backward") and data.draw(st.booleans(), label="backward")
    spec = draw_inputs(data, caps, tokens, dtype=dtype, batch=1)
    spec = spec.with_(lse_grad=lse and backward and draw_lse_grad(data, caps))
    case = PackedCase(
        spec.with_(seed=seed_for(f"{spec!r} {cuts}")),
        w,
        is_causal=causal,
        layout=layout,
        rotate_method=rotate,
        return_lse=lse,
        backward=backward,
        documents="drawn",
        cu_as=cu_as,
        cuts=cuts,
    )
    _run_and_judge(ring, _prepare(ring, case))
