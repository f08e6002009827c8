"""Pools of 8 and 16 ranks on a small machine: start time, resident memory per rank, 2-D meshes.

For each world size: the pool start (``get_pool`` until every rank joined its process group),
each rank's resident memory (VmRSS, and PSS, which splits the pages the ranks share with the
forkserver they were forked from) right after the start and after the cases below, then per mesh
shape: the first case that asks for the mesh (the mesh's process groups are created:
:meth:`harness.RankContext.device_mesh`), the same case again (the mesh cached), and a tiny
hybrid forward+backward (``ring_attention(exchange="hybrid")``, batch 1, 16 heads, local length
8, head_dim 8, float32). Times are wall-clock seconds on this machine, the median of ``--repeat``.

Usage: ``python benchmarks/mesh_pools.py [--world-sizes 8,16] [--repeat 5] [--json PATH]``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

REPO_ROOT = Path(__file__).resolve().parents[1]
if str(REPO_ROOT) not in sys.path:
    sys.path.insert(0, str(REPO_ROOT))

from benchmarks import runner  # noqa: E402

SHAPES = {8: [(8, 1), (2, 4), (4, 2)], 16: [(4, 4), (2, 8)]}


def _kib(pid: int, field: str, path: str) -> int:
    with open(f"/proc/{pid}/{path}") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    return 0


def memory(pids: list[int]) -> dict[str, float]:
    """Resident and proportional set sizes of the ranks, MiB: min, median,
    max (RSS) and the PSS sum."""
    rss = [_kib(p, "VmRSS", "status") / 1024 for p in pids]
    pss = [_kib(p, "Pss", "smaps_rollup") / 1024 for p in pids]
    return {
        "rss_min": min(rss),
        "rss_median": statistics.median(rss),
        "rss_max": max(rss),
        "pss_median": statistics.median(pss),
        "pss_total": sum(pss),
    }


def mesh_case(ctx, shape: tuple[int, int]) -> float:
    t = time.perf_counter()
    ctx.device_mesh((shape[1], shape[0]), ("ring", "ulysses"))
    return time.perf_counter() - t


def hybrid_case(ctx, shape: tuple[int, int]) -> float:
    import torch

    import ring_impl

    mesh = ctx.device_mesh((shape[1], shape[0]), ("ring", "ulysses"))
    q, k, v = (torch.randn(1, 16, 8, 8, requires_grad=True) for _ in range(3))
    t = time.perf_counter()
    out = ring_impl.ring_attention(
        q,
        k,
        v,
        group=mesh,
        exchange="hybrid",
        is_causal=True,
        layout="head_tail",
        rotate_method="alltoall",
    )
    out.sum().backward()
    return time.perf_counter() - t


def measure(world_size: int, repeat: int) -> dict[str, Any]:
    from harness import get_pool, shutdown_all_pools

    pool = None

    def start() -> None:
        nonlocal pool
        pool = get_pool(world_size, backend="gloo", device="cpu")

    # Each start from no pool (the shutdown untimed); a first one in the process includes the
    # forkserver's torch import.
    starts = runner.measure(runner.Candidate(start, lambda: shutdown_all_pools() or ()), 0, repeat)
    assert pool is not None
    after_start = memory(pool.pids)
    rows = []
    for shape in SHAPES[world_size]:
        first = max(pool.run(mesh_case, shape, timeout=300))  # the slowest rank's group creation
        # the cached mesh case and the hybrid call, interleaved
        times = runner.interleave(
            {
                "cached": lambda shape=shape: pool.run(mesh_case, shape),
                "hybrid": lambda shape=shape: pool.run(hybrid_case, shape, timeout=300),
            },
            repeat,
        ).times
        rows.append(
            {
                "shape": f"{shape[0]}x{shape[1]}",
                "mesh_create_s": first,
                "cached_case_s": runner.median(times["cached"]),
                "hybrid_case_s": runner.median(times["hybrid"]),
            }
        )
    after_cases = memory(pool.pids)
    shutdown_all_pools()
    return {
        "world_size": world_size,
        "start_s": runner.median(starts),
        "start_all_s": starts,
        "memory_after_start_mib": after_start,
        "memory_after_cases_mib": after_cases,
        "meshes": rows,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--world-sizes", default="8,16")
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--json", default=str(REPO_ROOT / "reports" / "bench_mesh_pools.json"))
    args = parser.parse_args(argv)
    from harness.settings import install, resolve

    install(resolve({}).with_(case_timeout=300.0))
    results = [measure(int(w), args.repeat) for w in args.world_sizes.split(",")]
    print(f"cpus: {os.cpu_count()}, load average at the end: {os.getloadavg()[0]:.1f}")
    for r in results:
        m0, m1 = r["memory_after_start_mib"], r["memory_after_cases_mib"]
        print(
            f"W={r['world_size']}: pool start {r['start_s']:.2f} s (median; runs: "
            f"{', '.join(f'{s:.2f}' for s in r['start_all_s'])}: a first run in the process "
            "includes the forkserver's torch import); per rank after start RSS "
            f"{m0['rss_median']:.0f} MiB (min {m0['rss_min']:.0f}, max {m0['rss_max']:.0f}), PSS "
            f"{m0['pss_median']:.0f} MiB (all ranks {m0['pss_total']:.0f}); after the cases RSS "
            f"{m1['rss_median']:.0f} MiB (max {m1['rss_max']:.0f}), PSS {m1['pss_median']:.0f} "
            f"MiB (all ranks {m1['pss_total']:.0f})"
        )
        for row in r["meshes"]:
            print(
                f"  mesh {row['shape']} (ulysses x ring): first case (creates the mesh) "
                f"{row['mesh_create_s']:.2f} s, the same case again "
                f"{row['cached_case_s'] * 1e3:.1f} ms, tiny hybrid fwd+bwd "
                f"{row['hybrid_case_s'] * 1e3:.0f} ms"
            )
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(json.dumps(results, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
