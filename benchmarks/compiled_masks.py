"""Benchmark of masked ring attention under ``torch.compile``: in the graph against eager.

Run from the repository root::

    python benchmarks/compiled_masks.py --quick   # seq 4096
    python benchmarks/compiled_masks.py           # seq 4096 and 8192

Forward + backward of a small attention block, ``wo(ring_attention(wq x, wk x, wv x, mask=m))``
(batch 1, 8 heads, head_dim 64, float32, CPU + gloo, one intra-op thread per rank, W=2), run three
ways in one process per rank, interleaved:

``eager``        no compile;
``in_graph``     ``torch.compile(fullgraph=True)`` (inductor): the masked call as the custom ops
                 of ``ring_impl.compiled.masked_call``, the projections compiled around them;
``graph_break``  ``torch.compile`` (inductor) with the masked call run eagerly inside the
                 compiled region, as before the ops (two graphs around a break).

Masks: packed documents (one of S/2 and 8 of S/16, causal within each) under ``head_tail``; the
same documents as a ``MaskMod`` closing over the ids (``ids[q] == ids[kv] & kv <= q``, flex
style), which in the graph is evaluated into a table of bits on the global grid
(``ring_impl.planning.mask_table``) and eagerly block by block; and a causal sliding window of 256
under ``contiguous`` (the halo exchange). Every way gets two
untimed calls (compiles, warms the plan cache), then ``--repeat`` timed repetitions; a
repetition's time is the slowest rank's, and the fastest repetition is reported (the median is in
the JSON). Only the ratios to ``eager`` within one run mean anything; nothing is asserted. Each
way's output and gradients are compared with eager's (max abs difference, printed).
"""

from __future__ import annotations

import os
import sys
import time
from dataclasses import asdict, dataclass, field

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.common import bench_args, run_world, write_rows
from benchmarks.runner import Candidate, across_ranks, interleave, summarize

WAYS = ("eager", "in_graph", "graph_break")
MASKS = ("documents", "mask_mod", "window")


@dataclass
class Bench:
    world: int = 2
    seqs: tuple[int, ...] = (4096, 8192)
    heads: int = 8
    head_dim: int = 64
    window: int = 256
    repeat: int = 5
    cores: int = field(default_factory=lambda: os.cpu_count() or 1)


def _rank(rank: int, world: int, b_dict: dict) -> list[dict]:
    import torch
    import torch.distributed as dist

    import ring_impl
    import ring_impl.compiled.masked_call as compiled_masks
    from ring_impl.masks import Documents, MaskMod, SlidingWindow

    b = Bench(**b_dict)
    hidden = b.heads * b.head_dim
    gen = torch.Generator().manual_seed(0)
    wq, wk, wv, wo = (torch.nn.Linear(hidden, hidden, bias=False) for _ in range(4))
    for lin in (wq, wk, wv, wo):
        with torch.no_grad():
            lin.weight.copy_(torch.randn(lin.weight.shape, generator=gen) / hidden**0.5)

    def block(x, mask, layout):
        def heads(t):  # (1, s, hidden) -> (1, heads, s, head_dim)
            return t.view(1, -1, b.heads, b.head_dim).transpose(1, 2)

        out = ring_impl.ring_attention(
            heads(wq(x)),
            heads(wk(x)),
            heads(wv(x)),
            mask=mask,
            layout=layout,
            rotate_method="alltoall",
        )
        return wo(out.transpose(1, 2).reshape(1, -1, hidden))

    # Every (seq, mask) is its own graph, for both compiled ways, all of one code object: more
    # than dynamo's default 8 entries per code object.
    torch._dynamo.config.recompile_limit = 64
    in_graph = torch.compile(block, fullgraph=True)
    broken = torch.compile(block)
    keep = compiled_masks.masked_ring_call

    def graph_break(*args):
        compiled_masks.masked_ring_call = lambda *a, **k: None  # the masked call runs eagerly
        try:
            return broken(*args)
        finally:
            compiled_masks.masked_ring_call = keep

    ways = {"eager": block, "in_graph": in_graph, "graph_break": graph_break}
    rows = []
    for seq in b.seqs:
        lengths = [seq // 2] + [seq // 16] * 8
        ids = torch.cat([torch.full((n,), d) for d, n in enumerate(lengths)])

        def same_document_causal(b_idx, h_idx, q_idx, kv_idx, ids=ids):
            return (ids[q_idx] == ids[kv_idx]) & (kv_idx <= q_idx)

        masks = {
            "documents": (Documents(ids), "head_tail"),
            "mask_mod": (MaskMod(same_document_causal), "head_tail"),
            "window": (SlidingWindow(b.window), "contiguous"),
        }
        x_full = torch.randn(1, seq, hidden, generator=gen)
        dy_full = torch.randn(1, seq, hidden, generator=gen)
        for name, (mask, layout) in masks.items():
            x = ring_impl.shard(x_full, world, rank, layout=layout, dim=1)
            dy = ring_impl.shard(dy_full, world, rank, layout=layout, dim=1)

            last: dict[str, list] = {}

            def step(way, fn, x=x, dy=dy, mask=mask, layout=layout, last=last) -> Candidate:
                def run(xs) -> None:
                    y = fn(xs, mask, layout)
                    y.backward(dy)
                    # references, not copies: the next call's setup replaces the gradients
                    last[way] = [y.detach(), xs.grad, wq.weight.grad]

                def setup() -> list:
                    for lin in (wq, wk, wv, wo):
                        lin.weight.grad = None
                    return [x.clone().requires_grad_()]

                return Candidate(run, setup)

            # Two warm-up rounds compile and warm the plan cache; then the ways interleaved, every
            # call from a common barrier (the driver takes the slowest rank of each round).
            times = interleave(
                {way: step(way, fn) for way, fn in ways.items()}, b.repeat, 2, before=dist.barrier
            ).times
            results = last
            for way in ways:
                diff = max(
                    float((a - e).abs().max()) for a, e in zip(results[way], results["eager"])
                )
                rows.append(
                    {
                        "seq": seq,
                        "mask": name,
                        "way": way,
                        "rank": rank,
                        "times": times[way],
                        "max_diff": diff,
                    }
                )
    return rows


def analyse(b: Bench, per_rank: list[list[dict]]) -> list[dict]:
    """Per (seq, mask, way): the slowest rank's time per repetition, then the fastest repetition."""
    out = []
    for i, row in enumerate(per_rank[0]):
        ranks = [rows[i] for rows in per_rank]
        stats = summarize({"way": across_ranks([r["times"] for r in ranks])})["way"]
        out.append(
            {
                "seq": row["seq"],
                "mask": row["mask"],
                "way": row["way"],
                "best_s": stats.min,
                "median_s": stats.median,
                "spread": stats.spread,
                "max_diff": max(r["max_diff"] for r in ranks),
            }
        )
    return out


def print_report(b: Bench, rows: list[dict]) -> None:
    print(
        f"W={b.world}, batch 1, {b.heads} heads, head_dim {b.head_dim}, float32, fastest of "
        f"{b.repeat} (slowest rank), {b.cores} cores"
    )
    print(
        "| seq | mask | eager s | in_graph / eager | graph_break / eager | max diff vs eager "
        "(in_graph, graph_break) |"
    )
    print("|---|---|---|---|---|---|")
    for seq in b.seqs:
        for mask in MASKS:
            by_way = {r["way"]: r for r in rows if r["seq"] == seq and r["mask"] == mask}
            e = by_way["eager"]["best_s"]
            print(
                f"| {seq} | {mask} | {e:.3f} | {by_way['in_graph']['best_s'] / e:.3f}x | "
                f"{by_way['graph_break']['best_s'] / e:.3f}x | "
                f"{by_way['in_graph']['max_diff']:.1e}, {by_way['graph_break']['max_diff']:.1e} |"
            )


def main(argv: list[str] | None = None) -> int:
    args = bench_args(
        argv,
        __doc__,
        quick="sequence 4096 only",
        repeat=Bench.repeat,
        json_name="compiled_masks.json",
    )
    b = Bench(repeat=args.repeat, seqs=(4096,) if args.quick else Bench.seqs)
    t0 = time.perf_counter()
    rows = analyse(b, run_world(b.world, _rank, asdict(b), timeout=3600))
    print_report(b, rows)
    write_rows(args.out, asdict(b), rows, t0)
    return 0


if __name__ == "__main__":
    sys.exit(main())
