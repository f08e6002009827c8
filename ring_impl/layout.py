"""Sequence layouts: which tokens each rank holds, and the helpers that shard and unshard.

``contiguous``: the sequence is cut into ``W`` equal chunks and rank ``r`` holds chunk ``r``.

``head_tail``: the sequence is cut into ``2W`` equal chunks and rank ``r`` holds chunks ``r``
and ``2W-1-r``, concatenated in that order. Under causal attention every rank then does the
same amount of work (a chunk near the head of the sequence sees few keys, its partner near the
tail sees many), which ``contiguous`` does not give: there rank ``W-1`` does ``2W-1`` times the
work of rank 0.
"""

from __future__ import annotations

import torch

__all__ = ["LAYOUTS", "check_layout", "chunk_ids", "layout_divisor", "shard", "unshard"]

LAYOUTS = ("contiguous", "head_tail")


def check_layout(layout: str) -> None:
    if layout not in LAYOUTS:
        raise ValueError(f"unknown layout {layout!r}; expected one of {LAYOUTS}")


def layout_divisor(layout: str, world_size: int) -> int:
    """How many equal chunks the global sequence is cut into."""
    check_layout(layout)
    return world_size if layout == "contiguous" else 2 * world_size


def chunk_ids(layout: str, world_size: int, rank: int) -> tuple[int, ...]:
    """The global chunk indices rank holds, in local order."""
    check_layout(layout)
    if layout == "contiguous":
        return (rank,)
    return (rank, 2 * world_size - 1 - rank)


def _check_divisible(seq_len: int, layout: str, world_size: int, what: str) -> int:
    n = layout_divisor(layout, world_size)
    if seq_len % n:
        raise ValueError(
            f"{what}: sequence length {seq_len} cannot be sharded in layout {layout!r} over "
            f"{world_size} ranks: it must be a multiple of {n}; pad the sequence"
        )
    return seq_len // n


def _check_world(world_size, rank: int | None, what: str) -> None:
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"{what}: world_size must be an int >= 1, got {world_size!r}")
    if rank is not None and (isinstance(rank, bool) or not isinstance(rank, int) or not 0 <= rank < world_size):
        raise ValueError(f"{what}: rank must be an int in [0, {world_size}) for world_size {world_size}, got {rank!r}")


def _check_dim(tensor: torch.Tensor, dim: int, what: str) -> int:
    if not -tensor.dim() <= dim < tensor.dim():
        raise ValueError(f"{what}: dim {dim} is out of range for a {tensor.dim()}-D tensor of shape {tuple(tensor.shape)}")
    return dim % tensor.dim()


def shard(tensor: torch.Tensor, world_size: int, rank: int, *, layout: str = "contiguous", dim: int = 2) -> torch.Tensor:
    """This rank's shard of a global tensor, sequence on ``dim``; a contiguous copy.

    Raises ValueError for an unknown layout, ``world_size < 1``, a rank outside
    ``[0, world_size)``, a dim out of range or a length the layout cannot split evenly.
    """
    check_layout(layout)
    _check_world(world_size, rank, "shard")
    dim = _check_dim(tensor, dim, "shard")
    chunk = _check_divisible(tensor.shape[dim], layout, world_size, "shard")
    parts = [tensor.narrow(dim, c * chunk, chunk) for c in chunk_ids(layout, world_size, rank)]
    return torch.cat(parts, dim=dim).contiguous() if len(parts) > 1 else parts[0].contiguous()


def unshard(shards: list[torch.Tensor] | tuple[torch.Tensor, ...], *, layout: str = "contiguous", dim: int = 2) -> torch.Tensor:
    """The global tensor from every rank's shard (``shards[r]`` from rank ``r``).

    Every shard must have the same shape (the layouts give every rank equal lengths) and, for
    ``head_tail``, an even length on ``dim`` (two equal chunks); ValueError otherwise.
    """
    check_layout(layout)
    shards = list(shards)
    if not shards:
        raise ValueError("unshard: no shards given; pass one shard per rank, rank 0 first")
    world_size = len(shards)
    dim = _check_dim(shards[0], dim, "unshard")
    shapes = [tuple(s.shape) for s in shards]
    if any(shape != shapes[0] for shape in shapes):
        raise ValueError(
            f"unshard: shards have different shapes {shapes}; every rank's shard of a {layout!r} layout has "
            "the same shape: pass one shard per rank, rank 0 first"
        )
    pieces_per_rank = len(chunk_ids(layout, world_size, 0))
    if shapes[0][dim] % pieces_per_rank:
        raise ValueError(
            f"unshard: a {layout!r} shard holds {pieces_per_rank} equal chunks, so its length on dim {dim} must be "
            f"a multiple of {pieces_per_rank}; got {shapes[0][dim]}"
        )
    per_rank = [list(s.chunk(pieces_per_rank, dim=dim)) for s in shards]
    ordered: list[torch.Tensor | None] = [None] * layout_divisor(layout, world_size)
    for rank, pieces in enumerate(per_rank):
        for c, piece in zip(chunk_ids(layout, world_size, rank), pieces):
            ordered[c] = piece
    return torch.cat(ordered, dim=dim)  # type: ignore[arg-type]
