"""RankContext: what a rank function gets as its first argument."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass
class RankContext:
    """The rank's view of the pool, passed as ``fn(ctx, *args, **kwargs)``.

    ``group`` is the pool's process group (also the default group, so ``dist.all_reduce(x)``
    without ``group=`` works); ``device`` is the ``torch.device`` this rank computes on (CPU, or
    its pinned GPU); ``case`` is the case label (normally the pytest node id) and ``seed`` the seed
    every rank was seeded with before the call; ``tmp_dir`` is a directory private to the pool that
    lives as long as the pool's processes.
    """

    rank: int
    world_size: int
    group: Any
    device: Any
    backend: str
    case: str = ""
    seed: int = 0
    tmp_dir: str = ""
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def is_leader(self) -> bool:
        """True on rank 0, the rank that prints and writes shared files."""
        return self.rank == 0
