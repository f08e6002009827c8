"""Exchanges: the ways a call's ranks share the sequence. Every one is a path behind one
autograd Function (:class:`.ring.Path`), chosen by ``ring_attention(exchange=...)``.

- :mod:`.ring`: the ring (key/value blocks rotate; forward and explicit backward).
- :mod:`.heads`: the ring over groups of heads one after another (``head_chunks``).
- :mod:`.halo`: neighbours' rows only, for masks that reach less than a shard.
- :mod:`.kv_gather`: each rank gathers only the key/value rows its queries see.
- :mod:`.ulysses`: heads over ranks, the sequence gathered by all-to-all
  (:mod:`.head_alltoall`).
- :mod:`.hybrid`: Ulysses inside each row of a ``(ulysses, ring)`` mesh, the ring across rows.
- :mod:`.mesh_groups`: ``group=`` of a head-parallel strategy (group, 2-D mesh, mapping).
- :mod:`.head_parallel`: what ``exchange="ulysses"`` / ``"hybrid"`` runs.

Their layouts live in :mod:`ring_impl.planning.mesh_layout`, their collective schedules in
:mod:`ring_impl.schedule`, their checks in :mod:`ring_impl.checks`. The names a user of the
head-parallel strategies needs (``local_shard``, ``shard``, ``unshard``, ``STRATEGIES``,
``Ulysses``, ``Hybrid``, ...) are served here, ``ring_impl.exchanges.local_shard``.
"""

from __future__ import annotations

import importlib

#: the head-parallel strategies' public names, served from their modules on first use (PEP 562),
#: so that importing one exchange (the ring, which every path imports) does not import every other
_NAMES = {
    "DEFAULT_ALGORITHMS": ".head_parallel",
    "strategy_path": ".head_parallel",
    "Hybrid": ".hybrid",
    "Ulysses": ".ulysses",
    "kv_replication": ".ulysses",
    "DIM_NAMES": ".mesh_groups",
    "StrategyGroups": ".mesh_groups",
    "resolve_strategy_groups": ".mesh_groups",
    "STRATEGIES": "ring_impl.planning.mesh_layout",
    "local_shard": "ring_impl.planning.mesh_layout",
    "mesh_coords": "ring_impl.planning.mesh_layout",
    "position_ranges": "ring_impl.planning.mesh_layout",
    "sequence_divisor": "ring_impl.planning.mesh_layout",
    "shard": "ring_impl.planning.mesh_layout",
    "unshard": "ring_impl.planning.mesh_layout",
    "strategy_schedule": "ring_impl.schedule.head_parallel",
}

__all__ = sorted(_NAMES)


def __getattr__(name: str):
    if name not in _NAMES:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(_NAMES[name], __name__), name)
