"""Moving key/value blocks and their gradients around the ring.

Every transfer goes through the functional collectives (``torch.ops._c10d_functional``): they
are asynchronous in eager mode (the result is a tensor whose ``wait_tensor`` blocks) and
traceable by dynamo, so the same code runs eagerly and under ``torch.compile(fullgraph=True)``.

Three rotation methods:

``allgather``
    forward: one all-gather of the packed local key/value; step ``s`` reads block
    ``(rank - s) mod W``. backward: one all-gather again (keeping the gathered copy alive from
    forward to backward would cost ``W`` times the key/value memory), every block's dK/dV
    accumulated locally, one reduce-scatter returns each block's gradient to its owner.
``alltoall``
    one ``all_to_all_single`` per hop in which each rank sends its block to ``rank + 1`` and
    receives from ``rank - 1`` (a permutation expressed as split sizes).
``p2p``
    one batched isend/irecv pair per hop to the same neighbours.

Ring methods move key/value ``W - 1`` times in forward; in backward key/value again ``W - 1``
times and the dK/dV accumulators ``W`` times (the last hop returns each block's gradient to its
owner). The next transfer is started before the current step computes.

Collectives are issued identically on every rank whatever the causal plan, so a rank that skips
a step still forwards what it received; nothing can deadlock on a skipped step.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

import torch
import torch.distributed as dist

__all__ = [
    "ROTATE_METHODS",
    "RingGroup",
    "check_rotate_method",
    "make_grad_rotation",
    "make_kv_rotation",
    "resolve_group",
]

ROTATE_METHODS = ("allgather", "alltoall", "p2p")

_c10d = torch.ops._c10d_functional


def check_rotate_method(name: str) -> None:
    if name not in ROTATE_METHODS:
        raise ValueError(f"unknown rotate_method {name!r}; expected one of {ROTATE_METHODS}")


def resolve_group(group) -> dist.ProcessGroup:
    """A ProcessGroup from ``None`` (the default group), a ProcessGroup or a 1-D DeviceMesh."""
    if group is None:
        if not dist.is_initialized():
            raise RuntimeError(
                "ring_attention needs torch.distributed: call torch.distributed.init_process_group "
                "first, or pass group= (a ProcessGroup or a 1-D DeviceMesh)"
            )
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
    raise TypeError(f"group must be None, a ProcessGroup or a 1-D DeviceMesh, not {type(group).__name__}")


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


def _wait(t: torch.Tensor) -> torch.Tensor:
    return _c10d.wait_tensor(t)


class Pending(Protocol):
    """A transfer in flight; ``result()`` waits for it and returns the received tensor."""

    def result(self) -> torch.Tensor: ...


class _Transfer:
    """A functional-collective transfer in flight."""

    def __init__(
        self,
        received: torch.Tensor,
        others: tuple[torch.Tensor, ...] = (),
        device: torch.device | None = None,
        shape: torch.Size | None = None,
    ):
        self._received = received
        self._others = others  # send handles: waited too, so the send buffer is not reused early
        self._device, self._shape = device, shape
        self._done = False

    def result(self) -> torch.Tensor:
        if self._done:
            raise RuntimeError("_Transfer.result called twice")
        self._done = True
        for t in self._others:
            _wait(t)
        out = _wait(self._received)
        out = out if self._device is None else out.to(self._device)
        return out if self._shape is None else out.view(self._shape)


def _stage(t: torch.Tensor, g: RingGroup) -> tuple[torch.Tensor, torch.device | None]:
    if g.stage_on_host:
        return t.cpu(), t.device
    return t, None


def shift(t: torch.Tensor, g: RingGroup, method: str) -> Pending:
    """Start sending ``t`` to rank+1 while receiving the same shape from rank-1."""
    flat, device = _stage(t.reshape(-1), g)
    if method == "p2p" and not torch.compiler.is_compiling():
        # Eager p2p goes through c10d directly: the functional batch_p2p_ops leaves one entry
        # per call in c10d's work registry even when both outputs are waited (torch 2.13).
        recv = torch.empty_like(flat)
        works = dist.batch_isend_irecv(
            [dist.P2POp(dist.isend, flat, g.next_global, g.pg), dist.P2POp(dist.irecv, recv, g.prev_global, g.pg)]
        )
        return _WorkTransfer(recv, works, flat, device, t.shape)
    if method == "p2p":
        recv = torch.empty_like(flat)
        send_h, recv_h = _c10d.batch_p2p_ops(
            ["isend", "irecv"], [g.next_global, g.prev_global], [0, 0], [flat, recv], g.group_name
        )
        return _Transfer(recv_h, (send_h,), device, t.shape)
    n = flat.numel()
    in_splits = [0] * g.world_size
    out_splits = [0] * g.world_size
    in_splits[(g.rank + 1) % g.world_size] = n
    out_splits[(g.rank - 1) % g.world_size] = n
    recv = _c10d.all_to_all_single(flat, out_splits, in_splits, g.group_name)
    return _Transfer(recv, (), device, t.shape)


class _WorkTransfer:
    """An eager c10d transfer: waits its works; keeps the send buffer alive until then."""

    def __init__(self, recv: torch.Tensor, works, send_buf: torch.Tensor, device: torch.device | None, shape: torch.Size):
        self._recv, self._works, self._device, self._shape = recv, works, device, shape
        self._send_buf: torch.Tensor | None = send_buf

    def result(self) -> torch.Tensor:
        for w in self._works:
            w.wait()
        self._works, self._send_buf = [], None
        out = self._recv if self._device is None else self._recv.to(self._device)
        return out.view(self._shape)


class _RingKV:
    """Key/value blocks by neighbour shifts (``alltoall`` or ``p2p``)."""

    def __init__(self, kv: torch.Tensor, g: RingGroup, method: str):
        self._kv, self._g, self._method = kv, g, method
        self._pending: Pending | None = None

    def block(self, step: int) -> torch.Tensor:
        current = self._kv if step == 0 else self._pending.result()  # type: ignore[union-attr]
        self._pending = None
        if step < self._g.world_size - 1:
            self._pending = shift(current, self._g, self._method)  # in flight during this step
        return current


class _GatheredKV:
    """Key/value blocks from one all-gather, started before step 0 computes."""

    def __init__(self, kv: torch.Tensor, g: RingGroup):
        self._kv, self._g = kv, g
        self._gathered: torch.Tensor | None = None
        self._pending: _Transfer | None = None
        if g.world_size > 1:
            flat, device = _stage(kv.reshape(-1), g)
            self._pending = _Transfer(_c10d.all_gather_into_tensor(flat, g.world_size, g.group_name), (), device)

    def block(self, step: int) -> torch.Tensor:
        if step == 0:
            return self._kv
        if self._gathered is None:
            self._gathered = self._pending.result().view(self._g.world_size, *self._kv.shape)  # type: ignore[union-attr]
        return self._gathered[(self._g.rank - step) % self._g.world_size]


def make_kv_rotation(kv: torch.Tensor, g: RingGroup, method: str) -> _RingKV | _GatheredKV:
    """The source of each step's packed key/value block ``(2, batch, heads_kv, seq_kv, head_dim)``."""
    check_rotate_method(method)
    return _GatheredKV(kv, g) if method == "allgather" else _RingKV(kv, g, method)


class _RingGrads:
    """dK/dV accumulators that travel with their block and come home after ``W`` hops."""

    def __init__(self, shape: torch.Size, dtype: torch.dtype, device: torch.device, g: RingGroup, method: str):
        self._shape, self._dtype, self._device = shape, dtype, device
        self._g, self._method = g, method
        self._pending: Pending | None = None

    def add(self, step: int, kv_rank: int, contribution: tuple[tuple[int, int], torch.Tensor, torch.Tensor] | None) -> None:
        """Add this rank's dK/dV for the step's block (None when skipped) and pass it on."""
        if step == 0:
            acc = torch.zeros(self._shape, dtype=self._dtype, device=self._device)
        else:
            acc = self._pending.result()  # type: ignore[union-attr]
        if contribution is not None:
            (k0, k1), dk, dv = contribution
            acc[0, :, :, k0:k1] += dk
            acc[1, :, :, k0:k1] += dv
        if self._g.world_size == 1:
            self._home = acc
        else:
            self._pending = shift(acc, self._g, self._method)

    def result(self) -> torch.Tensor:
        """This rank's own block gradient (2, batch, heads_kv, seq_kv, head_dim)."""
        if self._g.world_size == 1:
            return self._home
        return self._pending.result()  # type: ignore[union-attr]


class _ScatteredGrads:
    """dK/dV of every block accumulated locally, then one reduce-scatter to the owners."""

    def __init__(self, shape: torch.Size, dtype: torch.dtype, device: torch.device, g: RingGroup):
        self._g = g
        self._shape = shape
        self._all = torch.zeros((g.world_size, *shape), dtype=dtype, device=device)

    def add(self, step: int, kv_rank: int, contribution) -> None:
        if contribution is not None:
            (k0, k1), dk, dv = contribution
            self._all[kv_rank, 0, :, :, k0:k1] += dk
            self._all[kv_rank, 1, :, :, k0:k1] += dv

    def result(self) -> torch.Tensor:
        if self._g.world_size == 1:
            return self._all[0]
        flat, device = _stage(self._all.reshape(-1), self._g)
        out = _Transfer(_c10d.reduce_scatter_tensor(flat, "sum", self._g.world_size, self._g.group_name), (), device)
        return out.result().view(self._shape)


def make_grad_rotation(shape: torch.Size, dtype: torch.dtype, device: torch.device, g: RingGroup, method: str):
    """Where each step's dK/dV contribution goes; ``result()`` is the owner's total."""
    check_rotate_method(method)
    if method == "allgather":
        return _ScatteredGrads(shape, dtype, device, g)
    return _RingGrads(shape, dtype, device, g, method)
