"""The host's work in one warm one-rank call, the attention kernels stubbed out.

On a GPU, a one-rank ring call below tens of thousands of tokens is host-bound: the checks, the
plan lookup, the non-finite flags, the packing and autograd take longer on the host than the
kernel takes on the device (docs/benchmarks.md, "On a GPU"). This benchmark times that work
alone. The varlen op's two kernels (``kernel_forward``/``kernel_backward``) are replaced by stubs
that return outputs of the right shapes at once, and everything else runs as in a real call:

    python benchmarks/host_work.py                    # CPU: cpu_flash_varlen_layout, gloo
    python benchmarks/host_work.py --device cuda      # cuda_flash_varlen on a one-rank NCCL group
    python benchmarks/host_work.py --json out.json    # also write the rows

Rows, bfloat16 (float32 on CPU), batch 1, ``--heads`` heads of ``--head-dim``, seq ``--seq``
(small on CPU, where the flags' sums are the host's own arithmetic; 16k tokens of 16 heads x 128
on CUDA, as docs/benchmarks.md's rows):
``documents`` (``--docs`` causal documents, their ids on the CPU), ``documents on device`` (the
same ids on the device, where comparing them with their snapshot on the host is a read; on CPU
they are treated as such), ``window`` (a causal window of 1024), ``thd`` (the documents as a
packed call with ``cu_seqlens`` a list) and ``thd on device`` (``cu_seqlens`` an int32 tensor on
the device). Each row reports its forward alone and its forward + backward, in microseconds:
the median of ``--repeat`` interleaved rounds after ``--warmup`` (benchmarks/runner.py; on CUDA
the device is synchronised after each call, so a read's wait is counted). Printed with them:
per call, the aten ops the host dispatches, the launches among them (ops that are not views) and
the device reads (``.item()``; a compare of device ids, ``aten.equal``, too). These counts are
exact; the times vary with the machine and are meaningful only against each other in one run.
A read of ``cu_seqlens`` (``tolist``) dispatches no aten op: on CPU the ``thd`` rows cannot show
it.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

#: aten ops that launch nothing on a GPU (views and metadata)
VIEWS = frozenset(
    {
        "aten.alias",
        "aten.as_strided",
        "aten.detach",
        "aten.expand",
        "aten.permute",
        "aten.select",
        "aten.slice",
        "aten.squeeze",
        "aten.t",
        "aten.transpose",
        "aten.unsqueeze",
        "aten.view",
        "aten._unsafe_view",
    }
)


def _stub_kernels(op_class) -> None:
    """Replace ``op_class``'s varlen kernels by stubs that return tensors of the kernels' shapes
    at once: q (total_q, heads, d) -> out like q, LSE (heads, total_q) float32; backward ->
    tensors like q, k, v. Made once per shape and handed out again, so the stubs dispatch no op
    of their own and the counts are the ring's."""
    import torch

    made: dict[tuple, torch.Tensor] = {}

    def like(shape, dtype, device):
        key = (tuple(shape), dtype, device)
        if key not in made:
            made[key] = torch.zeros(shape, dtype=dtype, device=device)
        return made[key]

    def forward(self, q, k, v, *args, **kwargs):
        return like(q.shape, q.dtype, q.device), like(
            (q.shape[1], q.shape[0]), torch.float32, q.device
        )

    def backward(self, grad_out, q, k, v, *args, **kwargs):
        return tuple(like(t.shape, t.dtype, t.device) for t in (q, k, v))

    op_class.kernel_forward, op_class.kernel_backward = forward, backward


def _counts(fn, equal_reads: bool = False) -> dict[str, int]:
    """Per call of ``fn``: aten ops, launches (ops that are not views) and device reads;
    ``equal_reads``: ``aten.equal`` compares device tensors, a read."""
    from torch.utils._python_dispatch import TorchDispatchMode

    seen: dict[str, int] = {}

    class Count(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            name = str(func.overloadpacket)
            seen[name] = seen.get(name, 0) + 1
            return func(*args, **(kwargs or {}))

    with Count():
        fn()
    read_ops = {"aten._local_scalar_dense", *(("aten.equal",) if equal_reads else ())}
    reads = sum(seen.get(name, 0) for name in read_ops)
    launched = {name: n for name, n in seen.items() if name not in VIEWS and name not in read_ops}
    return {
        "aten_ops": sum(seen.values()),
        "launches": sum(launched.values()),
        "reads": reads,
        "launched": launched,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    # (CPU: small tensors, since there the flags' sums are the host's own arithmetic)
    parser.add_argument("--seq", type=int, default=None, help="default 512 (CPU), 16384 (CUDA)")
    parser.add_argument("--docs", type=int, default=16)
    parser.add_argument("--heads", type=int, default=None, help="default 2 (CPU), 16 (CUDA)")
    parser.add_argument("--head-dim", type=int, default=None, help="default 16 (CPU), 128 (CUDA)")
    parser.add_argument("--repeat", type=int, default=200)
    parser.add_argument("--warmup", type=int, default=20)
    parser.add_argument("--json", default=None)
    args = parser.parse_args(argv)

    sys.path[:0] = [ROOT]
    import torch
    import torch.distributed as dist

    import ring_impl
    from benchmarks.runner import clock_for, interleave, summarize, write_json
    from ring_impl.masks import Documents, SlidingWindow
    from ring_impl.ops.cpu import CpuFlashVarlenLayoutOp
    from ring_impl.ops.cuda import CudaFlashVarlenOp

    cuda = args.device == "cuda"
    for name, on_cpu, on_cuda in (("seq", 512, 16384), ("heads", 2, 16), ("head_dim", 16, 128)):
        if getattr(args, name) is None:
            setattr(args, name, on_cuda if cuda else on_cpu)
    device = torch.device(args.device)
    store = dist.FileStore(tempfile.mktemp(prefix="host_work_"), 1)
    dist.init_process_group("nccl" if cuda else "gloo", store=store, rank=0, world_size=1)
    _stub_kernels(CudaFlashVarlenOp if cuda else CpuFlashVarlenLayoutOp)
    op = "cuda_flash_varlen" if cuda else "cpu_flash_varlen_layout"
    dtype = torch.bfloat16 if cuda else torch.float32
    if not cuda:
        from ring_impl import masks
        from ring_impl.exchanges.ring import RingAttention

        RingAttention.reads_are_free = lambda self, tensors: False  # read once, as on a GPU
        masks.reads_are_free = lambda t: (
            t.device.type == "cpu" and all(t is not held for held in (device_ids, device_cu))
        )

    gen = torch.Generator().manual_seed(0)
    seq, docs = args.seq, args.docs
    cuts = sorted(torch.randperm(seq - 1, generator=gen)[: docs - 1].add(1).tolist())
    cu = [0, *cuts, seq]
    shape = (1, args.heads, seq, args.head_dim)
    q, k, v, do = (torch.randn(shape, generator=gen).to(device, dtype) for _ in range(4))
    packed = [t[0].transpose(0, 1) for t in (q, k, v, do)]  # (tokens, heads, head_dim) views
    documents = Documents.from_cu_seqlens(cu, seq)
    device_ids = documents.doc_ids.to(device, copy=True)
    device_cu = torch.tensor(cu, dtype=torch.int32, device=device)
    rows = {
        "documents": ((q, k, v, do), dict(mask=documents, op=op)),
        "documents on device": ((q, k, v, do), dict(mask=Documents(device_ids), op=op)),
        "window": ((q, k, v, do), dict(mask=SlidingWindow(1024, 0), op=op)),
        "thd": (tuple(packed), dict(is_causal=True, cu_seqlens=cu, op=op)),
        "thd on device": (tuple(packed), dict(is_causal=True, cu_seqlens=device_cu, op=op)),
    }

    def candidates(name):
        (a, b, c, grad), options = rows[name]

        def forward():
            with torch.no_grad():
                ring_impl.ring_attention(a, b, c, **options)

        def both():
            leaves = [t.detach().requires_grad_() for t in (a, b, c)]
            out = ring_impl.ring_attention(*leaves, **options)
            torch.autograd.grad(out, leaves, grad)

        return forward, both

    report: dict = {"device": str(device), "torch": torch.__version__, "args": vars(args)}
    report["rows"] = []
    calls = {}
    for name in rows:
        forward, both = candidates(name)
        calls[f"{name} forward"], calls[f"{name} forward+backward"] = forward, both
    samples = interleave(calls, args.repeat, args.warmup, clock=clock_for(device))
    stats = summarize(samples.times)
    print(f"{device}, torch {torch.__version__}, seq {seq}, {docs} documents, kernels stubbed")
    print(f"{'row':<38}{'us/call':>10}{'aten ops':>10}{'launches':>10}{'reads':>7}")
    for name, fn in calls.items():
        counts = _counts(fn, equal_reads=name.startswith("documents on device"))
        us = stats[name].median * 1e6
        print(
            f"{name:<38}{us:>10.0f}{counts['aten_ops']:>10}{counts['launches']:>10}"
            f"{counts['reads']:>7}"
        )
        report["rows"].append({"row": name, "us": us, "spread": stats[name].spread, **counts})
    print("launches:", {row["row"]: row["launched"] for row in report["rows"]})
    if args.json:
        write_json(args.json, report)
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
