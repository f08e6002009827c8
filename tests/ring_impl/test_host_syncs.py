"""Host syncs of a call as on a GPU: a device-to-host read (``aten._local_scalar_dense``:
``.item()``, ``bool(t)``, ``int(t)``) stalls the host until the device has caught up, so the
ring may not make one per block.

On CPU the ring skips the NaN propagation for blocks whose inputs are finite, a check that
reads a flag (free on CPU, a sync on a GPU, where it is never made). Here that shortcut is
switched off, so every block takes the path it takes on a GPU, and the reads are counted in
one warm call, forward and backward, at W=1 with the CUDA kernels' CPU emulations. Counts are
exact, not timings.
"""

from __future__ import annotations

import pytest
import torch

from conformance.implementation import DEFAULT_IMPL_SPEC

from .counting import AtenOps

SEQ = 2048


def _syncs(ctx, case: str) -> int:
    import ring_impl
    from ring_impl.masks import Documents, SlidingWindow
    from ring_impl.ring import RingAttention

    options = {
        "causal": dict(is_causal=True, op="cpu_efficient_layout"),
        "window": dict(mask=SlidingWindow(256, 0), op="cpu_efficient_layout"),
        "window_varlen": dict(mask=SlidingWindow(256, 0), op="cpu_flash_varlen_layout"),
        # (the ids live on the CPU: the checks that read them read host memory)
        "documents": dict(mask=Documents.from_cu_seqlens([0, 100, 400, 401, 900, 1500, 2000], SEQ),
                          op="cpu_flash_varlen_layout"),
    }[case]
    gen = torch.Generator().manual_seed(0)
    q, k, v, do = (torch.randn(1, 4, SEQ, 32, generator=gen) for _ in range(4))
    shortcut = RingAttention.all_finite
    RingAttention.all_finite = lambda self, *tensors: False  # as on a GPU
    try:
        for _ in range(2):  # the second call is counted: plans are cached by then
            leaves = [t.clone().requires_grad_() for t in (q, k, v)]
            with AtenOps() as reads:
                ring_impl.ring_attention(*leaves, group=ctx.group, **options).backward(do)
    finally:
        RingAttention.all_finite = shortcut
    return reads.ops["aten._local_scalar_dense"]


#: case -> the most device-to-host reads a call may make (documents: the ids' checks, on the CPU)
LIMITS = {"causal": 0, "window": 0, "window_varlen": 0, "documents": 2}


@pytest.mark.parametrize("case", sorted(LIMITS))
def test_no_host_sync_per_block(ring, case: str) -> None:
    if ring.impl.spec != DEFAULT_IMPL_SPEC:
        pytest.skip(f"a ring_impl property; the implementation under test is {ring.impl.spec} (run without --impl to check it)")
    (syncs,) = ring.rank_pool(1).run(_syncs, case)
    assert syncs <= LIMITS[case], f"{case}: {syncs} host syncs in one call at W=1, at most {LIMITS[case]} allowed"
