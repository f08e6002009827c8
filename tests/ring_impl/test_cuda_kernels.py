"""The CUDA kernels' own contract, kernel by kernel, against float64 (GPU runs only).

Each check here is a fault seen on an H100 (torch 2.11) that the ring's suites found first:

- the backward kernels take their dense path only with *undefined* cumulative lengths and bias
  (``None``); empty tensors selected the varlen path or were read as a bias, and raised;
- the memory-efficient backward reads ``out`` in (batch, seq, heads, head_dim) memory order
  whatever its strides say; the ring's merged output is (batch, heads, seq, head_dim)-contiguous,
  and dQ/dK came back wrong by O(1) (dV right);
- key/value blocks are views of one received buffer;
- FlashAttention and cuDNN return inf/NaN for causal attention with scale <= 0, which their
  capabilities declare (so ``op="auto"`` and routed SDPA calls avoid them there).

Checks of the ops whose CPU emulations the CPU tests run: the masked memory-efficient op
(``cuda_efficient_masked``), the varlen flash op (``cuda_flash_varlen``, the bottom-right
window rule it packs by included) and the memory-efficient kernels' value head dim of its own
(``OpCapabilities.value_head_dim``, declared from SDPA's checks).

Run: ``pytest tests/ring_impl/test_cuda_kernels.py --device cuda`` on a CUDA machine.
"""

from __future__ import annotations

import pytest
import torch

from ring_impl.ops import get_op

pytestmark = pytest.mark.gpu

CUDA_OPS = ("cuda_flash", "cuda_efficient", "cudnn")


def _reference(q, k, v, grad_out, scale: float, causal: bool):
    """float64 dQ, dK, dV of softmax(q k^T scale) v."""
    q, k, v = (t.double().detach().requires_grad_(True) for t in (q, k, v))
    s = (q @ k.transpose(-1, -2)) * scale
    if causal:
        s = s.masked_fill(
            torch.ones(s.shape[-2:], dtype=torch.bool, device=s.device).triu(1), float("-inf")
        )
    (s.softmax(-1) @ v).backward(grad_out.double())
    return q.grad, k.grad, v.grad


def _dtypes(name: str) -> list[torch.dtype]:
    device = torch.device("cuda")
    return [
        d
        for d in (torch.bfloat16, torch.float32)
        if get_op(name).capabilities.unsupported(device, d, 16) is None
    ]


def _bound(dtype: torch.dtype) -> float:
    # Far below the O(1) errors of the faults above, far above the kernels' rounding
    # (measured: bf16 <= 1.5e-2, f32 <= 3e-6 at these sizes).
    return 6e-2 if dtype == torch.bfloat16 else 1e-4


@pytest.mark.parametrize("name", CUDA_OPS)
@pytest.mark.parametrize("shape", [(1, 2, 6), (2, 4, 40), (1, 3, 64)])
@pytest.mark.parametrize("causal", [False, True])
def test_backward_takes_out_in_any_memory_order(name, shape, causal) -> None:
    b, h, s = shape
    op = get_op(name)
    for dtype in _dtypes(name):
        gen = torch.Generator(device="cuda").manual_seed(0)
        q, k, v, do = (
            torch.randn(b, h, s, 16, device="cuda", dtype=dtype, generator=gen) for _ in range(4)
        )
        out, lse = op.forward(q, k, v, is_causal=causal, scale=0.25)
        lse = lse.reshape(b, h, -1)[..., :s]  # the kernel's LSE layout to (batch, heads, seq)
        ref = _reference(q, k, v, do, 0.25, causal)
        orders = {
            "kernel's own": out,
            "bhsd": out.contiguous(),
            "bshd": out.transpose(1, 2).contiguous().transpose(1, 2),
        }
        for order, o in orders.items():
            grads = op.backward(do, q, k, v, o, lse, is_causal=causal, scale=0.25)
            for what, g, r in zip(("dq", "dk", "dv"), grads, ref):
                err = float((g.double() - r).abs().max())
                assert err < _bound(dtype), (
                    f"{name} {dtype} {shape} causal={causal}: {what} err {err:.2e} with out in "
                    f"{order} order"
                )


@pytest.mark.parametrize("name", CUDA_OPS)
def test_backward_takes_key_value_views_of_one_buffer(name) -> None:
    op = get_op(name)
    for dtype in _dtypes(name):
        gen = torch.Generator(device="cuda").manual_seed(1)
        q, do = (
            torch.randn(1, 2, 6, 16, device="cuda", dtype=dtype, generator=gen) for _ in range(2)
        )
        gathered = torch.randn(
            3, 2, 1, 2, 6, 16, device="cuda", dtype=dtype, generator=gen
        )  # (W, k|v, b, h, s, d)
        k, v = gathered[1][0], gathered[1][1]  # as an all-gathered ring block: views at an offset
        out, lse = op.forward(q, k, v, is_causal=False, scale=0.25)
        lse = lse.reshape(1, 2, -1)[..., :6]
        ref = _reference(q, k, v, do, 0.25, False)
        for what, g, r in zip(
            ("dq", "dk", "dv"), op.backward(do, q, k, v, out, lse, is_causal=False, scale=0.25), ref
        ):
            err = float((g.double() - r).abs().max())
            assert err < _bound(dtype), (
                f"{name} {dtype}: {what} err {err:.2e} with key/value views of one buffer"
            )


@pytest.mark.parametrize("name", CUDA_OPS)
@pytest.mark.parametrize("scale", [-0.3, 0.0])
def test_declared_causal_scale_fault_matches_the_kernel(name, scale) -> None:
    """A kernel declares ``causal_needs_positive_scale`` exactly when it returns non-finite
    values there: a declared fault that is not real would route calls away for nothing, an
    undeclared one would hand NaN to the caller."""
    op = get_op(name)
    gen = torch.Generator(device="cuda").manual_seed(2)
    q, k, v = (
        torch.randn(1, 2, 8, 16, device="cuda", dtype=torch.bfloat16, generator=gen)
        for _ in range(3)
    )
    out, lse = op.forward(q, k, v, is_causal=True, scale=scale)
    finite = bool(out.isfinite().all()) and bool(lse.reshape(1, 2, -1)[..., :8].isfinite().all())
    assert finite != op.capabilities.causal_needs_positive_scale, (
        f"{name}: causal scale {scale} gives {'finite' if finite else 'non-finite'} results but "
        "the kernel declares "
        f"causal_needs_positive_scale={op.capabilities.causal_needs_positive_scale}"
    )


def _masked_reference(q, k, v, grad_out, visible, scale: float):
    """float64 (out, lse, dQ, dK, dV) of softmax(q k^T scale) v with keys hidden where
    ``visible`` is False; rows that see nothing are left out (the ring sets them itself)."""
    q, k, v = (t.double().detach().requires_grad_(True) for t in (q, k, v))
    s = ((q @ k.transpose(-1, -2)) * scale).masked_fill(~visible, float("-inf"))
    lse = torch.logsumexp(s, -1)
    live = visible.any(-1).expand(lse.shape)
    p = torch.exp(s - torch.where(live, lse, 0.0).unsqueeze(-1))
    out = p @ v
    (out * grad_out.double() * live.unsqueeze(-1)).sum().backward()
    return out.detach(), lse.detach(), q.grad, k.grad, v.grad, live


@pytest.mark.parametrize(
    "shape",
    [(1, 2, 6, 40, (1, 1)), (2, 4, 40, 6, (2, 4)), (1, 3, 64, 64, (1, 3)), (2, 2, 17, 33, (2, 1))],
)
def test_masked_efficient_op_against_float64(shape) -> None:
    """cuda_efficient_masked (written without a GPU) on masked blocks: the visibility as the
    kernel's additive bias, key counts that are not multiples of the bias alignment, masks per
    batch and head or broadcast, rows that see nothing (compared nowhere: the ring overwrites
    them, and hands the backward LSE 0 and a zero output gradient there, as here)."""
    b, h, sq, sk, (mb, mh) = shape
    op = get_op("cuda_efficient_masked")
    for dtype in _dtypes("cuda_efficient_masked"):
        gen = torch.Generator(device="cuda").manual_seed(3)
        q, do = (
            torch.randn(b, h, sq, 16, device="cuda", dtype=dtype, generator=gen) for _ in range(2)
        )
        k, v = (
            torch.randn(b, h, sk, 16, device="cuda", dtype=dtype, generator=gen) for _ in range(2)
        )
        visible = torch.rand(mb, mh, sq, sk, device="cuda", generator=gen) < 0.5
        visible[..., 1, :] = False  # a row that sees nothing
        out, lse = op.forward(q, k, v, is_causal=False, scale=0.25, attn_mask=visible)
        want_out, want_lse, *want_grads, live = _masked_reference(q, k, v, do, visible, 0.25)
        lse = lse.reshape(b, h, -1)[..., :sq]
        for what, got, want in (("out", out, want_out), ("lse", lse, want_lse)):
            sel = live if what == "lse" else live.unsqueeze(-1).expand(want.shape)
            err = float((got.double() - want)[sel].abs().max())
            assert err < _bound(dtype), f"{dtype} {shape}: {what} err {err:.2e}"
        ring_lse = torch.where(live, want_lse, 0.0).float()
        grads = op.backward(
            do * live.unsqueeze(-1),
            q,
            k,
            v,
            want_out.to(dtype),
            ring_lse,
            is_causal=False,
            scale=0.25,
            attn_mask=visible,
        )
        for what, g, r in zip(("dq", "dk", "dv"), grads, want_grads):
            err = float((g.double() - r).abs().max())
            assert err < _bound(dtype), f"{dtype} {shape}: {what} err {err:.2e}"


@pytest.mark.parametrize("window", [(-1, -1), (-1, 0), (0, 0), (3, 0), (2, -1), (1, 2)])
def test_varlen_kernel_windows_match_the_emulated_rule(window) -> None:
    """The rule ring_impl.ops.varlen packs by, on the kernel itself: each sequence's window
    aligned to its bottom right, sequences with more and with fewer queries than keys (the
    emulator's ``varlen_visibility``). Rows that see nothing are compared nowhere."""
    from ring_impl.ops.varlen_emulation import varlen_visibility

    op = get_op("cuda_flash_varlen")
    len_q, len_k = [5, 1, 12, 7], [9, 4, 12, 3]
    cu_q = torch.tensor([0, *len_q], device="cuda").cumsum(0).to(torch.int32)
    cu_k = torch.tensor([0, *len_k], device="cuda").cumsum(0).to(torch.int32)
    gen = torch.Generator(device="cuda").manual_seed(4)
    q, do = (
        torch.randn(sum(len_q), 4, 16, device="cuda", dtype=torch.bfloat16, generator=gen)
        for _ in range(2)
    )
    k, v = (
        torch.randn(sum(len_k), 2, 16, device="cuda", dtype=torch.bfloat16, generator=gen)
        for _ in range(2)
    )
    vis = varlen_visibility(cu_q, cu_k, window)
    heads_first = [
        t.transpose(0, 1).unsqueeze(0)
        for t in (q, k.repeat_interleave(2, 1), v.repeat_interleave(2, 1), do)
    ]
    want_out, want_lse, *want_grads, live = _masked_reference(
        *heads_first[:3], heads_first[3], vis, 0.25
    )
    out, lse = op.kernel_forward(
        q, k, v, cu_q, cu_k, max(len_q), max(len_k), scale=0.25, window=window
    )
    got_out, got_lse = out.transpose(0, 1).unsqueeze(0), lse.unsqueeze(0)
    for what, got, want in (("out", got_out, want_out), ("lse", got_lse, want_lse)):
        sel = live if what == "lse" else live.unsqueeze(-1).expand(want.shape)
        err = float((got.double() - want)[sel].abs().max())
        assert err < _bound(torch.bfloat16), f"window {window}: {what} err {err:.2e}"
    ring_out = (
        torch.where(live.unsqueeze(-1), want_out, 0.0)[0]
        .transpose(0, 1)
        .to(torch.bfloat16)
        .contiguous()
    )
    ring_lse = torch.where(live, want_lse, 0.0)[0].float().contiguous()
    grads = op.kernel_backward(
        do * live[0].T.unsqueeze(-1),
        q,
        k,
        v,
        ring_out,
        ring_lse,
        cu_q,
        cu_k,
        max(len_q),
        max(len_k),
        scale=0.25,
        window=window,
    )
    dk_ref, dv_ref = (
        g.reshape(1, 2, 2, -1, 16).sum(2) for g in want_grads[1:]
    )  # GQA: sum each kv head's group
    for what, g, r in zip(("dq", "dk", "dv"), grads, (want_grads[0], dk_ref, dv_ref)):
        err = float((g.transpose(0, 1).unsqueeze(0).double() - r).abs().max())
        assert err < _bound(torch.bfloat16), f"window {window}: {what} err {err:.2e}"


@pytest.mark.parametrize("mask", ["documents", "sink_and_window", "per_batch", "unmasked_causal"])
def test_varlen_op_against_float64(mask) -> None:
    """cuda_flash_varlen (written without a GPU) on blocks as the ring gives them: packed
    documents, sink tokens with a window (two layers), a visibility per batch element, GQA, rows
    that see nothing."""
    b, h, hkv, s = 2, 4, 2, 96
    op = get_op("cuda_flash_varlen")
    i, j = torch.arange(s, device="cuda").view(-1, 1), torch.arange(s, device="cuda").view(1, -1)
    doc = i * 7 // s
    visible = {
        "documents": ((doc == doc.T) & (j <= i)).view(1, 1, s, s),
        "sink_and_window": ((j <= i) & ((j < 4) | (i - j < 9))).view(1, 1, s, s),
        "per_batch": torch.stack([(doc == doc.T) & (j <= i), (j <= i) & (i - j < 5)]).unsqueeze(1),
        "unmasked_causal": None,
    }[mask]
    if visible is not None:
        visible = visible.clone()
        visible[..., 10, :] = False
    gen = torch.Generator(device="cuda").manual_seed(5)
    q, do = (
        torch.randn(b, h, s, 64, device="cuda", dtype=torch.bfloat16, generator=gen)
        for _ in range(2)
    )
    k, v = (
        torch.randn(b, hkv, s, 64, device="cuda", dtype=torch.bfloat16, generator=gen)
        for _ in range(2)
    )
    ref_vis = visible if visible is not None else (j <= i).view(1, 1, s, s)
    want_out, want_lse, *want_grads, live = _masked_reference(
        q, k.repeat_interleave(2, 1), v.repeat_interleave(2, 1), do, ref_vis, 0.125
    )
    out, lse = op.forward(q, k, v, is_causal=visible is None, scale=0.125, attn_mask=visible)
    for what, got, want in (("out", out, want_out), ("lse", lse, want_lse)):
        sel = live if what == "lse" else live.unsqueeze(-1).expand(want.shape)
        err = float((got.double() - want)[sel].abs().max())
        assert err < _bound(torch.bfloat16), f"{mask}: {what} err {err:.2e}"
    ring_lse = torch.where(live, want_lse, 0.0).float()
    grads = op.backward(
        do * live.unsqueeze(-1),
        q,
        k,
        v,
        want_out.to(torch.bfloat16),
        ring_lse,
        is_causal=visible is None,
        scale=0.125,
        attn_mask=visible,
    )
    dk_ref, dv_ref = (g.reshape(b, hkv, 2, s, 64).sum(2) for g in want_grads[1:])
    for what, g, r in zip(("dq", "dk", "dv"), grads, (want_grads[0], dk_ref, dv_ref)):
        err = float((g.double() - r).abs().max())
        assert err < _bound(torch.bfloat16), f"{mask}: {what} err {err:.2e}"


@pytest.mark.parametrize(
    "name",
    [n for n in (*CUDA_OPS, "cuda_efficient_masked") if get_op(n).capabilities.value_head_dim],
)
@pytest.mark.parametrize("d,dv", [(16, 24), (24, 8)])
@pytest.mark.parametrize("causal", [False, True])
def test_value_head_dim_where_declared(name, d, dv, causal) -> None:
    """A kernel declaring ``value_head_dim`` (NOT YET RUN ON A GPU: declared from SDPA's
    check_head_dim_size_mem_efficient) takes value with its own head dim, key and value as views
    of the ring's packed buffer (side by side on the last dim)."""
    op = get_op(name)
    for dtype in _dtypes(name):
        gen = torch.Generator(device="cuda").manual_seed(2)
        q = torch.randn(1, 2, 40, d, device="cuda", dtype=dtype, generator=gen)
        packed = torch.randn(1, 2, 40, d + dv, device="cuda", dtype=dtype, generator=gen)
        k, v = packed[..., :d].contiguous(), packed[..., d:].contiguous()
        do = torch.randn(1, 2, 40, dv, device="cuda", dtype=dtype, generator=gen)
        out, lse = op.forward(q, k, v, is_causal=causal, scale=0.25)
        assert out.shape == (1, 2, 40, dv)
        lse = lse.reshape(1, 2, -1)[..., :40]
        ref = _reference(q, k, v, do, 0.25, causal)
        grads = op.backward(do, q, k, v, out, lse, is_causal=causal, scale=0.25)
        for what, g, r in zip(("dq", "dk", "dv"), grads, ref):
            assert g.shape == r.shape, (what, g.shape, r.shape)
            err = float((g.double() - r).abs().max())
            assert err < _bound(dtype), (
                f"{name} {dtype} d={d} dv={dv} causal={causal}: {what} err {err:.2e}"
            )


def _mask_mod_on_a_device_table(ctx, exchange: str) -> list[float]:
    """max |MaskMod - Documents| of out, dq, dk, dv: the same packed documents as a built-in mask
    and as a mask_mod reading a document-id table on the rank's GPU, as flex's are written,
    through ``exchange``."""
    import ring_impl
    from ring_impl.masks import Documents, MaskMod

    seq, cuts = 96 * ctx.world_size, [0, 17, 40, 41]
    cuts = [*cuts, 70 * ctx.world_size, 96 * ctx.world_size]
    ids = torch.repeat_interleave(torch.arange(len(cuts) - 1), torch.diff(torch.tensor(cuts))).to(
        ctx.device
    )

    def same_document(b, h, q, kv):
        return (ids[q] == ids[kv]) & (kv <= q)

    gen = torch.Generator(device=ctx.device).manual_seed(ctx.rank)
    q, k, v, do = (
        torch.randn(1, 4, seq // ctx.world_size, 32, device=ctx.device, generator=gen)
        for _ in range(4)
    )
    results = []
    for mask in (Documents.from_cu_seqlens(cuts, seq), MaskMod(same_document)):
        leaves = [t.clone().requires_grad_(True) for t in (q, k, v)]
        out = ring_impl.ring_attention(*leaves, group=ctx.group, mask=mask, exchange=exchange)
        out.backward(do)
        results.append([out.detach(), *(t.grad for t in leaves)])
    return [float((a - b).abs().max()) for a, b in zip(*results)]


@pytest.mark.parametrize(
    "world, exchange", [(1, "ring"), (2, "ring"), (2, "gather"), (2, "ulysses")]
)
def test_mask_mod_reads_a_table_on_the_gpu(ring, world, exchange) -> None:
    """A mask_mod indexing a CUDA tensor with the positions it is given runs (its positions are
    put on the inputs' device, by every exchange that plans from the mask) and masks as the
    built-in mask it spells (float32: the kernels' rounding is far below 1e-4 here)."""
    pool = ring.rank_pool(world)
    for rank, diffs in enumerate(pool.run(_mask_mod_on_a_device_table, exchange)):
        assert max(diffs) < 1e-4, (
            f"rank {rank}: max |MaskMod - Documents| (out, dq, dk, dv) {diffs}"
        )
