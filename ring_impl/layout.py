"""Sequence layouts: which global token positions each rank holds, and shard/unshard from them.

A layout is a permutation of the global positions ``0 .. S-1``: rank ``r`` holds ``S / W`` of
them, in its local order, written as runs ``(start, stop)`` of consecutive positions. Everything
else follows from the runs: :func:`shard` and :func:`unshard`, :func:`permutation`, and the ring's
per-step plan (:mod:`ring_impl.plan` derives from them which local query rows see which local
key/value rows). A new layout (a load balancer) is one function registered with
:func:`register_layout`; the ring, ``context_parallel`` and the input checks then accept its name.

Built in:

``contiguous``: the sequence is cut into ``W`` equal chunks and rank ``r`` holds chunk ``r``.

``head_tail``: the sequence is cut into ``2W`` equal chunks and rank ``r`` holds chunks ``r``
and ``2W-1-r``, concatenated in that order. Under causal attention every rank then does the
same amount of work (a chunk near the head of the sequence sees few keys, its partner near the
tail sees many), which ``contiguous`` does not give: there rank ``W-1`` does ``2W-1`` times the
work of rank 0.

Rules every layout keeps (checked by :func:`layout_runs`): each rank holds ``S / W`` positions,
every position is held exactly once, and a rank's positions increase along its local order (so
under a causal mask the key/value rows a query row sees are a prefix of any rank's block, which
the plan relies on; a balancer reorders *which* positions a rank holds, never their order).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from functools import lru_cache
from itertools import pairwise

import torch

__all__ = [
    "LAYOUTS",
    "Layout",
    "Runs",
    "check_layout",
    "chunk_ids",
    "get_layout",
    "layout_divisor",
    "layout_runs",
    "layouts",
    "permutation",
    "register_layout",
    "shard",
    "unshard",
]

#: A rank's positions: ``((start, stop), ...)`` half-open runs of global positions in local order.
Runs = tuple[tuple[int, int], ...]


@dataclass(frozen=True)
class Layout:
    """A sequence layout.

    ``runs(seq_len, world_size, rank)``: the runs of global positions ``rank`` holds, for a
    global length that is a multiple of ``divisor(world_size)``. ``chunks(world_size, rank)``
    (optional): for layouts that cut the sequence into ``divisor(world_size)`` equal chunks, the
    chunk indices a rank holds in local order (what :func:`chunk_ids` answers).
    """

    name: str
    runs: Callable[[int, int, int], Runs]
    divisor: Callable[[int], int]
    chunks: Callable[[int, int], tuple[int, ...]] | None = None


def chunked_layout(
    name: str, pieces: Callable[[int], int], chunks: Callable[[int, int], tuple[int, ...]]
) -> Layout:
    """A layout that cuts the sequence into ``pieces(W)`` equal chunks and gives rank ``r`` the
    chunks ``chunks(W, r)`` (in increasing order)."""

    def runs(seq_len: int, world_size: int, rank: int) -> Runs:
        n = seq_len // pieces(world_size)
        return tuple((c * n, (c + 1) * n) for c in chunks(world_size, rank))

    return Layout(name, runs, pieces, chunks)


_REGISTRY: dict[str, Layout] = {}


def register_layout(layout: Layout, *, replace: bool = False) -> Layout:
    """Make ``layout`` selectable as ``layout=layout.name`` (register it on every rank)."""
    if layout.name in _REGISTRY and not replace:
        raise ValueError(
            f"register_layout: a layout named {layout.name!r} is already registered; pass "
            "replace=True"
        )
    _REGISTRY[layout.name] = layout
    for cached in (layout_runs, _rank_runs, _check_cover):
        cached.cache_clear()
    return layout


def layouts() -> tuple[str, ...]:
    """Names accepted by ``layout=``, in registration order."""
    return tuple(_REGISTRY)


def check_layout(layout: str) -> None:
    if not isinstance(layout, str) or layout not in _REGISTRY:
        raise ValueError(f"unknown layout {layout!r}; expected one of {layouts()}")


def get_layout(layout: str) -> Layout:
    check_layout(layout)
    return _REGISTRY[layout]


def layout_divisor(layout: str, world_size: int) -> int:
    """The global length must be a multiple of this (for the built-ins: how many equal chunks
    the sequence is cut into)."""
    return get_layout(layout).divisor(world_size)


def chunk_ids(layout: str, world_size: int, rank: int) -> tuple[int, ...]:
    """The global chunk indices rank holds, in local order (chunked layouts only)."""
    lay = get_layout(layout)
    if lay.chunks is None:
        raise ValueError(f"layout {layout!r} is not made of equal chunks; use layout_runs")
    return lay.chunks(world_size, rank)


@lru_cache(maxsize=1024)
def layout_runs(layout: str, seq_len: int, world_size: int, rank: int) -> Runs:
    """Rank ``rank``'s runs of global positions for a global length ``seq_len``, checked
    (ValueError for a length the layout cannot split, or a layout that breaks its rules).

    Pure Python on ints, so plans built from it are constants under ``torch.compile``.
    """
    _check_world(world_size, rank, "layout")
    _check_cover(layout, seq_len, world_size)
    return _rank_runs(layout, seq_len, world_size, rank)


@lru_cache(maxsize=1024)
def _rank_runs(layout: str, seq_len: int, world_size: int, rank: int) -> Runs:
    lay = get_layout(layout)
    divisor = lay.divisor(world_size)
    if seq_len % divisor:
        raise ValueError(
            f"sequence length {seq_len} cannot be sharded in layout {layout!r} over {world_size} "
            f"ranks: it must be a multiple of {divisor}; pad the sequence"
        )
    runs = tuple((int(a), int(b)) for a, b in lay.runs(seq_len, world_size, rank) if b > a)
    held = sum(b - a for a, b in runs)
    if held != seq_len // world_size:
        raise ValueError(
            f"layout {layout!r} gives rank {rank} {held} positions of {seq_len}; every rank holds "
            f"{seq_len // world_size}"
        )
    for (_, stop), (start, _) in pairwise(runs):
        if start < stop:
            raise ValueError(
                f"layout {layout!r}: rank {rank}'s positions do not increase along its local "
                f"order ({runs})"
            )
    return runs


@lru_cache(maxsize=256)
def _check_cover(layout: str, seq_len: int, world_size: int) -> None:
    """Every position in ``[0, seq_len)`` held by exactly one rank."""
    end = 0
    for a, b in sorted(
        run for r in range(world_size) for run in _rank_runs(layout, seq_len, world_size, r)
    ):
        if a != end:
            raise ValueError(
                f"layout {layout!r}: position {min(a, end)} of {seq_len} is held by no rank or by "
                "two"
            )
        end = b
    if end != seq_len:
        raise ValueError(f"layout {layout!r}: positions {end}..{seq_len - 1} are held by no rank")


def permutation(layout: str, seq_len: int, world_size: int) -> torch.Tensor:
    """(seq_len,) int64: the global position of each element of ``cat(shards)`` (rank 0 first)."""
    return torch.cat(
        [
            torch.arange(a, b)
            for r in range(world_size)
            for a, b in layout_runs(layout, seq_len, world_size, r)
        ]
    )


def _check_world(world_size, rank: int | None, what: str) -> None:
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"{what}: world_size must be an int >= 1, got {world_size!r}")
    if rank is not None and (
        isinstance(rank, bool) or not isinstance(rank, int) or not 0 <= rank < world_size
    ):
        raise ValueError(
            f"{what}: rank must be an int in [0, {world_size}) for world_size {world_size}, got "
            f"{rank!r}"
        )


def _check_dim(tensor: torch.Tensor, dim: int, what: str) -> int:
    if not -tensor.dim() <= dim < tensor.dim():
        raise ValueError(
            f"{what}: dim {dim} is out of range for a {tensor.dim()}-D tensor of shape "
            f"{tuple(tensor.shape)}"
        )
    return dim % tensor.dim()


def shard(
    tensor: torch.Tensor, world_size: int, rank: int, *, layout: str = "contiguous", dim: int = 2
) -> torch.Tensor:
    """This rank's shard of a global tensor, sequence on ``dim``; a contiguous copy.

    (batch, heads, S, head_dim) -> (batch, heads, S / W, head_dim) for the default ``dim=2``.
    Raises ValueError for an unknown layout, ``world_size < 1``, a rank outside
    ``[0, world_size)``, a dim out of range or a length the layout cannot split evenly.
    """
    check_layout(layout)
    _check_world(world_size, rank, "shard")
    dim = _check_dim(tensor, dim, "shard")
    try:
        runs = layout_runs(layout, tensor.shape[dim], world_size, rank)
    except ValueError as exc:
        raise ValueError(f"shard: {exc}") from None
    parts = [tensor.narrow(dim, a, b - a) for a, b in runs]
    return torch.cat(parts, dim=dim).contiguous() if len(parts) > 1 else parts[0].contiguous()


def unshard(
    shards: list[torch.Tensor] | tuple[torch.Tensor, ...],
    *,
    layout: str = "contiguous",
    dim: int = 2,
) -> torch.Tensor:
    """The global tensor from every rank's shard (``shards[r]`` from rank ``r``); differentiable.

    Every shard must have the same shape (every layout gives every rank the same length) and a
    global length the layout can split; ValueError otherwise.
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
            f"unshard: shards have different shapes {shapes}; every rank's shard of a {layout!r} "
            "layout has the same shape: pass one shard per rank, rank 0 first"
        )
    seq_len = shapes[0][dim] * world_size
    try:
        per_rank = [layout_runs(layout, seq_len, world_size, r) for r in range(world_size)]
    except ValueError as exc:
        raise ValueError(
            f"unshard: {world_size} shards of length {shapes[0][dim]} on dim {dim}: {exc}"
        ) from None
    pieces: list[tuple[int, torch.Tensor]] = []
    for s, runs in zip(shards, per_rank):
        offset = 0
        for a, b in runs:
            pieces.append((a, s.narrow(dim, offset, b - a)))
            offset += b - a
    return torch.cat([p for _, p in sorted(pieces, key=lambda item: item[0])], dim=dim)


for _layout in (
    chunked_layout("contiguous", lambda w: w, lambda w, r: (r,)),
    chunked_layout("head_tail", lambda w: 2 * w, lambda w, r: (r, 2 * w - 1 - r)),
):
    register_layout(_layout)

#: The built-in layouts (``layouts()`` also lists registered ones).
LAYOUTS = layouts()
