"""Parallel strategies beside the ring: Ulysses (heads over ranks, sequence gathered by
all-to-all) and the hybrid (Ulysses inside each row of a 2-D mesh, the ring across rows).

- :mod:`.layout`: the global sequence layout each strategy implies; ``shard`` / ``unshard``.
- :mod:`.groups`: ``group=`` for each strategy (a process group, a 2-D mesh, a mapping).
- :mod:`.alltoall`: the sequence-to-heads all-to-all and its inverse.
- :mod:`.ulysses`: the algorithm (forward, explicit backward, key/value head replication).
- :mod:`.hybrid`: Ulysses around ``ring_impl``'s ring on the ring sub-group.
- :mod:`.validate`: bad input raises on every rank of the mesh before any collective.
- :mod:`.schedule`: the collectives a call issues, per phase.
- :mod:`.api`: what ``ring_attention(..., strategy=...)`` runs.
"""

from __future__ import annotations

from .api import DEFAULT_ALGORITHMS, strategy_path
from .groups import DIM_NAMES, StrategyGroups, resolve_strategy_groups
from .hybrid import Hybrid
from .layout import (
    STRATEGIES,
    local_shard,
    mesh_coords,
    position_ranges,
    sequence_divisor,
    shard,
    unshard,
)
from .schedule import strategy_schedule
from .ulysses import Ulysses, kv_replication

__all__ = [
    "DEFAULT_ALGORITHMS",
    "DIM_NAMES",
    "STRATEGIES",
    "Hybrid",
    "StrategyGroups",
    "Ulysses",
    "kv_replication",
    "local_shard",
    "mesh_coords",
    "position_ranges",
    "resolve_strategy_groups",
    "sequence_divisor",
    "shard",
    "strategy_path",
    "strategy_schedule",
    "unshard",
]
