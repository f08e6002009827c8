"""``allgather``: every key/value block from one all-gather per pass, started before step 0.

Forward: one all-gather of the packed local key/value; step ``s`` reads block ``(rank - s) mod W``.
Backward: one all-gather again (keeping the gathered copy alive from forward to backward would
cost ``W`` times the key/value memory); the dK/dV accumulators travel the ring by all-to-all hops
as with ``alltoall`` (PyTorch's ring does the same). A reduce-scatter of every block's dK/dV
would have to hold all ``W`` of them at once (``W * dkv``, and gloo clones its input on top) and
could only start after the last step, exposed; its input is ``W * dkv`` bytes against
``(W - 1) * dkv`` for the ring, and gloo implements it as an all-reduce, which sends twice the
ring's bytes. Measured with benchmarks/ring.py (W=4, seq 8192, causal head_tail, gloo): 1.87-2.00
s per forward+backward and a per-rank peak of 0.88x the single-process one with the
reduce-scatter, against 1.69 s and 0.67x with the accumulators on the ring.

The gathered copy holds every block by design (memory ``W`` blocks). From ``W = 3`` on the
backward computes the rank's own block first, overlapping the all-gather, which brings ``W - 1``
blocks at once that step 1 would otherwise wait for in full. Measured at W=4, seq 8192, gloo:
the backward's time waiting for transfers fell from 50-95 ms to 1-25 ms per rank (backward 2-3%
faster), and at seq 16384 the per-rank peak rose from 0.66x to 0.78x of one process's (PyTorch's
allgather ring: 0.83x). At ``W = 2`` the gather is one block, like a ring hop: ~10 ms saved did
not pay for 1.00x -> 1.11x.
"""

from __future__ import annotations

import torch

from ..group import RingGroup
from .base import PhaseSchedule
from .link import Link, Pending, Transfer, _c10d, alltoall_hop, stage_on_host

__all__ = ["ALLGATHER", "AllGather", "GatheredBlocks"]


class GatheredBlocks:
    """Key/value blocks from one all-gather, started before step 0 computes."""

    def __init__(self, kv: torch.Tensor, g: RingGroup, link: Link | None = None):
        self._kv: torch.Tensor | None = kv
        self._shape, self._g, self._link = kv.shape, g, link
        self._gathered: torch.Tensor | None = None
        self._pending: Pending | None = None
        if g.world_size > 1:
            flat, device = stage_on_host(kv.reshape(-1), g)
            self._pending = Transfer(
                _c10d.all_gather_into_tensor(flat, g.world_size, g.group_name), device
            )

    def block(self, step: int) -> torch.Tensor:
        if step == 0:
            assert self._kv is not None, "GatheredBlocks.block(0) called twice"
            current, self._kv = self._kv, None  # the gathered copy holds this block too
            return current
        if self._gathered is None:
            assert self._pending is not None
            self._gathered = self._pending.result().view(self._g.world_size, *self._shape)
            self._pending = None
            if self._link is not None:
                self._link.follow(self._gathered)  # dK/dV hops come after the all-gather
        return self._gathered[(self._g.rank - step) % self._g.world_size]


class AllGather:
    name = "allgather"
    kv_hops_share_link = False  # no key/value hops: the dK/dV accumulators flush on their own
    grad_hop = staticmethod(alltoall_hop)

    def kv_blocks(self, kv: torch.Tensor, g: RingGroup, link: Link | None) -> GatheredBlocks:
        return GatheredBlocks(kv, g, link)

    def own_block_first(self, world_size: int) -> bool:
        return world_size > 2

    def schedule(
        self, world_size: int, *, kv_bytes: int, dkv_bytes: int, compiled: bool
    ) -> PhaseSchedule:
        w = world_size
        return {
            "forward": {"all_gather": {"calls": 1, "bytes": kv_bytes}},
            "backward": {
                "all_gather": {"calls": 1, "bytes": kv_bytes},
                "all_to_all": {"calls": w - 1, "bytes": (w - 1) * dkv_bytes},
            },
        }


ALLGATHER = AllGather()
