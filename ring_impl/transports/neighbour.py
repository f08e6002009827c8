"""Key/value blocks passed to the next rank one hop per step (``alltoall`` and ``p2p``).

Forward: ``W - 1`` key/value hops. Backward: ``W - 1`` key/value hops and ``W - 1`` dK/dV hops,
all through one :class:`Link`; eager, one transfer per hop (``T = 2W - 2``); compiled, a step's
dK/dV hop travels packed with the next key/value hop, so ``T = 2`` at ``W = 2`` and ``T = W + 1``
from ``W = 3`` on (the first two carry key/value only, the last two dK/dV only). The next block
is in flight while the current step computes. Every figure is the minimum of a ring: each pass
needs every other rank's key/value once, and every block's partial dK/dV must reach its owner,
``W - 1`` hops (a block's accumulator starts on the rank after its owner; the owner's own
contribution never leaves).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from ..group import RingGroup
from .base import PhaseSchedule
from .link import Hop, Link

__all__ = ["NeighbourBlocks", "NeighbourTransport", "backward_transfers"]


class NeighbourBlocks:
    """``block(s)`` waits for block ``s`` and, for ``s < W - 1``, passes it on at once (with
    whatever the link has staged), so the next block is in flight while step ``s`` computes."""

    def __init__(self, kv: torch.Tensor, g: RingGroup, link: Link):
        self._kv: torch.Tensor | None = kv
        self._g, self._link = g, link

    def block(self, step: int) -> torch.Tensor:
        if step == 0:
            assert self._kv is not None, "NeighbourBlocks.block(0) called twice"
            current, self._kv = self._kv, None  # from here on the caller and the send hold it
        else:
            current = self._link.take("kv")
        if step < self._g.world_size - 1:
            self._link.stage("kv", current, follows_token=True)
        self._link.flush()
        return current


def backward_transfers(world_size: int, compiled: bool = False) -> int:
    """Transfers of a neighbour transport's backward: ``W - 1`` key/value and ``W - 1`` dK/dV
    hops; compiled, the two kinds share a transfer on steps ``2 .. W - 2``."""
    hops = 2 * (world_size - 1)
    return min(hops, world_size + 1) if compiled and world_size > 1 else hops


@dataclass(frozen=True)
class NeighbourTransport:
    """A transport whose hops go to the next rank: ``hop`` moves a tensor, ``kinds(compiled)``
    names the collective(s) one hop counts as (see the module docstring for the counts)."""

    name: str
    grad_hop: Hop
    kinds: Callable[[bool], tuple[str, ...]]
    kv_hops_share_link: bool = True

    def kv_blocks(self, kv: torch.Tensor, g: RingGroup, link: Link | None) -> NeighbourBlocks:
        return NeighbourBlocks(kv, g, link if link is not None else Link(g, self.grad_hop))

    def own_block_first(self, world_size: int) -> bool:
        # The own block last: its dK/dV goes straight into the accumulator that has just come
        # home, whose transfer its compute overlaps; the first key/value hop, one block, is all
        # step 1 waits for.
        return False

    def schedule(
        self, world_size: int, *, kv_bytes: int, dkv_bytes: int, compiled: bool
    ) -> PhaseSchedule:
        w = world_size
        fwd, bwd = {}, {}
        for kind in self.kinds(compiled):
            fwd[kind] = {"calls": w - 1, "bytes": (w - 1) * kv_bytes}
            bwd[kind] = {
                "calls": backward_transfers(w, compiled),
                "bytes": (w - 1) * (kv_bytes + dkv_bytes),
            }
        return {"forward": fwd, "backward": bwd}
