"""Benchmark of the parallel strategies at W=4: ring, Ulysses and the 2x2 hybrid against one
process.

Run from the repository root::

    python benchmarks/strategies.py --quick     # a smaller grid, about 2 minutes on 2 cores
    python benchmarks/strategies.py             # the grid in docs/benchmarks.md

Forward + backward of ``ring_impl.ring_attention`` on CPU + gloo at W=4 (every rank a process
with one intra-op thread) with ``exchange="ring"`` (``alltoall`` rotation; ``head_tail`` when
causal), ``"ulysses"`` (U=4) and ``"hybrid"`` (a 2x2 mesh: Ulysses pairs of consecutive ranks,
the ring across them), all on the CPU flash kernel, against one process running SDPA (the same
kernel, ``SDPBackend.FLASH_ATTENTION``) on the full sequence with 4 threads. Over a grid of query
heads x sequence lengths, causal and not (float32, batch 1, head_dim 64, key/value heads = query
heads). Per grid point, one warm-up round at a smaller size, then ``--repeat`` rounds with SDPA
and the strategies interleaved (``benchmarks.runner``); a round's time is that of the slowest
rank, and the fastest round is reported (on a shared machine it is the least disturbed; the
median and the spread are kept in the JSON). Ratios are only compared within one run.

Bytes: every collective a rank issues in its first measured call is recorded (a dispatch mode
that reads the groups and split sizes) and turned into the bytes the rank *sends to other ranks*
(an all-to-all's input minus the part it keeps; an all-gather's input times the other members).
Each strategy's minimum, per rank, with ``n`` elements per (query-sized) tensor of the local shard
and 4-byte elements, no LSE returned:

- ring over W: forward ``(W-1) 2n`` (every other rank's key/value once), backward
  ``(W-1) (2n + 2n)`` (key/value again, and each block's dK/dV back to its owner, in float32);
- Ulysses over U: forward ``(U-1)/U (3n + n)`` (each other rank's head slice of query, key,
  value, and of the output back), backward ``(U-1)/U (n + 3n)`` (dO there, dQ dK dV back);
- hybrid U x R: the Ulysses figure of its rows plus the ring's over R on a row's shard (``2n``
  per key/value block: U times the positions, 1/U of the heads).

The input check's all-reduce (a few hundred bytes) is reported apart. The crossover: for each
(heads, sequence, causal) the fastest strategy.
"""

from __future__ import annotations

import contextlib
import itertools
import os
import sys
import time
from dataclasses import asdict, dataclass, field
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.common import bench_args, run_world, write_rows
from benchmarks.runner import Candidate, across_ranks, interleave, summarize

STRATEGIES = ("ring", "ulysses", "hybrid")


@dataclass
class Bench:
    world: int = 4
    mesh: tuple[int, int] = (2, 2)  # the hybrid's (ulysses, ring)
    heads: tuple[int, ...] = (4, 16)
    seqs: tuple[int, ...] = (1024, 4096, 8192)
    head_dim: int = 64
    batch: int = 1
    warmup_seq: int = 512
    repeat: int = 3
    cores: int = field(default_factory=lambda: os.cpu_count() or 1)


def _sent_recorder():
    """A dispatch mode that adds up, per phase, the bytes
    this rank's collectives send to other ranks."""
    import torch.distributed as dist
    from torch.distributed.distributed_c10d import _resolve_process_group
    from torch.utils._python_dispatch import TorchDispatchMode

    class Sent(TorchDispatchMode):
        def __init__(self) -> None:
            super().__init__()
            self.phase = "forward"
            self.sent: dict[str, int] = {"forward": 0, "backward": 0}
            self.control = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            name = func._schema.name
            if name == "_c10d_functional::all_to_all_single":
                x, _, in_splits, group = args[:4]
                pg = _resolve_process_group(group)
                me = dist.get_rank(pg)
                total = sum(in_splits) if in_splits else pg.size()
                keep = in_splits[me] if in_splits else 1
                self.sent[self.phase] += x.numel() * x.element_size() * (total - keep) // total
            elif name == "_c10d_functional::all_gather_into_tensor":
                x, size = args[0], args[1]
                self.sent[self.phase] += (size - 1) * x.numel() * x.element_size()
            elif name.startswith("c10d::allreduce") or name == "_c10d_functional::all_reduce":
                self.control += (
                    args[0][0].numel() * args[0][0].element_size()
                    if isinstance(args[0], list)
                    else args[0].numel() * args[0].element_size()
                )
            elif name.startswith(("c10d::", "_c10d_functional::")) and not name.endswith(
                ("wait_tensor",)
            ):
                raise RuntimeError(
                    f"benchmarks/strategies.py: collective {name} is not counted; "
                    "extend _sent_recorder"
                )
            return func(*args, **(kwargs or {}))

    return Sent()


def _sdpa(q, k, v, do, causal: bool) -> float:
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel

    q, k, v = (t.detach().requires_grad_() for t in (q, k, v))
    t0 = time.perf_counter()
    with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
        out = F.scaled_dot_product_attention(q, k, v, is_causal=causal)
    out.backward(do)
    return time.perf_counter() - t0


def _rank(rank: int, world: int, b_dict: dict) -> dict:
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    import ring_impl
    from ring_impl.planning.mesh_layout import shard

    b = Bench(**{**b_dict, "mesh": tuple(b_dict["mesh"])})
    u, r = b.mesh
    mesh = init_device_mesh("cpu", (r, u), mesh_dim_names=("ring", "ulysses"))
    coords = {"ring": (0, rank), "ulysses": (rank, 0), "hybrid": (rank % u, rank // u)}
    shapes = {"ring": (1, world), "ulysses": (world, 1), "hybrid": (u, r)}
    groups = {"ring": dist.group.WORLD, "ulysses": dist.group.WORLD, "hybrid": mesh}

    def inputs(heads: int, seq: int, causal: bool):
        gen = torch.Generator().manual_seed(0)
        full = [torch.randn(b.batch, heads, seq, b.head_dim, generator=gen) for _ in range(4)]
        layout = "head_tail" if causal else "contiguous"
        local = {
            s: [
                shard(t, strategy=s, layout=layout, mesh_shape=shapes[s], coords=coords[s])
                for t in full
            ]
            for s in STRATEGIES
        }
        return full, local, layout

    def candidates(full: list, local: dict, layout: str, causal: bool, point: dict | None):
        """SDPA on rank 0 (the other ranks wait in the next barrier) and each strategy; with
        ``point``, each strategy's first call records the bytes it sends."""

        def sdpa() -> None:
            if rank == 0:
                torch.set_num_threads(world)
                try:
                    _sdpa(*full, causal)
                finally:
                    torch.set_num_threads(1)

        def strategy(s: str) -> Candidate:
            def call(q, k, v) -> None:
                rec = _sent_recorder() if point is not None and s not in point["sent"] else None
                with rec if rec is not None else contextlib.nullcontext():
                    out = ring_impl.ring_attention(
                        q,
                        k,
                        v,
                        group=groups[s],
                        exchange=s,
                        is_causal=causal,
                        layout=layout,
                        rotate_method="alltoall",
                    )
                    if rec is not None:
                        rec.phase = "backward"
                    out.backward(local[s][3])
                if rec is not None and point is not None:
                    point["sent"][s], point["control"][s] = rec.sent, rec.control

            return Candidate(call, lambda: [t.detach().requires_grad_() for t in local[s][:3]])

        return {"sdpa": Candidate(sdpa), **{s: strategy(s) for s in STRATEGIES}}

    results: dict[str, Any] = {}
    for heads, seq, causal in itertools.product(b.heads, b.seqs, (False, True)):
        key = f"h{heads}-s{seq}-{'causal' if causal else 'full'}"
        point = {"heads": heads, "seq": seq, "causal": causal, "sent": {}, "control": {}}
        # Per point: one warm-up round at a smaller size, then the recorded rounds, SDPA and the
        # strategies interleaved, every call from a common barrier.
        warm = candidates(*inputs(heads, b.warmup_seq, causal), causal, None)
        interleave(warm, rounds=0, warmup=1, before=dist.barrier)
        times = interleave(
            candidates(*inputs(heads, seq, causal), causal, point), b.repeat, before=dist.barrier
        ).times
        results[key] = {**point, **times}
    return results


def minimum_sent(strategy: str, b: Bench, heads: int, seq: int) -> dict[str, int]:
    """The strategy's minimum bytes sent per rank (see the module docstring)."""
    n = b.batch * heads * (seq // b.world) * b.head_dim * 4  # bytes of one query-sized local tensor
    w = b.world
    if strategy == "ring":
        return {"forward": (w - 1) * 2 * n, "backward": (w - 1) * 4 * n}
    u, r = (w, 1) if strategy == "ulysses" else b.mesh
    a2a = {"forward": (u - 1) * 4 * n // u, "backward": (u - 1) * 4 * n // u}
    return {
        "forward": a2a["forward"] + (r - 1) * 2 * n,
        "backward": a2a["backward"] + (r - 1) * 4 * n,
    }


def analyse(b: Bench, per_rank: list[dict]) -> list[dict]:
    rows = []
    for key, point in per_rank[0].items():
        row = {k: point[k] for k in ("heads", "seq", "causal")}
        slowest = {
            name: across_ranks([pr[key][name] for pr in ranks])
            for name, ranks in (("sdpa", per_rank[:1]), *((s, per_rank) for s in STRATEGIES))
        }
        stats = summarize(slowest, "sdpa")
        row["sdpa"] = stats["sdpa"].min
        for s in STRATEGIES:
            row[s] = stats[s].min
            row[f"{s}_median"] = stats[s].median
            row[f"{s}_ratio"] = stats[s].ratio_min
            row[f"{s}_spread"] = stats[s].spread
            mins = minimum_sent(s, b, point["heads"], point["seq"])
            sent = [pr[key]["sent"][s] for pr in per_rank]
            row[f"{s}_bytes"] = {ph: max(x[ph] for x in sent) for ph in ("forward", "backward")}
            row[f"{s}_bytes_ratio"] = {
                ph: (max(x[ph] for x in sent) / mins[ph]) if mins[ph] else 1.0
                for ph in ("forward", "backward")
            }
            row[f"{s}_control"] = max(pr[key]["control"][s] for pr in per_rank)
        row["winner"] = min(STRATEGIES, key=lambda s: row[s])
        rows.append(row)
    return rows


def print_report(b: Bench, rows: list[dict]) -> None:
    print(
        f"\nW={b.world} on {b.cores} cores; float32, batch {b.batch}, head_dim {b.head_dim}, "
        "key/value heads = heads; time = forward+backward of the slowest rank, fastest of "
        f"{b.repeat}; SDPA: one process, {b.world} threads"
    )
    print(
        f"\n{'heads':>5} {'seq':>6} {'causal':>6} {'SDPA s':>7} "
        + " ".join(f"{s + ' / SDPA':>15}" for s in STRATEGIES)
        + f" {'fastest':>8}"
    )
    for row in rows:
        print(
            f"{row['heads']:>5} {row['seq']:>6} {row['causal']!s:>6} {row['sdpa']:>7.3f} "
            + " ".join(f"{row[s + '_ratio']:>9.2f}x {row[s]:>4.2f}" for s in STRATEGIES)
            + f" {row['winner']:>8}"
        )
    print(
        "\nbytes sent per rank / the strategy's minimum (forward, backward); MiB sent in forward "
        "+ backward"
    )
    for row in rows:
        parts = []
        for s in STRATEGIES:
            r, by = row[f"{s}_bytes_ratio"], row[f"{s}_bytes"]
            parts.append(
                f"{s} {r['forward']:.2f} {r['backward']:.2f} "
                f"({(by['forward'] + by['backward']) / 2**20:.1f} MiB)"
            )
        print(
            f"  h{row['heads']} s{row['seq']} {'causal' if row['causal'] else 'full  '}: "
            + "; ".join(parts)
        )
    ctrl = sorted({row[f"{s}_control"] for row in rows for s in STRATEGIES})
    print(f"\ninput check all-reduce bytes per rank and call: {ctrl}")
    print("\ncrossover (fastest strategy):")
    for heads in b.heads:
        for causal in (False, True):
            line = [
                f"{row['seq']}: {row['winner']}"
                for row in rows
                if row["heads"] == heads and row["causal"] == causal
            ]
            print(f"  heads {heads:>3}, {'causal' if causal else 'full  '}: " + ", ".join(line))


def main(argv: list[str] | None = None) -> int:
    args = bench_args(
        argv,
        __doc__,
        quick="heads 4, 16 and sequences 1024, 4096",
        repeat=3,
        json_name="strategies.json",
    )
    b = Bench(repeat=args.repeat)
    if args.quick:
        b.seqs = (1024, 4096)
    t0 = time.perf_counter()
    per_rank = run_world(b.world, _rank, asdict(b), timeout=3600)
    rows = analyse(b, per_rank)
    print_report(b, rows)
    write_rows(args.out, asdict(b), rows, t0)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
