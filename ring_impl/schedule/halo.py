"""The halo exchange's collectives (:mod:`ring_impl.exchanges.halo`), per phase, as
:func:`ring_impl.collective_schedule` declares them for ``exchange="halo"``."""

from __future__ import annotations

import torch

from ..checks.inputs import exchange_nbytes
from ..exchanges.halo import halo_rows
from ..ops import accumulation_dtype

__all__ = ["halo_schedule"]


def halo_schedule(
    world_size: int,
    rank: int,
    left: int,
    right: int,
    *,
    batch: int,
    heads_kv: int,
    head_dim: int,
    dtype: torch.dtype,
    head_dim_v: int | None = None,
) -> dict[str, dict[str, dict[str, int]]]:
    """The collectives of one halo call on ``rank`` (forward and backward), eager.

    Forward: the input check's all_reduce; a ``send`` per neighbour that needs this rank's rows
    (their key/value, input dtype) and a ``recv`` per halo. Backward: the reverse: a ``send`` per
    halo (its dK/dV, accumulation dtype) and a ``recv`` per neighbour's part of this rank's rows.
    ``head_dim_v``: value's head dim (None: ``head_dim``).
    """
    h = halo_rows(rank, world_size, left, right)
    head_dim_v = head_dim if head_dim_v is None else head_dim_v
    row = batch * heads_kv * (head_dim + head_dim_v)  # elements of one packed key/value row
    kv, acc = dtype.itemsize, accumulation_dtype(dtype).itemsize

    def entry(rows: tuple[int, int], itemsize: int) -> dict[str, int] | None:
        calls = sum(1 for n in rows if n)
        return {"calls": calls, "bytes": row * sum(rows) * itemsize} if calls else None

    out: dict[str, dict[str, dict[str, int]]] = {
        "forward": {"all_reduce": {"calls": 1, "bytes": exchange_nbytes(world_size)}},
        "backward": {},
    }
    for phase, kind, rows, itemsize in (
        ("forward", "send", (h.to_prev, h.to_next), kv),
        ("forward", "recv", (h.left, h.right), kv),
        ("backward", "send", (h.left, h.right), acc),
        ("backward", "recv", (h.to_prev, h.to_next), acc),
    ):
        e = entry(rows, itemsize)
        if e is not None:
            out[phase][kind] = e
    return out
