"""SDPA routed through the context-parallel API on a rank: ``ring_impl.context_parallel`` over
buffers and a module parallelized by ``ring_impl.ContextParallel``, the two ways a user reaches
the ring without calling it."""

from __future__ import annotations

import torch


class CausalSDPA(torch.nn.Module):
    """Causal SDPA of its (query, key, value): what ``ContextParallel`` routes."""

    def forward(self, q, k, v):
        return torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)


def sdpa_both_routes(ctx, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, **options) -> dict:
    """Causal SDPA of the global (batch, heads, seq, head_dim) ``q, k, v`` with the alltoall
    rotation and ``options`` (strategy, head_chunks): under ``context_parallel`` (copies of the
    buffers, sharded in place) and through ``ContextParallel`` (this rank's head_tail shards),
    each with its collectives: ``{"cp": (out, log summary), "style": (out, log summary)}``."""
    import torch.nn.functional as F
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.tensor.parallel import parallelize_module

    import ring_impl
    from harness.accounting import CollectiveLog

    out: dict = {}
    qs, ks, vs = q.clone(), k.clone(), v.clone()
    with (
        CollectiveLog() as log,
        ring_impl.context_parallel(
            ctx.group,
            buffers=[qs, ks, vs],
            buffer_seq_dims=[2, 2, 2],
            rotate_method="alltoall",
            **options,
        ),
    ):
        o = F.scaled_dot_product_attention(qs, ks, vs, is_causal=True)
    out["cp"] = (o, log.summary())
    mesh = DeviceMesh.from_group(ctx.group, "cpu")
    style = ring_impl.ContextParallel(rotate_method="alltoall", **options)
    module = parallelize_module(CausalSDPA(), mesh, style)
    shards = (
        ring_impl.shard(t, ctx.world_size, ctx.rank, layout="head_tail", dim=2) for t in (q, k, v)
    )
    with CollectiveLog() as log:
        o = module(*shards)
    out["style"] = (o, log.summary())
    return out
