"""Compiled gradients on every supported torch release.

Dynamo before torch 2.12 hands a zero gradient to an ``autograd.Function`` output that the
forward wrote in place or returned through a no-op ``.to()``: the ring's merged output and LSE
are both, so on torch 2.11 (the GPU images' release) a compiled call's dQ, dK and dV were wrong
by O(1) while the eager call was right. There the ring returns copies of them when compiled
(``ring_impl.exchanges.ring._COPY_COMPILED_OUTPUTS``). Here the compiled call, with its loss through
the output and the LSE, equals the eager call bitwise with the copies forced on and with the running
release's own choice: on torch 2.11 the second is the regression test, on newer releases the
first proves the copies change nothing.
"""

from __future__ import annotations

import pytest


def _compiled_against_eager(ctx, copy: bool | None) -> list[float]:
    import ring_impl.exchanges.ring as ring_module

    default = ring_module._COPY_COMPILED_OUTPUTS
    ring_module._COPY_COMPILED_OUTPUTS = default if copy is None else copy
    try:
        return _diffs(ctx)
    finally:  # ranks outlive the case
        ring_module._COPY_COMPILED_OUTPUTS = default


def _diffs(ctx) -> list[float]:
    import torch._dynamo

    import ring_impl

    torch._dynamo.reset()

    def attention(q, k, v):
        return ring_impl.ring_attention(
            q, k, v, group=ctx.group, is_causal=True, layout="head_tail", return_lse=True
        )

    gen = torch.Generator().manual_seed(ctx.rank)
    q, dout = (torch.randn(1, 4, 8, 16, generator=gen) for _ in range(2))
    k, v = (torch.randn(1, 2, 8, 16, generator=gen) for _ in range(2))
    dlse = torch.randn(1, 4, 8, generator=gen)
    results = []
    for fn in (torch.compile(attention, backend="aot_eager", fullgraph=True), attention):
        leaves = [t.clone().requires_grad_(True) for t in (q, k, v)]
        out, lse = fn(*leaves)
        torch.autograd.backward([out, lse], [dout, dlse])
        results.append([out.detach(), lse.detach()] + [t.grad for t in leaves])
    return [float((a - b).abs().max()) for a, b in zip(*results)]


@pytest.mark.parametrize("copy", [True, None], ids=["copies", "release_default"])
def test_compiled_gradients_equal_eager(ring, copy) -> None:
    for rank, diffs in enumerate(
        ring.rank_pool(2).run(_compiled_against_eager, copy, timeout=240.0)
    ):
        assert diffs == [0.0] * 5, (
            f"rank {rank}: compiled differs from eager (max |difference| of out, lse, dq, dk, "
            f"dv): {diffs}"
        )


@pytest.mark.parametrize(
    ("version", "release"),
    [("2.11.0+cu130", (2, 11)), ("2.13.0+cpu", (2, 13)), ("2.15.0.dev20261101", (2, 15))],
)
def test_release_is_read_from_the_version_string(version, release) -> None:
    from ring_impl.exchanges.ring import _release

    assert _release(version) == release
