"""``ring_impl.exchanges.local_shard``: a rank's shard for Ulysses and the hybrid, read from the
groups the call uses, on a hybrid mesh with its dims in either order. Cutting shards by global
rank as if the dims were the other way round runs without complaint and gives wrong attention
(error 0.65 in a trial); local_shard gives the float64 oracle's answer on both orders."""

from __future__ import annotations

import pytest
import torch

SEQ = 32


def _run(ctx, dims: tuple[str, str]) -> dict:
    import ring_impl
    from reference.attention import attention
    from ring_impl.planning.mesh_layout import local_shard, mesh_coords, shard

    mesh = ctx.device_mesh((2, 2), dims)
    gen = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(1, 4, SEQ, 8, generator=gen, dtype=torch.float64) for _ in range(3))
    want = attention(q, k, v, visible=torch.ones(SEQ, SEQ, dtype=torch.bool).tril()).out
    spec = {"strategy": "hybrid", "layout": "head_tail"}
    got = ring_impl.ring_attention(
        *(local_shard(t, mesh, **spec) for t in (q, k, v)), group=mesh, is_causal=True, **spec
    )
    # The pitfall: coordinates from the global rank, as if the mesh were ("ring", "ulysses").
    naive = shard(q, **spec, mesh_shape=(2, 2), coords=mesh_coords(ctx.rank, (2, 2)))
    return {
        "error": float((got - local_shard(want, mesh, **spec)).abs().max()),
        "naive_differs": not torch.equal(naive, local_shard(q, mesh, **spec)),
    }


@pytest.mark.parametrize("dims", [("ring", "ulysses"), ("ulysses", "ring")])
def test_local_shard_follows_the_mesh(ring, dims) -> None:
    results = ring.rank_pool(4).run(_run, dims)
    assert all(r["error"] < 1e-12 for r in results), [r["error"] for r in results]
    # The global-rank coordinates are right for ("ring", "ulysses") only: the pitfall is real.
    assert any(r["naive_differs"] for r in results) == (dims == ("ulysses", "ring")), results


def _ring_shard_equal(ctx) -> bool:
    from ring_impl import shard
    from ring_impl.planning.mesh_layout import local_shard

    x = torch.arange(2 * SEQ, dtype=torch.float32).view(1, 1, 2 * SEQ, 1)
    return torch.equal(
        local_shard(x, ctx.group, strategy="ring", layout="head_tail"),
        shard(x, ctx.world_size, ctx.rank, layout="head_tail"),
    )


def test_local_shard_of_the_ring_is_the_layouts_shard(ring) -> None:
    assert all(ring.rank_pool(2).run(_ring_shard_equal))
