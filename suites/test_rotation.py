"""Every KV rotation method, and agreement between them.

Each method alone meets the numerics policy (test_forward_backward); here the three methods run on
the same inputs and their results must agree with each other as closely as each agrees with the
reference: ``max|X_a - X_b| <= k * max|B - R| + floor``, the policy with one method's result in
the place of the reference. A rotation that sends to the wrong neighbour or drops a hop on some
step passes through one method only and shows up here too.
"""

from __future__ import annotations

import itertools

import pytest

from reference.budget import assert_verdict, check
from suites.cases import RingCase
from suites.inputs import InputSpec
from suites.judge import QUANTITIES, baseline_for, reference_for, unshard_results
from suites.matrix import LAYOUTS, ROTATIONS, params, world_sizes


def pytest_generate_tests(metafunc):
    if "case" not in metafunc.fixturenames:
        return
    cases = []
    for w, dtype, causal, layout in itertools.product(
        world_sizes(metafunc.config, at_least=2), ("float32", "bfloat16"), (False, True), LAYOUTS
    ):
        inputs = InputSpec.per_rank(w, heads_kv=2, dtype=dtype)
        cases.append(
            RingCase(inputs, w, is_causal=causal, layout=layout, rotate_method="allgather")
        )
    metafunc.parametrize("case", params(cases, id_extra=lambda c: ("all-methods",)))


def test_rotation_methods_agree(ring, case: RingCase) -> None:
    supported = [m for m in ROTATIONS if ring.caps.claims("rotate_methods", m)]
    if len(supported) < 2:
        pytest.skip(f"N/A: {ring.impl.name} declares fewer than two rotation methods")
    results = {}
    for method in supported:
        c = ring.prepare(case.with_(rotate_method=method))
        results[method] = ring.run(c)
        ring.check(c, results=results[method])
    ref, base = (
        reference_for(case.inputs, case.is_causal),
        baseline_for(case.inputs, case.is_causal, ring.prepare(case).op),
    )
    first, *others = supported
    a = unshard_results(results[first], case.layout)
    for method in others:
        b = unshard_results(results[method], case.layout)
        for name in QUANTITIES:
            if a[name] is None or b[name] is None:
                continue
            # Judge X_b against X_a with the baseline shifted by X_a - R, so the allowance is
            # exactly k * max|B - R| + floor: the policy, with X_a standing in for the reference.
            shifted_base = base[name].double() + (a[name].double() - ref[name])
            verdict = check(
                f"{name} {method} vs {first}",
                b[name],
                a[name],
                shifted_base,
                dtype=case.inputs.torch_dtype,
                layout=case.layout,
                world_size=case.world_size,
                context=f"[{case.label}]",
            )
            assert_verdict(verdict)
