"""The halo exchange's collectives (:mod:`ring_impl.exchanges.halo`), per phase, as
:func:`ring_impl.collective_schedule` declares them for ``exchange="halo"``."""

from __future__ import annotations

from ..checks.inputs import exchange_nbytes
from ..exchanges.halo import halo_rows
from .ring import KVShards

__all__ = ["halo_schedule"]


def halo_schedule(
    world_size: int, rank: int, left: int, right: int, kv: KVShards
) -> dict[str, dict[str, dict[str, int]]]:
    """The collectives of one halo call on ``rank`` (forward and backward), eager, for a mask of
    reach ``left``/``right`` and shards ``kv``.

    Forward: the input check's all_reduce; a ``send`` per neighbour that needs this rank's rows
    (their key/value, input dtype) and a ``recv`` per halo. Backward: the reverse: a ``send`` per
    halo (its dK/dV, accumulation dtype) and a ``recv`` per neighbour's part of this rank's rows.
    """
    h = halo_rows(rank, world_size, left, right)

    def entry(rows: tuple[int, int], itemsize: int) -> dict[str, int] | None:
        calls = sum(1 for n in rows if n)
        return {"calls": calls, "bytes": kv.row * sum(rows) * itemsize} if calls else None

    out: dict[str, dict[str, dict[str, int]]] = {
        "forward": {"all_reduce": {"calls": 1, "bytes": exchange_nbytes(world_size)}},
        "backward": {},
    }
    for phase, kind, rows, itemsize in (
        ("forward", "send", (h.to_prev, h.to_next), kv.dtype.itemsize),
        ("forward", "recv", (h.left, h.right), kv.dtype.itemsize),
        ("backward", "send", (h.left, h.right), kv.acc_itemsize),
        ("backward", "recv", (h.to_prev, h.to_next), kv.acc_itemsize),
    ):
        e = entry(rows, itemsize)
        if e is not None:
            out[phase][kind] = e
    return out
