"""Ring plans and layouts, checked against the global causal mask built independently here."""

from __future__ import annotations

import random

import pytest
import torch

from reference.layout import positions
from ring_impl.layout import Layout, layout_runs, permutation, register_layout, shard, unshard
from ring_impl.planning.plan import ring_plan


def _shuffled_chunks(seed: int, per_rank: int) -> Layout:
    """A balancer-like layout: the sequence cut into ``per_rank * W`` chunks dealt out at random
    (each rank's chunks in increasing order), to exercise plans no built-in layout produces."""

    def assignment(world: int) -> list[list[int]]:
        ids = list(range(per_rank * world))
        random.Random(seed * 1000 + world).shuffle(ids)
        return [sorted(ids[r * per_rank : (r + 1) * per_rank]) for r in range(world)]

    def runs(seq: int, world: int, rank: int):
        n = seq // (per_rank * world)
        return tuple((c * n, (c + 1) * n) for c in assignment(world)[rank])

    return Layout(f"test_shuffled_{seed}_{per_rank}", runs, lambda w: per_rank * w)


CUSTOM = [
    register_layout(_shuffled_chunks(seed, per), replace=True).name
    for seed, per in ((1, 3), (2, 4), (3, 2))
]


def _positions(layout: str, world: int, rank: int, seq: int) -> list[int]:
    """Global positions a rank holds: the built-ins from the oracle's own layout code
    (independent of ring_impl), test layouts from their definition."""
    if layout in ("contiguous", "head_tail"):
        return positions(layout, world, rank, seq).tolist()
    return [p for a, b in layout_runs(layout, seq, world, rank) for p in range(a, b)]


@pytest.mark.parametrize("layout", ["contiguous", "head_tail", *CUSTOM])
@pytest.mark.parametrize("world", [1, 2, 3, 4, 5, 8])
@pytest.mark.parametrize("is_causal", [False, True])
def test_plans_cover_exactly_the_visible_pairs(layout: str, world: int, is_causal: bool) -> None:
    seq = 24 * world
    for rank in range(world):
        qpos = _positions(layout, world, rank, seq)
        covered = torch.zeros(seq, seq, dtype=torch.int64)
        for plan in ring_plan(
            rank, world, layout=layout, is_causal=is_causal, seq_q=len(qpos), seq_kv=len(qpos)
        ):
            assert plan.kv_rank == (rank - plan.step) % world
            kpos = _positions(layout, world, plan.kv_rank, seq)
            for block in plan.blocks:
                assert block.step == plan.step and block.kv_rank == plan.kv_rank
                for i in range(*block.q_rows):
                    for j in range(*block.kv_rows):
                        local_i, local_j = i - block.q_rows[0], j - block.kv_rows[0]
                        if block.kind == "causal" and local_j > local_i:
                            continue
                        covered[qpos[i], kpos[j]] += 1
        want = torch.ones(seq, seq, dtype=torch.int64)
        if is_causal:
            want = want.tril()
        assert torch.equal(covered[qpos], want[qpos]), (
            f"rank {rank}: a pair is missed or computed twice"
        )


@pytest.mark.parametrize("world", [2, 3, 4, 8])
def test_head_tail_balances_causal_work(world: int) -> None:
    n = 4  # rows per chunk

    def work(layout: str, rank: int) -> int:
        seq_local = n * (2 if layout == "head_tail" else 1)
        total = 0
        for p in ring_plan(
            rank, world, layout=layout, is_causal=True, seq_q=seq_local, seq_kv=seq_local
        ):
            for b in p.blocks:
                rows, cols = b.q_rows[1] - b.q_rows[0], b.kv_rows[1] - b.kv_rows[0]
                total += rows * (cols + 1) // 2 if b.is_causal else rows * cols
        return total

    balanced = {work("head_tail", r) for r in range(world)}
    assert len(balanced) == 1
    unbalanced = [work("contiguous", r) for r in range(world)]
    assert unbalanced == sorted(unbalanced) and unbalanced[0] < unbalanced[-1]


@pytest.mark.parametrize("layout", ["contiguous", "head_tail", *CUSTOM])
@pytest.mark.parametrize("dim", [0, 1, 2])
def test_shard_unshard_round_trip(layout: str, dim: int) -> None:
    x = torch.arange(2 * 3 * 72).reshape(2, 3, 72).movedim(2, dim).contiguous()
    parts = [shard(x, 3, r, layout=layout, dim=dim) for r in range(3)]
    for r, part in enumerate(parts):  # each rank holds exactly its positions, in local order
        assert torch.equal(part.movedim(dim, 2)[0, 0], torch.tensor(_positions(layout, 3, r, 72)))
    assert torch.equal(unshard(parts, layout=layout, dim=dim), x)
    assert torch.equal(
        permutation(layout, 72, 3),
        torch.cat([torch.tensor(_positions(layout, 3, r, 72)) for r in range(3)]),
    )


@pytest.mark.parametrize("world", [1, 2, 3, 4, 8])
def test_builtin_layouts_plan_one_block_per_step_as_documented(world: int) -> None:
    """The derived plan of the built-ins is the hand-written one of ring_impl.planning.plan's
    docstring."""
    n = 4
    for layout, seq in (("contiguous", n), ("head_tail", 2 * n)):
        for rank in range(world):
            got = [
                (p.kv_rank, [(b.kind, b.q_rows, b.kv_rows) for b in p.blocks])
                for p in ring_plan(
                    rank, world, layout=layout, is_causal=True, seq_q=seq, seq_kv=seq
                )
            ]
            want = []
            for step in range(world):
                kv_rank = (rank - step) % world
                if step == 0:
                    blocks = [("causal", (0, seq), (0, seq))]
                elif layout == "contiguous":
                    blocks = [("full", (0, seq), (0, seq))] if kv_rank < rank else []
                elif kv_rank < rank:
                    blocks = [("full", (0, seq), (0, n))]
                else:
                    blocks = [("full", (n, seq), (0, seq))]
                want.append((kv_rank, blocks))
            assert got == want, f"{layout} rank {rank}"


def test_layouts_that_break_the_rules_are_rejected_with_the_rule() -> None:
    def bad(runs):
        return Layout("test_bad", lambda seq, w, r: runs[r], lambda w: 2)

    register_layout(bad([((2, 4), (0, 2)), ((4, 8),)]), replace=True)  # rank 0 out of order
    with pytest.raises(ValueError, match="do not increase along its local order"):
        layout_runs("test_bad", 8, 2, 0)
    register_layout(bad([((0, 4),), ((2, 6),)]), replace=True)  # position 2..3 twice, 6..7 never
    with pytest.raises(ValueError, match="held by no rank or by two"):
        layout_runs("test_bad", 8, 2, 1)
    register_layout(bad([((0, 3),), ((3, 8),)]), replace=True)  # unequal shares
    with pytest.raises(ValueError, match="every rank holds 4"):
        shard(torch.zeros(1, 1, 8, 1), 2, 0, layout="test_bad")
    with pytest.raises(ValueError, match="already registered"):
        register_layout(bad([((0, 4),), ((4, 8),)]))


def test_head_tail_shard_holds_chunks_r_and_2w_minus_1_minus_r() -> None:
    x = torch.arange(8).reshape(1, 1, 8, 1)
    assert shard(x, 2, 0, layout="head_tail").flatten().tolist() == [0, 1, 6, 7]
    assert shard(x, 2, 1, layout="head_tail").flatten().tolist() == [2, 3, 4, 5]


def test_shard_splits_indivisible_sequences_unevenly_or_says_the_fix() -> None:
    """The built-in layouts split a length they do not divide as torch.tensor_split cuts their
    chunks (8 tokens, head_tail over 3: chunks 2 2 1 1 1 1, rank 0 holds chunks 0 and 5); a
    layout without an uneven split refuses it and says to pad."""
    from ring_impl.layout import Layout, register_layout, shard_lengths

    seq = torch.arange(8).view(1, 1, 8, 1)
    assert shard(seq, 3, 0, layout="head_tail").flatten().tolist() == [0, 1, 7]
    assert shard_lengths(8, 3, "head_tail") == (3, 3, 2)
    assert [shard(seq, 3, r).flatten().tolist() for r in range(3)] == [[0, 1, 2], [3, 4, 5], [6, 7]]
    register_layout(
        Layout("test_even_only", lambda s, w, r: ((r * s // w, (r + 1) * s // w),), lambda w: w),
        replace=True,
    )
    with pytest.raises(ValueError, match="multiple of 3; pad the sequence"):
        shard(seq, 3, 0, layout="test_even_only")


def _random_runs(rng: random.Random, length: int) -> tuple[tuple[int, int], ...]:
    """Increasing disjoint runs of positions in [0, length)."""
    held = sorted(rng.sample(range(length), rng.randint(1, length)))
    runs: list[list[int]] = []
    for p in held:
        if runs and runs[-1][1] == p:
            runs[-1][1] += 1
        else:
            runs.append([p, p + 1])
    return tuple((a, b) for a, b in runs)


@pytest.mark.parametrize("seed", range(200))
def test_step_blocks_cover_the_causal_pairs_of_any_positions(seed: int) -> None:
    """Queries and keys at arbitrary increasing positions (overlapping or not): every visible
    pair computed exactly once, no invisible one, blocks trimmed to visible rows."""
    from ring_impl.planning.plan import step_blocks

    rng = random.Random(seed)
    q_runs, kv_runs = _random_runs(rng, 24), _random_runs(rng, 24)
    qpos = [p for a, b in q_runs for p in range(a, b)]
    kpos = [p for a, b in kv_runs for p in range(a, b)]
    covered = torch.zeros(len(qpos), len(kpos), dtype=torch.int64)
    for kind, (q0, q1), (k0, k1) in step_blocks(q_runs, kv_runs):
        assert q0 < q1 and k0 < k1, "an empty block"
        for i in range(q0, q1):
            for j in range(k0, k1):
                if kind == "causal" and j - k0 > i - q0:
                    continue
                covered[i, j] += 1
    want = torch.tensor([[int(k <= q) for k in kpos] for q in qpos], dtype=torch.int64)
    assert torch.equal(covered, want), (q_runs, kv_runs)


def test_step_blocks_split_a_diagonal_that_starts_inside_the_keys() -> None:
    """Queries 4..7 over keys 0..7: a full block left of the diagonal, then the diagonal."""
    from ring_impl.planning.plan import step_blocks

    assert step_blocks(((4, 8),), ((0, 8),)) == [
        ("full", (0, 4), (0, 4)),
        ("causal", (0, 4), (4, 8)),
    ]
