"""The process groups of a head-parallel strategy: the Ulysses group and, for the hybrid, the ring
group.

``group=`` for ``strategy="ulysses"``: None (the default group), a ProcessGroup or a 1-D
DeviceMesh, as for the ring. For ``strategy="hybrid"``: a 2-D DeviceMesh whose dims are named
``"ulysses"`` and ``"ring"`` (in either order), or a mapping ``{"ulysses": ..., "ring": ...}`` of
ProcessGroups or 1-D meshes. The two groups of a rank must cross only at that rank (a mesh's rows
and columns do): every rank of a Ulysses group then holds a different piece of the same ring shard.
Ulysses groups of consecutive ranks (``init_device_mesh(..., (R, U), mesh_dim_names=("ring",
"ulysses"))``) keep the all-to-all inside a node.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import torch
import torch.distributed as dist

from ..group import RingGroup, resolve_group

__all__ = ["DIM_NAMES", "HeadGroup", "StrategyGroups", "resolve_strategy_groups"]

#: The mesh dim names of the hybrid.
DIM_NAMES = ("ulysses", "ring")


@dataclass(frozen=True)
class HeadGroup:
    """The Ulysses group as plain values (what the all-to-all needs; constants under tracing)."""

    group_name: str
    rank: int
    size: int
    stage_on_host: bool  # gloo with CUDA tensors: collectives run on host copies


@dataclass(frozen=True)
class StrategyGroups:
    """The resolved groups of one call: ``ulysses`` (degree U) and ``ring`` (degree R, the hybrid
    only; None otherwise). ``coords`` = (u, r); ``mesh_rank`` = r * U + u."""

    ulysses: dist.ProcessGroup
    ring: dist.ProcessGroup | None

    @property
    def shape(self) -> tuple[int, int]:
        return dist.get_world_size(self.ulysses), (
            1 if self.ring is None else dist.get_world_size(self.ring)
        )

    @property
    def coords(self) -> tuple[int, int]:
        return dist.get_rank(self.ulysses), (0 if self.ring is None else dist.get_rank(self.ring))

    @property
    def mesh_rank(self) -> int:
        (u, r), (size, _) = self.coords, self.shape
        return r * size + u

    def head_group(self, device: torch.device) -> HeadGroup:
        backend = str(dist.get_backend(self.ulysses)).lower()
        return HeadGroup(
            self.ulysses.group_name,
            dist.get_rank(self.ulysses),
            dist.get_world_size(self.ulysses),
            device.type != "cpu" and backend == "gloo",
        )

    def ring_group(self, device: torch.device) -> RingGroup:
        assert self.ring is not None
        return RingGroup.of(self.ring, device)


def _hybrid_from_mesh(mesh) -> StrategyGroups:
    names = tuple(mesh.mesh_dim_names or ())
    if mesh.ndim != 2 or sorted(names) != sorted(DIM_NAMES):
        raise ValueError(
            "strategy='hybrid' needs a 2-D DeviceMesh with dims named 'ulysses' and 'ring', got "
            f"a {mesh.ndim}-D mesh with dims {names or 'unnamed'}; e.g. init_device_mesh(device, "
            "(ring_degree, ulysses_degree), mesh_dim_names=('ring', 'ulysses')), or pass "
            "group={'ulysses': pg, 'ring': pg}"
        )
    return StrategyGroups(mesh.get_group("ulysses"), mesh.get_group("ring"))


def resolve_strategy_groups(strategy: str, group) -> StrategyGroups:
    """The groups of ``strategy`` from ``group=`` (see the module docstring); TypeError or
    ValueError (the same on every rank that passes the same kind of argument) otherwise."""
    from torch.distributed.device_mesh import DeviceMesh

    if strategy == "ulysses":
        if isinstance(group, DeviceMesh) and group.ndim != 1:
            raise ValueError(
                "strategy='ulysses' takes a ProcessGroup or a 1-D DeviceMesh, got a "
                f"{group.ndim}-D mesh; pass its Ulysses dimension (mesh['ulysses']) or use "
                "strategy='hybrid' for a (ulysses, ring) mesh"
            )
        return StrategyGroups(resolve_group(group), None)
    if strategy != "hybrid":
        raise ValueError(f"resolve_strategy_groups: strategy {strategy!r} is not head-parallel")
    if isinstance(group, DeviceMesh):
        return _hybrid_from_mesh(group)
    if isinstance(group, Mapping):
        if set(group) != set(DIM_NAMES):
            raise ValueError(
                "strategy='hybrid' with a mapping needs exactly the keys 'ulysses' and 'ring', "
                f"got {sorted(map(str, group))}"
            )
        ulysses, ring = resolve_group(group["ulysses"]), resolve_group(group["ring"])
        if not torch.compiler.is_compiling():  # (traced: the call's eager checks have run it)
            shared = set(dist.get_process_group_ranks(ulysses)) & set(
                dist.get_process_group_ranks(ring)
            )
            if shared != {dist.get_rank()}:
                raise ValueError(
                    "strategy='hybrid' with a mapping needs a 'ulysses' and a 'ring' group that "
                    "cross only at this rank (a row and a column of a mesh); these share ranks "
                    f"{sorted(shared)}"
                )
        return StrategyGroups(ulysses, ring)
    raise TypeError(
        "strategy='hybrid' needs group= a 2-D DeviceMesh with dims 'ulysses' and 'ring' or a "
        f"mapping {{'ulysses': group, 'ring': group}}, not {type(group).__name__}"
    )
