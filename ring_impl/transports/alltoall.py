"""``alltoall``: one ``all_to_all_single`` per hop, each rank sending its block to rank + 1 and
receiving from rank - 1 (a permutation expressed as split sizes)."""

from __future__ import annotations

from .link import alltoall_hop
from .neighbour import NeighbourTransport

__all__ = ["ALLTOALL"]

ALLTOALL = NeighbourTransport(
    "alltoall", grad_hop=alltoall_hop, kinds=lambda compiled: ("all_to_all",)
)
