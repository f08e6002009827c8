"""Packed (THD) inputs, ``ring_attention(q, k, v, cu_seqlens=...)`` (ring_impl.planning.packed):
each rank's shard of the global packed sequence, ``(tokens_local, heads, head_dim)``, judged against
the float64 oracle on the documents the global ``cu_seqlens`` describe (the oracle's own
document mask, written apart from ring_impl), with the numerics policy's bounds; bad packed
arguments raise on every rank."""

from __future__ import annotations

import itertools

import pytest
import torch

from reference import attention_grads
from reference.budget import error_scales
from reference.masks import visibility
from tests.ring_impl.oracle import QUANTITIES, assert_results_match_oracle
from tests.ring_impl.outcomes import assert_input_error_on_every_rank
from tests.ring_impl.rank_results import forward_backward, leaves, local_results

HEADS, HEADS_KV, HEAD_DIM = 4, 2, 8


def _cu(total: int) -> list[int]:
    """Uneven documents over ``total`` tokens and 3 tokens of padding at the end: a one-token
    document, documents that cross every shard border, one longer than a shard."""
    used = total - 3
    cuts = sorted({0, 1, 4, used // 3, used // 3 + 5, (2 * used) // 3, used})
    return cuts


def _inputs(total: int, dtype: torch.dtype):
    gen = torch.Generator().manual_seed(total)
    q = torch.randn(total, HEADS, HEAD_DIM, generator=gen, dtype=torch.float64)
    k, v = (
        torch.randn(total, HEADS_KV, HEAD_DIM, generator=gen, dtype=torch.float64) for _ in range(2)
    )
    dout = torch.randn(total, HEADS, HEAD_DIM, generator=gen, dtype=torch.float64)
    return tuple(t.to(dtype) for t in (q, k, v, dout))


def _run(ctx, total: int, dtype, layout: str, causal: bool, exchange: str, cu_as: str):
    import ring_impl

    q, k, v, dout = (
        ring_impl.shard(t, ctx.world_size, ctx.rank, layout=layout, dim=0)
        for t in _inputs(total, dtype)
    )
    q, k, v = leaves(q, k, v)
    cu = _cu(total)
    cu = torch.tensor(cu, dtype=torch.int32) if cu_as == "int32" else cu
    options = dict(cu_seqlens=cu, is_causal=causal, layout=layout, exchange=exchange, op="math")
    out, lse = forward_backward(q, k, v, dout, group=ctx.group, **options)
    return local_results(out, lse, q, k, v, contiguous=out.is_contiguous())


@pytest.mark.parametrize(
    "world,layout,causal,dtype,exchange,cu_as",
    [
        (1, "contiguous", True, torch.float64, "auto", "list"),
        (2, "head_tail", True, torch.float32, "auto", "int32"),
        (2, "contiguous", False, torch.float64, "gather", "list"),
        (3, "contiguous", True, torch.float32, "ring", "int32"),
        (4, "head_tail", False, torch.float32, "auto", "list"),
        (2, "contiguous", True, torch.float64, "ulysses", "list"),
    ],
)
def test_packed_inputs_match_the_oracle(
    ring, world, layout, causal, dtype, exchange, cu_as
) -> None:
    import ring_impl

    total = 24 * world
    results = ring.rank_pool(world).run(
        _run, total, dtype, layout, causal, exchange, cu_as, timeout=120.0
    )
    q, k, v, dout = (t.to(torch.float64) for t in _inputs(total, dtype))
    # The oracle's (batch, heads, seq, head_dim) view of the packed sequence, and its own
    # document mask from the same cumulative lengths (padding: id -1).
    q4, k4, v4, dout4 = (t.transpose(0, 1).unsqueeze(0) for t in (q, k, v, dout))
    cu = _cu(total)
    ids = [-1] * total
    for d, (a, b) in enumerate(itertools.pairwise(cu)):
        ids[a:b] = [d] * (b - a)
    vis = visibility(
        {"kind": "document", "doc_ids": ids, "causal": causal}, total, total, batch=1, heads=HEADS
    )
    ref = attention_grads(q4, k4, v4, dout4, visible=vis)
    scales = error_scales(q4, k4, v4, dout4, visible=vis, input_dtype=dtype)
    for r in results:
        assert r["contiguous"], "the packed output is (tokens_local, heads, head_dim), contiguous"
        assert r["out"].shape == (total // world, HEADS, HEAD_DIM) and r["lse"].shape == (
            HEADS,
            total // world,
        )
        assert r["dk"].shape == (total // world, HEADS_KV, HEAD_DIM)
    got = {}
    for n in QUANTITIES:
        dim = 1 if n == "lse" else 0
        x = ring_impl.unshard([r[n] for r in results], layout=layout, dim=dim)
        got[n] = x.unsqueeze(0) if n == "lse" else x.transpose(0, 1).unsqueeze(0)  # the oracle's
    assert torch.isneginf(ref.lse).any(), "the case has padding rows, which see nothing"
    label, blocks = f"W={world}, {layout}, causal={causal}, {exchange}", world
    if exchange == "ulysses":  # each rank attends over the whole sequence at once
        blocks = 1
    assert_results_match_oracle(label, got, ref, scales, world_size=blocks, dtype=dtype)


def _bad(ctx, kind: str) -> str:
    import ring_impl

    total = 8 * ctx.world_size
    q = torch.randn(8, 2, 4)
    k = v = torch.randn(8, 2, 4)
    cu: object = [0, 5, total]
    if kind == "decreasing":
        cu = [0, 6, 3, total]
    elif kind == "too_long":
        cu = [0, total + 1]
    elif kind == "float":
        cu = torch.tensor([0.0, 16.0])
    elif kind == "four_d":
        q = torch.randn(1, 2, 8, 4)
    elif kind == "cross":
        k = v = torch.randn(6, 2, 4)
    elif kind == "differ":  # ranks disagree on the documents
        cu = [0, 5 + ctx.rank, total]
    elif kind == "meta":  # lengths without data (a tensor made on the meta device)
        cu = torch.tensor([0, 5, total], device="meta")
    ring_impl.ring_attention(q, k, v, group=ctx.group, cu_seqlens=cu)
    return "no error"


@pytest.mark.parametrize(
    "kind,pattern",
    [
        ("decreasing", "cu_seqlens must start at 0, not decrease"),
        ("too_long", "end at most at the global token count 16"),
        ("float", "cu_seqlens must be a 1-D integer tensor"),
        ("four_d", "query must be packed (tokens_local, heads, head_dim)"),
        ("cross", "key and value hold the query's tokens"),
        ("differ", "ranks disagree on mask"),
        ("meta", "invalid packed arguments"),
    ],
)
def test_bad_packed_input_raises_on_every_rank(ring, kind: str, pattern: str) -> None:
    outcomes = ring.rank_pool(2).run_outcomes(_bad, kind, timeout=30.0)
    assert_input_error_on_every_rank(outcomes, pattern)
