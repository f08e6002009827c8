"""Profile one rank of benchmarks/masks.py's packed-documents call: where a rank's time goes.

Runs W ranks on CPU + gloo (one thread each) with the benchmark's inputs, documents and
layouts (``benchmarks/masks.py``: seq 8192 by default, 32 lognormal documents), warms up, then
profiles ``--calls`` forward + backward calls of rank 0 with ``cProfile`` and prints the
functions by their own time. The profiler's clock is ``time.thread_time``: the CPU seconds of
rank 0's main thread, which ranks sharing cores (W above the core count) do not inflate; gloo's
own threads are not in it. Also printed: each call's wall seconds.

    python benchmarks/profile_masks.py --world 4 --sparse        # the sparse gather at W=4
    python benchmarks/profile_masks.py --world 2 --layout head_tail --callers contiguous
"""

from __future__ import annotations

import argparse
import cProfile
import io
import os
import pstats
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _rank(rank: int, args: argparse.Namespace, port: int) -> None:
    sys.path[:0] = [ROOT]
    import torch
    import torch.distributed as dist

    from benchmarks import masks as bm
    from benchmarks.runner import measure

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=args.world)
    torch.set_num_threads(1)
    b = bm.Bench(world_sizes=(args.world,), seq=args.seq)
    case = bm._case(b, args.seq, rank, args.world, reference=False)
    config = {"part": "documents", "layout": args.layout, "sparse": args.sparse}
    op = bm._op()
    profile = cProfile.Profile(time.thread_time)
    warm = iter(range(2))

    def call() -> None:
        # the 2 warm-up calls are not profiled
        profiled = next(warm, None) is None
        if profiled:
            profile.enable()
        bm._ring_call(case, config, b, op, {})
        if profiled:
            profile.disable()

    walls = measure(call, warmup=2, repeat=args.calls, before=dist.barrier)
    if rank == 0:
        out = io.StringIO()
        stats = pstats.Stats(profile, stream=out)
        stats.sort_stats("tottime").print_stats(args.top)
        if args.callers:
            stats.print_callers(args.callers)
        print(
            f"rank 0, W={args.world}, layout "
            f"{args.layout}{' + sparse_kv' if args.sparse else ''}, seq {args.seq}: {args.calls} "
            f"calls, wall s {[round(t, 3) for t in walls]}; profile in main-thread CPU seconds "
            f"(divide by {args.calls} for one call)"
        )
        print(out.getvalue())
    dist.destroy_process_group()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--world", type=int, default=2)
    parser.add_argument("--seq", type=int, default=8192)
    parser.add_argument(
        "--layout", default="work_balanced", choices=["work_balanced", "head_tail", "contiguous"]
    )
    parser.add_argument(
        "--sparse", action="store_true", help="ring_attention(exchange='gather'): the sparse gather"
    )
    parser.add_argument(
        "--calls", type=int, default=4, help="profiled calls (after 2 warm-up calls)"
    )
    parser.add_argument("--top", type=int, default=35, help="functions printed")
    parser.add_argument(
        "--callers", default="", help="a regex: also print who called the functions it matches"
    )
    args = parser.parse_args(argv)
    import socket

    import torch.multiprocessing as mp

    with socket.socket() as s:  # a free port for the process group
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.spawn(_rank, args=(args, port), nprocs=args.world)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
