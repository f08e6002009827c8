"""The global sequence layout each parallel strategy implies, defined once; shard/unshard follow it.

A rank of a strategy sits at mesh coordinates ``(u, r)`` of a ``(ulysses, ring)`` mesh of shape
``(U, R)``; its *mesh rank* is ``r * U + u`` (rows of ``U`` Ulysses ranks, one row per ring rank).

``ring`` (mesh ``(1, W)``)
    The ring's layout over ``W`` ranks (:mod:`ring_impl.layout`): ``contiguous`` or ``head_tail``.
``ulysses`` (mesh ``(U, 1)``)
    The same layouts over the ``U`` Ulysses ranks, so data sharded for the ring runs under
    Ulysses unchanged. After the sequence-to-head all-to-all a rank holds its ranks' shards
    concatenated in rank order; causal ``head_tail`` puts them back in sequence order before the
    kernel (non-causal attention does not depend on the order).
``hybrid`` (mesh ``(U, R)``)
    The ring's layout over the ``R`` rows (load balance is the ring's concern: Ulysses gives every
    rank whole rows of the sequence), each row's shard then cut into ``U`` contiguous pieces, piece
    ``u`` on Ulysses rank ``u``. The sequence-to-head all-to-all of a row therefore rebuilds the
    row's ring shard in its own order, ready for the ring: with ``head_tail``, rank ``(u, r)`` holds
    piece ``u`` of ``[chunk r | chunk 2R-1-r]`` of ``2R`` chunks. A ``U x 1`` hybrid is therefore
    ``contiguous`` over ``U`` whatever the layout, and a ``1 x R`` hybrid is the ring.

Positions are returned as half-open ``(start, stop)`` ranges of the global sequence in local
order, so sharding is a few slices, never an index tensor.
"""

from __future__ import annotations

import math

import torch

from ..checks.inputs import STRATEGIES  # one order: the cross-rank check's codes use it
from ..layout import check_layout, chunk_ids, layout_divisor, layout_runs

__all__ = [
    "STRATEGIES",
    "check_strategy",
    "local_shard",
    "mesh_coords",
    "position_ranges",
    "sequence_divisor",
    "shard",
    "unshard",
]


def check_strategy(strategy: str) -> None:
    if strategy not in STRATEGIES:
        raise ValueError(f"unknown strategy {strategy!r}; expected one of {STRATEGIES}")


def _mesh_shape(strategy: str, mesh_shape) -> tuple[int, int]:
    """(U, R) after checking it fits the strategy."""
    check_strategy(strategy)
    if (
        not isinstance(mesh_shape, (tuple, list))
        or len(mesh_shape) != 2
        or any(isinstance(n, bool) or not isinstance(n, int) or n < 1 for n in mesh_shape)
    ):
        raise ValueError(
            f"mesh_shape must be (ulysses degree, ring degree), two ints >= 1, got {mesh_shape!r}"
        )
    u, r = int(mesh_shape[0]), int(mesh_shape[1])
    if strategy == "ring" and u != 1:
        raise ValueError(f"the ring runs on a (1, W) mesh, got mesh_shape {mesh_shape!r}")
    if strategy == "ulysses" and r != 1:
        raise ValueError(f"Ulysses runs on a (U, 1) mesh, got mesh_shape {mesh_shape!r}")
    return u, r


def mesh_coords(mesh_rank: int, mesh_shape: tuple[int, int]) -> tuple[int, int]:
    """(u, r) of mesh rank ``r * U + u``."""
    u_size = mesh_shape[0]
    return mesh_rank % u_size, mesh_rank // u_size


def sequence_divisor(strategy: str, layout: str, mesh_shape: tuple[int, int]) -> int:
    """What the global sequence length must be a multiple
    of for every rank to hold an equal shard."""
    u, r = _mesh_shape(strategy, mesh_shape)
    check_layout(layout)
    if strategy == "ulysses":
        return layout_divisor(layout, u)
    # ring / hybrid: R (or 2R) equal chunks, and each row's shard (S / R) cut into U equal pieces.
    chunks_per_row = layout_divisor(layout, r) // r
    return r * math.lcm(chunks_per_row, u)


def position_ranges(
    strategy: str, layout: str, mesh_shape, coords: tuple[int, int], seq_len: int
) -> list[tuple[int, int]]:
    """The global ``(start, stop)`` ranges rank ``coords = (u, r)`` holds, in local order."""
    u_size, r_size = _mesh_shape(strategy, mesh_shape)
    u, r = coords
    if not (0 <= u < u_size and 0 <= r < r_size):
        raise ValueError(f"coordinates {coords!r} are outside a mesh of shape {tuple(mesh_shape)}")
    divisor = sequence_divisor(strategy, layout, (u_size, r_size))
    if seq_len % divisor:
        raise ValueError(
            f"sequence length {seq_len} cannot be sharded by strategy {strategy!r} in layout "
            f"{layout!r} on a {u_size}x{r_size} mesh: it must be a multiple of {divisor}; pad the "
            "sequence"
        )
    if strategy == "ulysses":
        return list(layout_runs(layout, seq_len, u_size, u))
    n = seq_len // layout_divisor(layout, r_size)
    row = [(c * n, (c + 1) * n) for c in chunk_ids(layout, r_size, r)]
    piece = sum(b - a for a, b in row) // u_size
    return _cut(row, u * piece, (u + 1) * piece)


def _cut(ranges: list[tuple[int, int]], lo: int, hi: int) -> list[tuple[int, int]]:
    """The part ``[lo, hi)`` of the concatenation of ``ranges``, as ranges
    (adjacent ones joined)."""
    out: list[tuple[int, int]] = []
    offset = 0
    for a, b in ranges:
        s, e = max(lo, offset), min(hi, offset + b - a)
        if s < e:
            start, stop = a + s - offset, a + e - offset
            if out and out[-1][1] == start:
                out[-1] = (out[-1][0], stop)
            else:
                out.append((start, stop))
        offset += b - a
    return out


def shard(
    tensor: torch.Tensor,
    *,
    strategy: str,
    layout: str,
    mesh_shape,
    coords: tuple[int, int],
    dim: int = 2,
) -> torch.Tensor:
    """Rank ``coords``'s shard of a global tensor (sequence on ``dim``), a contiguous copy."""
    dim = dim % tensor.dim()
    ranges = position_ranges(strategy, layout, mesh_shape, coords, tensor.shape[dim])
    parts = [tensor.narrow(dim, a, b - a) for a, b in ranges]
    return (torch.cat(parts, dim=dim) if len(parts) > 1 else parts[0]).contiguous()


def local_shard(
    tensor: torch.Tensor, group, *, strategy: str, layout: str, dim: int = 2
) -> torch.Tensor:
    """This rank's shard of a global tensor for a call with ``group=group``: the documented way to
    shard for Ulysses and the hybrid. The rank's place is read from the groups the call will use
    (its rank in the Ulysses group and in the ring group), never from its global rank: a hybrid
    mesh's dims may be in either order (``("ring", "ulysses")`` or ``("ulysses", "ring")``) and
    its ranks numbered either way, and a shard cut by global rank for the other order runs
    without complaint and gives wrong attention (no rank can tell its shard was cut for another
    place). ``strategy="ring"`` takes ``layout`` over the group's ranks."""
    import torch.distributed as dist

    from ..exchanges.mesh_groups import resolve_strategy_groups
    from ..group import resolve_group

    if strategy == "ring":
        from ..layout import shard as ring_shard

        pg = resolve_group(group)
        return ring_shard(
            tensor, dist.get_world_size(pg), dist.get_rank(pg), layout=layout, dim=dim
        )
    groups = resolve_strategy_groups(strategy, group)
    return shard(
        tensor,
        strategy=strategy,
        layout=layout,
        mesh_shape=groups.shape,
        coords=groups.coords,
        dim=dim,
    )


def unshard(shards, *, strategy: str, layout: str, mesh_shape, dim: int = 2) -> torch.Tensor:
    """The global tensor from every rank's shard, ``shards[mesh_rank]``
    (``mesh_rank = r * U + u``)."""
    u_size, r_size = _mesh_shape(strategy, mesh_shape)
    shards = list(shards)
    if len(shards) != u_size * r_size:
        raise ValueError(
            f"unshard: {len(shards)} shards for a {u_size}x{r_size} mesh; pass one per rank, mesh "
            "rank order"
        )
    dim = dim % shards[0].dim()
    seq_len = sum(s.shape[dim] for s in shards)
    pieces: list[tuple[int, torch.Tensor]] = []
    for mesh_rank, s in enumerate(shards):
        offset = 0
        for a, b in position_ranges(
            strategy, layout, (u_size, r_size), mesh_coords(mesh_rank, (u_size, r_size)), seq_len
        ):
            pieces.append((a, s.narrow(dim, offset, b - a)))
            offset += b - a
        if offset != s.shape[dim]:
            raise ValueError(
                f"unshard: shard {mesh_rank} has length {s.shape[dim]} on dim {dim}, expected "
                f"{offset}"
            )
    return torch.cat([t for _, t in sorted(pieces, key=lambda p: p[0])], dim=dim)
