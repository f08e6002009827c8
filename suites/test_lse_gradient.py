"""The LSE is an output like any other: a loss that uses it backpropagates through it.

``return_lse=True`` returns the local LSE, and a loss ``(out * dO).sum() + (lse * g).sum()``
must give the gradients of float64 autograd of the same loss (judged by the numerics policy,
the baseline being the same kernel on one device with the same loss). In the backward the LSE's
gradient enters every block's ``dS = P * (dP - D + g)``: an implementation that marks the LSE
non-differentiable, or drops ``g`` on some step or op, fails here.
"""

from __future__ import annotations

import itertools

from suites.cases import RingCase
from suites.inputs import InputSpec
from suites.matrix import LAYOUTS, ROTATIONS, params, session_ops, tier, world_sizes


def pytest_generate_tests(metafunc):
    if "case" not in metafunc.fixturenames:
        return
    nightly = tier(metafunc.config) == "nightly"
    sizes = (
        world_sizes(metafunc.config, at_least=2)
        if nightly
        else world_sizes(metafunc.config, at_least=2, at_most=3)
    )
    cases = []
    for i, (op, rotate) in enumerate(
        itertools.product((None, *session_ops(metafunc.config)), ROTATIONS)
    ):
        combos = (
            itertools.product(sizes, ("float64", "float32", "bfloat16"), (False, True), LAYOUTS)
            if nightly
            else [
                (sizes[i % len(sizes)], "float32", True, "head_tail"),
                (sizes[-1], "float64", False, "contiguous"),
            ]
            if sizes
            else []
        )
        for w, dtype, causal, layout in combos:
            inputs = InputSpec.per_rank(w, batch=1, heads_kv=2, dtype=dtype, lse_grad=True)
            cases.append(
                RingCase(inputs, w, is_causal=causal, layout=layout, rotate_method=rotate, op=op)
            )
    if sizes:  # bfloat16 through every rotation with the implementation's own kernel
        for rotate in ROTATIONS:
            inputs = InputSpec(
                batch=1,
                heads=4,
                heads_kv=4,
                seq_q=8 * sizes[-1],
                seq_kv=8 * sizes[-1],
                head_dim=16,
                dtype="bfloat16",
                lse_grad=True,
            )
            cases.append(
                RingCase(
                    inputs, sizes[-1], is_causal=True, layout="head_tail", rotate_method=rotate
                )
            )
    metafunc.parametrize("case", params(cases, id_extra=lambda c: ("lse-grad",)))


def test_lse_gradient_matches_float64_autograd(ring, case: RingCase) -> None:
    ring.require("lse", why="the loss uses the returned LSE")
    ring.require("lse_grad", why="the loss backpropagates through the returned LSE")
    ring.check(ring.prepare(case))  # (a detached LSE is named before the verdicts)
