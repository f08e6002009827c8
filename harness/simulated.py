"""The ``simulated`` launcher: a pool whose W ranks are threads of this process (W up to 64+).

``--launcher simulated`` (``RING_LAUNCHER=simulated``) runs every case the suites run on rank
processes on :class:`SimulatedPool` instead: the same rank functions, the same
:class:`~harness.context.RankContext` (its ``group`` a real ``ProcessGroup``, so the code under
test runs unchanged), the same outcomes and failures. Collectives are exact
(:mod:`harness.simulated_group`), so results equal a process pool's bit for bit (the cross-check
in ``tests/harness/test_simulated.py``). What it buys: world sizes a machine has no processes or
memory for (W=64 of tiny shapes in seconds a case, without 64 torch imports and 64 gloo meshes),
and a deadlock reported at once, with what every rank waits for.

How a case runs: each rank thread takes the world's baton, runs ``fn(ctx, ...)`` and hands the
baton over only while it waits for a peer, so one rank runs at a time and each keeps its own
generator state (see :mod:`harness.simulated_group`). Rank threads persist with the pool, as
rank processes do, so meshes and sub-groups (``ctx.device_mesh``) are made once per pool.

What it cannot do: run CUDA ranks (``--device cuda`` gets no simulated pool), compile with
torch.compile (dynamo is not thread-safe; cases marked ``compile`` are skipped, saying so), or
stop a rank stuck in computation: a case that outlives its timeout aborts the ranks waiting on
peers, reports every rank's stack and retires the pool (a stuck thread is left to end with the
process). Ranks share the process's other global state: the default dtype and the thread count.
"""

from __future__ import annotations

import sys
import threading
import time
import traceback
from queue import Empty, Queue
from typing import Any

from harness import wire
from harness.context import RankContext
from harness.errors import (
    ABORTED,
    ERROR,
    OK,
    CaseFailure,
    PoolUnavailable,
    RankOutcome,
    unfinished_outcome,
)
from harness.pool_base import CaseCall, Pool, case_failure, shutdown_pools
from harness.settings import current

__all__ = ["SimulatedPool", "shutdown_simulated_pools", "simulated_pool"]

_START_TIMEOUT_S = 120.0


class _SimContext(RankContext):
    """A rank's context in a simulated world: group creation runs without the baton (it
    rendezvouses through the store with every rank at once)."""

    def device_mesh(self, shape: tuple[int, ...], dim_names: tuple[str, ...]) -> Any:
        with self.extra["world"].released():
            return super().device_mesh(shape, dim_names)

    def subgroup(self, ranks: tuple[int, ...]) -> Any:
        with self.extra["world"].released():
            return super().subgroup(ranks)


_installed = 0  # simulated pools alive; the thread-local world is installed while there are any
_install_lock = threading.Lock()
_saved: dict[str, Any] = {}


def _install() -> None:
    """Per-thread torch.distributed worlds and group registries (what PyTorch's own threaded
    tests use), installed while any simulated pool exists."""
    import torch
    import torch.distributed as dist
    from torch.testing._internal.distributed.multi_threaded_pg import ThreadLocalWorld

    from harness.simulated_group import register_backend

    global _installed
    with _install_lock:
        if _installed == 0:
            register_backend()
            _saved["world"] = dist.distributed_c10d._world
            # (torch's private per-thread world and its switch: absent from its type stubs)
            dist.distributed_c10d._world = ThreadLocalWorld()  # type: ignore[assignment]
            torch._C._distributed_c10d._set_thread_isolation_mode(True)  # type: ignore[attr-defined]
        _installed += 1


def _uninstall() -> None:
    import torch
    import torch.distributed as dist

    global _installed
    with _install_lock:
        _installed -= 1
        if _installed == 0 and "world" in _saved:
            dist.distributed_c10d._world = _saved.pop("world")
            torch._C._distributed_c10d._set_thread_isolation_mode(False)  # type: ignore[attr-defined]


class SimulatedPool(Pool):
    """``world_size`` rank threads sharing one :class:`~harness.simulated_group.SimWorld`."""

    def __init__(self, world_size: int, device: str = "cpu"):
        if device != "cpu":
            raise PoolUnavailable(
                f"the simulated world runs CPU ranks only, not {device!r}: "
                "use --launcher pool for --device cuda"
            )
        import torch
        import torch.distributed as dist

        from harness.simulated_group import BACKEND, SimWorld

        self.world_size, self.backend, self.device = world_size, BACKEND, device
        self.cases_run = 0
        self._world = SimWorld(world_size)
        self._store = dist.HashStore()
        self._jobs: list[Queue] = [Queue() for _ in range(world_size)]
        self._results: Queue = Queue()
        self._broken = ""
        self._lock = threading.Lock()
        torch.set_num_threads(current().rank_threads)
        _install()
        self._installed = True
        self._threads = [
            threading.Thread(
                target=self._rank_main, args=(r,), daemon=True, name=f"sim-rank-{r}/{world_size}"
            )
            for r in range(world_size)
        ]
        for t in self._threads:
            t.start()
        ready = [self._results.get(timeout=_START_TIMEOUT_S) for _ in range(world_size)]
        failed = [r for r in ready if r[0] != "ready"]
        if failed:
            self.shutdown()
            raise RuntimeError(f"simulated ranks failed to start: {failed[0][2]}")

    @property
    def pids(self) -> list[int]:
        import os

        return [os.getpid()]

    # ------------------------------------------------------------------ rank side

    def _rank_main(self, rank: int) -> None:
        import torch.distributed as dist

        from harness.simulated_group import BACKEND

        world = self._world
        try:
            # The ranks join without the baton: init rendezvouses through the store.
            world.bind(rank)
            dist.init_process_group(
                BACKEND, rank=rank, world_size=self.world_size, store=self._store
            )
            ctx = _SimContext(
                rank=rank,
                world_size=self.world_size,
                group=dist.group.WORLD,
                device=_cpu(),
                backend=BACKEND,
                extra={"world": world},
            )
        except BaseException:
            self._results.put(("start_error", rank, traceback.format_exc()))
            return
        self._results.put(("ready", rank, ""))
        while True:
            job = self._jobs[rank].get()
            if job is None:
                break
            case_id, fn, args, kwargs, seed, label = job
            self._results.put(
                (case_id, rank, self._run_one(world, rank, ctx, fn, args, kwargs, seed, label))
            )
        try:
            dist.destroy_process_group()
        except Exception:
            pass

    @staticmethod
    def _run_one(
        world, rank: int, ctx: RankContext, fn, args, kwargs, seed: int, label: str
    ) -> RankOutcome:
        import torch

        from harness.rank_main import seed_everything
        from harness.simulated_group import SimAbort

        ctx.case, ctx.seed = label, seed
        start = time.perf_counter()
        world.enter(rank)
        try:
            default_dtype = torch.get_default_dtype()
            seed_everything(seed)
            try:
                value = fn(ctx, *args, **kwargs)
                return RankOutcome(
                    rank,
                    True,
                    wire.loads(wire.dumps_to_host(value)),
                    status=OK,
                    duration_s=time.perf_counter() - start,
                )
            except BaseException as exc:
                # An aborted rank was stopped where it stood: its trace is where it waited (the
                # stack a real pool samples), not an error's traceback.
                aborted, trace = isinstance(exc, SimAbort), traceback.format_exc()
                return RankOutcome(
                    rank,
                    False,
                    None,
                    "harness.Aborted" if aborted else wire.exception_type_name(exc),
                    str(exc),
                    "" if aborted else trace,
                    status=ABORTED if aborted else ERROR,
                    stack=trace if aborted else "",
                    duration_s=time.perf_counter() - start,
                )
            finally:
                torch.set_default_dtype(default_dtype)
                torch.set_grad_enabled(True)
        finally:
            world.leave(rank)

    # ------------------------------------------------------------------ pytest side

    def _execute(self, case: CaseCall) -> tuple[list[RankOutcome], CaseFailure | None]:
        fn_name, timeout = case.fn_name, case.timeout_s()
        with self._lock:
            if self._broken:
                raise PoolUnavailable(self._broken)
            self.cases_run += 1
            case_id = self.cases_run
            label = case.label(case_id)
            # The arguments travel as they would to rank processes: a copy each, never shared.
            inner = wire.dumps((case.args, case.kwargs))
            self._world.begin_case()
            for rank in range(self.world_size):
                a, k = wire.loads(inner)
                self._jobs[rank].put((case_id, case.fn, a, k, int(case.seed), label))
            outcomes: dict[int, RankOutcome] = {}
            deadline = time.monotonic() + timeout
            note = ""
            while len(outcomes) < self.world_size:
                try:
                    got = self._results.get(timeout=max(0.0, deadline - time.monotonic()))
                except Empty:
                    note = self._time_out(outcomes, timeout)
                    break
                if got[0] == case_id:
                    outcomes[got[1]] = got[2]
        ordered = [outcomes[r] for r in range(self.world_size)]
        headline = ""
        if any(o.status == ABORTED for o in ordered) and not any(
            o.status == ERROR for o in ordered
        ):
            headline = "the ranks deadlocked (" + self._world.aborted.split(": ", 1)[0] + ")"
        return ordered, case_failure(
            self, label, fn_name, ordered, timeout=timeout, note=note, headline=headline
        )

    def _time_out(self, outcomes: dict[int, RankOutcome], timeout: float) -> str:
        """Abort the ranks that wait, record every unfinished rank's stack, retire the pool."""
        frames = sys._current_frames()
        by_name = {t.name: t.ident for t in self._threads}
        self._world.abort(f"the case did not finish within {timeout:g} s")
        for rank in range(self.world_size):
            if rank in outcomes:
                continue
            frame = frames.get(by_name.get(f"sim-rank-{rank}/{self.world_size}") or -1)
            stack = "".join(traceback.format_stack(frame)) if frame is not None else "(no stack)"
            outcomes[rank] = unfinished_outcome(rank, stack, timeout=timeout)
        self._broken = (
            "a simulated pool whose case timed out is retired (a rank thread may still be "
            "computing); the next case starts a fresh one"
        )
        _forget(self)
        self.shutdown(wait=False)
        return "the simulated pool was retired; the next case starts a fresh one"

    def shutdown(self, wait: bool = True) -> None:
        """Stop the rank threads (``wait``: join them; a retired pool's may be stuck) and, with
        the last simulated pool, restore torch.distributed's process-wide state."""
        for q in self._jobs:
            q.put(None)
        if wait:
            for t in self._threads:
                t.join(5.0)
        if self._installed:
            self._installed = False
            _uninstall()


def _cpu():
    import torch

    return torch.device("cpu")


_pools: dict[int, SimulatedPool] = {}
_registry_lock = threading.Lock()


def _forget(pool: SimulatedPool) -> None:
    with _registry_lock:
        for key, p in list(_pools.items()):
            if p is pool:
                del _pools[key]


def simulated_pool(
    world_size: int, backend: str = "simulated", device: str = "cpu"
) -> SimulatedPool:
    """This process's simulated pool of ``world_size`` ranks, started on first use and cached.
    ``backend`` is ignored: the ranks' process group is always the simulated one."""
    with _registry_lock:
        pool = _pools.get(world_size)
        if pool is None:
            pool = _pools[world_size] = SimulatedPool(world_size, device)
        elif device != "cpu":
            raise PoolUnavailable(
                f"the simulated world runs CPU ranks only, not {device!r}: "
                "use --launcher pool for --device cuda"
            )
        return pool


def shutdown_simulated_pools() -> None:
    """Stop every simulated pool of this process; safe to call more than once."""
    shutdown_pools(_pools, _registry_lock)
