"""Helpers shared by the benchmarks: the problem sizes, the command line, rank processes over
gloo, memory high-water marks, the run's environment and output.

The benchmarks run as ``python benchmarks/<name>.py`` or ``python -m benchmarks.<name>`` from the
repository root; importing this module puts the root on ``sys.path`` so ``ring_impl``,
``reference`` and ``harness`` import. Timing is :mod:`benchmarks.runner`'s.

Rank processes: :func:`run_world` starts a pool of the harness (:class:`harness.pool.RankPool`)
of ``W`` freshly spawned processes, each with ``threads`` intra-op threads and a gloo process
group, runs ``fn(rank, world_size, *args)`` on every rank as one case and returns the per-rank
results; the pool is stopped afterwards, so every call measures fresh processes. A rank that
raises, dies or hangs fails the call with every rank's traceback or stack.

Memory: :class:`PeakRss` reads the kernel's resident-set high-water mark (``VmHWM`` in
``/proc/self/status``) after resetting it (``echo 5 > /proc/self/clear_refs``), so the peak is
the physical memory the measured code really held, allocator caches included. To make that
track live tensors closely, the memory runs set ``MALLOC_MMAP_THRESHOLD_`` so glibc serves every
allocation above 64 KiB with its own mmap and returns it to the kernel when freed.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import platform
import re
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

__all__ = [
    "MEMORY_ENV",
    "ROOT",
    "PeakRss",
    "Sizes",
    "bench_args",
    "load_average",
    "no_cuda",
    "recorded_run",
    "run_world",
    "write_rows",
]

#: Environment for memory measurements: every allocation above 64 KiB is its own mmap, given
#: back to the kernel on free, so the RSS high-water mark follows the live tensors.
MEMORY_ENV = {"MALLOC_MMAP_THRESHOLD_": "65536", "MALLOC_TRIM_THRESHOLD_": "0"}


@dataclass
class Sizes:
    """The problem and the repetitions of a ring benchmark, the first fields of its settings:
    query/key/value (batch, heads, seq, head_dim) in ``dtype`` over the world sizes W, the
    global sequence ``seq`` measured ``repeat`` times after ``warmup`` calls at ``warmup_seq`` (a
    smaller size that runs every code path)."""

    batch: int = 1
    heads: int = 8
    head_dim: int = 64
    seq: int = 8192
    warmup_seq: int = 2048
    dtype: str = "float32"
    world_sizes: tuple[int, ...] = (2, 4)
    repeat: int = 3
    warmup: int = 1


def bench_args(
    argv: list[str] | None, doc: str, *, quick: str, repeat: int, json_name: str
) -> argparse.Namespace:
    """The command line ``argv`` of a one-table benchmark, parsed: the description (``doc``'s first
    paragraph), ``--quick`` (``quick`` says what it keeps), ``--repeat`` (default ``repeat``) and
    ``--out``/``--json`` (``args.out``), the JSON written (default
    ``reports/bench/<json_name>``)."""
    parser = argparse.ArgumentParser(description=doc.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help=quick)
    parser.add_argument("--repeat", type=int, default=repeat)
    parser.add_argument(
        "--out",
        "--json",
        dest="out",
        default=f"reports/bench/{json_name}",
        help="the JSON written (rows and settings)",
    )
    return parser.parse_args(argv)


def no_cuda(script: str) -> bool:
    """Whether this machine has no CUDA GPU; if so, ``script`` (the benchmark's path) says so on
    stderr, and the CUDA benchmark exits with status 2."""
    import torch

    if torch.cuda.is_available():
        return False
    print(f"{script}: needs a CUDA GPU (torch.cuda.is_available() is False)", file=sys.stderr)
    return True


@contextlib.contextmanager
def recorded_run(cores: int) -> Iterator[dict[str, Any]]:
    """``with recorded_run(cores) as env:`` around a benchmark's measurements: ``env`` holds the
    torch and python versions, ``cores``, the machine, the load average before (``load_before``)
    and the command line; on leaving, the load average after (``load_after``) and the seconds
    the block took (``wall_s``)."""
    import torch

    env: dict[str, Any] = {
        "torch": torch.__version__,
        "python": platform.python_version(),
        "cores": cores,
        "machine": platform.machine(),
        "load_before": load_average(),
        "argv": sys.argv[1:],
    }
    t0 = time.perf_counter()
    yield env
    env["load_after"] = load_average()
    env["wall_s"] = time.perf_counter() - t0


def load_average() -> str:
    """The 1, 5 and 15 minute load averages as text ("?" where the platform has none)."""
    try:
        return " ".join(f"{x:.1f}" for x in os.getloadavg())
    except OSError:
        return "?"


def write_rows(path: str, bench: dict[str, Any], rows: list[Any], t0: float) -> None:
    """Print the wall time since ``t0`` and the load, and write ``{"bench", "rows", "platform",
    "torch", "load", "wall_s"}`` as JSON to ``path`` (its directory created): the torch version
    and the load average at the end are what a table made from the rows names its run by."""
    import torch

    from benchmarks.runner import write_json

    wall, load = time.perf_counter() - t0, load_average()
    print(f"\nwall {wall:.0f} s; load average {load}")
    write_json(
        path,
        {
            "bench": bench,
            "rows": rows,
            "platform": platform.platform(),
            "torch": torch.__version__,
            "load": load,
            "wall_s": wall,
        },
    )


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


def _call(ctx, fn: Callable[..., Any], args: tuple[Any, ...]) -> Any:
    return fn(ctx.rank, ctx.world_size, *args)


def run_world(
    world_size: int,
    fn: Callable[..., Any],
    *args: Any,
    threads: int = 1,
    env: dict[str, str] | None = None,
    timeout: float = 1800.0,
) -> list[Any]:
    """``[fn(rank, world_size, *args) for rank in range(world_size)]``, on a fresh pool of the
    harness: each rank its own freshly spawned process, CPU + gloo (the pool's process group is
    the default group).

    ``fn`` must be importable by reference (a module-level function). ``env`` is added to the
    ranks' environment before their interpreters start (read by the C library at process start,
    e.g. malloc settings). A rank that raises, dies or outlives ``timeout`` makes the call raise
    the harness's :class:`~harness.errors.CaseFailure`, with every rank's traceback or stack.
    """
    from harness.pool import RankPool

    pool = RankPool(
        world_size,
        "gloo",
        "cpu",
        rank_threads=threads,
        rank_start="spawn",
        env=env,
        case_timeout=timeout,
    )
    try:
        return pool.run(_call, fn, args, timeout=timeout)
    finally:
        pool.shutdown()
