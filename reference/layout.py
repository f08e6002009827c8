"""Sequence layouts of context parallelism, written independently of ring_impl on purpose:
the oracle must not reuse the code under test.

contiguous: the sequence is cut into W equal chunks; rank r holds chunk r.
head_tail:  the sequence is cut into 2W equal chunks; rank r holds chunks r and 2W-1-r, in that
            order (load balancing for causal attention: every rank gets one early and one late
            chunk).

Uneven shards (``ring_attention(shard_lengths=...)``): rank r holds ``lengths[r]`` tokens of a
sequence of ``sum(lengths)`` that no layout need divide. ``contiguous`` takes any split (rank r
the next ``lengths[r]`` positions); ``head_tail`` only its own split of the sequence, its 2W
chunks cut as ``torch.tensor_split`` cuts (the first ``seq_len % 2W`` chunks one longer):
:func:`split_lengths`, :func:`split_positions`.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

__all__ = [
    "LAYOUTS",
    "chunk_ids",
    "locate",
    "num_chunks",
    "positions",
    "shard",
    "split_lengths",
    "split_positions",
    "unshard",
]

LAYOUTS: tuple[str, ...] = ("contiguous", "head_tail")


def _check_layout(layout: str, world_size: int) -> None:
    if layout not in LAYOUTS:
        raise ValueError(f"unknown layout {layout!r}; expected one of {LAYOUTS}")
    if world_size < 1:
        raise ValueError(f"world_size must be at least 1, got {world_size}")


def num_chunks(layout: str, world_size: int) -> int:
    """How many equal chunks the sequence is cut into: W (contiguous) or 2W (head_tail)."""
    _check_layout(layout, world_size)
    return world_size if layout == "contiguous" else 2 * world_size


def chunk_ids(layout: str, world_size: int, rank: int) -> tuple[int, ...]:
    """The global chunk indices rank holds, in its local order: (r,) or (r, 2W-1-r)."""
    _check_layout(layout, world_size)
    if not 0 <= rank < world_size:
        raise ValueError(f"rank {rank} is outside the world of size {world_size}")
    if layout == "contiguous":
        return (rank,)
    return (rank, 2 * world_size - 1 - rank)


def chunk_len(layout: str, world_size: int, seq_len: int) -> int:
    """Length of one chunk; ValueError when seq_len does not split into equal chunks."""
    n = num_chunks(layout, world_size)
    if seq_len % n != 0:
        raise ValueError(
            f"seq_len {seq_len} is not divisible by {n}, the number of chunks of layout "
            f"{layout!r} with world_size {world_size}; pad the sequence to a multiple of {n}"
        )
    return seq_len // n


def positions(layout: str, world_size: int, rank: int, seq_len: int) -> Tensor:
    """(seq_len // W,) int64: the global sequence positions rank holds, in its local order."""
    c = chunk_len(layout, world_size, seq_len)
    return torch.cat(
        [torch.arange(i * c, (i + 1) * c) for i in chunk_ids(layout, world_size, rank)]
    )


def shard(tensor: Tensor, layout: str, world_size: int, rank: int, dim: int = 2) -> Tensor:
    """The rank's shard of a global tensor along the sequence dim `dim` (a new tensor).
    (batch, heads, seq, d) -> (batch, heads, seq // W, d) for the default dim=2."""
    pos = positions(layout, world_size, rank, tensor.shape[dim]).to(tensor.device)
    return tensor.index_select(dim, pos)


def unshard(shards: Sequence[Tensor], layout: str, dim: int = 2) -> Tensor:
    """Inverse of `shard`: shards[r] is rank r's shard; returns the global tensor (differentiable).
    W = len(shards); every shard must have the same length along `dim`."""
    world_size = len(shards)
    if world_size == 0:
        raise ValueError("unshard needs at least one shard")
    lengths = {s.shape[dim] for s in shards}
    if len(lengths) != 1:
        raise ValueError(f"shards have unequal lengths {sorted(lengths)} along dim {dim}")
    seq_len = lengths.pop() * world_size
    # cat(shards) holds global positions in the order cat(positions(r)); argsort inverts it.
    order = torch.cat([positions(layout, world_size, r, seq_len) for r in range(world_size)])
    return torch.cat(list(shards), dim=dim).index_select(dim, order.argsort().to(shards[0].device))


def locate(
    index: Sequence[int], layout: str, world_size: int, seq_len: int, dim: int = 2
) -> tuple[int, tuple[int, ...]]:
    """Map an index into the global tensor to (rank, index into that rank's shard).
    Only the sequence dim `dim` changes; e.g. head_tail, W=2, seq_len 8: position 7 is in chunk 3,
    held by rank 0 as its second chunk -> (0, local position 3)."""
    index = tuple(int(i) for i in index)
    dim = dim % len(index)
    pos = index[dim]
    if not 0 <= pos < seq_len:
        raise ValueError(f"sequence position {pos} is outside a sequence of length {seq_len}")
    c = chunk_len(layout, world_size, seq_len)
    chunk, offset = divmod(pos, c)
    for rank in range(world_size):
        held = chunk_ids(layout, world_size, rank)
        if chunk in held:
            local = held.index(chunk) * c + offset
            return rank, (*index[:dim], local, *index[dim + 1 :])
    raise AssertionError(f"chunk {chunk} is held by no rank")  # unreachable: layouts cover all


def _pieces(seq_len: int, n: int) -> list[int]:
    """Lengths of ``n`` consecutive pieces of ``seq_len`` cut as ``torch.tensor_split`` cuts."""
    base, extra = divmod(seq_len, n)
    return [base + (i < extra) for i in range(n)]


def split_lengths(layout: str, world_size: int, seq_len: int) -> tuple[int, ...]:
    """How many of ``seq_len`` tokens each rank holds in ``layout``'s own split, rank 0 first:
    W pieces (contiguous) or 2W chunks (head_tail, rank r's chunks r and 2W-1-r), cut as
    ``torch.tensor_split`` cuts; equal to ``seq_len // W`` each when the chunks divide it."""
    _check_layout(layout, world_size)
    chunks = _pieces(seq_len, num_chunks(layout, world_size))
    return tuple(
        sum(chunks[c] for c in chunk_ids(layout, world_size, r)) for r in range(world_size)
    )


def split_positions(layout: str, lengths: Sequence[int], rank: int) -> Tensor:
    """(lengths[rank],) int64: the global positions rank ``rank`` holds, in its local order, when
    rank r holds ``lengths[r]`` tokens: ``contiguous`` any split (rank r the next ``lengths[r]``
    positions), ``head_tail`` only :func:`split_lengths`' (ValueError for another split)."""
    world_size, seq_len = len(lengths), sum(lengths)
    _check_layout(layout, world_size)
    if not 0 <= rank < world_size:
        raise ValueError(f"rank {rank} is outside the world of size {world_size}")
    if layout == "contiguous":
        start = sum(lengths[:rank])
        return torch.arange(start, start + lengths[rank])
    own = split_lengths(layout, world_size, seq_len)
    if tuple(lengths) != own:
        raise ValueError(
            f"layout {layout!r} splits {seq_len} tokens over {world_size} ranks as {list(own)}, "
            f"not {list(lengths)}"
        )
    chunks = _pieces(seq_len, num_chunks(layout, world_size))
    starts = [sum(chunks[:c]) for c in range(len(chunks))]
    return torch.cat(
        [
            torch.arange(starts[c], starts[c] + chunks[c])
            for c in chunk_ids(layout, world_size, rank)
        ]
    )
