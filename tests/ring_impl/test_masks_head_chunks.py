"""``ring_attention(mask=..., head_chunks=N)``: the rings over head groups each plan the mask for
their own query heads (a ``MaskMod`` may depend on the head), against the float64 oracle (the
ring forced: ``halo=False``; the halo exchange runs all heads at once)."""

from __future__ import annotations

import pytest
import torch

from reference import attention_grads
from reference.budget import error_scales
from reference.masks import visibility
from tests.ring_impl.oracle import assert_results_match_oracle, unshard_results
from tests.ring_impl.test_masks import BATCH, HEADS, _inputs, _masks


def heads_apart(b, h, q_idx, kv_idx):
    """Query heads 0-1 causal, heads 2-3 a causal window of 4: each head chunk of 2 sees its own."""
    return (kv_idx <= q_idx) & ((h < 2) | (kv_idx >= q_idx - 3))


def _spec(name: str, seq: int) -> dict:
    return {"kind": "mask_mod", "fn": heads_apart} if name == "heads_apart" else _masks(seq)[name]


def _run(ctx, spec, seq, dtype, layout, head_chunks):
    import ring_impl
    from ring_impl.masks import from_spec

    q, k, v, dout, _ = _inputs(seq, dtype, False)
    q, k, v, dout = (
        ring_impl.shard(t, ctx.world_size, ctx.rank, layout=layout) for t in (q, k, v, dout)
    )
    q, k, v = (t.requires_grad_(True) for t in (q, k, v))
    out, lse = ring_impl.ring_attention(
        q,
        k,
        v,
        group=ctx.group,
        mask=from_spec(spec),
        layout=layout,
        op="math",
        return_lse=True,
        head_chunks=head_chunks,
        halo=False,
    )
    out.backward(dout)
    return {"out": out.detach(), "lse": lse.detach(), "dq": q.grad, "dk": k.grad, "dv": v.grad}


@pytest.mark.parametrize("head_chunks", [2])  # HEADS_KV = 2 key/value heads: at most 2 chunks
@pytest.mark.parametrize(
    "name,world,layout",
    [
        ("heads_apart", 2, "head_tail"),
        ("heads_apart", 3, "contiguous"),
        ("mask_mod_per_head", 3, "contiguous"),
        ("documents_window", 3, "contiguous"),
        ("window_narrow", 2, "contiguous"),
    ],
)
def test_head_chunks_with_masks_match_the_oracle(ring, name, world, layout, head_chunks) -> None:

    seq, dtype = 24 * world, torch.float64
    spec = _spec(name, seq)
    results = ring.rank_pool(world).run(_run, spec, seq, dtype, layout, head_chunks, timeout=120.0)
    q, k, v, dout, _ = _inputs(seq, dtype, False)
    vis = visibility(spec, seq, seq, batch=BATCH, heads=HEADS)
    ref = attention_grads(q, k, v, dout, visible=vis)
    scales = error_scales(q, k, v, dout, visible=vis)
    got = unshard_results(results, layout)
    assert_results_match_oracle(
        f"{name}, W={world}, {layout}, head_chunks={head_chunks}",
        got,
        ref,
        scales,
        world_size=world,
        dtype=dtype,
    )
