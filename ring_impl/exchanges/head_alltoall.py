"""The all-to-alls of head parallelism: sequence shards to head shards and back.

Every tensor here is 4-D, ``(batch, heads, seq, feature)`` (an LSE travels as ``(batch, heads,
seq, 1)``). On a Ulysses group of ``U`` ranks:

``sequence_to_heads``
    in: this rank's sequence shard of every head, ``(b, h, s, f)``; out: every rank's shard of
    this rank's slice of heads, ``(b, h/U, U*s, f)``, the shards in rank order. Head slice ``j``
    goes to rank ``j``.
``heads_to_sequence``
    the inverse: in ``(b, h/U, U*s, f)``, out ``(b, h, s, f)``.

Several tensors travel in **one** ``all_to_all_single`` (query, key and value; out and LSE; the
three gradients): each rank's part of every tensor is laid side by side in one row per
destination. Tensors of one dtype are concatenated as they are; mixed dtypes (output and LSE)
go as bytes, widest element first so every part stays aligned. One call per direction and phase
means the ranks post the same collectives in the same order whatever the compiler does with
independent ones, and pay the latency once.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from ..transports.link import Transfer, stage_on_host
from .mesh_groups import HeadGroup

__all__ = ["heads_to_sequence", "sequence_to_heads"]

_c10d = torch.ops._c10d_functional


def _exchange(rows: torch.Tensor, g: HeadGroup) -> torch.Tensor:
    """all_to_all_single of ``rows`` (U, n): row j to rank j; returns (U, n), row i from rank i."""
    flat, device = stage_on_host(rows.reshape(-1), g)
    n = rows.numel() // g.size
    received = _c10d.all_to_all_single(flat, [n] * g.size, [n] * g.size, g.group_name)
    return Transfer(received, device).result().view(rows.shape)


def _pack(
    parts: list[torch.Tensor], g: HeadGroup
) -> tuple[torch.Tensor, list[tuple[torch.dtype, int]]]:
    """(U, n) rows, row j the concatenation of every part's row j;
    and each part's (dtype, width)."""
    same = all(p.dtype == parts[0].dtype for p in parts)
    rows, layout = [], []
    for p in parts:
        r = p.reshape(g.size, -1)
        if not same:
            r = r.contiguous().view(torch.uint8)
        rows.append(r)
        layout.append((p.dtype, r.shape[1]))
    return torch.cat(rows, dim=1) if len(rows) > 1 else rows[0].contiguous(), layout


def _unpack(rows: torch.Tensor, layout: list[tuple[torch.dtype, int]]) -> list[torch.Tensor]:
    out, offset = [], 0
    same = len({dtype for dtype, _ in layout}) == 1
    for dtype, width in layout:
        part = rows[:, offset : offset + width]
        if not same:
            part = part.contiguous().view(dtype)
        out.append(part)
        offset += width
    return out


def _widest_first(parts: list[torch.Tensor]) -> list[int]:
    return sorted(range(len(parts)), key=lambda i: -parts[i].element_size())


def _all_to_all(
    parts: list[torch.Tensor],
    g: HeadGroup,
    stage: Callable[[torch.Tensor], torch.Tensor],
    unstage: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
) -> list[torch.Tensor]:
    """One all-to-all for all ``parts``: ``stage(part)`` lays a part out as ``(U, ...)``, row
    ``j`` for rank ``j``; ``unstage(received, part)`` lays the ``(U, n)`` rows received for it,
    row ``i`` from rank ``i``, out as its result. The parts travel widest element first
    (:func:`_pack`) and come back in their own order. A group of one exchanges nothing."""
    if g.size == 1:
        return list(parts)
    order = _widest_first(parts)
    rows, layout = _pack([stage(parts[i]) for i in order], g)
    received = _unpack(_exchange(rows, g), layout)
    out: list[torch.Tensor] = [torch.empty(0)] * len(parts)
    for i, r in zip(order, received):
        out[i] = unstage(r, parts[i])
    return out


def sequence_to_heads(parts: list[torch.Tensor], g: HeadGroup) -> list[torch.Tensor]:
    """``(b, h, s, f)`` sequence shards -> ``(b, h/U, U*s, f)`` head shards,
    one all-to-all for all parts."""
    u = g.size

    def stage(p: torch.Tensor) -> torch.Tensor:
        # (b, h, s, f) -> (U, b, h/U, s, f): head slice j is row j.
        return p.reshape(p.shape[0], u, p.shape[1] // u, *p.shape[2:]).transpose(0, 1)

    def unstage(r: torch.Tensor, p: torch.Tensor) -> torch.Tensor:
        b, h, s, f = p.shape
        # row i came from rank i: its sequence shard of this rank's heads -> (b, h/U, U*s, f).
        return r.reshape(u, b, h // u, s, f).permute(1, 2, 0, 3, 4).reshape(b, h // u, u * s, f)

    return _all_to_all(parts, g, stage, unstage)


def heads_to_sequence(parts: list[torch.Tensor], g: HeadGroup) -> list[torch.Tensor]:
    """``(b, h/U, U*s, f)`` head shards -> ``(b, h, s, f)`` sequence shards,
    one all-to-all for all parts."""
    u = g.size

    def stage(p: torch.Tensor) -> torch.Tensor:
        # (b, h/U, U*s, f) -> (U, b, h/U, s, f): sequence shard j is row j.
        return p.reshape(p.shape[0], p.shape[1], u, p.shape[2] // u, p.shape[3]).permute(
            2, 0, 1, 3, 4
        )

    def unstage(r: torch.Tensor, p: torch.Tensor) -> torch.Tensor:
        b, hu, us, f = p.shape
        # row i came from rank i: its head slice of this rank's sequence -> (b, U*h/U, s, f).
        return r.reshape(u, b, hu, us // u, f).transpose(0, 1).reshape(b, u * hu, us // u, f)

    return _all_to_all(parts, g, stage, unstage)
