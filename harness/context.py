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
    lives as long as the pool's processes. :meth:`device_mesh` and :meth:`subgroup` give meshes
    and sub-groups over the pool's ranks, created once per pool and shape.
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
    _groups: dict[Any, Any] = field(default_factory=dict, repr=False)

    def device_mesh(self, shape: tuple[int, ...], dim_names: tuple[str, ...]) -> Any:
        """A ``DeviceMesh`` of ``shape`` over the pool's ranks (row-major: the last dim's ranks are
        consecutive), created on first use and kept for the pool's life, so a case pays for its
        process groups once per pool and mesh shape, not per case. Every rank must ask for the
        same meshes in the same order (creating one is a collective); rank functions that all
        run the same code do."""
        key = ("mesh", tuple(shape), tuple(dim_names))
        if key not in self._groups:
            from torch.distributed.device_mesh import init_device_mesh

            self._groups[key] = init_device_mesh(
                self.device.type, tuple(shape), mesh_dim_names=tuple(dim_names)
            )
        return self._groups[key]

    def subgroup(self, ranks: tuple[int, ...]) -> Any:
        """``dist.new_group(ranks)`` (GroupMember.NON_GROUP_MEMBER on the ranks it leaves out),
        created on first use and kept for the pool's life; the same rule as :meth:`device_mesh`:
        every rank asks for the same groups in the same order."""
        key = ("group", tuple(ranks))
        if key not in self._groups:
            import torch.distributed as dist

            self._groups[key] = dist.new_group(list(ranks))
        return self._groups[key]

    @property
    def is_leader(self) -> bool:
        """True on rank 0, the rank that prints and writes shared files."""
        return self.rank == 0
