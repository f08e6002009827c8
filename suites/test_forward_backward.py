"""Forward and backward (out, LSE, dQ, dK, dV) against the float64 reference, across the matrix.

Every quantity must meet the numerics policy (reference/budget.py): its error against the float64
reference on the same rounded inputs at most k times the single-device error of the same kernel
in the same dtype, plus a floor; a float64 ring must agree to about 1e-12.
"""

from __future__ import annotations

import itertools

from suites.cases import RingCase
from suites.inputs import InputSpec
from suites.matrix import DTYPES, LAYOUTS, ROTATIONS, params, tier, world_sizes


def pytest_generate_tests(metafunc):
    if "case" not in metafunc.fixturenames:
        return
    nightly = tier(metafunc.config) == "nightly"
    cases = []
    for w, dtype, causal, rotate, layout in itertools.product(
        world_sizes(metafunc.config), DTYPES, (False, True), ROTATIONS, LAYOUTS
    ):
        seq = (16 if nightly else 8) * w
        inputs = InputSpec(batch=2, heads=4, heads_kv=4, seq_q=seq, seq_kv=seq, head_dim=32 if nightly else 16, dtype=dtype)
        cases.append(RingCase(inputs, w, is_causal=causal, layout=layout, rotate_method=rotate))
    metafunc.parametrize("case", params(cases))


def test_forward_backward_match_reference(ring, case: RingCase) -> None:
    ring.check(ring.prepare(case))
