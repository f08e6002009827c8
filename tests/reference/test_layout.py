"""Layouts: positions written out by hand, shard/unshard round trips, locate."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from reference.layout import (
    LAYOUTS,
    locate,
    num_chunks,
    positions,
    shard,
    split_lengths,
    split_positions,
    unshard,
)
from tests.reference.strategies import REFERENCE_SETTINGS


@pytest.mark.parametrize(
    ("layout", "world_size", "seq_len", "expected"),
    [
        ("contiguous", 1, 4, [[0, 1, 2, 3]]),
        ("contiguous", 3, 6, [[0, 1], [2, 3], [4, 5]]),
        ("head_tail", 1, 4, [[0, 1, 2, 3]]),
        ("head_tail", 2, 8, [[0, 1, 6, 7], [2, 3, 4, 5]]),
        ("head_tail", 3, 6, [[0, 5], [1, 4], [2, 3]]),
    ],
)
def test_positions_written_out(
    layout: str, world_size: int, seq_len: int, expected: list[list[int]]
) -> None:
    for rank, want in enumerate(expected):
        got = positions(layout, world_size, rank, seq_len)
        assert got.dtype == torch.int64
        assert got.tolist() == want, f"{layout} W={world_size} rank {rank}"


@pytest.mark.parametrize(
    ("layout", "world_size", "seq_len", "match"),
    [
        ("contiguous", 3, 10, "not divisible by 3"),
        ("head_tail", 2, 6, "not divisible by 4"),
        ("zigzag", 2, 8, "unknown layout"),
        ("contiguous", 0, 8, "at least 1"),
    ],
)
def test_bad_layout_arguments_raise(layout: str, world_size: int, seq_len: int, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        positions(layout, world_size, 0, seq_len)


def test_rank_outside_world_raises() -> None:
    with pytest.raises(ValueError, match="outside the world"):
        positions("contiguous", 2, 2, 8)


@REFERENCE_SETTINGS
@given(st.data())
def test_shard_unshard_round_trip(data: st.DataObject) -> None:
    layout = data.draw(st.sampled_from(LAYOUTS), label="layout")
    world_size = data.draw(st.integers(1, 8), label="world_size")
    per_rank = data.draw(st.integers(1, 3), label="chunks_per_rank_len")
    dim = data.draw(st.sampled_from([0, 2, -1]), label="dim")
    seq_len = world_size * per_rank * (2 if layout == "head_tail" else 1)
    shape = [2, 3, 4]
    shape[dim] = seq_len
    x = torch.randn(shape)
    shards = [shard(x, layout, world_size, r, dim=dim) for r in range(world_size)]
    for r, s in enumerate(shards):
        assert torch.equal(s, x.index_select(dim, positions(layout, world_size, r, seq_len)))
    assert torch.equal(unshard(shards, layout, dim=dim), x)
    # Every position is held by exactly one rank.
    held = torch.cat([positions(layout, world_size, r, seq_len) for r in range(world_size)])
    assert sorted(held.tolist()) == list(range(seq_len))


def test_unshard_is_differentiable_and_rejects_ragged_shards() -> None:
    shards = [torch.ones(1, 1, 2, 1, requires_grad=True) for _ in range(2)]
    unshard(shards, "head_tail").sum().backward()
    for s in shards:
        assert s.grad is not None and torch.equal(s.grad, torch.ones_like(s))
    with pytest.raises(ValueError, match="unequal lengths"):
        unshard([torch.ones(1, 1, 2, 1), torch.ones(1, 1, 3, 1)], "contiguous")


@pytest.mark.parametrize(
    ("layout", "index", "expected"),
    [
        ("contiguous", (0, 3, 17, 5), (2, (0, 3, 1, 5))),  # W=4, chunks of 8: 17 = chunk 2 + 1
        ("head_tail", (0, 3, 17, 5), (3, (0, 3, 5, 5))),  # chunks of 4: chunk 4 = rank 3's tail, +1
        ("head_tail", (1, 0, 31, 0), (0, (1, 0, 7, 0))),  # chunk 7 = rank 0's tail, last row
        ("head_tail", (0, 0, 2, 0), (0, (0, 0, 2, 0))),
    ],
)
def test_locate_written_out(
    layout: str, index: tuple[int, ...], expected: tuple[int, tuple[int, ...]]
) -> None:
    assert locate(index, layout, 4, 32, dim=2) == expected


@REFERENCE_SETTINGS
@given(st.data())
def test_locate_agrees_with_shard(data: st.DataObject) -> None:
    layout = data.draw(st.sampled_from(LAYOUTS), label="layout")
    world_size = data.draw(st.integers(1, 6), label="world_size")
    seq_len = world_size * 2 * data.draw(st.integers(1, 3), label="chunk_len")
    x = torch.arange(2 * seq_len * 3).reshape(2, seq_len, 3)
    index = (
        data.draw(st.integers(0, 1), label="i0"),
        data.draw(st.integers(0, seq_len - 1), label="position"),
        data.draw(st.integers(0, 2), label="i2"),
    )
    rank, local = locate(index, layout, world_size, seq_len, dim=1)
    assert shard(x, layout, world_size, rank, dim=1)[local] == x[index]


@pytest.mark.parametrize(
    ("layout", "lengths", "rank", "expected"),
    [
        ("contiguous", (3, 0, 2), 0, [0, 1, 2]),
        ("contiguous", (3, 0, 2), 1, []),
        ("contiguous", (3, 0, 2), 2, [3, 4]),
        # 13 tokens in 4 chunks (4, 3, 3, 3): rank 0 chunks 0 and 3, rank 1 chunks 1 and 2
        ("head_tail", (7, 6), 0, [0, 1, 2, 3, 10, 11, 12]),
        ("head_tail", (7, 6), 1, [4, 5, 6, 7, 8, 9]),
    ],
)
def test_split_positions_written_out(layout: str, lengths, rank: int, expected) -> None:
    assert split_positions(layout, lengths, rank).tolist() == expected


@given(layout=st.sampled_from(LAYOUTS), world=st.integers(1, 6), seq=st.integers(1, 60))
@REFERENCE_SETTINGS
def test_split_lengths_cover_the_sequence_once(layout: str, world: int, seq: int) -> None:
    lengths = split_lengths(layout, world, seq)
    assert sum(lengths) == seq and max(lengths) - min(lengths) <= 2
    held = torch.cat([split_positions(layout, lengths, r) for r in range(world)])
    assert sorted(held.tolist()) == list(range(seq))
    if seq % num_chunks(layout, world) == 0:  # the even split: the layout's own positions
        for r in range(world):
            assert torch.equal(
                split_positions(layout, lengths, r), positions(layout, world, r, seq)
            )


def test_split_positions_refuse_another_split_of_head_tail() -> None:
    with pytest.raises(ValueError, match=r"splits 13 tokens over 2 ranks as \[7, 6\]"):
        split_positions("head_tail", (8, 5), 0)
