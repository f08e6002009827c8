"""The sparse key/value gather's collectives (:mod:`ring_impl.exchanges.kv_gather`), per phase,
as :func:`ring_impl.collective_schedule` declares them for ``exchange="gather"``."""

from __future__ import annotations

from ..checks.inputs import exchange_nbytes
from ..exchanges.kv_gather import GatherPlan
from .ring import KVShards

__all__ = ["gather_schedule"]


def gather_schedule(
    plan: GatherPlan, kv: KVShards, *, world_size: int
) -> dict[str, dict[str, dict[str, int]]]:
    """The collectives of one sparse-gather call on the rank ``plan`` is for, with shards
    ``kv``, eager: forward, the input check's all_reduce and one all_to_all whose input is the
    rows sent (packed key and value, input dtype); backward, one all_to_all whose input is the
    received rows' dK/dV (accumulation dtype)."""
    sent, received = sum(plan.send_counts), sum(plan.recv_counts)
    return {
        "forward": {
            "all_reduce": {"calls": 1, "bytes": exchange_nbytes(world_size)},
            "all_to_all": {"calls": 1, "bytes": sent * kv.row * kv.dtype.itemsize},
        },
        "backward": {"all_to_all": {"calls": 1, "bytes": received * kv.row * kv.acc_itemsize}},
    }
