"""The ring's transfers: what moves a tensor to the next rank, and the backward's one chain of them.

Every transfer goes through the functional collectives (``torch.ops._c10d_functional``) or, for
eager p2p, c10d's batched isend/irecv: asynchronous (the result is waited for when needed) and,
for the functional ones, traceable by dynamo, so the same code runs eagerly and under
``torch.compile(fullgraph=True)``.

A *hop* sends a tensor to rank + 1 while receiving the same shape from rank - 1
(:func:`alltoall_hop`, :func:`p2p_hop`). A :class:`Link` chains a pass's hops so every rank posts
them in one order, whatever order its compiled graph prefers.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

import torch
import torch.distributed as dist

from ..group import RingGroup

__all__ = [
    "Hop",
    "Link",
    "Pending",
    "Transfer",
    "after",
    "alltoall_hop",
    "p2p_hop",
    "stage_on_host",
]

_c10d = torch.ops._c10d_functional


def _wait(t: torch.Tensor) -> torch.Tensor:
    return _c10d.wait_tensor(t)


class Pending(Protocol):
    """A transfer in flight; ``result()`` waits for it and returns the received tensor."""

    def result(self) -> torch.Tensor: ...


class Transfer:
    """A functional-collective transfer in flight."""

    def __init__(
        self,
        received: torch.Tensor,
        device: torch.device | None = None,
        shape: torch.Size | None = None,
    ):
        self._received = received
        self._device, self._shape = device, shape
        self._done = False

    def result(self) -> torch.Tensor:
        if self._done:
            raise RuntimeError("Transfer.result called twice")
        self._done = True
        out = _wait(self._received)
        out = out if self._device is None else out.to(self._device)
        return out if self._shape is None else out.view(self._shape)


class Staging(Protocol):
    """A group that says whether its collectives run on host copies (a RingGroup, a
    ring_impl.exchanges HeadGroup: gloo with CUDA tensors)."""

    @property
    def stage_on_host(self) -> bool: ...


def stage_on_host(t: torch.Tensor, g: Staging) -> tuple[torch.Tensor, torch.device | None]:
    if g.stage_on_host:
        return t.cpu(), t.device
    return t, None


class _WorkTransfer:
    """An eager c10d transfer: waits its works; keeps the send buffer alive until then."""

    def __init__(
        self,
        recv: torch.Tensor,
        works,
        send_buf: torch.Tensor,
        device: torch.device | None,
        shape: torch.Size,
    ):
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


#: A hop: start sending a tensor to rank + 1 while receiving the same shape from rank - 1.
Hop = Callable[[torch.Tensor, RingGroup], Pending]


def alltoall_hop(t: torch.Tensor, g: RingGroup) -> Pending:
    """One ``all_to_all_single`` in which each rank sends ``t`` to rank + 1 and receives from
    rank - 1 (a permutation expressed as split sizes)."""
    flat, device = stage_on_host(t.reshape(-1), g)
    n = flat.numel()
    in_splits = [0] * g.world_size
    out_splits = [0] * g.world_size
    in_splits[(g.rank + 1) % g.world_size] = n
    out_splits[(g.rank - 1) % g.world_size] = n
    recv = _c10d.all_to_all_single(flat, out_splits, in_splits, g.group_name)
    return Transfer(recv, device, t.shape)


def p2p_hop(t: torch.Tensor, g: RingGroup) -> Pending:
    """One batched isend/irecv pair to the neighbours (eager); compiled, an all-to-all hop.

    Eager p2p goes through c10d directly: the functional batch_p2p_ops leaves one entry per call
    in c10d's work registry even when both outputs are waited (torch 2.13). Compiled p2p goes by
    all_to_all_single (the same neighbour permutation): the functional send ops (batch_p2p_ops,
    isend) leave a registry entry under the send buffer's storage that never completes (torch
    2.13, gloo); once that storage is reused for a receive buffer, which inductor's memory
    planning does from W = 3 on, waiting for the receive hangs. An eager repro: send x with
    batch_p2p_ops, wait both handles, then receive into x and wait.
    """
    if torch.compiler.is_compiling():
        return alltoall_hop(t, g)
    flat, device = stage_on_host(t.reshape(-1), g)
    recv = torch.empty_like(flat)
    works = dist.batch_isend_irecv(
        [
            dist.P2POp(dist.isend, flat, g.next_global, g.pg),
            dist.P2POp(dist.irecv, recv, g.prev_global, g.pg),
        ]
    )
    return _WorkTransfer(recv, works, flat, device, t.shape)


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

    def __init__(self, g: RingGroup, hop: Hop):
        self._g, self._hop = g, hop
        self._staged: dict[str, tuple[torch.Tensor, bool]] = {}
        self._pending: list[tuple[Pending, list[tuple[str, torch.Size, torch.dtype, int]]]] = []
        self._arrived: dict[str, torch.Tensor] = {}
        self._token: torch.Tensor | None = (
            None  # the last tensor received: what the next post follows
        )

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
        seq 16384 in benchmarks/ring.py).
        """
        if not self._staged:
            return
        self._land()
        parts = [(name, *self._staged[name]) for name in self._ORDER if name in self._staged]
        self._staged = {}
        compiling = torch.compiler.is_compiling()
        for group in [parts] if compiling else [[part] for part in parts]:
            layout = [
                (name, t.shape, t.dtype, t.numel() * t.element_size()) for name, t, _ in group
            ]
            if len(group) == 1:
                payload = group[0][1].reshape(-1)
            else:
                payload = torch.cat([t.reshape(-1).view(torch.uint8) for _, t, _ in group])
            if compiling and self._token is not None and not all(f for _, _, f in group):
                payload = after(payload, self._token)
            self._pending.append((self._hop(payload, self._g), layout))

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
