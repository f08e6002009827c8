"""GPU assignment to xdist workers and ranks (pure
functions and the pool registry: no GPU needed)."""

from __future__ import annotations

import pytest

from harness.devices import rank_devices, shares_gpus, worker_gpus, xdist_worker
from harness.errors import PoolUnavailable


def test_xdist_worker_from_environment() -> None:
    assert xdist_worker({}) == (0, 1)
    assert xdist_worker({"PYTEST_XDIST_WORKER": "gw3", "PYTEST_XDIST_WORKER_COUNT": "4"}) == (3, 4)
    assert xdist_worker({"PYTEST_XDIST_WORKER": "master", "PYTEST_XDIST_WORKER_COUNT": "4"}) == (
        0,
        1,
    )


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
    assert (
        "world_size 4 needs 4 GPUs for nccl but xdist worker gw1 of 4 owns 2 GPU(s) [2, 3]" in text
    )
    assert "fewer xdist workers" in text and "--dist-backend gloo" in text


def test_gloo_ranks_may_share_one_gpu() -> None:
    assert rank_devices(3, "gloo", "cuda", [0]) == ["cuda:0", "cuda:0", "cuda:0"]


def test_cuda_without_gpus_says_how_to_enable() -> None:
    with pytest.raises(PoolUnavailable, match="run on a CUDA machine or use --device cpu"):
        rank_devices(2, "gloo", "cuda", [])


def test_workers_share_gpus_only_when_fewer_gpus_than_workers() -> None:
    assert shares_gpus("cuda", 1, (3, 16))
    assert not shares_gpus("cuda", 8, (3, 8))
    assert not shares_gpus("cuda", 1, (0, 1))
    assert not shares_gpus("cpu", 1, (3, 16))
    assert not shares_gpus("cuda", 0, (3, 16))


def test_a_worker_sharing_its_gpu_keeps_one_cuda_pool_alive(monkeypatch) -> None:
    """Starting a CUDA pool of another world size stops this worker's other CUDA pools first when
    the GPU is shared with other workers; CPU pools and unshared GPUs keep every pool."""
    from harness import pool as pool_mod

    events: list[tuple[str, int]] = []
    monkeypatch.setattr(
        pool_mod.RankPool, "start", lambda self: events.append(("start", self.world_size))
    )
    monkeypatch.setattr(
        pool_mod.RankPool, "shutdown", lambda self: events.append(("stop", self.world_size))
    )
    monkeypatch.setattr(pool_mod, "visible_gpu_count", lambda: 1)
    monkeypatch.setattr(pool_mod, "_pools", {})
    monkeypatch.setenv("PYTEST_XDIST_WORKER", "gw2")
    monkeypatch.setenv("PYTEST_XDIST_WORKER_COUNT", "4")
    monkeypatch.setattr(pool_mod, "install_parent_hooks", lambda fn: None)
    pool_mod.rank_pool(2, "gloo", "cuda")
    pool_mod.rank_pool(2, "gloo", "cuda")  # the same pool again: nothing stopped
    pool_mod.rank_pool(4, "gloo", "cuda")
    assert events == [("start", 2), ("start", 2), ("stop", 2), ("start", 4)]
    assert [k[0] for k in pool_mod._pools] == [4]
    monkeypatch.setenv("PYTEST_XDIST_WORKER_COUNT", "1")
    monkeypatch.setenv("PYTEST_XDIST_WORKER", "gw0")
    pool_mod.rank_pool(2, "gloo", "cuda")  # one worker, one GPU: not shared, both kept
    assert sorted(k[0] for k in pool_mod._pools) == [2, 4]
