"""Host syncs of a call as on a GPU: a device-to-host read (``aten._local_scalar_dense``:
``.item()``, ``bool(t)``, ``int(t)``) stalls the host until the device has caught up, so the
ring may not make one per block.

The ring skips the NaN propagation for blocks whose inputs are finite, a check that reads a
flag: free on CPU, where it is made per ring step; a sync on a GPU, where a one-rank call makes
it once per direction (forward, backward: one read each) and a multi-rank call never (its forward
learns the group's verdict from the cross-rank check's all-reduce, its backward's blocks go
through the propagation). Here reads are made to count as on a GPU
(``RingAttention.reads_are_free``), and they are counted in one warm call, forward and backward,
at W=1 and W=2 with the CUDA kernels' CPU emulations. Counts are exact, not timings.
"""

from __future__ import annotations

import pytest
import torch

from conformance.implementation import DEFAULT_IMPL_SPEC

from .counting import AtenOps

SEQ = 2048


def _syncs(ctx, case: str) -> int:
    import ring_impl
    from ring_impl.exchanges.ring import RingAttention
    from ring_impl.masks import Documents, SlidingWindow

    options = {
        "causal": dict(is_causal=True, op="cpu_efficient_layout"),
        "window": dict(mask=SlidingWindow(256, 0), op="cpu_efficient_layout"),
        "window_varlen": dict(mask=SlidingWindow(256, 0), op="cpu_flash_varlen_layout"),
        # (the ids live on the CPU: the checks that read them read host memory)
        "documents": dict(
            mask=Documents.from_cu_seqlens([0, 100, 400, 401, 900, 1500, 2000], SEQ),
            op="cpu_flash_varlen_layout",
        ),
    }[case]
    gen = torch.Generator().manual_seed(0)
    q, k, v, do = (torch.randn(1, 4, SEQ // ctx.world_size, 32, generator=gen) for _ in range(4))
    shortcut = RingAttention.reads_are_free
    RingAttention.reads_are_free = lambda self, tensors: False  # as on a GPU
    try:
        for _ in range(2):  # the second call is counted: plans are cached by then
            leaves = [t.clone().requires_grad_() for t in (q, k, v)]
            with AtenOps() as reads:
                ring_impl.ring_attention(*leaves, group=ctx.group, **options).backward(do)
    finally:
        RingAttention.reads_are_free = shortcut
    return reads.ops["aten._local_scalar_dense"]


#: case -> device-to-host reads of one call at W=1: the non-finite decision once per direction
#: (2), plus, for documents, the checks of ids that live on the CPU (2, host memory)
LIMITS = {"causal": 2, "window": 2, "window_varlen": 2, "documents": 4}


@pytest.mark.parametrize("world", [1, 2])
@pytest.mark.parametrize("case", sorted(LIMITS))
def test_no_host_sync_per_block(ring, case: str, world: int) -> None:
    if ring.impl.spec != DEFAULT_IMPL_SPEC:
        pytest.skip(
            f"a ring_impl property; the implementation under test is {ring.impl.spec} (run "
            "without --impl to check it)"
        )
    syncs = ring.rank_pool(world).run(_syncs, case)
    # W=2: the forward's verdict comes with the cross-rank check; nothing else is read
    limit = LIMITS[case] if world == 1 else LIMITS[case] - 2
    assert max(syncs) <= limit, (
        f"{case}: {syncs} host syncs per rank in one call at W={world}, at most {limit} allowed"
    )


def _propagations(ctx, nan_rank: int | None) -> tuple[int, int]:
    """(forward blocks that went through the NaN propagation, forward blocks) in one call at W=2
    with reads as on a GPU; ``nan_rank``: the rank whose key holds a NaN (None: all finite)."""
    import ring_impl
    from ring_impl.exchanges.ring import RingAttention

    gen = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(1, 4, SEQ // 8, 32, generator=gen) for _ in range(3))
    if nan_rank == ctx.rank:
        k[0, 1, 3, 5] = float("nan")
    calls = {"propagated": 0, "blocks": 0}
    shortcut, propagate, block = (
        RingAttention.reads_are_free,
        RingAttention.nonfinite_forward,
        RingAttention.block_forward,
    )

    def counted_propagate(self, *args, **kwargs):
        calls["propagated"] += 1
        return propagate(self, *args, **kwargs)

    def counted_block(self, *args, **kwargs):
        calls["blocks"] += 1
        return block(self, *args, **kwargs)

    RingAttention.reads_are_free = lambda self, tensors: False  # as on a GPU
    RingAttention.nonfinite_forward = counted_propagate
    RingAttention.block_forward = counted_block
    try:
        ring_impl.ring_attention(q, k, v, group=ctx.group, is_causal=True, layout="head_tail")
    finally:
        RingAttention.reads_are_free = shortcut
        RingAttention.nonfinite_forward = propagate
        RingAttention.block_forward = block
    return calls["propagated"], calls["blocks"]


def test_a_multi_rank_forward_skips_the_propagation_on_the_groups_verdict(ring) -> None:
    """As on a GPU: with every rank's inputs finite (reported in the cross-rank check's
    all-reduce) no forward block goes through the NaN propagation; a NaN in one rank's key puts
    every block of every rank back through it (the verdict is the group's)."""
    if ring.impl.spec != DEFAULT_IMPL_SPEC:
        pytest.skip(f"a ring_impl property; the implementation under test is {ring.impl.spec}")
    finite = ring.rank_pool(2).run(_propagations, None)
    assert all(p == 0 and b > 0 for p, b in finite), finite
    poisoned = ring.rank_pool(2).run(_propagations, 1)
    assert all(p == b > 0 for p, b in poisoned), poisoned
