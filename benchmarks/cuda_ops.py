"""GPU benchmark: each CUDA kernel's forward + backward through the ring at W=1 against the bare
kernel, i.e. the ring's own overhead on one GPU, with peak memory (issue 17).

Run from the repository root on a CUDA machine::

    python benchmarks/cuda_ops.py                  # seq 16k-128k (a few minutes on an H100)
    python benchmarks/cuda_ops.py --quick          # seq 4k, 8k
    python benchmarks/cuda_ops.py --json out.json  # also write the rows

What is measured (bfloat16, batch 1, ``--heads`` heads, head_dim ``--head-dim``, causal and not):

bare kernel
    the op's own ``forward`` then ``backward`` (``ring_impl.ops``: ``cuda_flash`` is
    FlashAttention-2, ``cuda_efficient`` the memory-efficient kernel, ``cudnn`` cuDNN's fused
    attention), called on the whole sequence with the gradient of the output.
ring, W=1
    ``ring_impl.ring_attention(..., op=NAME)`` on a one-rank NCCL group, forward then
    ``backward``: validation, the cross-rank agreement (skipped at W=1), the step plan, LSE
    trimming, the float32 accumulators and merges, the autograd function and its backward.

Times come from CUDA events around ``--repeat`` calls after ``--warmup`` calls, the bare kernel
and the ring interleaved (``benchmarks.runner``); the median is reported. Peak memory is
``torch.cuda.max_memory_allocated`` above what was allocated before the call (the inputs and the
output gradient), after ``reset_peak_memory_stats``, in one more call of each. The ratio
ring / bare is the ring's overhead in time and memory; both are measured in one process, one run,
interleaved, so they share the machine's state. Nothing here is a timed assertion.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from functools import partial

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from benchmarks.common import no_cuda  # noqa: E402
from benchmarks.runner import CudaClock, interleave, median  # noqa: E402

OPS = ("cuda_flash", "cuda_efficient", "cudnn")


def _inputs(seq: int, heads: int, head_dim: int, seed: int = 0):
    g = torch.Generator(device="cuda").manual_seed(seed)
    shape = (1, heads, seq, head_dim)
    q, k, v, do = (
        torch.randn(shape, device="cuda", dtype=torch.bfloat16, generator=g) for _ in range(4)
    )
    return q, k, v, do


def _bare(op, q, k, v, do, causal: bool) -> None:
    scale = q.shape[-1] ** -0.5
    out, lse = op.forward(q, k, v, is_causal=causal, scale=scale)
    # The kernel's own LSE layout (padded to 32, or a trailing dim of 1) to (batch, heads, seq),
    # which the ops' backward takes (ring_impl.ops.contract).
    lse = lse.reshape(*lse.shape[:2], -1)[..., : q.shape[2]]
    op.backward(do, q, k, v, out, lse, is_causal=causal, scale=scale)


def _ring(name: str, q, k, v, do, causal: bool) -> None:
    from ring_impl import ring_attention

    q, k, v = (t.detach().requires_grad_(True) for t in (q, k, v))
    out = ring_attention(q, k, v, is_causal=causal, op=name)
    out.backward(do)


def _peak(fn) -> int:
    """Peak bytes of one call above the allocation before it."""
    torch.cuda.empty_cache()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    fn()
    torch.cuda.synchronize()
    return torch.cuda.max_memory_allocated() - base


def _measure(fns: dict, warmup: int, repeat: int) -> dict[str, tuple[float, int]]:
    """Per candidate (median milliseconds, peak bytes): the candidates timed interleaved with
    CUDA events, then each one's memory in a call of its own."""
    times = interleave(fns, repeat, warmup, clock=CudaClock()).times
    return {name: (median(times[name]) * 1e3, _peak(fn)) for name, fn in fns.items()}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="seq 4k and 8k only")
    parser.add_argument(
        "--seqs", default=None, help="comma-separated sequence lengths (default 16k-128k)"
    )
    parser.add_argument("--ops", default=",".join(OPS))
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--json", default=None, help="write the rows as JSON here")
    args = parser.parse_args(argv)
    if no_cuda("benchmarks/cuda_ops.py"):
        return 2
    seqs = (
        [int(s) for s in args.seqs.split(",")]
        if args.seqs
        else ([4096, 8192] if args.quick else [16384, 32768, 65536, 131072])
    )

    from ring_impl.ops import get_op

    torch.cuda.set_device(0)
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29533")
    dist.init_process_group("nccl", rank=0, world_size=1, device_id=torch.device("cuda", 0))
    device = torch.cuda.get_device_name(0)
    print(
        f"# {device}, torch {torch.__version__}, CUDA {torch.version.cuda}; bfloat16, batch 1, "
        f"{args.heads} heads, head_dim {args.head_dim}; median of {args.repeat} after "
        f"{args.warmup} warm-up"
    )
    print(
        "| op | seq | causal | bare ms | ring W=1 ms | ring / bare | bare peak MiB | ring peak "
        "MiB | ring / bare |"
    )
    print("|---|---|---|---|---|---|---|---|---|")
    rows = []
    for name in args.ops.split(","):
        op = get_op(name)
        for seq in seqs:
            for causal in (False, True):
                inputs = _inputs(seq, args.heads, args.head_dim)
                try:
                    measured = _measure(
                        {
                            "bare": partial(_bare, op, *inputs, causal),
                            "ring": partial(_ring, name, *inputs, causal),
                        },
                        args.warmup,
                        args.repeat,
                    )
                    (bare_ms, bare_peak), (ring_ms, ring_peak) = measured["bare"], measured["ring"]
                except torch.cuda.OutOfMemoryError as e:
                    print(
                        f"| {name} | {seq} | {causal} | out of memory: {str(e).splitlines()[0]} "
                        "|||||||"
                    )
                    continue
                finally:
                    inputs = None
                    torch.cuda.empty_cache()
                row = dict(
                    op=name,
                    seq=seq,
                    causal=causal,
                    bare_ms=bare_ms,
                    ring_ms=ring_ms,
                    bare_peak_mib=bare_peak / 2**20,
                    ring_peak_mib=ring_peak / 2**20,
                )
                rows.append(row)
                print(
                    f"| {name} | {seq} | {causal} | {bare_ms:.2f} | {ring_ms:.2f} | "
                    f"{ring_ms / bare_ms:.3f} | {row['bare_peak_mib']:.0f} | "
                    f"{row['ring_peak_mib']:.0f} | {ring_peak / max(bare_peak, 1):.2f} |",
                    flush=True,
                )
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"device": device, "torch": torch.__version__, "rows": rows}, f, indent=1)
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
