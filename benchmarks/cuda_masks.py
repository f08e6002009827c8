"""GPU benchmark: masked attention through the ring at W=1 against the kernels that express the
mask in one call: packed causal documents and a causal sliding window.

Run from the repository root on a CUDA machine (no install: ``PYTHONPATH=$PWD``)::

    python benchmarks/cuda_masks.py                  # seq 16k (16 documents) and 64k (32 documents)
    python benchmarks/cuda_masks.py --quick          # seq 16k only, fewer repetitions
    python benchmarks/cuda_masks.py --json out.json  # also write the rows

Rows, each forward + backward in bfloat16, batch 1, ``--heads`` heads, head_dim ``--head-dim``,
the tensors stored ``(1, seq, heads, head_dim)`` as a model's projections make them (the flex
and ring rows take ``(1, heads, seq, head_dim)`` views of them, as SDPA callers do):

``varlen``
    FlashAttention-2's varlen kernel called directly (``aten._flash_attention_forward`` /
    ``_backward`` with ``cu_seqlens``): every document in one call. The reference row (1.00x).
``window``
    FlashAttention-2 with ``window_size_left`` (the sliding-window reference).
``flex``
    ``flex_attention`` compiled, with a block mask of the same mask (created once, outside the
    timing, as a model does once per batch).
``ring:<op>``
    ``ring_impl.ring_attention(..., mask=...)`` with that op on a one-rank NCCL group: the
    ring's own cost over the kernel (plan, tiling, merges, checks).
``ring-ids-on-device:auto``
    ``ring:auto`` with the document ids on the device, as a model's batch holds them: their
    compare with the kept snapshot stays on the device (``ring_impl.masks.IdsCheck``).
``ring-thd:auto``, ``ring-thd-cu-on-device:auto``
    the packed call, ``ring_attention(q, k, v, is_causal=True, cu_seqlens=...)`` on the
    ``(tokens, heads, head_dim)`` tensors the varlen row takes, ``cu_seqlens`` a list, then the
    int32 tensor on the device the varlen row takes.
``ring-mod:auto``
    the same documents as a ``MaskMod`` reading a document-id table on the device (up to 16k
    tokens): what a general mask costs over the built-in one.
``ring-tab:auto``
    that ``MaskMod`` evaluated once by ``ring_impl.masks.tabulate`` (outside the timing, as the
    flex row's block mask) into ``KeyRanges``, which every call takes.
``documents x8 layers``: ``varlen``, ``ring:auto``
    8 layers back to back, each layer's output the next one's query, forward then backward: the
    kernels called directly against ``ring_attention`` with the ids on the device. A single
    call's device waits for the host at its start; in a model a layer's host work overlaps the
    kernels queued before it, up to the reads.

Each row is timed with CUDA events (median of ``--repeat`` after ``--warmup``), and one more call
is profiled with ``torch.profiler``: kernel launches, host-device synchronisations
(``cudaStreamSynchronize``, ``cudaDeviceSynchronize``, ``cudaMemcpy`` to the host), the call's wall
time and the GPU's busy time; the table gives that busy time over the timed call's wall time (the
profiler slows the host). A row that fails records its error instead of a time. Nothing here is a
timed assertion.
"""

from __future__ import annotations

import argparse
import math
import os
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from benchmarks.common import no_cuda  # noqa: E402
from benchmarks.runner import cuda_median_ms, write_json  # noqa: E402

#: (seq, documents) of the default run: the figures of the speed issue
SHAPES = ((16384, 16), (65536, 32))
#: the longest sequence the ``ring-mod`` row runs at (its visibility is seq x seq booleans)
MASK_MOD_MAX_SEQ = 16384
RING_OPS = ("auto", "cuda_flash_varlen", "cuda_efficient_masked")
#: the layers of the stacked rows
STACKED = 8
SYNC_EVENTS = ("cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaEventSynchronize")
LAUNCH_EVENTS = ("cudaLaunchKernel", "cudaLaunchKernelExC", "cuLaunchKernel", "cuLaunchKernelEx")


def document_lengths(seq: int, documents: int, seed: int = 0) -> list[int]:
    """``documents`` lognormal lengths (sigma 1) summing to ``seq``, each at least 1."""
    gen = torch.Generator().manual_seed(seed)
    raw = torch.exp(torch.randn(documents, generator=gen, dtype=torch.float64))
    lengths = [max(1, int(x)) for x in (raw / raw.sum() * seq).tolist()]
    lengths[-1] += seq - sum(lengths)
    while lengths[-1] < 1:  # rounding took the last one below 1: take from the longest
        i = max(range(len(lengths) - 1), key=lengths.__getitem__)
        lengths[i] -= 1
        lengths[-1] += 1
    return lengths


def _profile(fn, table_path: str | None = None) -> dict[str, float]:
    """Kernel launches, host syncs, wall and GPU-busy milliseconds of one call; with
    ``table_path``, the profiler's operator table (by count and by host time) written there."""
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        start = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        wall = (time.perf_counter() - start) * 1e3
    launches = syncs = items = copies_to_host = 0
    gpu_us = 0.0
    for e in prof.events():
        name = e.name
        if getattr(e, "device_type", None) == torch.autograd.DeviceType.CUDA:  # work on the GPU
            gpu_us += e.device_time if hasattr(e, "device_time") else e.cuda_time
            copies_to_host += "DtoH" in name
        elif name in LAUNCH_EVENTS:
            launches += 1
        elif name in SYNC_EVENTS:
            syncs += 1
        elif (
            name == "aten::_local_scalar_dense"
        ):  # .item(), bool(tensor), int(tensor) on device data
            items += 1
    if table_path:
        os.makedirs(os.path.dirname(os.path.abspath(table_path)), exist_ok=True)
        averages = prof.key_averages()
        with open(table_path, "w") as f:
            f.write(averages.table(sort_by="count", row_limit=40) + "\n")
            f.write(averages.table(sort_by="self_cpu_time_total", row_limit=40) + "\n")
    return {
        "launches": launches,
        "syncs": syncs,
        "items": items,
        "copies_to_host": copies_to_host,
        "profiled_wall_ms": wall,
        "gpu_busy_ms": gpu_us / 1e3,
    }


def _flash_stack(q, k, v, do, *, cu, max_len, layers):
    """``layers`` varlen FlashAttention-2 calls in a row, each layer's output the next one's
    query, then their backwards in reverse order, called directly (no autograd): the kernels of a
    model's attention layers back to back. Shapes as :func:`_flash`'s varlen call."""
    scale = q.shape[-1] ** -0.5
    saved = []
    x = q
    for _ in range(layers):
        out, lse, rng, unused, _ = torch.ops.aten._flash_attention_forward(
            x, k, v, cu, cu, max_len, max_len, 0.0, True, False, scale=scale
        )
        saved.append((x, out, lse, rng, unused))
        x = out
    for x, out, lse, rng, unused in reversed(saved):
        torch.ops.aten._flash_attention_backward(
            do, x, k, v, out, lse, cu, cu, max_len, max_len, 0.0, True, rng, unused, scale=scale
        )


def _flash(q, k, v, do, *, cu=None, max_len=0, causal=True, window=None):
    """FlashAttention-2 forward then backward, called directly. q/k/v/do (total, heads, d) with
    ``cu`` (varlen) or (1, seq, heads, d) without."""
    scale = q.shape[-1] ** -0.5
    extra = {} if window is None else {"window_size_left": window, "window_size_right": 0}
    seq = q.shape[0] if cu is not None else q.shape[1]
    mq = max_len if cu is not None else seq
    out, lse, rng, unused, _ = torch.ops.aten._flash_attention_forward(
        q, k, v, cu, cu, mq, mq, 0.0, causal, False, scale=scale, **extra
    )
    torch.ops.aten._flash_attention_backward(
        do, q, k, v, out, lse, cu, cu, mq, mq, 0.0, causal, rng, unused, scale=scale, **extra
    )


def _shape_rows(
    rows: list[dict], seq: int, docs: int, args, header: dict, flex, warmup: int, repeat: int
) -> None:
    """Measure every row of one sequence length, appending to ``rows`` (and to ``--json``)."""
    from torch.nn.attention.flex_attention import create_block_mask

    from ring_impl import ring_attention
    from ring_impl.masks import Documents, MaskMod, SlidingWindow, tabulate

    h, d = args.heads, args.head_dim
    lengths = document_lengths(seq, docs)
    cu_list = [0, *torch.tensor(lengths).cumsum(0).tolist()]
    cu = torch.tensor(cu_list, dtype=torch.int32, device="cuda")
    gen = torch.Generator(device="cuda").manual_seed(0)
    thd = [
        torch.randn(seq, h, d, device="cuda", dtype=torch.bfloat16, generator=gen) for _ in range(4)
    ]
    # (1, h, seq, d) views of (1, seq, h, d) storage, as a model's projections make them
    # (``proj(x).view(b, s, h, d).transpose(1, 2)``); the leaves are the (1, seq, h, d) tensors
    bshd = [t.unsqueeze(0) for t in thd]
    bhsd = [t.transpose(1, 2) for t in bshd]
    doc_ids = torch.repeat_interleave(
        torch.arange(docs, device="cuda"), torch.tensor(lengths, device="cuda")
    )
    window = args.window

    def doc_mod(b, hh, qi, ki):
        return (doc_ids[qi] == doc_ids[ki]) & (ki <= qi)

    def window_mod(b, hh, qi, ki):
        return (ki <= qi) & (ki >= qi - window)

    def ring_fn(op, mask):
        def run():
            q, k, v = (t.detach().requires_grad_(True) for t in bshd[:3])
            out = ring_attention(
                *(t.transpose(1, 2) for t in (q, k, v)),
                mask=mask,
                **({} if op == "auto" else {"op": op}),
            )
            out.backward(bhsd[3])

        return run

    def ring_stack_fn(mask, layers):
        def run():  # each layer's output the next one's query, as _flash_stack
            q, k, v = (t.detach().requires_grad_(True) for t in bshd[:3])
            x, kk, vv = (t.transpose(1, 2) for t in (q, k, v))
            for _ in range(layers):
                x = ring_attention(x, kk, vv, mask=mask)
            x.backward(bhsd[3])

        return run

    def thd_ring_fn(lengths_as):
        def run():  # the packed (THD) call: the documents as cu_seqlens, no mask object
            q, k, v = (t.detach().requires_grad_(True) for t in thd[:3])
            ring_attention(q, k, v, is_causal=True, cu_seqlens=lengths_as).backward(thd[3])

        return run

    def flex_fn(block_mask):
        def run():
            q, k, v = (t.detach().requires_grad_(True) for t in bshd[:3])
            flex(*(t.transpose(1, 2) for t in (q, k, v)), block_mask=block_mask).backward(bhsd[3])

        return run

    families = {
        "documents": [
            ("varlen", lambda: _flash(*thd, cu=cu, max_len=max(lengths))),
            ("flex", None),
            *[
                (f"ring:{op}", ring_fn(op, Documents.from_cu_seqlens(cu_list, seq_len=seq)))
                for op in args.ring_ops.split(",")
            ],
            # the ids, then cu_seqlens, on the device, as a model's batch holds them (their
            # compare with the kept snapshot stays on the device)
            ("ring-ids-on-device:auto", ring_fn("auto", Documents(doc_ids))),
            ("ring-thd:auto", thd_ring_fn(cu_list)),
            ("ring-thd-cu-on-device:auto", thd_ring_fn(cu)),
            # the same documents as a mask_mod reading a device table (evaluated on every call,
            # its steps' blocks cached by their visibility): at most MASK_MOD_MAX_SEQ, since a
            # call evaluates the whole seq x seq visibility
            *(
                [("ring-mod:auto", ring_fn("auto", MaskMod(doc_mod)))]
                if seq <= MASK_MOD_MAX_SEQ
                else []
            ),
            # that mask_mod tabulated once, outside the timing (as flex's block mask is made)
            ("ring-tab:auto", ring_fn("auto", tabulate(MaskMod(doc_mod), seq, device="cuda"))),
        ],
        # a model's view: 8 layers back to back, where a layer's host work can overlap the
        # kernels queued before it (a single call above waits for the host at its start)
        "documents x8 layers": [
            (
                "varlen",
                lambda: _flash_stack(*thd, cu=cu, max_len=max(lengths), layers=STACKED),
            ),
            ("ring:auto", ring_stack_fn(Documents(doc_ids), STACKED)),
        ],
        "window": [
            ("window", lambda: _flash(*bshd, window=window)),
            ("flex", None),
            *[
                (f"ring:{op}", ring_fn(op, SlidingWindow(window, 0)))
                for op in ("auto", "cuda_flash_varlen")
            ],
        ],
    }
    for family, variants in families.items():
        reference_ms = None
        for row_name, fn in variants:
            row = {
                "mask": family,
                "seq": seq,
                "documents": docs if family.startswith("documents") else None,
                "row": row_name,
            }
            try:
                if row_name == "flex":
                    block_mask = create_block_mask(
                        doc_mod if family == "documents" else window_mod,
                        1,
                        1,
                        seq,
                        seq,
                        device="cuda",
                    )
                    fn = flex_fn(block_mask)
                ms = cuda_median_ms(fn, warmup, repeat)
                table = (
                    os.path.join(
                        args.profile_dir, f"{family}-{seq}-{row_name.replace(':', '-')}.txt"
                    )
                    if args.profile_dir
                    else None
                )
                row.update(ms=ms, **_profile(fn, table))
                if (
                    row_name == variants[0][0]
                ):  # the kernel called directly: the reference of the family
                    reference_ms = ms
                row["ratio"] = ms / reference_ms if reference_ms else None
            except Exception as exc:  # a row that cannot run says why; the others go on
                row["error"] = f"{type(exc).__name__}: {str(exc).splitlines()[0][:300]}"
            rows.append(row)
            if args.json:  # after every row: a run stopped early keeps what it measured
                write_json(args.json, {**header, "rows": rows})
            if "error" in row:
                print(
                    f"| {family} | {seq} | {row['documents'] or ''} | {row_name} | error: "
                    f"{row['error']} |||||||"
                )
            else:
                # the profiled call's GPU time over the timed (unprofiled) call's wall time: the
                # profiler's own host overhead inflates the profiled call's wall
                busy = row["gpu_busy_ms"] / row["ms"] if row["ms"] else math.nan
                print(
                    f"| {family} | {seq} | {row['documents'] or ''} | {row_name} | "
                    f"{row['ms']:.2f} | {row['ratio'] or math.nan:.2f}x | {row['launches']} | "
                    f"{row['syncs']} | {row['items']} | {row['copies_to_host']} | {busy:.2f} |",
                    flush=True,
                )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--quick", action="store_true", help="seq 16k only, 1 warm-up, 3 repetitions"
    )
    parser.add_argument("--heads", type=int, default=16)
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--window", type=int, default=1024, help="sliding window (left) in tokens")
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--ring-ops", default=",".join(RING_OPS))
    parser.add_argument("--json", default=None, help="write the rows as JSON here")
    parser.add_argument("--profile-dir", default=None, help="write each row's profiler table here")
    args = parser.parse_args(argv)
    if no_cuda("benchmarks/cuda_masks.py"):
        return 2
    shapes = SHAPES[:1] if args.quick else SHAPES
    warmup, repeat = (1, 3) if args.quick else (args.warmup, args.repeat)

    from torch.nn.attention.flex_attention import flex_attention

    torch.cuda.set_device(0)
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29534")
    if not dist.is_initialized():
        dist.init_process_group("nccl", rank=0, world_size=1, device_id=torch.device("cuda", 0))
    flex = torch.compile(flex_attention)
    header = {
        "device": torch.cuda.get_device_name(0),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "dtype": "bfloat16",
        "heads": args.heads,
        "head_dim": args.head_dim,
        "window": args.window,
        "warmup": warmup,
        "repeat": repeat,
    }
    print(
        f"# {header['device']}, torch {header['torch']}, CUDA {header['cuda']}; bfloat16, batch "
        f"1, {args.heads} heads, head_dim {args.head_dim}; forward + backward, median of {repeat} "
        f"after {warmup} warm-up; ring at W=1 (NCCL)"
    )
    print(
        "| mask | seq | docs | row | ms | / reference | launches | syncs | .item() | copies to "
        "host | GPU busy / timed wall |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    rows: list[dict] = []
    for seq, docs in shapes:
        _shape_rows(rows, seq, docs, args, header, flex, warmup, repeat)
        torch.cuda.empty_cache()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
