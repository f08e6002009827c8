"""A layout is one function: a balancer registered with ``ring_impl.register_layout`` gets a
causal ring that is right (against the float64 oracle, by the numerics policy) through shard,
plan and unshard derived from its positions, for every rotation method, with several blocks per
step where its chunks interleave."""

from __future__ import annotations

import random

import pytest
import torch
import torch.nn.functional as F

from reference import attention_grads
from reference.budget import assert_close

WORLD, CHUNKS_PER_RANK, CHUNK = 3, 3, 4
SEQ = WORLD * CHUNKS_PER_RANK * CHUNK


def dealt_chunks():
    """The sequence cut into 3W chunks dealt out at random (seeded): rank r holds 3 chunks in
    increasing order. A stand-in for a work-aware balancer's output."""
    from ring_impl import Layout

    def runs(seq: int, world: int, rank: int):
        ids = list(range(CHUNKS_PER_RANK * world))
        random.Random(world).shuffle(ids)
        n = seq // (CHUNKS_PER_RANK * world)
        return tuple(
            (c * n, (c + 1) * n)
            for c in sorted(ids[rank * CHUNKS_PER_RANK : (rank + 1) * CHUNKS_PER_RANK])
        )

    return Layout("test_dealt_chunks", runs, lambda w: CHUNKS_PER_RANK * w)


def _inputs():
    gen = torch.Generator().manual_seed(11)
    q = torch.randn(1, 4, SEQ, 8, dtype=torch.float64, generator=gen)
    k, v = (torch.randn(1, 2, SEQ, 8, dtype=torch.float64, generator=gen) for _ in range(2))
    dout = torch.randn(1, 4, SEQ, 8, dtype=torch.float64, generator=gen)
    return q, k, v, dout


def _run(ctx, rotate: str) -> dict:
    import ring_impl
    from ring_impl.planning.plan import ring_plan

    layout = ring_impl.register_layout(dealt_chunks(), replace=True).name
    q, k, v, dout = (ring_impl.shard(t, ctx.world_size, ctx.rank, layout=layout) for t in _inputs())
    q, k, v = (t.requires_grad_(True) for t in (q, k, v))
    out = ring_impl.ring_attention(
        q, k, v, group=ctx.group, is_causal=True, layout=layout, rotate_method=rotate, op="math"
    )
    out.backward(dout)
    blocks = [
        len(p.blocks)
        for p in ring_plan(
            ctx.rank,
            ctx.world_size,
            layout=layout,
            is_causal=True,
            seq_q=q.shape[2],
            seq_kv=k.shape[2],
        )
    ]
    return {"out": out.detach(), "dq": q.grad, "dk": k.grad, "dv": v.grad, "blocks": blocks}


@pytest.mark.parametrize("rotate", ["allgather", "alltoall", "p2p"])
def test_registered_layout_runs_right(ring, rotate: str) -> None:
    import ring_impl

    layout = ring_impl.register_layout(dealt_chunks(), replace=True).name
    results = ring.rank_pool(WORLD).run(_run, rotate, timeout=120.0)
    assert max(n for r in results for n in r["blocks"]) > 1, (
        "the layout should give some step several blocks"
    )
    q, k, v, dout = _inputs()
    ref = attention_grads(q, k, v, dout, is_causal=True)
    base_q, base_k, base_v = (t.clone().requires_grad_(True) for t in (q, k, v))
    base_out = F.scaled_dot_product_attention(
        base_q, base_k, base_v, is_causal=True, enable_gqa=True
    )
    base_out.backward(dout)
    for name, want, base in (
        ("out", ref.out, base_out.detach()),
        ("dq", ref.dq, base_q.grad),
        ("dk", ref.dk, base_k.grad),
        ("dv", ref.dv, base_v.grad),
    ):
        got = ring_impl.unshard([r[name] for r in results], layout=layout)
        assert_close(f"{name} [{rotate}, layout {layout}]", got, want, base, world_size=WORLD)


def _layout_registered_per_rank(ctx, kind: str):
    import ring_impl
    from ring_impl import Layout

    def halves(order):
        def runs(seq: int, world: int, rank: int):
            n = seq // (2 * world)
            return tuple(sorted((c * n, (c + 1) * n) for c in order(world, rank)))

        return runs

    straight = Layout("test_per_rank", halves(lambda w, r: (2 * r, 2 * r + 1)), lambda w: 2 * w)
    mirrored = Layout("test_per_rank", halves(lambda w, r: (r, 2 * w - 1 - r)), lambda w: 2 * w)
    other = Layout("test_per_rank_other", halves(lambda w, r: (r, 2 * w - 1 - r)), lambda w: 2 * w)
    if kind == "other_positions":  # one name, other positions on the last rank
        ring_impl.register_layout(
            mirrored if ctx.rank == ctx.world_size - 1 else straight, replace=True
        )
    else:  # the same two layouts, registered in another order on the last rank
        pair = [straight, other] if ctx.rank != ctx.world_size - 1 else [other, straight]
        for layout in pair:
            ring_impl.register_layout(layout, replace=True)
    q = torch.randn(1, 2, 4, 8)
    try:
        ring_impl.ring_attention(
            q,
            q,
            q,
            group=ctx.group,
            is_causal=True,
            layout="test_per_rank",
            rotate_method="alltoall",
        )
        return "no error"
    except ring_impl.InputError as exc:
        return str(exc)


def test_a_layout_name_with_other_positions_on_one_rank_is_refused_everywhere(ring) -> None:
    """The cross-rank check compares the positions a layout gives every rank, not only its name:
    the same name registered with other runs on one rank would pair wrong rows silently."""
    messages = ring.rank_pool(2).run(_layout_registered_per_rank, "other_positions", timeout=60.0)
    for rank, msg in enumerate(messages):
        assert (
            "ranks disagree on layout (rank 0 'test_per_rank'; rank 1 layout #" in msg
            or "ranks disagree on layout (rank 0 layout #" in msg
        ), f"rank {rank}: {msg}"
    # Registration order is not compared: the same layouts registered in another order agree.
    assert (
        ring.rank_pool(2).run(_layout_registered_per_rank, "other_order", timeout=60.0)
        == ["no error"] * 2
    )


def _unsplittable_non_causal(ctx):
    import ring_impl

    ring_impl.register_layout(dealt_chunks(), replace=True)
    q = torch.randn(
        1, 2, 4, 8, dtype=torch.float64
    )  # 8 global positions: not a multiple of 3W chunks
    out = ring_impl.ring_attention(
        q, q, q, group=ctx.group, layout="test_dealt_chunks", rotate_method="alltoall", op="math"
    )
    return bool(torch.isfinite(out).all())


def test_the_layout_check_never_raises_before_its_collective(ring) -> None:
    """A non-causal, unmasked call needs no positions, so it runs with a layout that cannot split
    its lengths; comparing the layout's positions must not raise there (it would on some ranks
    only, before the check's all-reduce, when lengths differ)."""
    assert ring.rank_pool(2).run(_unsplittable_non_causal, timeout=60.0) == [True, True]
