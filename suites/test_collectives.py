"""Collective accounting: every rank issues exactly the declared schedule, per phase and kind.

The implementation declares ``collective_schedule(world_size, rotate_method, ...)``; each rank's
recorded calls and bytes (harness.accounting) must equal it. A rank that skips a collective, an
extra hop, a dK/dV return trip that is missing or a transfer of the wrong size shows up here
as a difference on the rank that made it.

The strategy axis (:mod:`suites.meshes`): Ulysses and the hybrid declare the all-to-alls of
their Ulysses rows and the ring's transfers across rows (``collective_schedule(...,
strategy=, mesh_shape=, heads=, seq_q=, return_lse=)``); a difference names the rank's mesh
coordinates.
"""

from __future__ import annotations

import itertools

from suites import meshes
from suites.cases import RingCase
from suites.coverage import combos
from suites.inputs import InputSpec
from suites.matrix import LAYOUTS, ROTATIONS, params, world_sizes

#: Cases that tests select by id (tests/conformance/test_protocol.py, test_report.py,
#: tests/packaging): in the quick tier whenever its world sizes hold them.
KEEP = (
    (2, "alltoall", "contiguous", True, ("float32", 4)),
    (2, "allgather", "contiguous", True, ("float32", 4)),
)


def _cases(config) -> list:
    cases = []
    # Quick: every world size with every rotation, and every other value and pair of values
    # (suites.coverage); nightly: the product.
    for w, rotate, layout, causal, (dtype, heads_kv) in combos(
        config,
        world_sizes(config),
        ROTATIONS,
        LAYOUTS,
        (False, True),
        (("float32", 4), ("bfloat16", 2)),
        keep=KEEP,
    ):
        inputs = InputSpec.per_rank(w, heads_kv=heads_kv, dtype=dtype)
        cases.append(
            RingCase(inputs, w, is_causal=causal, layout=layout, rotate_method=rotate, account=True)
        )
    # value's own head dim (capability value_head_dim): its bytes move at d_v, not at d_qk
    for i, (w, rotate) in enumerate(itertools.product(world_sizes(config, at_least=2), ROTATIONS)):
        inputs = InputSpec.per_rank(w, heads_kv=2, head_dim_v=(8, 40)[i % 2], dtype="bfloat16")
        cases.append(
            RingCase(
                inputs,
                w,
                is_causal=bool(i % 2),
                layout=LAYOUTS[i % 2],
                rotate_method=rotate,
                account=True,
            )
        )
    return params(
        cases,
        id_extra=lambda c: (
            f"hkv{c.inputs.heads_kv}",
            *(() if c.inputs.head_dim_v is None else (f"dv{c.inputs.head_dim_v}",)),
        ),
    )


def pytest_generate_tests(metafunc):
    if "case" in metafunc.fixturenames:
        metafunc.parametrize(
            "case", _cases(metafunc.config) + meshes.collectives_cases(metafunc.config)
        )


def test_collectives_match_declared_schedule(ring, case: RingCase) -> None:
    case = ring.prepare(case)
    # N/A only with capabilities.collective_schedule=False; claimed but missing fails.
    schedule = ring.protocol(
        "collective_schedule", why="the collectives of every rank are asserted against it"
    )
    spec = case.inputs
    # head_dim_v only where value's head dim differs
    # (a schedule without the keyword serves the rest)
    value_dim = {} if spec.head_dim_v is None else {"head_dim_v": spec.head_dim_v}
    if case.mesh_shape is not None:  # the strategy's own keywords
        value_dim.update(
            strategy=case.strategy,
            mesh_shape=case.mesh_shape,
            heads=spec.heads,
            seq_q=spec.seq_q // case.world_size,
            return_lse=case.return_lse,
        )
    expected = case.declared_schedule(schedule, **value_dim)
    results = ring.run(case)
    # The result first: a ring that computes wrongly is reported for that, not for its traffic.
    ring.check(case, results=results)
    ring.check_collectives(case, expected, results)
