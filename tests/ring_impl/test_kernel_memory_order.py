"""The memory-efficient backward's memory-order quirk, held on CPU, eager and compiled.

On an H100 (torch 2.11) the CUDA memory-efficient backward read ``out`` as (batch, seq, heads,
head_dim)-contiguous memory whatever its strides said, so the ring's (batch, heads, seq,
head_dim)-contiguous merged output gave dQ/dK wrong by O(1) (dV right).
``ring_impl.ops.cuda.in_efficient_order`` hands it that order. Here a CPU kernel that reads memory
the same way (an opaque custom op, as the aten kernel is to a compiler) runs behind that same
function, at W=2, eagerly and under ``torch.compile`` (``aot_eager``, ``inductor``): a compiled
graph that handed the kernel another memory order would show as the GPU's wrong dQ.

The same kernel records the head dim each backward call gets, which shows whether a call went
through the LSE-gradient fold (``ring_impl.ops.calls._with_lse_grad``, a padded head dim): a
compiled call whose LSE is dropped must not (compiled graphs hand a zero gradient for it, which
made compiled calls 1.18x-1.32x eager on CPU).
"""

from __future__ import annotations

import pytest
import torch

from ring_impl.ops.cpu import CpuFlashOp
from ring_impl.ops.cuda import in_efficient_order

SEQ, HEADS, HEAD_DIM = 32, 4, 16
#: the head dim of every call of the kernel's backward in this process,
#: in order (recorded when it runs)
SEEN_HEAD_DIMS: list[int] = []


@torch.library.custom_op("ring_impl_tests::order_blind_backward", mutates_args=())
def order_blind_backward(
    grad_out: torch.Tensor,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    is_causal: bool,
    scale: float,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """CPU flash's backward reading ``out`` as (batch, seq, heads, head_dim)-contiguous memory
    from its storage offset, whatever its strides (the CUDA kernel's way)."""
    b, h, s, d = out.shape
    SEEN_HEAD_DIMS.append(d)
    read = torch.as_strided(out, (b, h, s, d), (s * h * d, d, h * d, 1), out.storage_offset())
    grads = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
        grad_out.contiguous(),
        query.contiguous(),
        key.contiguous(),
        value.contiguous(),
        read.contiguous(),
        lse.contiguous(),
        0.0,
        is_causal,
        scale=scale,
    )
    return tuple(g.contiguous() for g in grads)


@order_blind_backward.register_fake
def _(grad_out, query, key, value, out, lse, is_causal, scale):
    return tuple(torch.empty(t.shape, dtype=t.dtype, device=t.device) for t in (query, key, value))


class OrderBlindOp(CpuFlashOp):
    """CPU flash forward; the backward as the CUDA memory-efficient op calls its kernel."""

    name = "order_blind"

    def __init__(self, reorder: bool = True):
        self.reorder = reorder

    def backward(self, grad_out, query, key, value, out, lse, *, is_causal, scale):
        out = in_efficient_order(out, query.dtype) if self.reorder else out.to(query.dtype)
        return order_blind_backward(
            grad_out.to(query.dtype), query, key, value, out, lse.float(), is_causal, scale
        )


def _grads(ctx, backend):
    import ring_impl
    from ring_impl.ops import register_op

    for name, reorder in (("order_blind", True), ("order_blind_unordered", False)):
        if name not in ring_impl.available_ops():
            register_op(OrderBlindOp(reorder), name=name)
    gen = torch.Generator().manual_seed(0)
    q, k, v, do = (torch.randn(1, HEADS, SEQ, HEAD_DIM, generator=gen) for _ in range(4))
    q, k, v, do = (
        ring_impl.shard(t, ctx.world_size, ctx.rank, layout="head_tail") for t in (q, k, v, do)
    )

    def attend(q, k, v, op):
        return ring_impl.ring_attention(
            q, k, v, is_causal=True, layout="head_tail", op=op, rotate_method="alltoall"
        )

    torch._dynamo.reset()
    compiled = torch.compile(attend, backend=backend, fullgraph=True)

    def attend_with_lse(q, k, v, op):  # the LSE in the loss: its gradient goes through the fold
        out, lse = ring_impl.ring_attention(
            q,
            k,
            v,
            is_causal=True,
            layout="head_tail",
            op=op,
            rotate_method="alltoall",
            return_lse=True,
        )
        return out + lse.unsqueeze(-1)

    compiled_with_lse = torch.compile(attend_with_lse, backend=backend, fullgraph=True)
    result = {}
    for name, fn, op in (
        ("reference", attend, "cpu_flash"),
        ("eager", attend, "order_blind"),
        ("compiled", compiled, "order_blind"),
        ("unordered", attend, "order_blind_unordered"),
        ("compiled_with_lse", compiled_with_lse, "order_blind"),
    ):
        qq, kk, vv = (t.clone().requires_grad_(True) for t in (q, k, v))
        SEEN_HEAD_DIMS.clear()
        fn(qq, kk, vv, op).backward(do)
        result[name] = (qq.grad, kk.grad, vv.grad)
        result[f"{name} head dims"] = sorted(set(SEEN_HEAD_DIMS))
    return result


@pytest.mark.parametrize("backend", ["aot_eager", "inductor"])
def test_compiled_ring_hands_the_efficient_kernel_its_memory_order(ring, backend) -> None:
    # Two graphs, forward and backward, built by inductor on both ranks at once from a cold
    # cache: minutes of C++ compilation on a loaded 2-core machine (the timeout only stops a hang)
    timeout = 480.0 if backend == "inductor" else 240.0
    for rank, r in enumerate(ring.rank_pool(2).run(_grads, backend, timeout=timeout)):
        ref = r["reference"]
        # The kernel really is order-blind: without the reorder dQ and dK are wrong, dV right.
        bad = [float((g - w).abs().max()) for g, w in zip(r["unordered"], ref)]
        assert bad[0] > 0.1 and bad[1] > 0.1 and bad[2] < 1e-5, (
            f"rank {rank}: the emulation is not order-blind: {bad}"
        )
        for how in ("eager", "compiled"):
            for what, g, w in zip(("dq", "dk", "dv"), r[how], ref):
                err = float((g - w).abs().max())
                assert err < 1e-5, (
                    f"rank {rank}, {how} ({backend}): {what} differs from cpu_flash by {err:.2e}"
                )
        # The LSE dropped: the kernel gets the call's head dim, compiled as eagerly; with the LSE
        # in the loss the fold pads it (the recording sees padding when there is some).
        assert r["eager head dims"] == r["compiled head dims"] == [HEAD_DIM], (
            rank,
            r["compiled head dims"],
        )
        assert r["compiled_with_lse head dims"] == [24], (rank, r["compiled_with_lse head dims"])
