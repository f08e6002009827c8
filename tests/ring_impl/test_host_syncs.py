"""Host syncs of a call as on a GPU: a device-to-host read (``aten._local_scalar_dense``:
``.item()``, ``bool(t)``, ``int(t)``) stalls the host until the device has caught up, so the
ring may not make one per block.

The ring skips the NaN propagation for blocks whose inputs are finite, a check that reads a
flag: free on CPU, where it is made per ring step; a sync on a GPU, where a one-rank call makes
it once per direction (forward, backward: one read each) and a multi-rank call once (its forward
learns the group's verdict from the cross-rank check's all-reduce; its backward, when every
rank's inputs are finite, reads one flag of the rank's own gradients; otherwise its blocks go
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
    # W=2: the forward's verdict comes with the cross-rank check; the backward reads one flag
    limit = LIMITS[case] if world == 1 else LIMITS[case] - 1
    assert max(syncs) <= limit, (
        f"{case}: {syncs} host syncs per rank in one call at W={world}, at most {limit} allowed"
    )


def _propagations(ctx, nan_in: str | None) -> dict[str, tuple[int, int]]:
    """Per direction, (blocks that went through the NaN propagation, blocks) of one call at W=2
    with reads as on a GPU; ``nan_in``: rank 1's tensor holding a NaN, "key" or "grad_out"
    (None: all finite)."""
    import ring_impl
    from ring_impl.exchanges.ring import RingAttention

    gen = torch.Generator().manual_seed(1)
    q, k, v, do = (torch.randn(1, 4, SEQ // 8, 32, generator=gen) for _ in range(4))
    if ctx.rank == 1 and nan_in == "key":
        k[0, 1, 3, 5] = float("nan")
    if ctx.rank == 1 and nan_in == "grad_out":
        do[0, 2, 7, 1] = float("nan")
    counts = {name: 0 for name in ("forward", "forward_blocks", "backward", "backward_blocks")}
    patched = {
        "nonfinite_forward": "forward",
        "block_forward": "forward_blocks",
        "nonfinite_backward": "backward",
        "block_backward": "backward_blocks",
    }
    originals = {name: getattr(RingAttention, name) for name in (*patched, "reads_are_free")}

    def counted(name: str):
        def method(self, *args, **kwargs):
            counts[patched[name]] += 1
            return originals[name](self, *args, **kwargs)

        return method

    RingAttention.reads_are_free = lambda self, tensors: False  # as on a GPU
    for name in patched:
        setattr(RingAttention, name, counted(name))
    try:
        leaves = [t.clone().requires_grad_() for t in (q, k, v)]
        out = ring_impl.ring_attention(*leaves, group=ctx.group, is_causal=True, layout="head_tail")
        out.backward(do)
    finally:
        for name, method in originals.items():
            setattr(RingAttention, name, method)
    return {
        "forward": (counts["forward"], counts["forward_blocks"]),
        "backward": (counts["backward"], counts["backward_blocks"]),
    }


def test_a_multi_rank_call_skips_the_propagation_on_the_groups_verdict(ring) -> None:
    """As on a GPU: with every rank's inputs finite (reported in the cross-rank check's
    all-reduce) no block of the forward goes through the NaN propagation, nor any of the backward
    on a rank whose gradients are finite (one read); a NaN in one rank's key puts every block of
    every rank back through it (the verdict is the group's); a NaN in one rank's output gradient
    puts that rank's backward blocks through it and no others (what it poisons elsewhere travels
    in that rank's dK/dV accumulators)."""
    if ring.impl.spec != DEFAULT_IMPL_SPEC:
        pytest.skip(f"a ring_impl property; the implementation under test is {ring.impl.spec}")
    pool = ring.rank_pool(2)
    for rank, calls in enumerate(pool.run(_propagations, None)):
        assert all(p == 0 and b > 0 for p, b in calls.values()), (rank, calls)
    for rank, calls in enumerate(pool.run(_propagations, "key")):
        assert all(p == b > 0 for p, b in calls.values()), (rank, calls)
    for rank, calls in enumerate(pool.run(_propagations, "grad_out")):
        (pf, bf), (pb, bb) = calls["forward"], calls["backward"]
        assert pf == 0 and bf > 0, (rank, calls)
        assert bb > 0 and pb == (bb if rank == 1 else 0), (rank, calls)
