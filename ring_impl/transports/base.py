"""What a transport (a KV rotation method) is to the ring, and the schedule it declares.

A transport says how each step's key/value block reaches a rank (:meth:`Transport.kv_blocks`),
how the backward's dK/dV accumulators travel (:attr:`Transport.grad_hop`: always around the ring,
``W - 1`` hops home), whether its key/value hops are posts of the backward's :class:`Link` (so a
step's dK/dV hop rides on the next key/value hop, :attr:`Transport.kv_hops_share_link`), which
block the backward computes first, and exactly which collectives one call issues
(:meth:`Transport.schedule`), so ``collective_schedule`` and the suites hold the ring to it.

Accounting convention (shared with ``harness.accounting``): one entry per collective call a
rank issues; the bytes of a call are the bytes of the tensors the rank passes in (for a recv,
the receive buffer). Batched p2p counts one ``send`` and one ``recv`` per hop.
"""

from __future__ import annotations

from typing import Protocol

import torch

from ..group import RingGroup
from .link import Hop, Link

__all__ = ["KVBlocks", "PhaseSchedule", "Transport"]

#: ``{phase: {kind: {"calls": n, "bytes": b}}}`` for phases "forward" and "backward".
PhaseSchedule = dict[str, dict[str, dict[str, int]]]


class KVBlocks(Protocol):
    """The source of one pass's key/value blocks: ``block(s)`` is the packed block ``(2, batch,
    heads_kv, seq_kv, head_dim)`` of rank ``(rank - s) mod W``; ``block(0)`` first, once."""

    def block(self, step: int) -> torch.Tensor: ...


class Transport(Protocol):
    """A KV rotation method; one object per method in ring_impl.transports' registry."""

    # Read-only members (properties), so that a frozen dataclass or class attributes provide them.
    @property
    def name(self) -> str: ...

    @property
    def kv_hops_share_link(self) -> bool:
        """Its key/value hops are posts of the backward's link: each step's flush carries the
        dK/dV accumulator staged since the last one (False: the accumulators flush on their
        own)."""
        ...

    @property
    def grad_hop(self) -> Hop:
        """How the dK/dV accumulators (and, for ring methods, key/value blocks) hop to rank + 1."""
        ...

    def kv_blocks(self, kv: torch.Tensor, g: RingGroup, link: Link | None) -> KVBlocks:
        """The blocks of one pass over the packed local ``kv``; ``link``: the backward's chain."""
        ...

    def own_block_first(self, world_size: int) -> bool:
        """Whether the backward computes the rank's own block first (else last)."""
        ...

    def schedule(
        self, world_size: int, *, kv_bytes: int, dkv_bytes: int, compiled: bool
    ) -> PhaseSchedule:
        """The collectives of one ring (one forward, one backward) over ``world_size > 1``
        ranks: ``kv_bytes`` of packed key/value and ``dkv_bytes`` of its dK/dV accumulator per
        block. Excludes the cross-rank input check."""
        ...
