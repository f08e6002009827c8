"""The collective schedule ring_impl declares, so a suite can assert it exactly.

Accounting convention (shared with ``harness.accounting``): one entry per collective call a
rank issues; the bytes of a call are the bytes of the tensors the rank passes in (for a recv,
the receive buffer). Batched p2p counts one ``send`` and one ``recv`` per hop.

Per phase, for ``W > 1`` and packed key/value bytes ``kv = 2*batch*heads_kv*seq_kv*head_dim*itemsize``
and gradient bytes ``dkv`` (the same elements in the accumulation dtype, float32 or float64):

============  ==========================================  =============================================
method        forward                                     backward
============  ==========================================  =============================================
allgather     all_gather: 1 call, kv                      all_gather: 1 call, kv; reduce_scatter: 1, W*dkv
alltoall      all_to_all: W-1 calls, (W-1)*kv             all_to_all: 2W-1 calls, (W-1)*kv + W*dkv
p2p           send, recv: W-1 calls each, (W-1)*kv each   send, recv: 2W-1 each, (W-1)*kv + W*dkv each
============  ==========================================  =============================================

plus, in eager mode, the forward's cross-rank input check: all_reduce, 1 call (see
:mod:`ring_impl.validate`). ``W == 1`` issues no collective at all.
"""

from __future__ import annotations

import torch

from .comm import check_rotate_method
from .ops import accumulation_dtype
from .validate import exchange_nbytes

__all__ = ["collective_schedule"]

Schedule = dict[str, dict[str, dict[str, int]]]


def collective_schedule(
    world_size: int,
    rotate_method: str,
    *,
    batch: int,
    heads_kv: int,
    seq_kv: int,
    head_dim: int,
    dtype: torch.dtype,
    compiled: bool = False,
) -> Schedule:
    """``{phase: {kind: {"calls": n, "bytes": b}}}`` for one forward and one backward call.

    ``seq_kv`` is the local key/value length per rank.
    """
    check_rotate_method(rotate_method)
    fwd: dict[str, dict[str, int]] = {}
    bwd: dict[str, dict[str, int]] = {}
    if world_size > 1:
        elems = 2 * batch * heads_kv * seq_kv * head_dim
        kv = elems * dtype.itemsize
        dkv = elems * accumulation_dtype(dtype).itemsize
        w = world_size
        if not compiled:
            fwd["all_reduce"] = {"calls": 1, "bytes": exchange_nbytes(w)}
        if rotate_method == "allgather":
            fwd["all_gather"] = {"calls": 1, "bytes": kv}
            bwd["all_gather"] = {"calls": 1, "bytes": kv}
            bwd["reduce_scatter"] = {"calls": 1, "bytes": w * dkv}
        else:
            kinds = ("all_to_all",) if rotate_method == "alltoall" else ("send", "recv")
            for kind in kinds:
                fwd[kind] = {"calls": w - 1, "bytes": (w - 1) * kv}
                bwd[kind] = {"calls": 2 * w - 1, "bytes": (w - 1) * kv + w * dkv}
    return {"forward": fwd, "backward": bwd}
