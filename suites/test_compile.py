"""torch.compile(fullgraph=True) of the ring: no graph break, and the same results as eager.

Quick tier: ``aot_eager`` (bitwise equal to eager: same ops, no codegen). Nightly: ``inductor``
over the rotation/layout/causal matrix, equal to eager within the numerics policy (inductor
fuses and reorders floating-point work).

The strategy axis (:mod:`suites.meshes`): Ulysses and the hybrid on 4-rank meshes, compiled
the same way.
"""

from __future__ import annotations

import itertools

import pytest
import torch

from harness.errors import CaseFailure
from reference.budget import assert_verdict, check
from suites import meshes
from suites.cases import RingCase
from suites.inputs import InputSpec
from suites.judge import QUANTITIES, baseline_for, reference_for, unshard_case
from suites.matrix import LAYOUTS, ROTATIONS, params, tier, world_sizes


def pytest_generate_tests(metafunc):
    if "case" not in metafunc.fixturenames:
        return
    nightly = tier(metafunc.config) == "nightly"
    cases = []
    if nightly:
        combos = itertools.product(
            world_sizes(metafunc.config, at_least=2, at_most=4),
            ("aot_eager", "inductor"),
            ROTATIONS,
            LAYOUTS,
            (False, True),
        )
    else:
        combos = [(2, "aot_eager", r, "head_tail", True) for r in ROTATIONS] + [
            (2, "aot_eager", "allgather", "contiguous", False)
        ]
        combos = [c for c in combos if c[0] in world_sizes(metafunc.config)]
    for w, backend, rotate, layout, causal in combos:
        inputs = InputSpec(
            batch=1, heads=4, heads_kv=2, seq_q=8 * w, seq_kv=8 * w, head_dim=16, dtype="float32"
        )
        cases.append(
            RingCase(
                inputs, w, is_causal=causal, layout=layout, rotate_method=rotate, compile=backend
            )
        )
    metafunc.parametrize("case", params(cases) + meshes.compile_cases(metafunc.config))


def test_compiled_matches_eager_and_reference(ring, case: RingCase) -> None:
    compiled = ring.prepare(case)
    try:
        compiled_results = ring.run(compiled)
    except CaseFailure as exc:
        try:
            ring.run(compiled.with_(compile=None))
        except CaseFailure:
            raise exc from None  # fails eagerly too: not a compile problem
        head = "\n".join(str(exc).splitlines()[:2])
        what = "ring_attention" if case.mesh_shape is None else f"the {case.strategy} strategy"
        pytest.fail(
            f"torch.compile(backend={case.compile!r}, fullgraph=True) of {what} raised on "
            "the ranks, and the same case run eagerly does not: it fails only under "
            "torch.compile (a graph break in the ring, or code dynamo cannot trace) "
            f"[{case.label}]\n{head}\n{exc}",
            pytrace=False,
        )
    ring.check(compiled, results=compiled_results)
    eager = unshard_case(case, ring.run(compiled.with_(compile=None)))
    got = unshard_case(case, compiled_results)
    ref, base = (
        reference_for(case.inputs, case.is_causal),
        baseline_for(case.inputs, case.is_causal, compiled.op),
    )
    for name in QUANTITIES:
        if got[name] is None:
            continue
        if case.compile == "aot_eager":
            assert torch.equal(got[name], eager[name]), (
                f"{name}: aot_eager result differs from eager (max "
                f"{float((got[name].double() - eager[name].double()).abs().max()):.2e}); "
                f"aot_eager runs the same ops and must be bitwise equal [{case.label}]"
            )
        else:
            # The policy with eager standing in for the reference (see test_rotation.py).
            shifted = base[name].double() + (eager[name].double() - ref[name])
            assert_verdict(
                check(
                    f"{name} compiled vs eager",
                    got[name],
                    eager[name],
                    shifted,
                    dtype=case.inputs.torch_dtype,
                    context=f"[{case.label}]",
                )
            )
