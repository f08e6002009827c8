"""GPU assignment to xdist workers and ranks (pure functions: no GPU needed)."""

from __future__ import annotations

import pytest

from harness.devices import rank_devices, worker_gpus, xdist_worker
from harness.errors import PoolUnavailable


def test_xdist_worker_from_environment() -> None:
    assert xdist_worker({}) == (0, 1)
    assert xdist_worker({"PYTEST_XDIST_WORKER": "gw3", "PYTEST_XDIST_WORKER_COUNT": "4"}) == (3, 4)
    assert xdist_worker({"PYTEST_XDIST_WORKER": "master", "PYTEST_XDIST_WORKER_COUNT": "4"}) == (0, 1)


@pytest.mark.parametrize(("gpus", "workers"), [(8, 1), (8, 2), (8, 3), (8, 8), (4, 3), (2, 2)])
def test_workers_get_disjoint_slices_covering_every_gpu(gpus: int, workers: int) -> None:
    slices = [worker_gpus(gpus, w, workers) for w in range(workers)]
    flat = [g for s in slices for g in s]
    assert sorted(flat) == list(range(gpus)), slices
    assert all(s for s in slices), f"a worker got no GPU: {slices}"


def test_more_workers_than_gpus_share_round_robin() -> None:
    assert [worker_gpus(2, w, 5) for w in range(5)] == [[0], [1], [0], [1], [0]]
    assert worker_gpus(0, 0, 1) == []


def test_cpu_ranks() -> None:
    assert rank_devices(3, "gloo", "cpu", []) == ["cpu", "cpu", "cpu"]


def test_nccl_ranks_get_one_gpu_each() -> None:
    assert rank_devices(2, "nccl", "cuda", [4, 5, 6], (1, 2)) == ["cuda:4", "cuda:5"]


def test_nccl_needs_as_many_gpus_as_ranks_and_says_how_to_fix() -> None:
    with pytest.raises(PoolUnavailable) as info:
        rank_devices(4, "nccl", "cuda", [2, 3], (1, 4))
    text = str(info.value)
    assert "world_size 4 needs 4 GPUs for nccl but xdist worker gw1 of 4 owns 2 GPU(s) [2, 3]" in text
    assert "fewer xdist workers" in text and "--dist-backend gloo" in text


def test_gloo_ranks_may_share_one_gpu() -> None:
    assert rank_devices(3, "gloo", "cuda", [0]) == ["cuda:0", "cuda:0", "cuda:0"]


def test_cuda_without_gpus_says_how_to_enable() -> None:
    with pytest.raises(PoolUnavailable, match="run on a CUDA machine or use --device cpu"):
        rank_devices(2, "gloo", "cuda", [])
