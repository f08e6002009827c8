"""The simulated world's process group: every rank a thread of this process, collectives exact.

:class:`SimWorld` is what the W rank threads of one simulated pool share: a lock that is the
*baton* (the one rank that runs holds it; a rank gives it up only while it waits for a peer), the
collectives in progress and the point-to-point messages in flight. :class:`SimGroup` is a
``torch.distributed.ProcessGroup`` written in Python (backend name ``"simulated"``): each rank
thread holds its own group object, and a collective is complete when every member rank has
joined it; the last to join computes it for all of them, exactly (copies, and sums in the
tensors' own dtype in rank order).

Why one rank at a time: ranks are threads, so Python state that a real rank keeps per process
(module caches, the global random generators) is shared. With the baton, a rank's code between
two collectives runs without another rank interleaving, each rank keeps its own torch and Python
generator states across hand-overs (saved and restored as the baton passes; numpy's is shared),
and a deadlock is seen at once: a
rank that is about to wait while no rank can run any more (every unfinished rank waits for
something no rank will send) aborts the case, naming what every rank waits for.

What it serves: the functional collectives (``torch.ops._c10d_functional``: all_gather_into_tensor,
all_to_all_single, all_reduce, broadcast) through the Python ``ProcessGroup`` methods PyTorch's
trampolines call, and eager ``torch.distributed`` calls (all_reduce, all_gather, all_to_all,
broadcast, barrier, reduce_scatter, isend/irecv and batch_isend_irecv, new_group and DeviceMesh
over the world). Eager calls on a Python process group never reach the
dispatcher, where :class:`harness.accounting.CollectiveLog` listens: the group reports them to
the rank's active logs itself, with the arguments of the c10d op a native backend would run.
Functional collectives reach the dispatcher already, and a log is off its own thread's mode stack
while the op it intercepted runs, so nothing is counted twice.

A collective whose kind or size differs between ranks (a native backend hangs or corrupts
memory) raises on every member, naming each rank's call. Not served: the functional
reduce_scatter_tensor (its C++ path calls a ProcessGroup method Python cannot override) and the
functional point-to-point ops; both fail with "No backend type associated with device type cpu".
"""

from __future__ import annotations

import contextlib
import random
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch.futures import Future

__all__ = ["BACKEND", "SimAbort", "SimGroup", "SimWorld", "current_world"]

BACKEND = "simulated"


class SimAbort(RuntimeError):
    """Raised on a rank that waits in an aborted case (a deadlock, a timeout, a mismatch)."""


@dataclass
class _Collective:
    """One collective on one group, by sequence number: each member's call, then the result."""

    kind: str
    size: int
    calls: dict[int, tuple[str, Any]] = field(default_factory=dict)  # group rank -> (kind, data)
    done: bool = False
    error: str = ""
    readers: int = 0  # members that have returned from it (the last one forgets it)


_local = threading.local()  # .world: the SimWorld of this rank thread; .rank: its global rank


def current_world() -> SimWorld | None:
    """The simulated world of the calling rank thread (None outside one)."""
    return getattr(_local, "world", None)


class SimWorld:
    """State the rank threads of one simulated pool share (see the module docstring)."""

    def __init__(self, world_size: int):
        self.world_size = world_size
        lock = threading.RLock()
        self.baton = threading.Condition(lock)
        # One condition per rank on the baton's lock: a change wakes only the ranks it lets go on
        # (notify_all on one condition would wake all W waiters, W times per ring step).
        self._wakeup = [threading.Condition(lock) for _ in range(world_size)]
        self.aborted = ""
        self._collectives: dict[tuple[str, int], _Collective] = {}
        self._issued: dict[tuple[str, int], int] = {}  # (group, group rank) -> collectives issued
        self._mail: dict[tuple, torch.Tensor] = {}  # (group, src, dst, tag, n) -> payload
        self._posted: dict[tuple, int] = {}  # (group, src, dst, tag, "send"|"recv") -> count
        self._active: set[int] = set()
        self._waiting: dict[int, tuple[Callable[[], bool], str]] = {}
        self._released: set[int] = set()
        self._rng: dict[int, tuple[torch.Tensor, Any]] = {}

    # ------------------------------------------------------------------ cases

    def begin_case(self) -> None:
        """Forget the previous case's state (an aborted case leaves calls half joined)."""
        with self.baton:
            self.aborted = ""
            self._collectives.clear()
            self._issued.clear()
            self._mail.clear()
            self._posted.clear()
            self._waiting.clear()
            self._released.clear()
            self._active = set(range(self.world_size))

    def bind(self, rank: int) -> None:
        """Make the calling thread ``rank`` of this world (its groups join this world)."""
        _local.world, _local.rank = self, rank

    def enter(self, rank: int) -> None:
        """Bind the calling thread to ``rank`` and take the baton."""
        self.bind(rank)
        self.baton.acquire()

    def leave(self, rank: int) -> None:
        """The rank's case is over: give the baton up (and see whether the others can go on)."""
        self._active.discard(rank)
        self._rng.pop(rank, None)
        if self.aborted:
            self._abort(self.aborted)
        self._check_progress()
        self.baton.release()

    def abort(self, why: str) -> None:
        """Abort the case from outside the ranks (the pool's timeout). A rank may be computing
        with the baton held: then the flag alone is set, and the ranks see it as they wait."""
        if not self.aborted:
            self.aborted = why
        if self.baton.acquire(timeout=1.0):
            try:
                self._abort(why)
            finally:
                self.baton.release()

    def _abort(self, why: str) -> None:
        if not self.aborted:
            self.aborted = why
        for cond in self._wakeup:
            cond.notify()

    def _wake(self) -> None:
        """Wake the waiting ranks whose wait is over (call under the baton after a change)."""
        for rank, (ready, _) in list(self._waiting.items()):
            if ready():
                self._wakeup[rank].notify()

    @contextlib.contextmanager
    def released(self) -> Iterator[None]:
        """Run the block without the baton, beside the other ranks (for calls that rendezvous
        through the store, such as new_group and DeviceMesh creation)."""
        rank = _local.rank
        self._released.add(rank)
        self._save_rng(rank)
        self.baton.release()
        try:
            yield
        finally:
            self.baton.acquire()
            self._released.discard(rank)
            self._restore_rng(rank)

    def wait_until(self, ready: Callable[[], bool], what: str) -> None:
        """Give up the baton until ``ready()`` (evaluated under the baton); ``what`` names the
        wait in a deadlock report. Raises :class:`SimAbort` when the case is aborted."""
        rank = _local.rank
        if ready():
            return
        if self.aborted:
            self._abort(self.aborted)  # wake the ranks an outside abort could not reach
        self._waiting[rank] = (ready, what)
        self._save_rng(rank)
        try:
            self._check_progress()
            while not (self.aborted or ready()):
                self._wakeup[rank].wait()
        finally:
            del self._waiting[rank]
            self._restore_rng(rank)
        if self.aborted and not ready():
            raise SimAbort(
                f"rank {rank} was waiting for {what} when the case was aborted: {self.aborted}"
            )

    def _check_progress(self) -> None:
        """Abort when no unfinished rank can run: each waits for what no rank will do."""
        if self.aborted or not self._active:
            return
        runnable = [r for r in self._active if r not in self._waiting or self._waiting[r][0]()]
        if runnable:
            return
        finished = sorted(set(range(self.world_size)) - self._active)
        lines = [f"rank {r} waits for {self._waiting[r][1]}" for r in sorted(self._waiting)]
        self._abort(
            "deadlock: every unfinished rank waits for a peer"
            + (f" (ranks {finished} have finished the case)" if finished else "")
            + "; "
            + "; ".join(lines)
        )

    def _save_rng(self, rank: int) -> None:
        self._rng[rank] = (torch.get_rng_state(), random.getstate())

    def _restore_rng(self, rank: int) -> None:
        kept = self._rng.pop(rank, None)
        if kept is not None:
            torch.set_rng_state(kept[0])
            random.setstate(kept[1])

    # ------------------------------------------------------------------ collectives

    def collective(
        self,
        group: str,
        group_rank: int,
        size: int,
        kind: str,
        data: Any,
        compute: Callable[[dict[int, Any]], None],
    ) -> None:
        """Join collective number n of ``group`` (n = how many this rank issued on it before);
        the last member to join runs ``compute`` over every member's data; all return once done."""
        key = (group, group_rank)
        n = self._issued.get(key, 0)
        self._issued[key] = n + 1
        slot = self._collectives.setdefault((group, n), _Collective(kind, size))
        slot.calls[group_rank] = (kind, data)
        if len(slot.calls) == size and not slot.done:
            kinds = {k for k, _ in slot.calls.values()}
            if len(kinds) > 1:
                slot.error = (
                    f"collective #{n} on group {group!r} differs between ranks: "
                    + ", ".join(f"rank {r} {k}" for r, (k, _) in sorted(slot.calls.items()))
                )
            else:
                try:
                    compute({r: d for r, (_, d) in slot.calls.items()})
                except Exception as exc:  # a size mismatch: every member raises it
                    slot.error = f"{kind} #{n} on group {group!r}: {type(exc).__name__}: {exc}"
            slot.done = True
            self._wake()
        self.wait_until(
            lambda: slot.done,
            f"{kind} #{n} on group {group!r} "
            f"(joined by group ranks {sorted(slot.calls)} of {size})",
        )
        slot.readers += 1
        if slot.readers == size:
            del self._collectives[(group, n)]
        if slot.error:
            raise RuntimeError(f"simulated {slot.error}")

    # ------------------------------------------------------------------ point to point

    def send(self, group: str, src: int, dst: int, tag: int, payload: torch.Tensor) -> None:
        n = self._next(group, src, dst, tag, "send")
        self._mail[(group, src, dst, tag, n)] = payload
        self._wake()

    def post_recv(self, group: str, src: int, dst: int, tag: int) -> tuple:
        return (group, src, dst, tag, self._next(group, src, dst, tag, "recv"))

    def take(self, key: tuple) -> torch.Tensor:
        self.wait_until(
            lambda: key in self._mail,
            f"receive #{key[4]} from group rank {key[1]} (tag {key[3]}) on group {key[0]!r}",
        )
        return self._mail.pop(key)

    def _next(self, *key: Any) -> int:
        n = self._posted.get(key, 0)
        self._posted[key] = n + 1
        return n


# ---------------------------------------------------------------------- the process group


def _done(result: Any = None) -> dist.Work:
    fut: Future = Future()
    fut.set_result(result)
    # (private in torch's type stubs; the public way, Work.get_future, goes the other way)
    return torch._C._distributed_c10d._create_work_from_future(fut)  # type: ignore[attr-defined]


class _RecvWork(dist.Work):
    """An irecv: the payload is copied in when it is waited for."""

    def __init__(self, world: SimWorld, key: tuple, tensor: torch.Tensor):
        super().__init__()
        self._world, self._key, self._tensor, self._done = world, key, tensor, False

    def wait(self, timeout: Any = None) -> bool:
        if not self._done:
            payload = self._world.take(self._key)
            with torch.no_grad():
                self._tensor.detach().copy_(payload.view_as(self._tensor))
            self._done = True
        return True

    def is_completed(self) -> bool:
        return self._done


def _report(op: str, *args: Any) -> None:
    """Tell the rank's active CollectiveLogs about an eager call (see the module docstring)."""
    from torch.utils._python_dispatch import _get_current_dispatch_mode_stack

    from harness.accounting import CollectiveLog

    for mode in _get_current_dispatch_mode_stack():
        if isinstance(mode, CollectiveLog):
            mode.note(op, args, op=op.replace("::", ".") + ".default")


def _splits(total: int, sizes: list[int] | None, world: int) -> list[int]:
    """Start offsets (world + 1 of them) of all_to_all_single's split sizes."""
    sizes = list(sizes) if sizes else [total // world] * world
    out = [0]
    for s in sizes:
        out.append(out[-1] + int(s))
    return out


_REDUCE = {
    dist.ReduceOp.SUM: lambda ts: _fold(ts, torch.add),
    dist.ReduceOp.MAX: lambda ts: _fold(ts, torch.maximum),
    dist.ReduceOp.MIN: lambda ts: _fold(ts, torch.minimum),
    dist.ReduceOp.PRODUCT: lambda ts: _fold(ts, torch.mul),
    dist.ReduceOp.BAND: lambda ts: _fold(ts, torch.bitwise_and),
    dist.ReduceOp.BOR: lambda ts: _fold(ts, torch.bitwise_or),
    dist.ReduceOp.BXOR: lambda ts: _fold(ts, torch.bitwise_xor),
}


def _fold(tensors: list[torch.Tensor], op: Callable) -> torch.Tensor:
    out = tensors[0].clone()
    for t in tensors[1:]:
        out = op(out, t)
    return out


def _reduce(op: Any, tensors: list[torch.Tensor]) -> torch.Tensor:
    kind = getattr(op, "op", op)
    if kind == dist.ReduceOp.AVG:
        return _REDUCE[dist.ReduceOp.SUM](tensors) / len(tensors)
    if kind not in _REDUCE:
        raise NotImplementedError(
            f"reduce op {op} is not simulated; use SUM, AVG, MAX, MIN, PRODUCT or a bitwise op"
        )
    return _REDUCE[kind](tensors)


class SimGroup(dist.ProcessGroup):
    """One rank's view of a simulated process group (see the module docstring)."""

    def __init__(self, rank: int, world_size: int):
        super().__init__(rank, world_size)  # type: ignore[call-arg]  # (the store-less overload)
        self._rank, self._size = rank, world_size
        world = current_world()
        if world is None:
            raise RuntimeError(
                "a 'simulated' process group exists only on a rank thread of a simulated pool "
                "(harness.simulated); use --launcher simulated"
            )
        self._world = world
        self._ctx = torch.autograd.set_multithreading_enabled(False)

    # identity
    def size(self) -> int:
        return self._size

    def getBackendName(self) -> str:
        return BACKEND

    @property
    def group_name(self) -> str:  # type: ignore[override]  # (a property, as torch reads it)
        return dist.distributed_c10d._world.pg_names[self]

    @property
    def pg_name(self) -> str:
        return self.group_name

    def __repr__(self) -> str:
        return f"SimGroup(rank={self._rank}, size={self._size})"

    def _run(self, kind: str, data: Any, compute: Callable[[dict[int, Any]], None]) -> dist.Work:
        self._world.collective(self.group_name, self._rank, self._size, kind, data, compute)
        return _done(
            data
            if isinstance(data, list) and all(isinstance(t, torch.Tensor) for t in data)
            else None
        )

    # collectives (names as PyTorch's ProcessGroup trampolines call them)
    def allreduce(self, tensors, opts=None):
        _report("c10d::allreduce_", tensors, self)
        op = opts.reduceOp if opts is not None else dist.ReduceOp.SUM

        @torch.no_grad()
        def compute(data):
            for i in range(len(data[0])):
                total = _reduce(op, [data[r][i].detach() for r in range(self._size)])
                for r in range(self._size):
                    data[r][i].detach().copy_(total)

        return self._run("all_reduce", tensors, compute)

    def allreduce_coalesced(self, tensors, opts=None):
        return self.allreduce(tensors, opts)

    def barrier(self, opts=None):
        _report("c10d::barrier", None, self)
        return self._run("barrier", None, lambda data: None)

    def allgather(self, output_tensors, input_tensors, opts=None):
        _report("c10d::allgather_", output_tensors, input_tensors, self)

        @torch.no_grad()
        def compute(data):
            for dst in range(self._size):
                for src in range(self._size):
                    data[dst][0][0][src].detach().copy_(data[src][1][0])

        return self._run("all_gather", (output_tensors, input_tensors), compute)

    def all_gather_single(self, output_tensor, input_tensor, opts=None):
        _report("c10d::_allgather_base_", output_tensor, input_tensor, self)
        n = input_tensor.shape[0] if input_tensor.dim() else 1

        @torch.no_grad()
        def compute(data):
            for dst in range(self._size):
                out = (
                    data[dst][0].view(-1, *data[dst][0].shape[1:])
                    if data[dst][0].dim()
                    else data[dst][0]
                )
                for src in range(self._size):
                    out[src * n : (src + 1) * n].detach().copy_(data[src][1])

        return self._run("all_gather", (output_tensor, input_tensor), compute)

    def _allgather_base(self, output_tensor, input_tensor, opts=None):
        return self.all_gather_single(output_tensor, input_tensor, opts)

    def all_gather_single_coalesced(self, output_tensors, input_tensors, opts=None):
        work = None
        for out, inp in zip(output_tensors, input_tensors, strict=True):
            work = self.all_gather_single(out, inp, opts)
        return work

    def all_to_all_single(
        self, output_tensor, input_tensor, output_split_sizes, input_split_sizes, opts=None
    ):
        _report("c10d::alltoall_base_", output_tensor, input_tensor, self)

        @torch.no_grad()
        def compute(data):
            w = self._size
            outs = {r: _splits(data[r][0].shape[0], data[r][2], w) for r in range(w)}
            ins = {r: _splits(data[r][1].shape[0], data[r][3], w) for r in range(w)}
            for dst in range(w):
                for src in range(w):
                    o0, o1 = outs[dst][src], outs[dst][src + 1]
                    i0, i1 = ins[src][dst], ins[src][dst + 1]
                    if o1 - o0 != i1 - i0:
                        got, sent = o1 - o0, i1 - i0
                        why = f"rank {dst} expects {got} rows from rank {src}, which sends {sent}"
                        raise ValueError(why)
                    if o1 > o0:
                        data[dst][0][o0:o1].detach().copy_(data[src][1][i0:i1])

        return self._run(
            "all_to_all",
            (output_tensor, input_tensor, output_split_sizes, input_split_sizes),
            compute,
        )

    def alltoall_base(
        self, output_tensor, input_tensor, output_split_sizes, input_split_sizes, opts=None
    ):
        return self.all_to_all_single(
            output_tensor, input_tensor, output_split_sizes, input_split_sizes, opts
        )

    def alltoall(self, output_tensors, input_tensors, opts=None):
        _report("c10d::alltoall_", output_tensors, input_tensors, self)

        @torch.no_grad()
        def compute(data):
            for dst in range(self._size):
                for src in range(self._size):
                    data[dst][0][src].detach().copy_(data[src][1][dst])

        return self._run("all_to_all", (output_tensors, input_tensors), compute)

    def broadcast(self, tensors, opts=None):
        _report("c10d::broadcast_", tensors, self)
        root = opts.rootRank if opts is not None else 0

        @torch.no_grad()
        def compute(data):
            for i, t in enumerate(data[root]):
                for r in range(self._size):
                    if r != root:
                        data[r][i].detach().copy_(t)

        return self._run("broadcast", tensors, compute)

    def reduce_scatter(self, output_tensors, input_tensors, opts=None):
        _report("c10d::reduce_scatter_", output_tensors, input_tensors, self)
        op = opts.reduceOp if opts is not None else dist.ReduceOp.SUM

        @torch.no_grad()
        def compute(data):
            for dst in range(self._size):
                total = _reduce(op, [data[src][1][0][dst].detach() for src in range(self._size)])
                data[dst][0][0].detach().copy_(total)

        return self._run("reduce_scatter", (output_tensors, input_tensors), compute)

    def reduce_scatter_single(self, output_tensor, input_tensor, opts=None):
        _report("c10d::_reduce_scatter_base_", output_tensor, input_tensor, self)
        chunks = list(torch.chunk(input_tensor, self._size))
        op = opts.reduceOp if opts is not None else dist.ReduceOp.SUM

        @torch.no_grad()
        def compute(data):
            for dst in range(self._size):
                data[dst][0].detach().copy_(
                    _reduce(op, [data[src][1][dst].detach() for src in range(self._size)])
                )

        return self._run("reduce_scatter", (output_tensor, chunks), compute)

    def _reduce_scatter_base(self, output_tensor, input_tensor, opts=None):
        return self.reduce_scatter_single(output_tensor, input_tensor, opts)

    # point to point
    def send(self, tensors, dst, tag=0):
        _report("c10d::send", tensors, self, dst, tag)
        (tensor,) = tensors
        self._world.send(self.group_name, self._rank, dst, tag, tensor.detach().clone())
        return _done(tensors)

    def recv(self, tensors, src, tag=0):
        _report("c10d::recv_", tensors, self, src, tag)
        (tensor,) = tensors
        return _RecvWork(
            self._world, self._world.post_recv(self.group_name, src, self._rank, tag), tensor
        )


def _create_group(prefix_store, rank: int, world_size: int, timeout) -> SimGroup:
    return SimGroup(rank, world_size)


def register_backend() -> None:
    """Make ``init_process_group("simulated", ...)`` and ``new_group`` build :class:`SimGroup`s."""
    if not hasattr(dist.Backend, BACKEND.upper()):
        dist.Backend.register_backend(BACKEND, _create_group, devices=["cpu"])
