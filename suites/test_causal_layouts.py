"""Causal handling per ring step, both layouts, and load balance.

Per step: the implementation's recorded partial of every (rank, step) is compared with the
float64 ring simulation (reference/simulate.py): the right key/value block, the right mask,
computed exactly when needed. Load balance: the attention work each rank does (score entries
computed, counted by wrapping the kernel) equals the simulation's visible pairs; under
``head_tail`` every rank does the same work.
"""

from __future__ import annotations

import itertools

from reference.diagnose import compare_records
from suites.cases import RingCase
from suites.inputs import InputSpec, make_inputs
from suites.judge import simulation_for
from suites.matrix import LAYOUTS, params, world_sizes


def _cases(config, **extra):
    out = []
    for w, layout, causal in itertools.product(
        world_sizes(config, at_least=2), LAYOUTS, (True, False)
    ):
        inputs = InputSpec.per_rank(w, batch=1, heads=2, heads_kv=2, dtype="float64")
        out.append(RingCase(inputs, w, is_causal=causal, layout=layout, **extra))
    return params(out)


def pytest_generate_tests(metafunc):
    if "step_case" in metafunc.fixturenames:
        metafunc.parametrize("step_case", _cases(metafunc.config, record=True))
    if "work_case" in metafunc.fixturenames:
        metafunc.parametrize("work_case", _cases(metafunc.config, count_work=True, backward=False))


def test_every_ring_step_matches_the_simulation(ring, step_case: RingCase) -> None:
    case = ring.prepare(
        step_case
    )  # needs record_steps: N/A if declared lacking, a failure if missing
    results = ring.run(case)
    records = [rec for r in results for rec in r["records"]]
    findings = compare_records(
        simulation_for(case, make_inputs(case.inputs)), records, dtype=case.inputs.torch_dtype
    )
    assert not findings, f"ring steps diverge from the simulation [{case.label}]:\n" + "\n".join(
        f.what for f in findings
    )
    ring.check(case, results=results)


def test_work_per_rank_is_minimal_and_balanced(ring, work_case: RingCase) -> None:
    case = ring.prepare(work_case)
    sim = simulation_for(case, make_inputs(case.inputs))
    expected = (
        sim.work_per_rank()
    )  # visible score entries per (batch, head), like CountingOp counts
    work = [r["work"] for r in ring.run(case)]
    assert work == expected, (
        f"attention work per rank {work} differs from the visible (query, key) pairs {expected} "
        f"per batch-head [{case.label}]: a step that must be skipped was computed, or a needed "
        "one was not"
    )
    if case.is_causal and case.layout == "head_tail":
        assert len(set(work)) == 1, (
            f"head_tail must balance causal work; per-rank work {work} [{case.label}]"
        )
