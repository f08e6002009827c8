"""The sparse key/value gather's collectives (:mod:`ring_impl.exchanges.kv_gather`), per phase,
as :func:`ring_impl.collective_schedule` declares them for ``exchange="gather"``."""

from __future__ import annotations

import torch

from ..checks.inputs import exchange_nbytes
from ..exchanges.kv_gather import GatherPlan
from ..ops import accumulation_dtype

__all__ = ["gather_schedule"]


def gather_schedule(
    plan: GatherPlan,
    *,
    world_size: int,
    batch: int,
    heads_kv: int,
    head_dim: int,
    dtype: torch.dtype,
    head_dim_v: int | None = None,
) -> dict[str, dict[str, dict[str, int]]]:
    """The collectives of one sparse-gather call on the rank ``plan`` is for, eager: forward,
    the input check's all_reduce and one all_to_all whose input is the rows sent (packed key and
    value, input dtype); backward, one all_to_all whose input is the received rows' dK/dV
    (accumulation dtype). ``head_dim_v``: value's head dim (None: ``head_dim``)."""
    row = batch * heads_kv * (head_dim + (head_dim if head_dim_v is None else head_dim_v))
    sent, received = sum(plan.send_counts), sum(plan.recv_counts)
    return {
        "forward": {
            "all_reduce": {"calls": 1, "bytes": exchange_nbytes(world_size)},
            "all_to_all": {"calls": 1, "bytes": sent * row * dtype.itemsize},
        },
        "backward": {
            "all_to_all": {"calls": 1, "bytes": received * row * accumulation_dtype(dtype).itemsize}
        },
    }
