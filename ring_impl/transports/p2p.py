"""``p2p``: one batched isend/irecv pair per hop to the neighbours (eager); compiled, the hop is
an ``all_to_all_single`` permutation (see :func:`ring_impl.transports.link.p2p_hop` for the torch
2.13 fault that forces it), counted as such."""

from __future__ import annotations

from .link import p2p_hop
from .neighbour import NeighbourTransport

__all__ = ["P2P"]

P2P = NeighbourTransport(
    "p2p",
    grad_hop=p2p_hop,
    kinds=lambda compiled: ("all_to_all",) if compiled else ("send", "recv"),
)
