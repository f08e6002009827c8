"""Kernel calls and host work of a masked call with a varlen kernel, counted on CPU with the CUDA
varlen op's emulation (``cpu_flash_varlen_layout``: the same packing and plans as
``cuda_flash_varlen``, the kernel evaluated with the math op). Counts are exact, not timings.

- A ring step (or the halo block) of packed documents, a sliding window, or both, reaches the
  kernel as one call forward and one backward, however many documents it holds.
- The host work of a call (aten ops dispatched, forward and backward) does not grow with the
  number of documents.
- One rank runs its kernel and nothing that holds memory around it (no packed copy of key and
  value, no accumulators).
"""

from __future__ import annotations

import pytest
import torch

from .counting import AtenOps, varlen_kernel_calls

OP = "cpu_flash_varlen_layout"


def _mask(name: str, seq: int):
    from ring_impl.masks import Documents, SlidingWindow

    def documents(n: int) -> Documents:
        # n documents of uneven lengths (one of a single token), every token in one
        cuts = sorted({0, seq, 1, *(seq * (i * i) // (n * n) for i in range(1, n))})
        return Documents.from_cu_seqlens(cuts, seq)

    return {
        "documents_16": lambda: documents(16),
        "documents_64": lambda: documents(64),
        "window": lambda: SlidingWindow(seq // 8),
        "documents_and_window": lambda: documents(16) & SlidingWindow(seq // 16),
    }[name]()


def _counted_call(ctx, name: str, seq: int, layout: str):
    """(kernel calls forward, backward, planned blocks per step, aten ops) of this rank's second
    call (the first builds the plans)."""
    import ring_impl
    from ring_impl.planning.plan import masked_plan

    world, rank = ctx.world_size, ctx.rank
    mask = _mask(name, seq)
    gen = torch.Generator().manual_seed(rank)
    local = seq // world
    q, k, v, do = (torch.randn(1, 4, local, 16, generator=gen) for _ in range(4))
    for _ in range(2):
        leaves = [t.clone().requires_grad_() for t in (q, k, v)]
        with varlen_kernel_calls() as calls, AtenOps() as ops:
            ring_impl.ring_attention(
                *leaves, group=ctx.group, mask=mask, op=OP, layout=layout, halo=False
            ).backward(do)
    plan = masked_plan(
        rank,
        world,
        layout=layout,
        mask=mask,
        seq_q=local,
        seq_kv=local,
        batch=1,
        heads=1,
        ranges=True,
    )
    return calls["forward"], calls["backward"], [len(p.blocks) for p in plan], sum(ops.ops.values())


@pytest.mark.parametrize("name", ["documents_16", "documents_64", "window", "documents_and_window"])
@pytest.mark.parametrize(
    "world,layout", [(1, "contiguous"), (2, "contiguous"), (2, "head_tail"), (4, "head_tail")]
)
def test_one_kernel_call_per_ring_step_per_direction(
    ring, name: str, world: int, layout: str
) -> None:
    results = ring.rank_pool(world).run(_counted_call, name, 1024, layout, timeout=120.0)
    for rank, (fwd, bwd, blocks, _) in enumerate(results):
        assert max(blocks) <= 1, f"rank {rank}: a step planned as {max(blocks)} blocks"
        assert fwd == sum(blocks) and bwd == sum(blocks), (
            f"rank {rank}: {fwd} kernel calls forward and {bwd} backward for {sum(blocks)} ring "
            "steps with work"
        )


def test_host_work_does_not_grow_with_the_documents(ring) -> None:
    """16 and 64 documents at W=1: the same aten ops dispatched, within 10%."""
    pool = ring.rank_pool(1)
    (few,) = pool.run(_counted_call, "documents_16", 4096, "contiguous", timeout=120.0)
    (many,) = pool.run(_counted_call, "documents_64", 4096, "contiguous", timeout=120.0)
    assert many[3] <= 1.1 * few[3], f"{few[3]} aten ops for 16 documents, {many[3]} for 64"


def _halo_calls(ctx, seq: int):
    import ring_impl
    from ring_impl.masks import SlidingWindow

    q, k, v, do = (torch.randn(1, 2, seq // ctx.world_size, 16) for _ in range(4))
    with varlen_kernel_calls() as calls:
        leaves = [t.clone().requires_grad_() for t in (q, k, v)]
        ring_impl.ring_attention(
            *leaves, group=ctx.group, mask=SlidingWindow(seq // 16), op=OP, halo=True
        ).backward(do)
    return calls["forward"], calls["backward"]


def test_the_halo_block_of_a_window_is_one_call(ring) -> None:
    assert ring.rank_pool(3).run(_halo_calls, 768, timeout=120.0) == [(1, 1)] * 3


def _one_rank_ops(ctx, dtype: str) -> dict[str, int]:
    import ring_impl

    q, k, v, do = (torch.randn(1, 4, 512, 32, dtype=getattr(torch, dtype)) for _ in range(4))
    for _ in range(2):
        leaves = [t.clone().requires_grad_() for t in (q, k, v)]
        with AtenOps() as ops:
            ring_impl.ring_attention(
                *leaves, group=ctx.group, is_causal=True, op="cpu_flash"
            ).backward(do)
    return dict(ops.ops)


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_one_rank_takes_the_kernels_own_path(ring, dtype: str) -> None:
    """W=1, causal: one kernel call each way and nothing around it that holds memory: no packed
    key/value copy (stack), no accumulators (zeros), no dtype conversions of the output or the
    gradients (_to_copy)."""
    (ops,) = ring.rank_pool(1).run(_one_rank_ops, dtype, timeout=60.0)
    assert ops.get("aten._scaled_dot_product_flash_attention_for_cpu") == 1, ops
    assert ops.get("aten._scaled_dot_product_flash_attention_for_cpu_backward") == 1, ops
    extra = {
        name: ops.get(name, 0) for name in ("aten.stack", "aten.zeros", "aten._to_copy", "aten.cat")
    }
    assert not any(extra.values()), f"one rank's call does more than its kernel: {extra}"
