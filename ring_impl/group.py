"""The ring's process group: resolving ``group=``, and the plain values the ring needs of it."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.distributed as dist

__all__ = ["RingGroup", "as_device", "resolve_group"]


def as_device(device: torch.device | str | None) -> torch.device:
    """``device`` as a torch.device, the CPU for None. A torch.device is returned as it is, so
    whatever a call builds on "its inputs' device" is built on the object read off the inputs
    (``q.device``), which a placement check can follow (tests/ring_impl/placement.py)."""
    return device if isinstance(device, torch.device) else torch.device(device or "cpu")


def resolve_group(group) -> dist.ProcessGroup:
    """A ProcessGroup from ``None`` (the default group), a ProcessGroup or a 1-D DeviceMesh."""
    if group is None:
        if not dist.is_initialized():
            raise RuntimeError(
                "ring_attention needs torch.distributed: call torch.distributed.init_process_group "
                "first, or pass group= (a ProcessGroup or a 1-D DeviceMesh)"
            )
        # (torch types WORLD Optional: it is set once the default group is initialized)
        return dist.group.WORLD  # type: ignore[return-value]
    if isinstance(group, dist.ProcessGroup):
        return group
    from torch.distributed.device_mesh import DeviceMesh

    if isinstance(group, DeviceMesh):
        if group.ndim != 1:
            raise ValueError(
                f"group is a {group.ndim}-D DeviceMesh; pass its context-parallel dimension, "
                "e.g. mesh['cp'], which is 1-D"
            )
        return group.get_group()
    if group is dist.GroupMember.NON_GROUP_MEMBER:
        raise ValueError(
            f"this rank (global rank {dist.get_rank() if dist.is_initialized() else '?'}) is not "
            "a member of the process group passed as group= (new_group returns "
            "GroupMember.NON_GROUP_MEMBER on the ranks it leaves out): call ring_attention only "
            "on the group's member ranks"
        )
    raise TypeError(
        f"group must be None, a ProcessGroup or a 1-D DeviceMesh, not {type(group).__name__}"
    )


@dataclass(frozen=True)
class RingGroup:
    """The ring's view of a process group: plain values, so tracing sees constants."""

    group_name: str
    rank: int
    world_size: int
    next_global: int  # global rank of (rank + 1) mod W: where blocks are sent
    prev_global: int  # global rank of (rank - 1) mod W: where blocks come from
    stage_on_host: bool  # gloo with CUDA tensors: collectives run on host copies
    pg: dist.ProcessGroup | None = field(default=None, compare=False, repr=False)

    @staticmethod
    def of(pg: dist.ProcessGroup, device: torch.device) -> RingGroup:
        rank, world = dist.get_rank(pg), dist.get_world_size(pg)
        backend = str(dist.get_backend(pg)).lower()
        return RingGroup(
            group_name=pg.group_name,
            rank=rank,
            world_size=world,
            next_global=dist.get_global_rank(pg, (rank + 1) % world),
            prev_global=dist.get_global_rank(pg, (rank - 1) % world),
            stage_on_host=device.type != "cpu" and backend == "gloo",
            pg=pg,
        )

    @staticmethod
    def alone(pg: dist.ProcessGroup, device: torch.device) -> RingGroup:
        """This rank of ``pg`` as a ring of one: its own key and value are the only block and
        nothing travels (key/value every rank holds whole, ``replicated_kv=True``)."""
        me = dist.get_global_rank(pg, dist.get_rank(pg))
        return RingGroup(
            group_name=pg.group_name,
            rank=0,
            world_size=1,
            next_global=me,
            prev_global=me,
            stage_on_host=False,
            pg=pg,
        )
