"""Moving key/value blocks and their gradients around the ring.

Every transfer goes through the functional collectives (``torch.ops._c10d_functional``): they
are asynchronous in eager mode (the result is a tensor whose ``wait_tensor`` blocks) and
traceable by dynamo, so the same code runs eagerly and under ``torch.compile(fullgraph=True)``.

Three rotation methods:

``allgather``
    forward: one all-gather of the packed local key/value; step ``s`` reads block
    ``(rank - s) mod W``. backward: one all-gather again (keeping the gathered copy alive from
    forward to backward would cost ``W`` times the key/value memory); the dK/dV accumulators
    travel the ring by all-to-all as with ``alltoall`` (PyTorch's ring does the same). A
    reduce-scatter of every block's dK/dV would have to hold all ``W`` of them at once
    (``W * dkv``, and gloo clones its input on top) and could only start after the last step,
    exposed; its input is ``W * dkv`` bytes against ``(W - 1) * dkv`` for the ring, and gloo
    implements it as an all-reduce, which sends twice the ring's bytes. Measured with
    ci/bench_ring.py (W=4, seq 8192, causal head_tail, gloo): 1.87-2.00 s per forward+backward
    and a per-rank peak of 0.88x the single-process one with the reduce-scatter, against
    1.69 s and 0.67x with the accumulators on the ring.
``alltoall``
    one ``all_to_all_single`` per hop in which each rank sends its block to ``rank + 1`` and
    receives from ``rank - 1`` (a permutation expressed as split sizes).
``p2p``
    one batched isend/irecv pair per hop to the same neighbours (eager mode; compiled, the
    hop is an ``all_to_all_single``, see :func:`shift`).

Ring methods move key/value ``W - 1`` times in forward; in backward key/value again ``W - 1``
times and the dK/dV accumulators ``W - 1`` times: a block's accumulator starts on the rank after
its owner and its last hop brings it home, where the owner's own contribution has waited
(sending that contribution around too would cost one more hop of ``dkv`` bytes for nothing).
The next transfer is started before the current step computes.

A buffer is dropped as soon as the ring no longer needs it (the packed local key/value after
step 0, a received block once it has been passed on and used), so a rank holds one block in use
and one in flight per rotation and its memory falls like ``1/W`` (except the gathered key/value
of ``allgather``, which holds every block by design).

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
    if group is dist.GroupMember.NON_GROUP_MEMBER:
        raise ValueError(
            f"this rank (global rank {dist.get_rank() if dist.is_initialized() else '?'}) is not a member of the "
            "process group passed as group= (new_group returns GroupMember.NON_GROUP_MEMBER on the ranks it leaves "
            "out): call ring_attention only on the group's member ranks"
        )
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

    def __init__(self, received: torch.Tensor, device: torch.device | None = None, shape: torch.Size | None = None):
        self._received = received
        self._device, self._shape = device, shape
        self._done = False

    def result(self) -> torch.Tensor:
        if self._done:
            raise RuntimeError("_Transfer.result called twice")
        self._done = True
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
    # Compiled p2p goes by all_to_all_single (the same neighbour permutation). The functional
    # send ops (batch_p2p_ops, isend) leave a registry entry under the send buffer's storage
    # that never completes (torch 2.13, gloo): once that storage is reused for a receive buffer,
    # which inductor's memory planning does from W = 3 on, waiting for the receive hangs. An
    # eager repro: send x with batch_p2p_ops, wait both handles, then receive into x and wait.
    n = flat.numel()
    in_splits = [0] * g.world_size
    out_splits = [0] * g.world_size
    in_splits[(g.rank + 1) % g.world_size] = n
    out_splits[(g.rank - 1) % g.world_size] = n
    recv = _c10d.all_to_all_single(flat, out_splits, in_splits, g.group_name)
    return _Transfer(recv, device, t.shape)


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


@torch.library.custom_op("ring_impl::after", mutates_args=())
def after(x: torch.Tensor, token: torch.Tensor) -> torch.Tensor:
    """``x`` (a copy), computed only once ``token`` exists: an ordering edge compilers keep.

    Arithmetic ties such as ``x + 0 * token.sum()`` are simplified away by the joint-graph
    passes; an opaque op is not.
    """
    return x.clone()


@after.register_fake
def _(x: torch.Tensor, token: torch.Tensor) -> torch.Tensor:
    return torch.empty_like(x)


class Link:
    """The ring's transfers as one chain: one step's in flight, every rank posting the same.

    A step's outgoing payloads (``"kv"``: the key/value block passed on, ``"grad"``: a dK/dV
    accumulator passed on) are staged, then :meth:`flush` sends them: compiled, in *one*
    transfer, packed byte-wise when there are two; eager, one transfer each in a fixed order.
    :meth:`take` waits for the step's transfers and returns one payload.

    Why one chain: a compiled graph orders independent collectives as it likes, and the ranks'
    graphs differ (their causal plans do). Two streams (key/value hops and dK/dV hops) could then
    be posted in different orders on different ranks, which pairs a key/value send with a dK/dV
    receive, or deadlocks when a rank waits for a hop its neighbour posts only after waiting for
    it. With one transfer per step whose payload depends on the previous transfer (it carries
    the block that transfer brought, or is tied to it by :func:`after` under compile), the order
    of posts is the same total order on every rank.
    """

    #: payload order in a packed buffer: the accumulator (4- or 8-byte elements) first, so the
    #: key/value part starts at an offset aligned for its (no larger) element size.
    _ORDER = ("grad", "kv")

    def __init__(self, g: RingGroup, method: str):
        check_rotate_method(method)
        self._g = g
        self._method = "alltoall" if method == "allgather" else method  # allgather: grads by all-to-all
        self.carries_kv = False  # a key/value rotation posts through this link (it flushes each step)
        self._staged: dict[str, tuple[torch.Tensor, bool]] = {}
        self._pending: list[tuple[Pending, list[tuple[str, torch.Size, torch.dtype, int]]]] = []
        self._arrived: dict[str, torch.Tensor] = {}
        self._token: torch.Tensor | None = None  # the last tensor received: what the next post follows

    def follow(self, token: torch.Tensor) -> None:
        """Order the next post after ``token`` (e.g. a block that arrived by another route)."""
        self._token = token

    def stage(self, name: str, t: torch.Tensor, *, follows_token: bool = False) -> None:
        """Queue ``t`` for the next :meth:`flush`; ``follows_token``: it already depends on the
        last received tensor (a block being passed on), so needs no ordering edge."""
        assert name not in self._staged, f"Link: {name!r} staged twice"
        self._staged[name] = (t, follows_token)

    def flush(self) -> None:
        """Send what is staged (nothing staged: no transfer) to rank + 1, receive from rank - 1.

        Compiled, the payloads go packed in one transfer (the order argument above). Eager, each
        payload is its own transfer, posted in program order, which is the same on every rank:
        no packing copy (a key/value block and a dK/dV accumulator, 32 MiB per rank at W=4 and
        seq 16384 in ci/bench_ring.py).
        """
        if not self._staged:
            return
        self._land()
        parts = [(name, *self._staged[name]) for name in self._ORDER if name in self._staged]
        self._staged = {}
        compiling = torch.compiler.is_compiling()
        for group in [parts] if compiling else [[part] for part in parts]:
            layout = [(name, t.shape, t.dtype, t.numel() * t.element_size()) for name, t, _ in group]
            if len(group) == 1:
                payload = group[0][1].reshape(-1)
            else:
                payload = torch.cat([t.reshape(-1).view(torch.uint8) for _, t, _ in group])
            if compiling and self._token is not None and not all(f for _, _, f in group):
                payload = after(payload, self._token)
            self._pending.append((shift(payload, self._g, self._method), layout))

    def take(self, name: str) -> torch.Tensor:
        """The payload ``name`` of the last transfer, waiting for it if it is still in flight."""
        if name not in self._arrived:
            self._land()
        if name not in self._arrived:
            raise RuntimeError(f"Link.take({name!r}): no {name!r} payload in flight")
        return self._arrived.pop(name)

    def _land(self) -> None:
        """Wait for every transfer in flight and file its payloads under their names."""
        pending, self._pending = self._pending, []
        for transfer, layout in pending:
            buf = transfer.result().reshape(-1)
            self._token = buf
            if len(layout) == 1:
                name, shape, _, _ = layout[0]
                self._arrived[name] = buf.view(shape)
                continue
            offset = 0
            for name, shape, dtype, nbytes in layout:
                self._arrived[name] = buf[offset : offset + nbytes].view(dtype).view(shape)
                offset += nbytes


class _RingKV:
    """Key/value blocks by neighbour shifts (``alltoall`` or ``p2p``) through a :class:`Link`.

    ``block(s)`` waits for block ``s`` and, for ``s < W - 1``, passes it on at once (with
    whatever the link has staged), so the next block is in flight while step ``s`` computes.
    """

    def __init__(self, kv: torch.Tensor, g: RingGroup, link: Link):
        self._kv: torch.Tensor | None = kv
        self._g, self._link = g, link
        link.carries_kv = True

    def block(self, step: int) -> torch.Tensor:
        if step == 0:
            assert self._kv is not None, "_RingKV.block(0) called twice"
            current, self._kv = self._kv, None  # from here on the caller and the send hold it
        else:
            current = self._link.take("kv")
        if step < self._g.world_size - 1:
            self._link.stage("kv", current, follows_token=True)
        self._link.flush()
        return current


class _GatheredKV:
    """Key/value blocks from one all-gather, started before step 0 computes."""

    def __init__(self, kv: torch.Tensor, g: RingGroup, link: Link | None = None):
        self._kv: torch.Tensor | None = kv
        self._shape, self._g, self._link = kv.shape, g, link
        self._gathered: torch.Tensor | None = None
        self._pending: _Transfer | None = None
        if g.world_size > 1:
            flat, device = _stage(kv.reshape(-1), g)
            self._pending = _Transfer(_c10d.all_gather_into_tensor(flat, g.world_size, g.group_name), device)

    def block(self, step: int) -> torch.Tensor:
        if step == 0:
            assert self._kv is not None, "_GatheredKV.block(0) called twice"
            current, self._kv = self._kv, None  # the gathered copy holds this block too
            return current
        if self._gathered is None:
            self._gathered = self._pending.result().view(self._g.world_size, *self._shape)  # type: ignore[union-attr]
            self._pending = None
            if self._link is not None:
                self._link.follow(self._gathered)  # dK/dV hops come after the all-gather
        return self._gathered[(self._g.rank - step) % self._g.world_size]


def make_kv_rotation(kv: torch.Tensor, g: RingGroup, method: str, link: Link | None = None) -> _RingKV | _GatheredKV:
    """The source of each step's packed key/value block ``(2, batch, heads_kv, seq_kv, head_dim)``.

    ``link``: the backward's shared :class:`Link` (the forward makes its own).
    """
    check_rotate_method(method)
    if method == "allgather":
        return _GatheredKV(kv, g, link)
    return _RingKV(kv, g, link if link is not None else Link(g, method))


class _RingGrads:
    """dK/dV accumulators that travel with their block and come home after ``W - 1`` hops.

    At step ``s`` rank ``r`` holds block ``r - s``. A block's accumulator starts (zero) on the
    rank after its owner at step 1, collects one contribution per rank and reaches the owner
    with the hop after step ``W - 1``. The owner's own (step 0) contribution never travels: it
    is added when the accumulator is home (:meth:`result`). ``RingAttention.backward`` computes
    step 0 last for ring methods, so that contribution is not held while the others are
    computed (``allgather`` from ``W = 3`` computes it first, to overlap its all-gather, and
    holds it).

    The accumulator of step ``s`` leaves with the key/value hop posted at the start of step
    ``s + 1`` when a ring rotation shares the link, else (``allgather``) at once; the last one
    leaves at once, overlapping step 0.
    """

    def __init__(self, shape: torch.Size, dtype: torch.dtype, device: torch.device, g: RingGroup, link: Link):
        self._shape, self._dtype, self._device = shape, dtype, device
        self._g, self._link = g, link
        self._own: tuple[tuple[int, int], torch.Tensor, torch.Tensor] | None = None

    @staticmethod
    def _accumulate(acc: torch.Tensor, contribution) -> None:
        if contribution is not None:
            (k0, k1), dk, dv = contribution
            acc[0, :, :, k0:k1] += dk
            acc[1, :, :, k0:k1] += dv

    def _zeros(self) -> torch.Tensor:
        return torch.zeros(self._shape, dtype=self._dtype, device=self._device)

    def add(self, step: int, kv_rank: int, contribution: tuple[tuple[int, int], torch.Tensor, torch.Tensor] | None) -> None:
        """Add this rank's dK/dV for the step's block (None when skipped) and pass it on."""
        if step == 0:  # this rank's own block: added once the accumulator is home
            self._own = contribution
            return
        acc = self._zeros() if step == 1 else self._link.take("grad")
        self._accumulate(acc, contribution)
        self._link.stage("grad", acc)
        if step == self._g.world_size - 1 or not self._link.carries_kv:
            self._link.flush()

    def result(self) -> torch.Tensor:
        """This rank's own block gradient (2, batch, heads_kv, seq_kv, head_dim)."""
        home = self._link.take("grad") if self._g.world_size > 1 else self._zeros()
        self._accumulate(home, self._own)
        self._own = None
        return home


def make_grad_rotation(shape: torch.Size, dtype: torch.dtype, device: torch.device, g: RingGroup, method: str,
                       link: Link | None = None) -> _RingGrads:
    """Where each step's dK/dV contribution goes; ``result()`` is the owner's total.

    The accumulators travel the ring for every method; ``allgather`` moves them by all-to-all.
    """
    check_rotate_method(method)
    return _RingGrads(shape, dtype, device, g, link if link is not None else Link(g, method))
