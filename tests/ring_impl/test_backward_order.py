"""Where the ring's backward computes its own block (step 0): around the transfers nothing else
covers.

The backward's first key/value hop (step 1's block) and its last dK/dV hop (this rank's own
accumulator coming home) have no other step to overlap. With the own block computed last, the
first hop was waited for with nothing computed: 10-60 ms of a 0.31 s call on packed documents at
W=2 (benchmarks/masks.py). ``ring_impl.exchanges.ring.backward_order`` cuts an own step of several
blocks in two by kernel area, one part before step 1 and the rest after step W-1.
"""

from __future__ import annotations

import pytest
import torch

from ring_impl.exchanges.ring import backward_order
from ring_impl.planning.plan import Block, StepPlan


def _block(step: int, rows: tuple[int, int], cols: tuple[int, int], kind: str = "full") -> Block:
    return Block(step=step, kv_rank=0, kind=kind, q_rows=rows, kv_rows=cols)


def _plans(own_blocks, others: int = 1) -> list[StepPlan]:
    plans = [StepPlan(0, 0, tuple(own_blocks))]
    for s in range(1, others + 1):
        plans.append(StepPlan(s, s, (_block(s, (0, 8), (0, 8)),)))
    return plans


def _blocks_of(order: list[StepPlan]) -> list[Block]:
    return [b for p in order for b in p.blocks]


@pytest.mark.parametrize("own_first", [False, True])
def test_an_own_step_of_several_blocks_is_cut_around_the_others(own_first) -> None:
    own = [
        _block(0, (0, 4), (0, 4), "causal"),
        _block(0, (4, 8), (0, 4)),
        _block(0, (4, 8), (4, 8), "causal"),
        _block(0, (8, 16), (8, 16)),
    ]
    plans = _plans(own, others=2)
    order = backward_order(plans, own_first)
    assert [p.step for p in order] == [0, 1, 2, 0]
    # every block exactly once, the own ones in their order
    assert sorted(map(repr, _blocks_of(order))) == sorted(map(repr, _blocks_of(plans)))
    assert list(order[0].blocks) + list(order[-1].blocks) == own
    # areas 10, 16, 10, 64 (half: 50): the cut closest to half leaves 36 first
    assert [sum(b.area for b in p.blocks) for p in (order[0], order[-1])] == [36, 64]


def test_the_cut_leaves_both_parts_non_empty() -> None:
    own = [_block(0, (0, 64), (0, 64)), _block(0, (64, 65), (0, 1))]
    order = backward_order(_plans(own), False)
    assert [len(p.blocks) for p in order] == [1, 1, 1]


@pytest.mark.parametrize("own_first,steps", [(False, [1, 2, 0]), (True, [0, 1, 2])])
def test_an_own_step_of_one_block_goes_where_the_transport_says(own_first, steps) -> None:
    plans = _plans([_block(0, (0, 8), (0, 8), "causal")], others=2)
    assert [p.step for p in backward_order(plans, own_first)] == steps


def test_a_single_rank_keeps_its_plan() -> None:
    plans = _plans([_block(0, (0, 4), (0, 4)), _block(0, (4, 8), (4, 8))], others=0)
    assert backward_order(plans, False) == plans


# --- on the ranks: kernel calls and transfer waits, in the order they happen ----------------


def _events(ctx, rotate: str):
    """The backward's events in order: "k" a kernel backward call, "s" the ring's staged transfers
    sent (``Link.flush``), "w" a transfer waited for."""
    import ring_impl
    from ring_impl.masks import Documents
    from ring_impl.ops.cpu import CpuFlashOp
    from ring_impl.transports import link as link_mod

    events: list[str] = []

    class Recording(CpuFlashOp):
        def backward(self, *args, **kwargs):
            events.append("k")
            return super().backward(*args, **kwargs)

    seq = 128 * ctx.world_size
    # documents of 40 tokens: every rank's own step is several blocks
    docs = Documents(torch.arange(seq) // 40)
    gen = torch.Generator().manual_seed(ctx.rank)
    q, k, v = (torch.randn(1, 2, 128, 8, generator=gen).requires_grad_(True) for _ in range(3))
    saved = link_mod.Transfer.result, link_mod._WorkTransfer.result, link_mod.Link.flush

    def record(original, event):
        def method(self, *args, **kwargs):
            events.append(event)
            return original(self, *args, **kwargs)

        return method

    link_mod.Transfer.result, link_mod._WorkTransfer.result, link_mod.Link.flush = (
        record(f, e) for f, e in zip(saved, "wws")
    )
    try:
        out = ring_impl.ring_attention(
            q,
            k,
            v,
            group=ctx.group,
            mask=docs,
            layout="head_tail",
            rotate_method=rotate,
            op=Recording(),
        )
        events.clear()
        out.sum().backward()
    finally:
        link_mod.Transfer.result, link_mod._WorkTransfer.result, link_mod.Link.flush = saved
    return "".join(events)


@pytest.mark.parametrize("rotate", ["alltoall", "p2p", "allgather"])
@pytest.mark.parametrize("world", [2, 3])
def test_the_backward_computes_while_its_first_and_last_transfers_travel(
    ring, rotate, world
) -> None:
    for rank, events in enumerate(ring.rank_pool(world).run(_events, rotate, timeout=120.0)):
        assert {"k", "s", "w"} <= set(events), f"rank {rank}: {events}"
        assert "k" in events[: events.index("w")], (
            f"rank {rank}: the first transfer was waited for before any kernel ran: {events}"
        )
        assert events.rindex("k") > events.rindex("s"), (
            f"rank {rank}: the last transfer (this rank's dK/dV accumulator, home) was sent after "
            f"every kernel ran: {events}"
        )
