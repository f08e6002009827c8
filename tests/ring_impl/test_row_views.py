"""Row views: kernels that honour strides get views of the rows a block reads, not copies.

A masked call runs many small kernel calls (packed documents at W=2: about 19 blocks a
direction per rank), and each used to copy every input into a contiguous tensor: query, key and
value forward, six tensors backward. An op declaring ``capabilities.row_views`` (CPU flash, the
math op, the varlen ops, whose packing hands the kernel (tokens, heads, head_dim) views with a
dense head dim) reads views; every other op (the dense CUDA kernels, a vendor's, the CPU
emulations of dense CUDA kernels, one of which reads memory in a fixed order on the GPU) still
gets contiguous copies. Checked here: the kernels give the same bits on views as on copies, and the
ring, the halo exchange and the sparse gather hand views exactly to the ops that declare them, with
the same results either way.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from ring_impl.exchanges.ring import block_rows
from ring_impl.ops.cpu import CpuFlashOp, CpuFlashVarlenLayoutOp
from ring_impl.ops.math import MathOp

SEQ, HEADS, HEAD_DIM = 96, 4, 16


def _inputs(dtype: torch.dtype, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(2, HEADS, SEQ, HEAD_DIM, generator=gen).to(dtype) for _ in range(4)]


def test_block_rows_views_only_when_asked_and_the_last_dim_is_dense() -> None:
    t = torch.randn(2, 3, 10, 4)
    part = block_rows(t, (2, 7), view=True)
    assert part.data_ptr() == t[:, :, 2:].data_ptr() and not part.is_contiguous()
    assert torch.equal(part, t[:, :, 2:7])
    copy = block_rows(t, (2, 7))
    assert copy.is_contiguous() and copy.data_ptr() != t.data_ptr() and torch.equal(copy, part)
    # a head dim with stride 2 is copied even when views are allowed (the CPU flash kernel
    # misreads it: ring_impl.ops.cpu._dense_head_dim)
    strided = torch.randn(2, 3, 10, 8)[..., ::2]
    assert block_rows(strided, (0, 10), view=True).is_contiguous()
    # an LSE (batch, heads, seq): its last dim is the sequence
    lse = torch.randn(2, 3, 10)
    assert torch.equal(block_rows(lse, (3, 9), view=True), lse[:, :, 3:9])


@pytest.mark.parametrize(
    "op",
    [CpuFlashOp(), MathOp(), CpuFlashVarlenLayoutOp()],
    ids=lambda op: op.name if hasattr(op, "name") else "math",
)
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("kind", ["full", "causal", "masked"])
def test_kernels_give_the_same_bits_on_row_views(op, dtype, kind) -> None:
    assert op.capabilities.row_views
    q, k, v, do = _inputs(dtype)
    rows, cols = ((20, 52), (20, 52)) if kind == "causal" else ((5, 37), (40, 90))
    views = [block_rows(t, rows, True) for t in (q, do)] + [
        block_rows(t, cols, True) for t in (k, v)
    ]
    assert not any(t.is_contiguous() for t in views)
    copies = [t.contiguous() for t in views]
    extra = {}
    if kind == "masked":
        gen = torch.Generator().manual_seed(1)
        vis = torch.rand(1, 1, rows[1] - rows[0], cols[1] - cols[0], generator=gen) < 0.5
        vis[..., 0] = True  # every row sees something: the kernel's empty rows are the ring's job
        extra = {"attn_mask": vis}
    scale = HEAD_DIM**-0.5
    results = []
    for qq, dd, kk, vv in (views, copies):
        out, lse = op.forward(qq, kk, vv, is_causal=kind == "causal", scale=scale, **extra)
        lse = lse.float() if dtype != torch.float64 else lse
        # the backward reads the block's out/LSE as the ring hands them: rows of larger tensors
        big_out = torch.zeros(2, HEADS, SEQ, HEAD_DIM, dtype=out.dtype)
        big_out[:, :, rows[0] : rows[1]] = out
        big_lse = torch.zeros(2, HEADS, SEQ, dtype=lse.dtype)
        big_lse[:, :, rows[0] : rows[1]] = lse
        view = qq is views[0]
        o_, l_ = block_rows(big_out, rows, view), block_rows(big_lse, rows, view)
        grads = op.backward(
            dd, qq, kk, vv, o_, l_, is_causal=kind == "causal", scale=scale, **extra
        )
        results.append((out, lse, *grads))
    for name, a, b in zip(("out", "lse", "dq", "dk", "dv"), *results):
        assert torch.equal(a, b), (
            f"{name}: views and contiguous copies differ by "
            f"{(a.double() - b.double()).abs().max():.3g}"
        )


def test_ops_that_do_not_declare_views_keep_contiguous_inputs() -> None:
    from ring_impl.ops import cpu, cuda

    for cls in (
        cpu.CpuEfficientLayoutOp,
        cpu.CpuEfficientMaskedLayoutOp,
        cpu.CpuCudnnLayoutOp,
        cuda.CudaFlashOp,
        cuda.CudaEfficientOp,
        cuda.CudaCudnnOp,
        cuda.CudaEfficientMaskedOp,
    ):
        assert not cls.capabilities.row_views, f"{cls.__name__} declares row_views"


# --- on the ranks: what the ops are handed, on every path ---------------------------------


def _seen(ctx, path: str, views: bool):
    """(out, dq, dk, dv, [is_contiguous of every tensor an op got]) of one masked call."""
    import ring_impl
    from ring_impl.masks import Documents, SlidingWindow

    seen: list[bool] = []

    class Recording(CpuFlashOp):
        capabilities = dataclasses.replace(CpuFlashOp.capabilities, row_views=views)

        def forward(self, *args, **kwargs):
            seen.extend(t.is_contiguous() for t in args)
            return super().forward(*args, **kwargs)

        def backward(self, *args, **kwargs):
            seen.extend(t.is_contiguous() for t in args)
            return super().backward(*args, **kwargs)

    seq = 256 * ctx.world_size
    gen = torch.Generator().manual_seed(ctx.rank)
    q, k, v = (
        torch.randn(1, 2, 256, 8, generator=gen, dtype=torch.float64).requires_grad_(True)
        for _ in range(3)
    )
    # documents of 100 tokens and a window of 100: blocks the tiler cuts rather than masks whole
    docs = Documents(torch.arange(seq) // 100)
    kwargs = {
        "window": dict(mask=SlidingWindow(100), layout="contiguous", halo=True),
        "documents": dict(mask=docs, layout="head_tail"),
        "sparse": dict(mask=docs, layout="head_tail", sparse_kv=True),
    }[path]
    out = ring_impl.ring_attention(q, k, v, group=ctx.group, op=Recording(), **kwargs)
    out.backward(torch.randn(out.shape, generator=gen, dtype=out.dtype))
    return out.detach(), q.grad, k.grad, v.grad, seen


@pytest.mark.parametrize("path", ["documents", "window", "sparse"])
def test_the_ring_hands_views_to_the_ops_that_declare_them(ring, path) -> None:
    pool = ring.rank_pool(2)
    copies = pool.run(_seen, path, False, timeout=120.0)
    views = pool.run(_seen, path, True, timeout=120.0)
    for rank, (a, b) in enumerate(zip(copies, views)):
        assert a[4] and all(a[4]), (
            f"rank {rank}: an op without row_views got a non-contiguous input"
        )
        assert not all(b[4]), f"rank {rank}: an op with row_views still got only contiguous copies"
        for name, x, y in zip(("out", "dq", "dk", "dv"), a[:4], b[:4]):
            assert torch.equal(x, y), f"rank {rank}: {name} differs between views and copies"
