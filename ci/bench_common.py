"""Helpers shared by the scripts in ci/: rank processes over gloo, memory high-water marks, timing.

Scripts in ci/ run as ``python ci/<script>.py`` from the repository root; importing this module
puts the root on ``sys.path`` so ``ring_impl``, ``reference`` and ``harness`` import.

Rank processes: :func:`run_world` spawns ``W`` fresh processes (``multiprocessing`` spawn), each
with ``threads`` intra-op threads and a gloo process group over a FileStore on loopback, runs
``fn(rank, world_size, *args)`` on every rank and returns the per-rank results. A rank that
raises makes the call raise with that rank's traceback, after the others are stopped.

Memory: :class:`PeakRss` reads the kernel's resident-set high-water mark (``VmHWM`` in
``/proc/self/status``) after resetting it (``echo 5 > /proc/self/clear_refs``), so the peak is
the physical memory the measured code really held, allocator caches included. To make that
track live tensors closely, the memory runs set ``MALLOC_MMAP_THRESHOLD_`` so glibc serves every
allocation above 64 KiB with its own mmap and returns it to the kernel when freed.
"""

from __future__ import annotations

import contextlib
import os
import re
import statistics
import sys
import tempfile
import time
import traceback
from collections.abc import Callable, Iterator
from typing import Any

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

__all__ = [
    "MEMORY_ENV",
    "ROOT",
    "PeakRss",
    "median",
    "run_world",
    "timed",
]

#: Environment for memory measurements: every allocation above 64 KiB is its own mmap, given
#: back to the kernel on free, so the RSS high-water mark follows the live tensors.
MEMORY_ENV = {"MALLOC_MMAP_THRESHOLD_": "65536", "MALLOC_TRIM_THRESHOLD_": "0"}


def median(values: list[float]) -> float:
    return float(statistics.median(values))


@contextlib.contextmanager
def timed(into: list[float]) -> Iterator[None]:
    """Append the wall time of the block (seconds) to ``into``."""
    t0 = time.perf_counter()
    try:
        yield
    finally:
        into.append(time.perf_counter() - t0)


def _status_kib(field: str) -> int:
    with open("/proc/self/status") as f:
        match = re.search(rf"^{field}:\s+(\d+) kB", f.read(), re.MULTILINE)
    if match is None:
        raise RuntimeError(f"/proc/self/status has no {field}; the memory benchmark needs Linux")
    return int(match.group(1))


class PeakRss:
    """Peak resident memory of this process above a baseline, in bytes.

    ``reset()`` takes the current RSS as the baseline and resets the kernel's high-water mark;
    ``peak()`` is the high-water mark since then minus the baseline.
    """

    def __init__(self) -> None:
        self.base = 0

    @staticmethod
    def supported() -> bool:
        try:
            with open("/proc/self/clear_refs", "w") as f:
                f.write("5")
            _status_kib("VmHWM")
            return True
        except OSError:
            return False

    def reset(self) -> None:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        self.base = _status_kib("VmRSS") * 1024

    def peak(self) -> int:
        return _status_kib("VmHWM") * 1024 - self.base


def _rank_main(rank: int, world_size: int, store_path: str, threads: int, fn: Callable, args: tuple, queue) -> None:
    from harness.procs import set_parent_death_signal

    set_parent_death_signal()
    import torch
    import torch.distributed as dist

    torch.set_num_threads(threads)
    try:
        store = dist.FileStore(store_path, world_size)
        dist.init_process_group("gloo", store=store, rank=rank, world_size=world_size)
        result = fn(rank, world_size, *args)
        queue.put((rank, True, result))
    except BaseException:  # reported to the parent, which owns the verdict
        queue.put((rank, False, traceback.format_exc()))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def run_world(
    world_size: int,
    fn: Callable[..., Any],
    *args: Any,
    threads: int = 1,
    env: dict[str, str] | None = None,
    timeout: float = 1800.0,
) -> list[Any]:
    """``[fn(rank, world_size, *args) for rank in range(world_size)]``, each in its own process.

    ``fn`` must be importable by reference (a module-level function). ``env`` is added to the
    ranks' environment (read by the C library at process start, e.g. malloc settings).
    """
    import multiprocessing as mp
    import queue as queue_mod

    ctx = mp.get_context("spawn")
    results: dict[int, Any] = {}
    saved = {k: os.environ.get(k) for k in (env or {})}
    os.environ.update(env or {})
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    with tempfile.TemporaryDirectory(prefix="ring_bench_") as tmp:
        q = ctx.Queue()
        procs = [
            ctx.Process(
                target=_rank_main,
                args=(rank, world_size, os.path.join(tmp, "store"), threads, fn, args, q),
                daemon=True,
            )
            for rank in range(world_size)
        ]
        try:
            for p in procs:
                p.start()
        finally:
            for k, v in saved.items():
                if v is None:
                    os.environ.pop(k, None)
                else:
                    os.environ[k] = v
        deadline = time.monotonic() + timeout
        try:
            while len(results) < world_size:
                try:
                    rank, ok, payload = q.get(timeout=max(0.1, min(5.0, deadline - time.monotonic())))
                except queue_mod.Empty:
                    dead = [p for p in procs if not p.is_alive() and p.exitcode not in (0, None)]
                    if dead:
                        raise RuntimeError(f"rank process {dead[0].pid} died ({dead[0].exitcode})") from None
                    if time.monotonic() > deadline:
                        raise TimeoutError(f"{fn.__name__} on W={world_size} did not finish in {timeout:.0f} s") from None
                    continue
                if not ok:
                    raise RuntimeError(f"rank {rank} of {world_size} failed in {fn.__name__}:\n{payload}")
                results[rank] = payload
            for p in procs:
                p.join(timeout=60)
        finally:
            for p in procs:
                if p.is_alive():
                    p.terminate()
                    p.join(timeout=10)
    return [results[r] for r in range(world_size)]
