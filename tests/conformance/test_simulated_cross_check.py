"""The simulated world against the process pool, at world sizes both run: the same suite cases
(ring, masked with a balancer, hybrid on a 2-D mesh) give bit-identical outputs, gradients and
collective counts on both, and so the same verdicts. A cross-check of the simulated tier (the
nightly W=8..64 job), not a second truth: the judge and the float64 oracle stay the suites'."""

from __future__ import annotations

import pytest
import torch

from harness import get_pool
from harness.simulated import shutdown_simulated_pools, simulated_pool
from suites.cases import RingCase, ring_case
from suites.cases_masks import MaskCase, judge_masked, masked_case
from suites.inputs import InputSpec
from suites.judge import judge


def _spec(w: int, dtype: str, heads_kv: int = 2) -> InputSpec:
    return InputSpec(
        batch=1,
        heads=4,
        heads_kv=heads_kv,
        seq_q=8 * w,
        seq_kv=8 * w,
        head_dim=16,
        dtype=dtype,
        seed=w,
    )


def _ring(w: int, dtype: str, heads_kv: int = 2, **options) -> RingCase:
    """A ring case of ``w`` ranks with its collectives accounted."""
    return RingCase(_spec(w, dtype, heads_kv), w, account=True, **options)


CASES = [
    pytest.param(
        2,
        _ring(2, "float32", is_causal=True, layout="head_tail", rotate_method="p2p"),
        id="W2-f32-causal-p2p-head_tail",
    ),
    pytest.param(
        4,
        _ring(4, "bfloat16", heads_kv=4, layout="contiguous", rotate_method="alltoall"),
        id="W4-bf16-full-alltoall-contiguous",
    ),
    pytest.param(
        4,
        _ring(4, "float64", is_causal=True, layout="contiguous", rotate_method="allgather"),
        id="W4-f64-causal-allgather-contiguous",
    ),
    pytest.param(
        4,
        MaskCase(
            InputSpec(batch=1, heads=4, heads_kv=2, seq_q=96, seq_kv=96, head_dim=16, seed=7),
            4,
            layout="work_aware",
            rotate_method="p2p",
            mask="documents_window",
            sinks=True,
        ),
        id="W4-f32-documents_window-work_aware-p2p-sinks",
    ),
    pytest.param(
        4,
        RingCase(
            InputSpec(batch=2, heads=12, heads_kv=2, seq_q=32, seq_kv=32, head_dim=8, seed=3),
            4,
            strategy="hybrid",
            mesh_shape=(2, 2),
            is_causal=True,
            layout="head_tail",
            rotate_method="alltoall",
        ),
        id="W4-f32-hybrid-2x2-causal-head_tail-gqa",
    ),
]
RUN = {RingCase: ring_case, MaskCase: masked_case}
JUDGE = {RingCase: judge, MaskCase: judge_masked}


def _same(a, b, where: str) -> None:
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b), (
            f"{where} differs"
        )
    elif isinstance(a, dict):
        assert a.keys() == b.keys(), f"{where}: keys {sorted(a)} vs {sorted(b)}"
        for k in a:
            _same(a[k], b[k], f"{where}.{k}")
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), f"{where}: lengths {len(a)} vs {len(b)}"
        for i, (x, y) in enumerate(zip(a, b)):
            _same(x, y, f"{where}[{i}]")
    else:
        assert a == b, f"{where}: {a!r} vs {b!r}"


@pytest.fixture(scope="module", autouse=True)
def _simulated_pools_end_with_the_module():
    """The simulated world swaps in per-thread torch.distributed state while a pool lives: leave
    the process as the other tests of this worker expect it."""
    yield
    shutdown_simulated_pools()


@pytest.mark.parametrize(("w", "case"), CASES)
def test_simulated_world_equals_the_process_pool(w: int, case) -> None:
    fn = RUN[type(case)]
    simulated = simulated_pool(w).run(fn, case, timeout=120)
    real = get_pool(w, backend="gloo", device="cpu").run(fn, case, timeout=120)
    _same(simulated, real, "results")
    verdicts = [JUDGE[type(case)](case, results) for results in (simulated, real)]
    assert [(v.name, v.passed, v.max_err) for v in verdicts[0]] == [
        (v.name, v.passed, v.max_err) for v in verdicts[1]
    ]
    assert verdicts[0] and all(v.passed for v in verdicts[0])
