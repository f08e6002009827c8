"""Benchmark of the halo exchange against the ring under the same sliding window.

Run from the repository root::

    python benchmarks/halo.py --quick     # W=2 and 4, seq 4096, windows 256 and 512
    python benchmarks/halo.py             # also seq 8192

Forward + backward of ``ring_impl.ring_attention(mask=SlidingWindow(window))`` (a causal window:
``window`` keys back, none forward) on CPU + gloo, every rank a process with one intra-op thread,
``contiguous`` layout, the CPU flash kernel, float32, batch 1, 8 heads (key/value heads too),
head_dim 64: ``exchange="auto"`` (the halo exchange, ring_impl.exchanges.halo) against
``exchange="ring"`` (the ring, ``p2p`` rotation, skipping the blocks the window does not reach but
moving every block). One warm-up call at a small size, one untimed call per point that records the
collectives, then ``--repeat`` rounds with both paths interleaved (``benchmarks.runner``); a round's
time is that of the slowest rank and the fastest round is reported (the median and the spread are
kept in the JSON). Only the ratio halo /
ring within this run means anything; nothing is asserted.

Bytes: every collective of the first measured call is recorded (harness.accounting) and the
bytes each rank sends (``send`` calls; the input check's all-reduce apart) are summed over the
ranks, against the halo minimum: each rank's last ``window`` key/value rows to the next rank,
``(W - 1) * window`` rows in all, forward; their dK/dV back in float32, backward.
"""

from __future__ import annotations

import contextlib
import itertools
import os
import sys
import time
from dataclasses import asdict, dataclass, field

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.common import bench_args, run_world, write_rows
from benchmarks.runner import Candidate, across_ranks, interleave, measure, summarize

PATHS = {"halo": "auto", "ring": "ring"}  # the exchange= each path is asked by


@dataclass
class Bench:
    worlds: tuple[int, ...] = (2, 4)
    seqs: tuple[int, ...] = (4096, 8192)
    windows: tuple[int, ...] = (256, 512)
    heads: int = 8
    head_dim: int = 64
    batch: int = 1
    warmup_seq: int = 1024
    repeat: int = 3
    cores: int = field(default_factory=lambda: os.cpu_count() or 1)


def _rank(rank: int, world: int, b_dict: dict) -> dict:
    import torch
    import torch.distributed as dist

    import ring_impl
    from harness.accounting import CollectiveLog
    from ring_impl.masks import SlidingWindow

    b = Bench(**b_dict)
    torch.set_num_threads(1)
    results: dict = {}

    def inputs(seq: int) -> list:
        gen = torch.Generator().manual_seed(seq)
        return [
            ring_impl.shard(
                torch.randn(b.batch, b.heads, seq, b.head_dim, generator=gen), world, rank
            )
            for _ in range(4)
        ]

    def call(seq: int, window: int, exchange: str, log: CollectiveLog | None = None) -> Candidate:
        q0, k0, v0, do = inputs(seq)

        def run(q, k, v) -> None:
            with log if log is not None else contextlib.nullcontext():
                phase = log.phase if log is not None else (lambda name: contextlib.nullcontext())
                with phase("forward"):
                    out = ring_impl.ring_attention(
                        q,
                        k,
                        v,
                        mask=SlidingWindow(window),
                        op="cpu_flash",
                        rotate_method="p2p",
                        exchange=exchange,
                    )
                with phase("backward"):
                    out.backward(do)

        return Candidate(run, lambda: [t.detach().requires_grad_() for t in (q0, k0, v0)])

    # one warm-up call of each path at a smaller size
    interleave(
        {name: call(b.warmup_seq, min(b.windows), exchange) for name, exchange in PATHS.items()},
        rounds=0,
        warmup=1,
        before=dist.barrier,
    )
    for seq, window in itertools.product(b.seqs, b.windows):
        point: dict = {"seq": seq, "window": window, "sent": {}}
        # A first call of each path records its collectives, untimed (the log's dispatch mode
        # sees every op); then the paths interleaved, every call from a common barrier.
        for name, exchange in PATHS.items():
            log = CollectiveLog()
            measure(call(seq, window, exchange, log), warmup=0, repeat=1, before=dist.barrier)
            summary = log.summary()
            point["sent"][name] = {
                ph: sum(e["bytes"] for kind, e in summary.get(ph, {}).items() if kind == "send")
                for ph in ("forward", "backward")
            }
        calls = {name: call(seq, window, exchange) for name, exchange in PATHS.items()}
        point.update(interleave(calls, b.repeat, before=dist.barrier).times)
        results[f"s{seq}-w{window}"] = point
    return results


def minimum_sent(b: Bench, world: int, window: int) -> dict[str, int]:
    """Bytes all ranks together must send (see the module docstring), float32."""
    rows = (world - 1) * window
    row = 2 * b.batch * b.heads * b.head_dim * 4
    return {"forward": rows * row, "backward": rows * row}


def analyse(b: Bench, world: int, per_rank: list[dict]) -> list[dict]:
    rows = []
    for key, point in per_rank[0].items():
        row = {"world": world, "seq": point["seq"], "window": point["window"]}
        mins = minimum_sent(b, world, point["window"])
        stats = summarize(
            {name: across_ranks([pr[key][name] for pr in per_rank]) for name in PATHS}, "ring"
        )
        row["halo_over_ring"] = stats["halo"].ratio_min
        for name in PATHS:
            row[name], row[f"{name}_median"] = stats[name].min, stats[name].median
            row[f"{name}_spread"] = stats[name].spread
            sent = {
                ph: sum(pr[key]["sent"][name][ph] for pr in per_rank)
                for ph in ("forward", "backward")
            }
            row[f"{name}_sent"] = sent
            row[f"{name}_sent_ratio"] = {ph: sent[ph] / mins[ph] for ph in sent}
        rows.append(row)
    return rows


def print_report(b: Bench, rows: list[dict]) -> None:
    print(
        f"\n{b.cores} cores, one thread per rank; float32, batch {b.batch}, heads {b.heads}, "
        f"head_dim {b.head_dim}; causal window; time = forward+backward of the slowest rank, "
        f"fastest of {b.repeat}"
    )
    print(
        f"\n{'W':>2} {'seq':>6} {'window':>6} {'ring s':>7} {'halo s':>7} {'halo/ring':>9}   "
        f"{'sent MiB ring':>13} {'sent MiB halo':>13}   halo sent / minimum (fwd, bwd)"
    )
    for r in rows:
        mib = {p: (r[f"{p}_sent"]["forward"] + r[f"{p}_sent"]["backward"]) / 2**20 for p in PATHS}
        ratio = r["halo_sent_ratio"]
        print(
            f"{r['world']:>2} {r['seq']:>6} {r['window']:>6} {r['ring']:>7.3f} {r['halo']:>7.3f} "
            f"{r['halo_over_ring']:>9.2f}   {mib['ring']:>13.2f} {mib['halo']:>13.3f}   "
            f"{ratio['forward']:.2f}, {ratio['backward']:.2f}"
        )


def main(argv: list[str] | None = None) -> int:
    args = bench_args(argv, __doc__, quick="sequence 4096 only", repeat=3, json_name="halo.json")
    b = Bench(repeat=args.repeat)
    if args.quick:
        b.seqs = (4096,)
    t0 = time.perf_counter()
    rows = []
    for world in b.worlds:
        rows += analyse(b, world, run_world(world, _rank, asdict(b), timeout=3600))
    print_report(b, rows)
    write_rows(args.out, asdict(b), rows, t0)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
