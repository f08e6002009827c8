"""Transports (KV rotation methods) in one registry: ``rotate_method=`` names one.

- :mod:`.link`: hops and the backward's chain of transfers (:class:`Link`).
- :mod:`.base`: the :class:`Transport` contract and the schedule it declares.
- :mod:`.allgather`, :mod:`.alltoall`, :mod:`.p2p`: the built-in methods (the last two share
  :mod:`.neighbour`).

A new method is one module defining a :class:`Transport` and registering it with
:func:`register_transport` (its name then works in ``rotate_method=``, ``set_rotate_method``,
``collective_schedule``, ``context_parallel`` and the input checks).
"""

from __future__ import annotations

from .allgather import ALLGATHER
from .alltoall import ALLTOALL
from .base import KVBlocks, PhaseSchedule, Transport
from .link import Hop, Link, after
from .p2p import P2P

__all__ = [
    "ROTATE_METHODS",
    "Hop",
    "KVBlocks",
    "Link",
    "PhaseSchedule",
    "Transport",
    "after",
    "check_rotate_method",
    "get_transport",
    "register_transport",
    "rotate_methods",
]

_REGISTRY: dict[str, Transport] = {}


def register_transport(transport: Transport, *, replace: bool = False) -> Transport:
    """Make ``transport`` selectable as ``rotate_method=transport.name``."""
    name = transport.name
    if name in _REGISTRY and not replace:
        raise ValueError(
            f"register_transport: a transport named {name!r} is already registered; pass "
            "replace=True"
        )
    _REGISTRY[name] = transport
    return transport


def rotate_methods() -> tuple[str, ...]:
    """Names accepted by ``rotate_method=``, in registration order (the same on every rank)."""
    return tuple(_REGISTRY)


def check_rotate_method(name: str) -> None:
    if not isinstance(name, str) or name not in _REGISTRY:
        raise ValueError(f"unknown rotate_method {name!r}; expected one of {rotate_methods()}")


def get_transport(name: str) -> Transport:
    check_rotate_method(name)
    return _REGISTRY[name]


for _t in (ALLGATHER, ALLTOALL, P2P):
    register_transport(_t)

#: The built-in methods (``rotate_methods()`` also lists registered ones).
ROTATE_METHODS = rotate_methods()
