"""Determinism: the same case twice on the same ranks gives bitwise equal outputs and gradients."""

from __future__ import annotations

import itertools

import torch

from suites.cases import RingCase, ring_case_twice
from suites.inputs import InputSpec
from suites.judge import QUANTITIES
from suites.matrix import LAYOUTS, ROTATIONS, params, world_sizes


def pytest_generate_tests(metafunc):
    if "case" not in metafunc.fixturenames:
        return
    sizes = world_sizes(metafunc.config, at_least=2)
    cases = [
        RingCase(
            InputSpec.per_rank(w, batch=1, heads_kv=2, dtype="bfloat16"),
            w,
            is_causal=causal,
            layout=layout,
            rotate_method=rotate,
        )
        for w, rotate, layout, causal in itertools.product(
            sizes[-1:], ROTATIONS, LAYOUTS, (False, True)
        )
    ]
    metafunc.parametrize("case", params(cases, id_extra=lambda c: ("twice",)))


def test_same_case_twice_is_bitwise_equal(ring, case: RingCase) -> None:
    case = ring.prepare(case)
    first, second = zip(*ring.run(case, fn=ring_case_twice))
    for rank, (a, b) in enumerate(zip(first, second)):
        for name in QUANTITIES:
            if a[name] is None:
                continue
            assert torch.equal(a[name], b[name]), (
                f"{name}[rank={rank}] differs between two identical runs (max "
                f"{float((a[name].double() - b[name].double()).abs().max()):.2e}) [{case.label}]"
            )
