"""Ring plans and layouts, checked against the global causal mask built independently here."""

from __future__ import annotations

import pytest
import torch

from reference.layout import positions
from ring_impl.layout import shard, unshard
from ring_impl.plan import ring_plan


def _positions(layout: str, world: int, rank: int, seq: int) -> list[int]:
    """Global positions a rank holds, from the oracle's own layout code (independent of ring_impl)."""
    return positions(layout, world, rank, seq).tolist()


@pytest.mark.parametrize("layout", ["contiguous", "head_tail"])
@pytest.mark.parametrize("world", [1, 2, 3, 4, 5, 8])
@pytest.mark.parametrize("is_causal", [False, True])
def test_plans_cover_exactly_the_visible_pairs(layout: str, world: int, is_causal: bool) -> None:
    seq = 4 * world
    for rank in range(world):
        qpos = _positions(layout, world, rank, seq)
        covered = torch.zeros(seq, seq, dtype=torch.int64)
        for plan in ring_plan(rank, world, layout=layout, is_causal=is_causal, seq_q=len(qpos), seq_kv=len(qpos)):
            assert plan.kv_rank == (rank - plan.step) % world
            if plan.skipped:
                continue
            kpos = _positions(layout, world, plan.kv_rank, seq)
            for i in range(*plan.q_rows):
                for j in range(*plan.kv_rows):
                    local_i, local_j = i - plan.q_rows[0], j - plan.kv_rows[0]
                    if plan.kind == "causal" and local_j > local_i:
                        continue
                    covered[qpos[i], kpos[j]] += 1
        want = torch.ones(seq, seq, dtype=torch.int64)
        if is_causal:
            want = want.tril()
        assert torch.equal(covered[qpos], want[qpos]), f"rank {rank}: a pair is missed or computed twice"


@pytest.mark.parametrize("world", [2, 3, 4, 8])
def test_head_tail_balances_causal_work(world: int) -> None:
    n = 4  # rows per chunk

    def work(layout: str, rank: int) -> int:
        seq_local = n * (2 if layout == "head_tail" else 1)
        total = 0
        for p in ring_plan(rank, world, layout=layout, is_causal=True, seq_q=seq_local, seq_kv=seq_local):
            rows, cols = p.q_rows[1] - p.q_rows[0], p.kv_rows[1] - p.kv_rows[0]
            total += 0 if p.skipped else rows * (cols + 1) // 2 if p.is_causal else rows * cols
        return total

    balanced = {work("head_tail", r) for r in range(world)}
    assert len(balanced) == 1
    unbalanced = [work("contiguous", r) for r in range(world)]
    assert unbalanced == sorted(unbalanced) and unbalanced[0] < unbalanced[-1]


@pytest.mark.parametrize("layout", ["contiguous", "head_tail"])
@pytest.mark.parametrize("dim", [0, 1, 2])
def test_shard_unshard_round_trip(layout: str, dim: int) -> None:
    x = torch.arange(2 * 3 * 24).reshape(2, 3, 24).movedim(2, dim).contiguous()
    parts = [shard(x, 3, r, layout=layout, dim=dim) for r in range(3)]
    assert torch.equal(unshard(parts, layout=layout, dim=dim), x)


def test_head_tail_shard_holds_chunks_r_and_2w_minus_1_minus_r() -> None:
    x = torch.arange(8).reshape(1, 1, 8, 1)
    assert shard(x, 2, 0, layout="head_tail").flatten().tolist() == [0, 1, 6, 7]
    assert shard(x, 2, 1, layout="head_tail").flatten().tolist() == [2, 3, 4, 5]


def test_shard_rejects_indivisible_sequences_with_the_fix() -> None:
    with pytest.raises(ValueError, match="multiple of 6; pad the sequence"):
        shard(torch.zeros(1, 1, 8, 1), 3, 0, layout="head_tail")
