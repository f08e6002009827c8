"""Device inventory and GPU assignment: which GPUs this pytest (xdist) worker owns, which GPU each
rank pins.

Under ``pytest -n N`` on a multi-GPU runner every xdist worker gets a disjoint slice of the visible
GPUs, so two workers never run NCCL ranks on the same GPU. A case that needs more GPUs than the
worker owns skips with a reason that says so. With ``--dist-backend gloo --device cuda`` ranks may
share GPUs (gloo stages CUDA tensors through host memory), so a single-GPU runner can still check
CUDA kernels at world size > 1.

The functions here take their inputs as arguments (GPU count, worker index) so they can be tested
without a GPU; :func:`visible_gpu_count` is the only one that asks torch, and it does not
initialise CUDA in the calling process.
"""

from __future__ import annotations

import os
from collections.abc import Mapping

from harness.errors import PoolUnavailable


def xdist_worker(env: Mapping[str, str] | None = None) -> tuple[int, int]:
    """(index, count) of this xdist worker; (0, 1) when not under xdist.

    ``PYTEST_XDIST_WORKER`` is ``gw<index>``; ``PYTEST_XDIST_WORKER_COUNT`` is the worker count.
    """
    env = os.environ if env is None else env
    name = env.get("PYTEST_XDIST_WORKER", "")
    count = env.get("PYTEST_XDIST_WORKER_COUNT", "")
    if not name.startswith("gw") or not name[2:].isdigit() or not count.isdigit():
        return 0, 1
    index, total = int(name[2:]), max(int(count), 1)
    return index % total, total


def worker_gpus(gpu_count: int, worker_index: int, worker_count: int) -> list[int]:
    """The GPU indices (as visible to this process) owned by one xdist worker.

    With at least as many GPUs as workers, the GPUs are split into contiguous disjoint slices
    (8 GPUs, 3 workers -> [0, 1], [2, 3, 4], [5, 6, 7]). With fewer GPUs than workers, workers
    share round-robin (worker i gets GPU i % gpu_count), which only gloo pools can use at W>1.
    """
    if gpu_count <= 0:
        return []
    if worker_count <= gpu_count:
        start = worker_index * gpu_count // worker_count
        stop = (worker_index + 1) * gpu_count // worker_count
        return list(range(start, stop))
    return [worker_index % gpu_count]


def rank_devices(
    world_size: int,
    backend: str,
    device: str,
    gpus: list[int],
    worker: tuple[int, int] = (0, 1),
) -> list[str]:
    """The device string each rank pins, or :class:`PoolUnavailable` saying why none fits.

    CPU ranks all get ``"cpu"``. CUDA ranks get one GPU each from ``gpus``; with gloo they may
    share (rank r gets ``gpus[r % len(gpus)]``), with nccl every rank needs its own GPU.
    """
    if device == "cpu":
        return ["cpu"] * world_size
    if device != "cuda":
        raise PoolUnavailable(f"unknown device {device!r}: use cpu or cuda")
    index, count = worker
    if not gpus:
        raise PoolUnavailable(
            "needs CUDA but no GPU is visible to this process "
            "(check CUDA_VISIBLE_DEVICES and torch.cuda.is_available()); run on a CUDA machine "
            "or use --device cpu"
        )
    if backend == "nccl" and world_size > len(gpus):
        where = f"xdist worker gw{index} of {count} owns" if count > 1 else "this process sees"
        raise PoolUnavailable(
            f"world_size {world_size} needs {world_size} GPUs for nccl but {where} {len(gpus)} "
            f"GPU(s) {gpus}: run with fewer xdist workers (-n {max(1, count // 2)} or -n 0), on a "
            "machine with more GPUs, or share GPUs with --dist-backend gloo"
        )
    return [f"cuda:{gpus[r % len(gpus)]}" for r in range(world_size)]


def shares_gpus(device: str, gpu_count: int, worker: tuple[int, int]) -> bool:
    """Whether this xdist worker's CUDA ranks share their GPUs with other workers' (fewer GPUs
    than workers). Such a worker keeps one pool alive at a time: every rank process holds a CUDA
    context (about 0.5 GiB), and on one 80 GiB H100, 14 workers each keeping W=4 and W=6 gloo
    pools alive ran the GPU out of memory."""
    return device == "cuda" and gpu_count > 0 and worker[1] > gpu_count


def visible_gpu_count() -> int:
    """Number of CUDA devices visible to this process (0 without CUDA); does not initialise CUDA."""
    import torch

    if not torch.cuda.is_available():
        return 0
    return int(torch.cuda.device_count())


def inventory() -> list[str]:
    """Lines describing the devices of this machine, for the pytest report header."""
    import torch

    lines = [f"CPUs: {os.cpu_count()} (usable by this process: {len(os.sched_getaffinity(0))})"]
    if torch.version.cuda is None and getattr(torch.version, "hip", None) is None:
        lines.append(f"CUDA: none (torch {torch.__version__} is a CPU build)")
    else:
        count = visible_gpu_count()
        visible = os.environ.get("CUDA_VISIBLE_DEVICES")
        lines.append(
            f"CUDA {torch.version.cuda or torch.version.hip}: {count} GPU(s) visible"
            + (f" (CUDA_VISIBLE_DEVICES={visible})" if visible is not None else "")
        )
    return lines


def dist_backends() -> list[str]:
    """torch.distributed backends usable here, e.g. ['gloo', 'nccl unavailable']."""
    import torch.distributed as dist

    if not dist.is_available():
        return ["torch.distributed unavailable"]
    found = []
    for name, check in (
        ("gloo", dist.is_gloo_available),
        ("nccl", dist.is_nccl_available),
        ("mpi", dist.is_mpi_available),
    ):
        try:
            ok = bool(check())
        except Exception:
            ok = False
        found.append(name if ok else f"{name} unavailable")
    return found
