"""Benchmark of ring attention (issue 8): speed, balance, memory and traffic, all in one run.

Run from the repository root::

    python benchmarks/ring.py --quick     # seq 2048, a few minutes on 2 cores
    python benchmarks/ring.py             # seq 8192 (the issue's figures), 8 minutes on 2 cores
    python benchmarks/ring.py --analyse reports/bench/bench.json   # the tables of a run again

Writes ``bench.json`` and ``bench.png`` under ``--out`` (default ``reports/bench/``) and prints
the tables and the issue's aims with the measured figures. Timings are only compared as ratios
within one run on the same machine; nothing here is a timed assertion.

What is measured (float32, batch 1, 8 heads, head_dim 64 by default):

speed
    forward + backward of ``ring_impl.ring_attention`` at each world size W on CPU + gloo, every
    rank a process with one intra-op thread, against one process running SDPA (CPU flash,
    ``SDPBackend.FLASH_ATTENTION``) on the full sequence with W threads, and against PyTorch's
    own templated ring (``conformance.adapters.torch_cp``: ``_templated_ring_attention`` and its
    backward with the same CPU flash kernel). Non-causal (``contiguous``) and causal
    (``contiguous`` and ``head_tail``), every rotation. One warm-up call at a smaller size, then
    ``--repeat`` repetitions in which the configurations are interleaved; the time of one
    repetition is that of the slowest rank, from a common barrier to the end of its backward.
    The reported time is the fastest repetition: on a shared machine the other processes' load
    comes and goes within seconds and can double a repetition, and the fastest one is the least
    disturbed (the median is reported beside it). Also the process CPU seconds (all threads,
    gloo's included), summed over ranks: the work done, whatever the load; its ratio to SDPA's is
    the ring's overhead in work. And the seconds outside the attention kernel (elapsed minus
    kernel time, slowest rank): rotation, merging, accumulation and waiting, the part a ring
    implementation controls. The kernel is ~95% of a call here and its run-to-run noise hides
    differences between two rings in the total; outside the kernel they show.
balance
    per-rank time inside the attention kernel (the op is wrapped with a timer) for causal
    attention under ``contiguous`` and ``head_tail``: max / mean over ranks.
memory
    per-rank peak resident memory of one forward + backward, in a fresh set of processes per
    (sequence length, W): the kernel's RSS high-water mark (``VmHWM``, reset through
    ``/proc/self/clear_refs``) above the RSS before the inputs were created, so it counts the
    inputs (query, key, value, grad_out), the output, the gradients, every temporary and
    communication buffer, gloo's own copies included. glibc is told to serve allocations above
    64 KiB with mmap so freed memory leaves the RSS at once (see benchmarks/common.py). W=1 is
    single-process SDPA on the full sequence.
memory-lean configurations (``hcN``)
    the ring with ``head_chunks=N`` (``--lean-head-chunks``, default 4): N rings one after
    another over groups of heads, so the blocks and accumulators in flight and the kernel's
    step results are 1/N as large (``ring_impl.exchanges.heads``). In the speed, balance, traffic
    and memory tables beside the default (``head_chunks=1``).
traffic
    the collectives each rank issued in the first measured call, recorded per phase with
    ``harness.accounting.CollectiveLog``, turned into bytes the rank sends: all-gather
    ``(W-1) x input``; reduce-scatter ``(W-1)/W x input`` (what the collective must send) and, on
    gloo, which implements it as a clone plus an all-reduce, ``2 (W-1)/W x input``;
    all-to-all ``input`` (the rings send everything to one neighbour); send ``bytes``. The
    minimum of a ring: forward ``(W-1) kv``, backward ``(W-1) (kv + dkv)`` (every other rank's
    key/value must arrive once per pass, and every block's partial dK/dV, in float32, must reach
    its owner once). The declared ``ring_impl.collective_schedule`` is compared exactly.
score_mod (``--score-mod``: this section alone)
    forward + backward of the ring with ``score_mod=ring_impl.score_mods.SoftCap(50.0)``
    (Gemma 2's attention soft-cap) against the plain call, causal ``head_tail``, at each world
    size: the plain call on the same kernel (``op="math"``: what a score_mod runs on, the one
    built-in op that takes one) and on the kernel ``op="auto"`` picks without a score_mod (CPU
    flash). Ratios: softcap / plain math (the cost of modifying the scores) and softcap / plain
    CPU flash (the cost of a score_mod call against an unmodified one). Interleaved repetitions,
    the slowest rank's time, the fastest repetition reported.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import json
import os
import platform
import sys
import time
from dataclasses import asdict, dataclass, field
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.common import MEMORY_ENV, PeakRss, Sizes, load_average, recorded_run, run_world
from benchmarks.runner import (
    Candidate,
    across_ranks,
    interleave,
    median,
    summarize,
    timing_row,
    write_json,
)

RING_ROTATIONS = ("allgather", "alltoall", "p2p")
TORCH_ROTATIONS = ("allgather", "alltoall")
#: aims: non-causal and causal ``head_tail`` ring / SDPA at most these; per-rank peak memory
#: at the longest sequence and W=4 at most AIM_MEMORY of one process's
AIM_FULL, AIM_CAUSAL, AIM_MEMORY = 1.15, 1.25, 0.35
#: (causal, layout) variants of the speed benchmark
VARIANTS = ((False, "contiguous"), (True, "contiguous"), (True, "head_tail"))
MiB = 1024 * 1024


@dataclass
class Bench(Sizes):
    ring_rotations: tuple[str, ...] = RING_ROTATIONS
    torch_rotations: tuple[str, ...] = TORCH_ROTATIONS
    scaling_seqs: tuple[int, ...] = (2048, 4096, 8192, 16384)
    scaling_world_sizes: tuple[int, ...] = (1, 2, 4)
    scaling_rotations: tuple[str, ...] = ("allgather", "alltoall")
    #: the memory-lean configuration: the ring run over this many head groups (0: left out)
    lean_head_chunks: int = 4
    lean_rotations: tuple[str, ...] = ("alltoall",)
    cores: int = field(default_factory=lambda: os.cpu_count() or 1)


# ------------------------------------------------------------------------------------------
# Rank side
# ------------------------------------------------------------------------------------------


class KernelTimer:
    """Seconds spent inside the attention kernel on this rank (CPU ops are synchronous)."""

    def __init__(self) -> None:
        self.total = 0.0

    def wrap(self, fn):
        def timed(*args, **kwargs):
            t0 = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self.total += time.perf_counter() - t0

        return timed


def _timed_ring_op(timer: KernelTimer):
    from ring_impl.ops import CpuFlashOp

    class TimedCpuFlashOp(CpuFlashOp):
        name = "cpu_flash_timed"

        def forward(self, *args, **kwargs):
            return timer.wrap(super().forward)(*args, **kwargs)

        def backward(self, *args, **kwargs):
            return timer.wrap(super().backward)(*args, **kwargs)

    return TimedCpuFlashOp()


def _configs(world: int, b: Bench) -> list[dict[str, Any]]:
    """The speed configurations of one world size, in the order each repetition runs them."""
    out: list[dict[str, Any]] = []
    threads = [world] + ([b.cores] if world > b.cores else [])
    for causal in (False, True):
        for t in threads:
            out.append(
                {
                    "name": f"sdpa {'causal' if causal else 'full'} {t}t",
                    "impl": "sdpa",
                    "causal": causal,
                    "layout": "-",
                    "rotate": "-",
                    "threads": t,
                }
            )
    for causal, layout in VARIANTS:
        kind = "causal" if causal else "full"
        for rot in b.ring_rotations:
            out.append(
                {
                    "name": f"ring {kind} {layout} {rot}",
                    "impl": "ring",
                    "causal": causal,
                    "layout": layout,
                    "rotate": rot,
                    "threads": 1,
                }
            )
        for rot in b.lean_rotations if b.lean_head_chunks > 1 else ():
            out.append(
                {
                    "name": f"ring {kind} {layout} {rot}{_hc(b.lean_head_chunks)}",
                    "impl": "ring",
                    "causal": causal,
                    "layout": layout,
                    "rotate": rot,
                    "threads": 1,
                    "head_chunks": b.lean_head_chunks,
                }
            )
        for rot in b.torch_rotations:
            out.append(
                {
                    "name": f"torch {kind} {layout} {rot}",
                    "impl": "torch",
                    "causal": causal,
                    "layout": layout,
                    "rotate": rot,
                    "threads": 1,
                }
            )
    return out


def _sdpa_fwd_bwd(q, k, v, do, causal: bool) -> tuple[float, float]:
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel

    q, k, v = (t.detach().requires_grad_() for t in (q, k, v))
    t0 = time.perf_counter()
    with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
        out = F.scaled_dot_product_attention(q, k, v, is_causal=causal)
    t1 = time.perf_counter()
    out.backward(do)
    t2 = time.perf_counter()
    del out
    return t2 - t0, t1 - t0


def _speed_rank(rank: int, world: int, b_dict: dict) -> dict:
    import torch
    import torch.distributed as dist

    import ring_impl
    from conformance.adapters import torch_cp
    from harness.accounting import CollectiveLog

    b = Bench(**b_dict)
    timer = KernelTimer()
    torch_cp.FLASH_FORWARD = timer.wrap(torch_cp.FLASH_FORWARD)
    torch_cp.FLASH_BACKWARD = timer.wrap(torch_cp.FLASH_BACKWARD)
    ring_op = _timed_ring_op(timer)
    dtype = getattr(torch, b.dtype)

    def inputs(seq: int):
        gen = torch.Generator().manual_seed(0)
        full = [
            torch.randn(b.batch, b.heads, seq, b.head_dim, generator=gen, dtype=dtype)
            for _ in range(4)
        ]
        return full, {
            layout: [ring_impl.shard(t, world, rank, layout=layout) for t in full]
            for layout in ring_impl.LAYOUTS
        }

    configs = _configs(world, b)
    traffic: dict[str, Any] = {c["name"]: None for c in configs}

    def sdpa(c: dict, full: list) -> Candidate:
        def call() -> dict[str, float]:
            # Rank 0 runs the single process with W threads; the other ranks return at once and
            # wait, asleep, in the next call's barrier.
            if rank != 0:
                return {}
            torch.set_num_threads(c["threads"])
            try:
                return {"forward": _sdpa_fwd_bwd(*full, c["causal"])[1]}
            finally:
                torch.set_num_threads(1)

        return Candidate(call)

    def ring(c: dict, shards: dict, record: bool) -> Candidate:
        q0, k0, v0, do = shards[c["layout"]]

        def call(q, k, v) -> dict[str, float]:
            # The collectives of the first recorded call are logged: the log's dispatch mode
            # costs microseconds per op, nothing against a kernel of seconds.
            log = CollectiveLog() if record and traffic[c["name"]] is None else None
            phase = log.phase if log is not None else (lambda name: contextlib.nullcontext())
            timer.total = 0.0
            with log if log is not None else contextlib.nullcontext():
                t0 = time.perf_counter()
                with phase("forward"):
                    if c["impl"] == "ring":
                        out = ring_impl.ring_attention(
                            q,
                            k,
                            v,
                            is_causal=c["causal"],
                            layout=c["layout"],
                            rotate_method=c["rotate"],
                            op=ring_op,
                            head_chunks=c.get("head_chunks", 1),
                        )
                    else:
                        out = torch_cp.IMPLEMENTATION.ring_attention(
                            q,
                            k,
                            v,
                            is_causal=c["causal"],
                            layout=c["layout"],
                            rotate_method=c["rotate"],
                        )
                forward = time.perf_counter() - t0
                with phase("backward"):
                    out.backward(do)
            if log is not None:
                traffic[c["name"]] = log.summary()
            return {"forward": forward, "compute": timer.total}

        return Candidate(call, lambda: [t.detach().requires_grad_() for t in (q0, k0, v0)])

    def candidates(seq: int, record: bool) -> dict[str, Candidate]:
        full, shards = inputs(seq)
        return {
            c["name"]: sdpa(c, full) if c["impl"] == "sdpa" else ring(c, shards, record)
            for c in configs
        }

    # Warm-up at a smaller size (every code path once), then the recorded rounds; each round
    # runs every configuration once, from a common barrier.
    interleave(candidates(b.warmup_seq, False), b.warmup, before=dist.barrier)
    s = interleave(candidates(b.seq, True), b.repeat, before=dist.barrier)
    return {
        c["name"]: {
            "config": c,
            "elapsed": s.times[c["name"]],
            "forward": s.extra[c["name"]].get("forward", []),
            "compute": s.extra[c["name"]].get("compute", []),
            "cpu": s.cpu[c["name"]],
            "traffic": traffic[c["name"]],
        }
        for c in configs
    }


#: the score_mod section's configurations: (name, op, soft-cap or None)
SCORE_MOD_CONFIGS = (
    ("plain cpu_flash", "auto", None),
    ("plain math", "math", None),
    ("softcap math", "auto", 50.0),
)


def _score_mod_rank(rank: int, world: int, b_dict: dict) -> dict:
    """Seconds (forward + backward, from a common barrier) of each SCORE_MOD_CONFIGS entry, per
    recorded round, on this rank."""
    import torch
    import torch.distributed as dist

    import ring_impl
    from ring_impl.score_mods import SoftCap

    b = Bench(**b_dict)
    torch.set_num_threads(1)
    dtype = getattr(torch, b.dtype)

    def candidates(seq: int) -> dict[str, Candidate]:
        gen = torch.Generator().manual_seed(0)
        full = [
            torch.randn(b.batch, b.heads, seq, b.head_dim, generator=gen, dtype=dtype)
            for _ in range(4)
        ]
        q0, k0, v0, do = (ring_impl.shard(t, world, rank, layout="head_tail") for t in full)

        def call(op: str, cap: float | None) -> Candidate:
            def run(q, k, v) -> None:
                ring_impl.ring_attention(
                    q,
                    k,
                    v,
                    is_causal=True,
                    layout="head_tail",
                    rotate_method="alltoall",
                    op=op,
                    score_mod=None if cap is None else SoftCap(cap),
                ).backward(do)

            return Candidate(run, lambda: [t.detach().requires_grad_() for t in (q0, k0, v0)])

        return {name: call(op, cap) for name, op, cap in SCORE_MOD_CONFIGS}

    interleave(candidates(b.warmup_seq), b.warmup, before=dist.barrier)
    return interleave(candidates(b.seq), b.repeat, before=dist.barrier).times


def run_score_mod(b: Bench) -> list[dict]:
    """One row per world size: each configuration's time (slowest rank, fastest round) and
    the ratios of the soft-capped call to the plain ones."""
    rows = []
    for world in b.world_sizes:
        per_rank = run_world(world, _score_mod_rank, asdict(b), timeout=3600)
        slowest = {
            name: across_ranks([r[name] for r in per_rank]) for name, _, _ in SCORE_MOD_CONFIGS
        }
        row: dict[str, Any] = {"world": world}
        for name, stats in summarize(slowest, "softcap math").items():
            row[name], row[f"{name} median"] = stats.min, stats.median
        row["softcap / plain math"] = row["softcap math"] / row["plain math"]
        row["softcap / plain cpu_flash"] = row["softcap math"] / row["plain cpu_flash"]
        rows.append(row)
    print(
        f"\nscore_mod: forward+backward, causal head_tail, alltoall, {b.dtype}, batch {b.batch}, "
        f"heads {b.heads}, head_dim {b.head_dim}, seq {b.seq}; slowest rank, "
        f"fastest of {b.repeat}"
    )
    print(
        f"{'W':>2} {'plain cpu_flash s':>17} {'plain math s':>12} {'softcap s':>9} "
        f"{'softcap/math':>12} {'softcap/cpu_flash':>17}"
    )
    for r in rows:
        print(
            f"{r['world']:>2} {r['plain cpu_flash']:>17.3f} {r['plain math']:>12.3f} "
            f"{r['softcap math']:>9.3f} {r['softcap / plain math']:>12.2f} "
            f"{r['softcap / plain cpu_flash']:>17.2f}"
        )
    return rows


def _scaling_rank(rank: int, world: int, b_dict: dict, seq: int) -> dict:
    """Peak memory and time of one forward + backward per configuration, at one sequence length."""
    import torch

    import ring_impl
    from conformance.adapters import torch_cp

    b = Bench(**b_dict)
    dtype = getattr(torch, b.dtype)
    mem = PeakRss()
    if world == 1:
        configs = [{"name": "sdpa", "impl": "sdpa", "threads": min(2, b.cores)}]
    else:
        configs = [{"name": f"ring {r}", "impl": "ring", "rotate": r} for r in b.scaling_rotations]
        if b.lean_head_chunks > 1:
            configs += [
                {
                    "name": f"ring {r}{_hc(b.lean_head_chunks)}",
                    "impl": "ring",
                    "rotate": r,
                    "head_chunks": b.lean_head_chunks,
                }
                for r in b.scaling_rotations
            ]
        configs += [
            {"name": f"torch {r}", "impl": "torch", "rotate": r}
            for r in b.scaling_rotations
            if r in TORCH_ROTATIONS
        ]
    out: dict[str, Any] = {}
    for c in configs:
        for size in (min(1024, seq), seq):  # a small warm-up call, then the measured one
            local = size // world
            mem.reset()
            gen = torch.Generator().manual_seed(rank)
            q, k, v, do = (
                torch.randn(b.batch, b.heads, local, b.head_dim, generator=gen, dtype=dtype)
                for _ in range(4)
            )
            inputs = mem.peak()
            q, k, v = (t.requires_grad_() for t in (q, k, v))
            if world > 1:
                torch.distributed.barrier()
            t0 = time.perf_counter()
            if c["impl"] == "sdpa":
                torch.set_num_threads(c["threads"])
                _sdpa_fwd_bwd(q, k, v, do, True)
                torch.set_num_threads(1)
            else:
                extra = {"head_chunks": c["head_chunks"]} if "head_chunks" in c else {}
                fn = (
                    ring_impl.ring_attention
                    if c["impl"] == "ring"
                    else torch_cp.IMPLEMENTATION.ring_attention
                )
                o = fn(
                    q, k, v, is_causal=True, layout="head_tail", rotate_method=c["rotate"], **extra
                )
                o.backward(do)
                del o
            elapsed = time.perf_counter() - t0
            peak = mem.peak()
            del q, k, v, do
        out[c["name"]] = {"peak": peak, "inputs": inputs, "elapsed": elapsed}
    return out


# ------------------------------------------------------------------------------------------
# Driver side
# ------------------------------------------------------------------------------------------


def _hc(head_chunks: int) -> str:
    """The name suffix of a head_chunks configuration (none for one ring over all heads)."""
    return f" hc{head_chunks}" if head_chunks > 1 else ""


def _outside_kernel(row: dict) -> float:
    """Seconds outside the attention kernel of the slowest rank (elapsed minus kernel time)."""
    return max(e - k for e, k in zip(row["elapsed_per_rank"], row["compute_per_rank"]))


def _sent_bytes(summary: dict, world: int, gloo: bool) -> dict[str, int]:
    """Bytes a rank sends per phase from its collective log (see the module docstring)."""
    out = {}
    for phase in ("forward", "backward"):
        total = 0
        for kind, e in summary.get(phase, {}).items():
            n = e["bytes"]
            if kind == "all_gather":
                total += (world - 1) * n
            elif kind == "reduce_scatter":
                total += (2 if gloo else 1) * (world - 1) * n // world
            elif kind in ("all_to_all", "send"):
                total += n
        out[phase] = total
    return out


def _control_bytes(summary: dict) -> int:
    return sum(e["bytes"] for p in summary.values() for k, e in p.items() if k == "all_reduce")


def run_speed(b: Bench) -> dict:
    report: dict[str, Any] = {}
    for world in b.world_sizes:
        t0 = time.perf_counter()
        per_rank = run_world(world, _speed_rank, asdict(b), timeout=3600)
        rows = {}
        for name in per_rank[0]:
            c = per_rank[0][name]["config"]
            ranks = [per_rank[0]] if c["impl"] == "sdpa" else per_rank  # SDPA runs on rank 0

            def rounds(key: str, reduce=max, ranks=ranks, name=name) -> list[float]:
                return across_ranks([r[name][key] for r in ranks], reduce)

            rows[name] = {
                **timing_row(c, rounds("elapsed")),
                "forward": min(rounds("forward")),
                "cpu": median(rounds("cpu", sum)),
            }
            if c["impl"] != "sdpa":
                rows[name].update(
                    compute_per_rank=[median(per_rank[r][name]["compute"]) for r in range(world)],
                    elapsed_per_rank=[median(per_rank[r][name]["elapsed"]) for r in range(world)],
                    traffic_per_rank=[per_rank[r][name]["traffic"] for r in range(world)],
                )
        report[str(world)] = {"rows": rows, "wall_s": time.perf_counter() - t0}
        print(f"  speed W={world}: {time.perf_counter() - t0:.0f} s", flush=True)
    return report


def run_scaling(b: Bench) -> dict:
    report: dict[str, Any] = {}
    for seq in b.scaling_seqs:
        for world in b.scaling_world_sizes:
            if seq % (2 * world):
                continue
            t0 = time.perf_counter()
            per_rank = run_world(world, _scaling_rank, asdict(b), seq, env=MEMORY_ENV, timeout=3600)
            for name in per_rank[0]:
                report.setdefault(str(seq), {})[f"W={world} {name}"] = {
                    "world": world,
                    "impl": name,
                    "peak_per_rank": [r[name]["peak"] for r in per_rank],
                    "inputs_per_rank": [r[name]["inputs"] for r in per_rank],
                    "time": max(r[name]["elapsed"] for r in per_rank),
                }
            print(f"  scaling seq={seq} W={world}: {time.perf_counter() - t0:.0f} s", flush=True)
    return report


def analyse(b: Bench, speed: dict, scaling: dict) -> dict:
    """Ratios, balance, traffic against the minimum, and the aims of issue 8."""
    import torch

    import ring_impl

    itemsize = getattr(torch, b.dtype).itemsize
    out: dict[str, Any] = {"speed": [], "balance": [], "traffic": [], "memory": [], "aims": []}
    for w, entry in speed.items():
        world = int(w)
        rows = entry["rows"]
        sdpa = {
            c: rows[f"sdpa {'causal' if c else 'full'} {world}t"]["time"] for c in (False, True)
        }
        sdpa_cpu = {
            c: rows[f"sdpa {'causal' if c else 'full'} {world}t"]["cpu"] for c in (False, True)
        }
        sdpa_median = {
            c: rows[f"sdpa {'causal' if c else 'full'} {world}t"]["time_median"]
            for c in (False, True)
        }
        for name, r in rows.items():
            c = r["config"]
            row = {
                "W": world,
                "name": name,
                "impl": c["impl"],
                "causal": c["causal"],
                "layout": c["layout"],
                "rotate": c["rotate"],
                "threads": c["threads"],
                "time_s": r["time"],
                "forward_s": r["forward"],
                "median_s": r["time_median"],
                "vs_sdpa": r["time"] / sdpa[c["causal"]],
                "median_vs_sdpa": r["time_median"] / sdpa_median[c["causal"]],
                "cpu_s": r["cpu"],
                "cpu_vs_sdpa": r["cpu"] / sdpa_cpu[c["causal"]],
            }
            if c["impl"] != "sdpa":
                # Seconds outside the attention kernel (rotation, merge, accumulation, waiting),
                # the slowest rank's: the part a ring implementation controls, free of the
                # kernel's run-to-run noise (the kernel is ~95% of a call here).
                row["overhead_s"] = _outside_kernel(r)
            if c["impl"] == "ring":
                kind = "causal" if c["causal"] else "full"
                torch_rows = {
                    rot: rows[f"torch {kind} {c['layout']} {rot}"] for rot in b.torch_rotations
                }
                torch_times = {rot: t["time"] for rot, t in torch_rows.items()}
                same = torch_times.get(c["rotate"])
                row["vs_torch_same_rotation"] = r["time"] / same if same else None
                row["vs_torch_best"] = (
                    r["time"] / min(torch_times.values()) if torch_times else None
                )
                torch_overheads = {rot: _outside_kernel(t) for rot, t in torch_rows.items()}
                row["torch_overhead_s"] = torch_overheads.get(
                    c["rotate"], min(torch_overheads.values(), default=None)
                )
            out["speed"].append(row)
            if c["impl"] in ("ring", "torch") and c["causal"]:
                comp = r["compute_per_rank"]
                out["balance"].append(
                    {
                        "W": world,
                        "impl": c["impl"],
                        "layout": c["layout"],
                        "rotate": c["rotate"],
                        "head_chunks": c.get("head_chunks", 1),
                        "compute_per_rank_s": comp,
                        "max_over_mean": max(comp) / (sum(comp) / len(comp)),
                    }
                )
            if (
                c["impl"] in ("ring", "torch")
                and c["layout"] in ("contiguous",)
                and not c["causal"]
            ):
                local = b.seq // world
                kv = 2 * b.batch * b.heads * local * b.head_dim * itemsize
                dkv = 2 * b.batch * b.heads * local * b.head_dim * 4
                minimum = {"forward": (world - 1) * kv, "backward": (world - 1) * (kv + dkv)}
                traffic = r["traffic_per_rank"]
                sent = [_sent_bytes(t, world, gloo=False) for t in traffic]
                wire = [_sent_bytes(t, world, gloo=True) for t in traffic]
                declared_ok = None
                if c["impl"] == "ring":
                    declared = ring_impl.collective_schedule(
                        world,
                        c["rotate"],
                        batch=b.batch,
                        heads_kv=b.heads,
                        seq_kv=local,
                        head_dim=b.head_dim,
                        dtype=getattr(torch, b.dtype),
                        head_chunks=c.get("head_chunks", 1),
                    )
                    declared_ok = all(
                        {p: t.get(p, {}) for p in ("forward", "backward")} == declared
                        for t in traffic
                    )
                for phase in ("forward", "backward"):
                    out["traffic"].append(
                        {
                            "W": world,
                            "impl": c["impl"],
                            "rotate": c["rotate"],
                            "phase": phase,
                            "head_chunks": c.get("head_chunks", 1),
                            "calls": {k: e["calls"] for k, e in traffic[0].get(phase, {}).items()},
                            "sent_bytes": max(s[phase] for s in sent),
                            "gloo_wire_bytes": max(s[phase] for s in wire),
                            "minimum_bytes": minimum[phase],
                            "ratio": max(s[phase] for s in sent) / minimum[phase],
                            "gloo_ratio": max(s[phase] for s in wire) / minimum[phase],
                            "control_bytes": _control_bytes(traffic[0])
                            if phase == "forward"
                            else 0,
                            "declared_equals_measured": declared_ok,
                        }
                    )
    for seq, entries in scaling.items():
        single = entries.get("W=1 sdpa")
        for name, e in entries.items():
            peak = max(e["peak_per_rank"])
            out["memory"].append(
                {
                    "seq": int(seq),
                    "name": name,
                    "W": e["world"],
                    "peak_per_rank_MiB": peak / MiB,
                    "inputs_MiB": max(e["inputs_per_rank"]) / MiB,
                    "vs_single": peak / max(single["peak_per_rank"]) if single else None,
                    "time_s": e["time"],
                }
            )
    out["aims"] = _aims(b, out)
    return out


def _analysis(b: Bench, speed: dict, scaling: dict) -> dict:
    """:func:`analyse`, also for a run without the
    speed part (then no world size has speed rows)."""
    return analyse(b if speed else Bench(**{**asdict(b), "world_sizes": ()}), speed, scaling)


def _aims(b: Bench, a: dict) -> list[dict]:
    aims = []
    speed = {(r["W"], r["name"]): r for r in a["speed"]}
    for world in b.world_sizes:
        for rot in b.ring_rotations:
            lean = (
                [_hc(b.lean_head_chunks)]
                if rot in b.lean_rotations and b.lean_head_chunks > 1
                else []
            )
            for suffix in ["", *lean]:
                for kind, bound in (
                    ("full contiguous", AIM_FULL),
                    ("causal head_tail", AIM_CAUSAL),
                ):
                    r = speed[(world, f"ring {kind} {rot}{suffix}")]
                    what = "non-causal" if kind.startswith("full") else "causal head_tail"
                    aims.append(
                        {
                            "aim": (
                                f"W={world} {rot}{suffix}: {what} ring <= {bound}x SDPA ({world} "
                                "threads)"
                            ),
                            "measured": f"{r['vs_sdpa']:.2f}x",
                            "met": r["vs_sdpa"] <= bound,
                        }
                    )
            nc = speed[(world, f"ring full contiguous {rot}")]
            ht = speed[(world, f"ring causal head_tail {rot}")]
            for r in (nc, ht, speed[(world, f"ring causal contiguous {rot}")]):
                if r["vs_torch_best"] is None:  # PyTorch's ring was not run (--rotations)
                    continue
                key = (
                    "vs_torch_same_rotation"
                    if r["vs_torch_same_rotation"] is not None
                    else "vs_torch_best"
                )
                label = "same rotation" if key == "vs_torch_same_rotation" else "its best rotation"
                aims.append(
                    {
                        "aim": f"W={world} {r['name']} <= PyTorch's ring ({label})",
                        "measured": f"{r[key]:.2f}x",
                        "met": r[key] <= 1.0,
                    }
                )
                if r["torch_overhead_s"] is not None:
                    aims.append(
                        {
                            "aim": (
                                f"W={world} {r['name']}: seconds outside the kernel <= PyTorch's "
                                f"({label})"
                            ),
                            "measured": f"{r['overhead_s']:.3f} vs {r['torch_overhead_s']:.3f}",
                            "met": r["overhead_s"] <= r["torch_overhead_s"],
                        }
                    )
    longest = max((m["seq"] for m in a["memory"]), default=None)
    for m in a["memory"]:
        if m["seq"] == longest and m["W"] == 4 and m["vs_single"] is not None:
            aims.append(
                {
                    "aim": (
                        f"seq={longest} {m['name']}: per-rank peak <= {AIM_MEMORY}x single-process"
                    ),
                    "measured": f"{m['vs_single']:.2f}x",
                    "met": m["vs_single"] <= AIM_MEMORY,
                }
            )
    for t in a["traffic"]:
        if t["impl"] == "ring":
            aims.append(
                {
                    "aim": (
                        f"W={t['W']} ring {t['rotate']}{_hc(t['head_chunks'])} {t['phase']}: "
                        "traffic = minimum"
                    ),
                    "measured": f"{t['ratio']:.2f}x (gloo wire {t['gloo_ratio']:.2f}x)",
                    "met": abs(t["ratio"] - 1.0) < 1e-9,
                }
            )
    return aims


def print_report(b: Bench, a: dict, env: dict) -> None:
    from tabulate import tabulate

    print(
        f"\nring attention benchmark: batch {b.batch}, heads {b.heads}, head_dim {b.head_dim}, "
        f"{b.dtype}, seq {b.seq}; torch {env['torch']}, {env['cores']} cores, load "
        f"{env['load_before']} -> {env['load_after']}"
    )
    print(
        f"{b.repeat} repetitions after {b.warmup} warm-up at seq {b.warmup_seq}, configurations "
        "interleaved; time = slowest rank, forward + backward;\n'time' is the fastest repetition "
        "(the one least disturbed by other processes), 'median' the median; CPU = process CPU "
        "seconds summed over ranks (median)\n"
    )
    rows = [
        [
            r["W"],
            r["name"],
            r["threads"],
            f"{r['time_s']:.3f}",
            f"{r['forward_s']:.3f}",
            f"{r['vs_sdpa']:.2f}",
            "" if r.get("vs_torch_same_rotation") is None else f"{r['vs_torch_same_rotation']:.2f}",
            "" if r.get("vs_torch_best") is None else f"{r['vs_torch_best']:.2f}",
            f"{r['median_s']:.3f}",
            f"{r['median_vs_sdpa']:.2f}",
            "" if r.get("overhead_s") is None else f"{r['overhead_s']:.3f}",
            f"{r['cpu_s']:.2f}",
            f"{r['cpu_vs_sdpa']:.2f}",
        ]
        for r in a["speed"]
    ]
    print(
        tabulate(
            rows,
            headers=[
                "W",
                "configuration",
                "thr",
                "time s",
                "fwd s",
                "x SDPA",
                "x torch same rot",
                "x torch best",
                "median s",
                "median x SDPA",
                "outside kernel s",
                "CPU s",
                "CPU x SDPA",
            ],
        )
    )
    print("\nbalance: per-rank seconds in the attention kernel, causal")
    rows = [
        [
            r["W"],
            r["impl"],
            r["layout"],
            r["rotate"] + _hc(r["head_chunks"]),
            " ".join(f"{x:.2f}" for x in r["compute_per_rank_s"]),
            f"{r['max_over_mean']:.2f}",
        ]
        for r in a["balance"]
        if r["rotate"] in ("allgather", "alltoall")
    ]
    print(
        tabulate(rows, headers=["W", "impl", "layout", "rotate", "kernel s per rank", "max/mean"])
    )
    print("\nmemory: per-rank peak RSS of forward + backward (inputs included), causal head_tail")
    rows = [
        [
            m["seq"],
            m["name"],
            f"{m['peak_per_rank_MiB']:.1f}",
            f"{m['inputs_MiB']:.1f}",
            "" if m["vs_single"] is None else f"{m['vs_single']:.2f}",
            f"{m['time_s']:.2f}",
        ]
        for m in a["memory"]
    ]
    print(
        tabulate(
            rows,
            headers=["seq", "configuration", "peak MiB/rank", "inputs MiB", "x single", "time s"],
        )
    )
    print("\ntraffic: bytes each rank sends (non-causal; causal issues the same collectives)")
    rows = [
        [
            t["W"],
            t["impl"],
            t["rotate"] + _hc(t["head_chunks"]),
            t["phase"],
            " ".join(f"{k}:{v}" for k, v in t["calls"].items()),
            t["sent_bytes"],
            t["minimum_bytes"],
            f"{t['ratio']:.2f}",
            f"{t['gloo_ratio']:.2f}",
            ""
            if t["declared_equals_measured"] is None
            else ("yes" if t["declared_equals_measured"] else "NO"),
        ]
        for t in a["traffic"]
    ]
    print(
        tabulate(
            rows,
            headers=[
                "W",
                "impl",
                "rotate",
                "phase",
                "calls",
                "sent B",
                "minimum B",
                "x min",
                "x min (gloo wire)",
                "declared = measured",
            ],
        )
    )
    print("\naims of issue 8")
    print(
        tabulate(
            [[x["aim"], x["measured"], "met" if x["met"] else "NOT met"] for x in a["aims"]],
            headers=["aim", "measured", ""],
        )
    )


def plot(a: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    series: dict[str, list[tuple[int, float, float]]] = {}
    for m in a["memory"]:
        series.setdefault(m["name"], []).append((m["seq"], m["time_s"], m["peak_per_rank_MiB"]))
    fig, (ax_t, ax_m) = plt.subplots(1, 2, figsize=(12, 4.8))
    for name, pts in sorted(series.items()):
        pts.sort()
        xs = [p[0] for p in pts]
        style = "-" if "ring" in name else ("--" if "torch" in name else ":")
        ax_t.plot(xs, [p[1] for p in pts], style, marker="o", label=name)
        ax_m.plot(xs, [p[2] for p in pts], style, marker="o", label=name)
    for ax, title, ylabel in (
        (ax_t, "forward + backward time (causal, head_tail)", "seconds (slowest rank)"),
        (ax_m, "peak memory per rank (inputs included)", "MiB"),
    ):
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("sequence length")
        ax.set_ylabel(ylabel)
        ax.set_title(title)
        ax.grid(True, which="both", alpha=0.3)
    ax_m.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description="Ring attention benchmark: speed, balance, memory and traffic"
    )
    parser.add_argument(
        "--quick", action="store_true", help="Small sizes for a run of a few minutes"
    )
    parser.add_argument(
        "--seq", type=int, help="Global sequence length of the speed benchmark (default 8192)"
    )
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--head-dim", type=int, default=64)
    parser.add_argument(
        "--dtype", default="float32", choices=["float32", "bfloat16", "float16", "float64"]
    )
    parser.add_argument(
        "--world-sizes",
        type=int,
        nargs="+",
        help="World sizes of the speed benchmark (default 2 4)",
    )
    parser.add_argument(
        "--repeat",
        type=int,
        help="Measured repetitions; the fastest is reported, the median beside it (default 3)",
    )
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument(
        "--scaling-seqs", type=int, nargs="*", help="Sequence lengths of the memory/time sweep"
    )
    parser.add_argument(
        "--out", default="reports/bench", help="Output directory for bench.json and bench.png"
    )
    parser.add_argument(
        "--json",
        help="the JSON written (default: OUT/bench.json, with --score-mod OUT/score_mod.json)",
    )
    parser.add_argument(
        "--rotations",
        nargs="+",
        choices=RING_ROTATIONS,
        help=(
            "Rotation methods of the speed benchmark (default: all; PyTorch's ring runs those it "
            "has)"
        ),
    )
    parser.add_argument(
        "--lean-head-chunks",
        type=int,
        default=Bench.lean_head_chunks,
        help="head_chunks of the memory-lean ring configurations (0: leave them out)",
    )
    parser.add_argument(
        "--analyse",
        metavar="BENCH_JSON",
        help="Measure nothing: print the tables and aims of an earlier run's bench.json again",
    )
    parser.add_argument("--skip-speed", action="store_true", help="Only the memory/time sweep")
    parser.add_argument(
        "--skip-scaling", action="store_true", help="Only the speed, balance and traffic part"
    )
    parser.add_argument(
        "--score-mod",
        action="store_true",
        help="Only the score_mod section: a soft-capped call against the plain one, as ratios",
    )
    args = parser.parse_args(argv)

    b = Bench(
        batch=args.batch,
        heads=args.heads,
        head_dim=args.head_dim,
        dtype=args.dtype,
        warmup=args.warmup,
        lean_head_chunks=args.lean_head_chunks,
    )
    if args.quick:
        b.seq, b.warmup_seq, b.repeat, b.scaling_seqs = 2048, 512, 2, (1024, 2048, 4096)
    b.seq = args.seq or b.seq
    b.warmup_seq = min(b.warmup_seq, b.seq)
    b.repeat = args.repeat or b.repeat
    if args.world_sizes:
        b.world_sizes = tuple(args.world_sizes)
    if args.rotations:
        b.ring_rotations = tuple(args.rotations)
        b.torch_rotations = tuple(r for r in args.rotations if r in TORCH_ROTATIONS)
        b.lean_rotations = tuple(r for r in b.lean_rotations if r in args.rotations)
    if args.scaling_seqs is not None:
        b.scaling_seqs = tuple(args.scaling_seqs)
    if args.analyse:
        with open(args.analyse) as f:
            saved = json.load(f)
        fields = {
            "lean_head_chunks": 0,
            **saved["bench"],
        }  # runs from before the lean configurations had none
        b = Bench(**{k: tuple(v) if isinstance(v, list) else v for k, v in fields.items()})
        print_report(b, _analysis(b, saved["speed_raw"], saved["scaling_raw"]), saved["env"])
        return 0
    if args.score_mod:
        import torch

        t0 = time.perf_counter()
        rows = run_score_mod(b)
        path = args.json or os.path.join(args.out, "score_mod.json")
        write_json(
            path,
            {
                "bench": asdict(b),
                "rows": rows,
                "platform": platform.platform(),
                "torch": torch.__version__,
                "load": load_average(),
            },
        )
        print(f"\nwrote {path} in {time.perf_counter() - t0:.0f} s; load average {load_average()}")
        return 0
    if not PeakRss.supported():
        print(
            "memory: /proc/self/clear_refs is not writable here; the memory sweep is skipped",
            file=sys.stderr,
        )
        args.skip_scaling = True
    with recorded_run(b.cores) as env:
        speed = {} if args.skip_speed else run_speed(b)
        scaling = {} if args.skip_scaling else run_scaling(b)
    analysis = _analysis(b, speed, scaling)
    print_report(b, analysis, env)
    path = args.json or os.path.join(args.out, "bench.json")
    write_json(
        path,
        {
            "bench": asdict(b),
            "env": env,
            "analysis": analysis,
            "speed_raw": speed,
            "scaling_raw": scaling,
        },
    )
    plotted = bool(analysis["memory"]) and importlib.util.find_spec("matplotlib") is not None
    if plotted:
        os.makedirs(args.out, exist_ok=True)
        plot(analysis, os.path.join(args.out, "bench.png"))
    elif analysis["memory"]:
        print("no bench.png: it needs matplotlib (pip install -e '.[bench]')", file=sys.stderr)
    print(
        f"\nwrote {path}"
        + (f" and {args.out}/bench.png" if plotted else "")
        + f" in {env['wall_s']:.0f} s"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
