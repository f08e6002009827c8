"""Masks under context parallelism: packed documents (causal and full, uneven, crossing shard
boundaries, one-token documents, padding), sliding windows narrower and wider than a shard,
chunked causal, prefix-LM, documents combined with a window, a head-dependent mask_mod, and
attention sinks; every rotation, both layouts, W 1..4 (nightly 5..8), float64/float32/bfloat16,
GQA. Judged against the float64 oracle with the same mask (reference.masks) by the numerics
policy; rows that see nothing must come back as nothing (out 0, LSE -inf).

Capabilities: ``masks`` (the mask kinds of reference.masks the implementation handles) and
``sinks``; undeclared claims them.
"""

from __future__ import annotations

import itertools
from dataclasses import replace

import pytest

from suites.cases_masks import (
    MASK_NAMES,
    MaskCase,
    diagnose_masked,
    judge_masked,
    mask_spec,
    masked_case,
)
from suites.inputs import InputSpec
from suites.judge import format_failure
from suites.matrix import LAYOUTS, ROTATIONS, params, tier, world_sizes
from suites.runner import case_properties

#: The mask kinds (reference.masks) each named mask uses.
KINDS = {"causal": {"causal"}, "documents": {"document"}, "documents_full": {"document"}, "documents_with_gaps": {"document"},
         "one_token_documents": {"document"}, "window_narrow": {"sliding_window"}, "window_wide": {"sliding_window"},
         "chunked_causal": {"chunked_causal"}, "prefix_lm": {"prefix_lm"}, "documents_window": {"and", "document", "sliding_window"},
         "mask_mod": {"mask_mod"}}


def _cases(config) -> list:
    nightly = tier(config) == "nightly"
    sizes = world_sizes(config) if nightly else world_sizes(config, at_most=4)
    dtypes = ("float64", "float32", "bfloat16")
    out = []
    for i, (name, w, layout) in enumerate(itertools.product(MASK_NAMES, sizes, LAYOUTS)):
        chosen = dtypes if nightly else (dtypes[i % 3],)
        for j, dtype in enumerate(chosen):
            rotate = ROTATIONS[(i // 3 + j) % 3]
            heads_kv = 2 if (i + j) % 2 else 4  # GQA on every other case
            seq = 24 * w
            spec = InputSpec(batch=1, heads=4, heads_kv=heads_kv, seq_q=seq, seq_kv=seq, head_dim=16, dtype=dtype)
            out.append(MaskCase(spec, w, layout=layout, rotate_method=rotate, mask=name, sinks=(i + j) % 4 == 0))
    return params(out, id_extra=lambda c: (c.mask, *(("sinks",) if c.sinks else ())))


def pytest_generate_tests(metafunc):
    if "case" in metafunc.fixturenames:
        metafunc.parametrize("case", _cases(metafunc.config))


def _prepare(ring, case: MaskCase) -> MaskCase:
    __tracebackhide__ = True
    op = case.op if case.op is not None else ring.op_spec
    ring.request.node.user_properties.append(("ring_case", case_properties(replace(case, op=op))))
    for kind in sorted(KINDS[case.mask]):
        ring.require("masks", kind, why=f"mask {case.mask!r}")
    if case.sinks:
        ring.require("sinks")
    ring.require("lse", why="the masked rows' LSE is part of the contract")
    ring.require("layouts", case.layout)
    ring.require("rotate_methods", case.rotate_method)
    ring.require("backward")
    ring.require_inputs(case, op)
    return replace(case, impl=ring.impl.spec, op=op)


def test_masked_attention_matches_reference(ring, case: MaskCase) -> None:
    """out, LSE, dQ, dK, dV (and dSinks) under the mask against the float64 oracle."""
    case = _prepare(ring, case)
    assert mask_spec(case.mask, case.inputs.seq_q)["kind"] in KINDS[case.mask]
    results = ring.rank_pool(case.world_size).run(masked_case, case, timeout=ring.timeout_for(case))
    try:
        verdicts = judge_masked(case, results, baseline_op=getattr(ring.impl.obj, "baseline_op", None))
    except AssertionError as exc:  # a broken contract: no numbers to judge
        pytest.fail(f"{exc}\nrepro: {ring.repro()}", pytrace=False)
    ring.record(case, verdicts)
    failed = [v for v in verdicts if not v.passed]
    if failed:
        pytest.fail(format_failure(failed, diagnose_masked(case, results), ring.repro()), pytrace=False)
