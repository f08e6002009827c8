"""The context-parallel API: buffers sharded and restored, SDPA routed and restored, unshard,
the tutorial example. Needs ``capabilities.context_parallel`` (ring_impl's API)."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

from harness.procs import run_tree
from reference.attention import attention
from reference.budget import assert_verdict, check
from suites import cases_api
from suites.matrix import world_sizes

ROOT = Path(__file__).resolve().parents[1]


def pytest_generate_tests(metafunc):
    if "w" in metafunc.fixturenames:
        metafunc.parametrize("w", [pytest.param(w, id=f"W{w}") for w in world_sizes(metafunc.config, at_least=2)])


@pytest.fixture
def cp(ring):
    ring.require("context_parallel", why="context_parallel / ContextParallel API")
    return ring


@pytest.mark.parametrize("dtype", ["float64", "bfloat16"])
@pytest.mark.parametrize("is_causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("layout", ["contiguous", "head_tail"])
def test_buffers_sharded_routed_and_restored(cp, w: int, layout: str, is_causal: bool, dtype: str) -> None:
    results = cp.rank_pool(w).run(cases_api.context_parallel_case, cp.impl.spec, layout, is_causal, dtype, timeout=cp.timeout)
    for rank, r in enumerate(results):
        assert r["routed_inside"], f"rank {rank}: F.scaled_dot_product_attention was not routed inside the context"
        assert r["inside_q_matches_shard"], f"rank {rank}: the buffer inside the context is not this rank's {layout} shard"
        assert r["inside_shapes"][0][2] == 8, f"rank {rank}: sharded buffer shapes {r['inside_shapes']}, expected seq 8 per rank"
        assert r["restored"], f"rank {rank}: buffers were not restored to their global contents on exit"
        assert r["kept_positions"] == r["expected_kept"], f"rank {rank}: a no_restore buffer was restored or mis-sharded"
        assert r["sdpa_restored"], f"rank {rank}: F.scaled_dot_product_attention was not restored on exit"
    q, k, v = results[0]["inputs"]
    ref = attention(q, k, v, is_causal=is_causal).out
    for rank, r in enumerate(results):
        assert_verdict(check("out", r["full"], ref, r["expected"], context=f"[context_parallel_unshard on rank {rank}, {layout}]"))


def test_exception_inside_restores_buffers_and_sdpa(cp, w: int) -> None:
    for rank, r in enumerate(cp.rank_pool(w).run(cases_api.context_parallel_exception_case, cp.impl.spec, timeout=cp.timeout)):
        assert r == {"raised": True, "restored": True, "sdpa_restored": True}, f"rank {rank}: {r}"


def test_tutorial_example_in_the_pool(cp) -> None:
    """The tutorial's own check (same-dtype comparison, atol 1e-3 * W) at its world size, 4."""
    for rank, r in enumerate(cp.rank_pool(4).run(cases_api.tutorial_case, cp.impl.spec, timeout=cp.timeout)):
        assert r["allclose"], f"rank {rank}: tutorial check failed: max diff {r['max_diff']:.3e} > atol {r['atol']:.1e}"


def test_tutorial_script_under_torchrun(cp, tmp_path) -> None:
    """examples/context_parallel_tutorial.py, verbatim, under torchrun with 4 CPU ranks."""
    if cp.impl.spec != cp_default_spec():
        pytest.skip("N/A: the tutorial script imports ring_impl; it checks the default implementation only")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]), "OMP_NUM_THREADS": "1"}
    # A process tree: torchrun's ranks leave its session; an interrupted run must not orphan them.
    proc = run_tree(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=4",
         str(ROOT / "examples" / "context_parallel_tutorial.py")],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=240,
    )
    assert proc.returncode == 0, f"torchrun exited {proc.returncode}\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    assert "matches single-process SDPA" in proc.stdout


def cp_default_spec() -> str:
    from harness.implementation import DEFAULT_IMPL_SPEC

    return DEFAULT_IMPL_SPEC
