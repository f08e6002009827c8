"""Benchmark of an unmasked ring call under ``torch.compile`` against eager.

Run from the repository root::

    python benchmarks/compiled_ring.py            # head_dim 16 and 64, seq 4096
    python benchmarks/compiled_ring.py --quick    # head_dim 64 only

Forward + backward of ``ring_attention(q, k, v, is_causal=True, layout="head_tail",
rotate_method="alltoall")`` (batch 1, 8 heads, float32, CPU + gloo, one intra-op thread per rank,
W=2), three ways in one process per rank, interleaved:

``eager``             no compile;
``compiled``          ``torch.compile(fullgraph=True)`` (inductor), the LSE dropped;
``compiled_lse_used`` the same with the LSE in the result at weight 0 (``out + 0 * lse.sum()``):
                      a zero gradient reaches it, so kernels without an LSE gradient run their
                      backward through the padded head dim of
                      ``ring_impl.ops.calls._with_lse_grad``: what ``compiled`` would cost if the
                      compiled call kept a dropped LSE's zero gradient.

Every way gets two untimed calls, then ``--repeat`` timed repetitions; a repetition's time is the
slowest rank's, the fastest repetition is reported. Only the ratios within one run mean anything;
nothing is asserted.
"""

from __future__ import annotations

import os
import sys
import time
from dataclasses import asdict, dataclass

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.common import bench_args, run_world, write_rows
from benchmarks.runner import Candidate, across_ranks, interleave, summarize

WAYS = ("eager", "compiled", "compiled_lse_used")


@dataclass
class Bench:
    world: int = 2
    seq: int = 4096
    heads: int = 8
    head_dims: tuple[int, ...] = (16, 64)
    repeat: int = 5


def _rank(rank: int, world: int, b_dict: dict) -> list[dict]:
    import torch
    import torch.distributed as dist

    import ring_impl

    b = Bench(**{**b_dict, "head_dims": tuple(b_dict["head_dims"])})
    torch._dynamo.config.recompile_limit = 64

    def attend(q, k, v):
        return ring_impl.ring_attention(
            q, k, v, is_causal=True, layout="head_tail", rotate_method="alltoall"
        )

    def attend_lse_used(q, k, v):
        out, lse = ring_impl.ring_attention(
            q, k, v, is_causal=True, layout="head_tail", rotate_method="alltoall", return_lse=True
        )
        return out + 0 * lse.sum()

    rows = []
    for head_dim in b.head_dims:
        gen = torch.Generator().manual_seed(0)
        q, k, v, do = (
            ring_impl.shard(
                torch.randn(1, b.heads, b.seq, head_dim, generator=gen),
                world,
                rank,
                layout="head_tail",
            )
            for _ in range(4)
        )
        ways = {
            "eager": attend,
            "compiled": torch.compile(attend, fullgraph=True),
            "compiled_lse_used": torch.compile(attend_lse_used, fullgraph=True),
        }

        def step(fn, q=q, k=k, v=v, do=do) -> Candidate:
            def run(*leaves) -> None:
                fn(*leaves).backward(do)

            return Candidate(run, lambda: [t.clone().requires_grad_(True) for t in (q, k, v)])

        # Two warm-up rounds compile and warm every way; then the ways interleaved, every call
        # from a common barrier (the driver takes the slowest rank of each round).
        times = interleave(
            {name: step(fn) for name, fn in ways.items()}, b.repeat, 2, before=dist.barrier
        ).times
        rows.append({"head_dim": head_dim, "times": times})
    return rows


def analyse(per_rank: list[list[dict]]) -> list[dict]:
    """Per head_dim: the slowest rank's time per round, then each way's fastest round and its
    ratio to the eager call's."""
    out = []
    for i, row in enumerate(per_rank[0]):
        slowest = {
            name: across_ranks([rows[i]["times"][name] for rows in per_rank]) for name in WAYS
        }
        stats = summarize(slowest, "eager")
        out.append(
            {
                "head_dim": row["head_dim"],
                **{f"{n}_s": stats[n].min for n in WAYS},
                **{f"{n}_median_s": stats[n].median for n in WAYS},
                **{f"{n}_vs_eager": stats[n].ratio_min for n in WAYS[1:]},
            }
        )
    return out


def main(argv: list[str] | None = None) -> int:
    args = bench_args(
        argv, __doc__, quick="head_dim 64 only", repeat=Bench.repeat, json_name="compiled_ring.json"
    )
    b = Bench(repeat=args.repeat, head_dims=(64,) if args.quick else Bench.head_dims)
    t0 = time.perf_counter()
    rows = analyse(run_world(b.world, _rank, asdict(b), timeout=3600))
    print(
        f"W={b.world}, seq {b.seq}, {b.heads} heads, causal head_tail alltoall, inductor, fastest "
        f"of {b.repeat}\n"
    )
    print("| head_dim | eager s | compiled / eager | compiled, LSE used at weight 0 / eager |")
    print("|---|---|---|---|")
    for r in rows:
        print(
            f"| {r['head_dim']} | {r['eager_s']:.3f} | {r['compiled_vs_eager']:.3f}x | "
            f"{r['compiled_lse_used_vs_eager']:.3f}x |"
        )
    write_rows(args.out, asdict(b), rows, t0)
    return 0


if __name__ == "__main__":
    sys.exit(main())
