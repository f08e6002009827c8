"""Rank pools (parent side): persistent rank processes that run one case after another.

``rank_pool(world_size, backend, device)`` (behind :func:`harness.get_pool`) returns the pool for
that key, starting it the first time; it is cached for the life of the process (one per pytest or
xdist worker) and reused by every case. A case is ``pool.run(fn, *args, timeout=None, seed=0,
**kwargs)``: ``fn(ctx, *args, **kwargs)`` runs on every rank and the per-rank return values come
back (index = rank).

Why it is fast: ranks are forked from multiprocessing's forkserver, which imports torch once for
the whole process (:mod:`harness.rank_start`); a pool start is then one fork plus a FileStore
rendezvous per rank, and a case is one pickled message to each rank and one back.

What happens when a case fails (see :mod:`harness.errors` for the statuses; the waiting is
:func:`harness.waiting.gather`):

* a rank raises: the others get ``grace`` seconds to finish (they may be blocked in a collective
  the failed rank never joined); ranks still running then have their Python stacks dumped
  (:mod:`harness.stacks`) and the pool is killed and rebuilt before the next case. When every
  rank reported, one probe all_reduce checks the process group still agrees; if so the pool is
  kept (so bad-input tests where every rank raises cost nothing), otherwise it is rebuilt;
* a rank dies: the case fails with :class:`RankCrashed` naming the exit status and the rank's
  last output; the pool is rebuilt;
* the case outlives its timeout: every unfinished rank's stack is dumped, :class:`CaseTimeout`
  is raised, the pool is rebuilt.

The rendezvous is a FileStore in a private temporary directory (a fresh file per start), so pools
of concurrent xdist workers or concurrent pytest runs never meet; gloo is told to listen on the
loopback interface only.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import sys
import tempfile
import threading
import time
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

from harness import wire
from harness.devices import rank_devices, shares_gpus, visible_gpu_count, worker_gpus, xdist_worker
from harness.errors import (
    ABORTED,
    CRASHED,
    ERROR,
    OK,
    TIMEOUT,
    CaseFailure,
    PoolStartError,
    RankOutcome,
    unfinished_outcome,
)
from harness.pool_base import CaseCall, Pool, case_failure, shutdown_pools
from harness.procs import install_parent_hooks, pid_alive, signal_name
from harness.rank_output import RankOutput
from harness.rank_start import mp_context, rank_env
from harness.settings import BACKENDS, DEVICES, RANK_STARTS, current
from harness.stacks import dump_stacks
from harness.waiting import gather

__all__ = ["RankPool", "active_pools", "rank_pool", "shutdown_rank_pools"]

_START_TIMEOUT_S = 180.0
_PROBE_TIMEOUT_S = 5.0
_STOP_TIMEOUT_S = 5.0
# Process-group timeout inside the ranks: the harness enforces case timeouts itself by killing
# ranks, so the backend's own timeout only has to be longer than any case.
_PG_TIMEOUT_S = 3600.0

_TMP_PREFIX = "ring-harness-"
_stale_checked = False


def _remove_stale_tmp_dirs() -> None:
    """Remove pool directories whose owning process is gone (it was SIGKILLed: no cleanup ran).

    Runs once per process. Directory names carry the owner's pid: ``ring-harness-<pid>-w<W>-*``.
    """
    global _stale_checked
    if _stale_checked:
        return
    _stale_checked = True
    root = tempfile.gettempdir()
    try:
        names = os.listdir(root)
    except OSError:
        return
    for name in names:
        owner = name[len(_TMP_PREFIX) :].split("-", 1)[0] if name.startswith(_TMP_PREFIX) else ""
        if owner.isdigit() and not pid_alive(int(owner)):
            shutil.rmtree(os.path.join(root, name), ignore_errors=True)


@contextlib.contextmanager
def _environ(extra: Mapping[str, str]) -> Iterator[None]:
    """``extra`` in this process's environment for the duration (a spawned rank inherits it)."""
    saved = {key: os.environ.get(key) for key in extra}
    os.environ.update(extra)
    try:
        yield
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


class RankPool(Pool):
    """``world_size`` rank processes sharing one process group, reused across cases.

    Use :func:`harness.get_pool` rather than constructing one: it caches pools per process and
    makes sure they are shut down at exit. ``case_timeout``, ``rank_threads``, ``grace`` and
    ``rank_start`` default to the installed :mod:`harness.settings` (set by the pytest options)
    at the time of each case or start.

    ``env``: variables added to the ranks' environment. With ``rank_start="spawn"`` they are in
    place when each rank's interpreter starts, so they reach what the C library reads at process
    start (glibc's ``MALLOC_*`` settings); a forked rank gets them only once it runs.
    """

    def __init__(
        self,
        world_size: int,
        backend: str,
        device: str,
        *,
        case_timeout: float | None = None,
        rank_threads: int | None = None,
        grace: float | None = None,
        start_timeout: float = _START_TIMEOUT_S,
        rank_start: str | None = None,
        env: Mapping[str, str] | None = None,
    ) -> None:
        if not isinstance(world_size, int) or world_size < 1:
            raise ValueError(f"world_size must be a positive int, got {world_size!r}")
        if backend not in BACKENDS:
            raise ValueError(f"backend must be one of {', '.join(BACKENDS)}, got {backend!r}")
        if device not in DEVICES:
            raise ValueError(f"device must be one of {', '.join(DEVICES)}, got {device!r}")
        if backend == "nccl" and device != "cuda":
            raise ValueError("backend 'nccl' needs device 'cuda'; use backend 'gloo' for CPU ranks")
        if rank_start is not None and rank_start not in RANK_STARTS:
            raise ValueError(
                f"rank_start must be one of {', '.join(RANK_STARTS)}, got {rank_start!r}"
            )
        self.world_size = world_size
        self.backend = backend
        self.device = device
        self.case_timeout = case_timeout
        self.rank_threads = rank_threads
        self.grace = grace
        self.start_timeout = start_timeout
        self.rank_start = rank_start
        self.env = dict(env or {})
        gpus = worker_gpus(visible_gpu_count(), *xdist_worker()) if device == "cuda" else []
        self.rank_devices = rank_devices(world_size, backend, device, gpus, xdist_worker())
        self.starts = 0
        self.cases_run = 0
        self.last_start_s = 0.0
        self._lock = threading.RLock()
        self._procs: list[Any] = []
        self._conns: list[Any] = []
        self._pids: list[int] = []
        self._tmp_dir: str | None = None
        self._output = RankOutput([])
        self._healthy = False
        self._case_counter = 0

    # ------------------------------------------------------------------ lifecycle

    def __repr__(self) -> str:
        state = "running" if self._healthy else "stopped"
        return (
            f"RankPool(world_size={self.world_size}, {self.backend}/{self.device}, {state}, "
            f"pids={self._pids})"
        )

    @property
    def pids(self) -> list[int]:
        """Process ids of the ranks (index = rank); empty while stopped."""
        return list(self._pids)

    @property
    def running(self) -> bool:
        return self._healthy

    def _paths(self, rank: int) -> tuple[str, str]:
        assert self._tmp_dir is not None
        return (
            os.path.join(self._tmp_dir, f"rank{rank}.log"),
            os.path.join(self._tmp_dir, f"rank{rank}.stack"),
        )

    def start(self) -> None:
        """Start the rank processes and wait until they formed their process group."""
        with self._lock:
            if self._healthy:
                return
            self._kill()
            self._remove_tmp_dir()
            began = time.monotonic()
            self._start_processes()
            self.last_start_s = time.monotonic() - began
            self.starts += 1

    def _start_processes(self) -> None:
        from harness.rank_main import RankBoot, main

        method = self.rank_start or current().rank_start
        ctx: Any = mp_context(method)
        _remove_stale_tmp_dirs()
        self._tmp_dir = tempfile.mkdtemp(prefix=f"{_TMP_PREFIX}{os.getpid()}-w{self.world_size}-")
        store_path = os.path.join(self._tmp_dir, "store")
        threads = self.rank_threads or current().rank_threads
        spawned_env = (
            _environ(self.env) if method == "spawn" and self.env else contextlib.nullcontext()
        )
        with spawned_env:
            for rank in range(self.world_size):
                log_path, stack_path = self._paths(rank)
                boot = RankBoot(
                    rank=rank,
                    world_size=self.world_size,
                    backend=self.backend,
                    device=self.rank_devices[rank],
                    store_path=store_path,
                    owner_pid=os.getpid(),
                    env=rank_env(rank, self.world_size, self.env),
                    sys_path=list(sys.path),
                    cwd=os.getcwd(),
                    rank_threads=threads,
                    stack_path=stack_path,
                    log_path=log_path,
                    tmp_dir=self._tmp_dir,
                    pg_timeout_s=_PG_TIMEOUT_S,
                )
                parent_end, child_end = ctx.Pipe(duplex=True)
                proc = ctx.Process(
                    target=main, args=(child_end, boot), name=f"ring-rank{rank}", daemon=True
                )
                proc.start()
                child_end.close()
                self._procs.append(proc)
                self._conns.append(parent_end)
        self._pids = [p.pid for p in self._procs]
        self._output = RankOutput([self._paths(rank)[0] for rank in range(self.world_size)])
        self._wait_for_hello()
        self._healthy = True

    def _receive_hello(self, rank: int, ready: Any) -> RankOutcome:
        try:
            message = wire.loads(self._conns[rank].recv_bytes())
        except (EOFError, OSError):
            return self._crashed(rank, "died while starting")
        if message[0] == "hello":
            return RankOutcome(rank, True, status=OK)
        return RankOutcome(
            rank,
            False,
            None,
            "harness.RankStartError",
            "could not join the process group",
            message[3],
            status=ERROR,
        )

    def _wait_for_hello(self) -> None:
        """Wait until every rank joined the process group; on failure kill them all and raise."""
        grace = self.grace if self.grace is not None else current().grace
        gathered = gather(
            self.world_size,
            lambda rank: [self._conns[rank]],
            self._receive_hello,
            timeout=self.start_timeout,
            grace=grace,
        )
        if not gathered.unfinished and not gathered.failed:
            return
        outcomes = gathered.outcomes
        for rank in gathered.unfinished:
            if not gathered.failed:
                outcomes[rank] = RankOutcome(
                    rank,
                    False,
                    None,
                    "harness.RankStartTimeout",
                    f"had not joined the process group after {self.start_timeout:g} s",
                    status=TIMEOUT,
                )
            else:
                outcomes[rank] = RankOutcome(
                    rank,
                    False,
                    None,
                    "harness.RankStartAborted",
                    f"was still joining the process group {grace:g} s after "
                    "another rank failed to start",
                    status=ABORTED,
                )
        stacks = self._dump_stacks(gathered.unfinished)
        self._kill()
        for rank, outcome in outcomes.items():
            outcome.stack = stacks.get(rank, "")
            if not outcome.ok:
                outcome.output = self._output.tail(rank)
        self._remove_tmp_dir()
        raise PoolStartError(
            case="pool start",
            fn_name="harness.rank_main.main",
            world_size=self.world_size,
            backend=self.backend,
            device=self.device,
            outcomes=[outcomes[r] for r in range(self.world_size)],
            note="the rank processes were killed; the next case will try to start them again",
        )

    def shutdown(self) -> None:
        """Stop the ranks (politely, then by SIGKILL) and remove the pool's temporary files."""
        with self._lock:
            for conn in self._conns:
                try:
                    conn.send_bytes(wire.dumps(("stop",)))
                except (OSError, ValueError):
                    pass
            deadline = time.monotonic() + _STOP_TIMEOUT_S
            for proc in self._procs:
                proc.join(max(0.0, deadline - time.monotonic()))
            self._kill()
            self._remove_tmp_dir()

    def _kill(self) -> None:
        """SIGKILL every rank still alive, reap them and close the connections."""
        for proc in self._procs:
            if proc.exitcode is None:
                try:
                    os.kill(proc.pid, signal.SIGKILL)
                except (ProcessLookupError, TypeError):
                    pass
        for proc in self._procs:
            proc.join(5.0)
        for conn in self._conns:
            try:
                conn.close()
            except OSError:
                pass
        self._procs, self._conns, self._pids = [], [], []
        self._healthy = False

    def _remove_tmp_dir(self) -> None:
        if self._tmp_dir is not None:
            shutil.rmtree(self._tmp_dir, ignore_errors=True)
            self._tmp_dir = None
            self._output = RankOutput([])

    # ------------------------------------------------------------------ cases

    def _execute(self, case: CaseCall) -> tuple[list[RankOutcome], CaseFailure | None]:
        fn_name, timeout = case.fn_name, case.timeout_s(self.case_timeout)
        if not timeout > 0:
            raise ValueError(f"timeout must be a positive number of seconds, got {timeout!r}")
        grace = min(self.grace if self.grace is not None else current().grace, timeout)
        try:
            inner = wire.dumps((case.fn, case.args, case.kwargs))
        except Exception as exc:
            raise TypeError(
                f"cannot send {fn_name} and its arguments to the ranks: {exc}. The function must "
                "be defined at module level (not a lambda or closure) and every argument "
                "picklable"
            ) from exc
        with self._lock:
            self._case_counter += 1
            case_id = self._case_counter
            label = case.label(case_id)
            if not self._healthy:
                try:
                    self.start()
                except PoolStartError as exc:
                    raise PoolStartError(
                        case=label,
                        fn_name=fn_name,
                        world_size=self.world_size,
                        backend=self.backend,
                        device=self.device,
                        outcomes=exc.outcomes,
                        note=exc.note,
                        headline="the ranks could not be (re)started for this case",
                    ) from None
            message = wire.dumps(("case", case_id, int(case.seed), label, inner))
            try:
                for conn in self._conns:
                    try:
                        conn.send_bytes(message)
                    except OSError:
                        pass  # the rank is gone: its sentinel tells the wait below
                results, note = self._collect(case_id, timeout, grace)
            except BaseException:
                # Interrupted (Ctrl-C) mid-case: the ranks are in an unknown state.
                self._kill()
                raise
            self.cases_run += 1
            outcomes = [results[r] for r in range(self.world_size)]
            self._output.forward(outcomes)
        return outcomes, case_failure(self, label, fn_name, outcomes, timeout=timeout, note=note)

    def _collect(
        self, case_id: int, timeout: float, grace: float
    ) -> tuple[dict[int, RankOutcome], str]:
        """Gather every rank's result; deal with hangs and crashes. Returns the outcomes by rank
        and a note for reports (what was done with the pool)."""

        def receive(rank: int, ready: Any) -> RankOutcome | None:
            if isinstance(ready, int):  # the rank's process sentinel: it exited
                if self._conns[rank].poll(0):
                    return None  # unread data (a result, or EOF) is read through the connection
                return self._crashed(rank, "died while running the case")
            return self._receive(rank, case_id)

        gathered = gather(
            self.world_size,
            lambda rank: [self._conns[rank], self._procs[rank].sentinel],
            receive,
            timeout=timeout,
            grace=grace,
        )
        results = gathered.outcomes
        crashed = any(o.status == CRASHED for o in results.values())
        if gathered.unfinished:
            first = min((r for r, o in results.items() if not o.ok), default=None)
            stacks = self._dump_stacks(gathered.unfinished)
            for rank in gathered.unfinished:
                results[rank] = unfinished_outcome(
                    rank, stacks.get(rank, ""), timeout=timeout, grace=grace, failed_rank=first
                )
        if gathered.unfinished or crashed:
            self._output.attach(results)
            self._kill()
            return (
                results,
                "the pool's rank processes were killed; the next case starts a fresh pool",
            )
        if gathered.failed:
            if self._probe(case_id):
                return (
                    results,
                    "every rank reported and a probe all_reduce passed: the pool is kept",
                )
            self._output.attach(results)
            self._kill()
            return results, (
                "the process group failed a probe all_reduce after the case; "
                "the pool was killed and will be rebuilt"
            )
        return results, ""

    def _receive(self, rank: int, case_id: int) -> RankOutcome | None:
        try:
            message = wire.loads(self._conns[rank].recv_bytes())
        except (EOFError, OSError):
            return self._crashed(rank, "died while running the case")
        if message[0] != "result" or message[1] != case_id:
            return None  # a late reply to an earlier request: not this case's
        _, _, _, ok, value_bytes, exc_type, exc_message, tb, duration = message
        if not ok:
            return RankOutcome(
                rank, False, None, exc_type, exc_message, tb, status=ERROR, duration_s=duration
            )
        try:
            value = wire.loads(value_bytes)
        except Exception as exc:
            return RankOutcome(
                rank,
                False,
                None,
                "harness.UnpicklableResult",
                f"the rank's return value cannot be unpickled in the pytest process: {exc}",
                status=ERROR,
                duration_s=duration,
            )
        return RankOutcome(rank, True, value, status=OK, duration_s=duration)

    def _crashed(self, rank: int, what: str) -> RankOutcome:
        proc = self._procs[rank]
        proc.join(1.0)
        message = f"(pid {proc.pid}) {what}: {signal_name(proc.exitcode)}"
        if not os.path.exists(self._paths(rank)[0]):
            # The entry point opens the log first: without one the process died while Python
            # prepared it, importing the parent's main module again (spawn and forkserver).
            message += (
                " before the harness's entry point ran (it left no log): the spawn and "
                "forkserver start methods import the parent's main module again, so a script "
                'that starts a pool must do so under `if __name__ == "__main__":`; the error '
                "went to this process's stderr"
            )
        return RankOutcome(rank, False, None, "harness.RankCrashed", message, status=CRASHED)

    def _probe(self, case_id: int) -> bool:
        """One all_reduce on every rank after a case some ranks failed:
        does the group still agree?"""
        message = wire.dumps(("probe", case_id))
        try:
            for conn in self._conns:
                conn.send_bytes(message)
        except OSError:
            return False

        def receive(rank: int, ready: Any) -> RankOutcome | None:
            try:
                reply = wire.loads(self._conns[rank].recv_bytes())
            except (EOFError, OSError):
                return RankOutcome(rank, False, status=CRASHED)
            if reply[0] != "probe_ok" or reply[1] != case_id:
                return None
            return RankOutcome(rank, bool(reply[3]), status=OK if reply[3] else ERROR)

        gathered = gather(
            self.world_size,
            lambda rank: [self._conns[rank]],
            receive,
            timeout=_PROBE_TIMEOUT_S,
            grace=0.0,
        )
        return not gathered.unfinished and not gathered.failed

    def _dump_stacks(self, ranks: Sequence[int]) -> dict[int, str]:
        if self._tmp_dir is None:
            return {}
        return dump_stacks(
            {
                rank: (self._pids[rank], self._paths(rank)[1])
                for rank in ranks
                if rank < len(self._pids)
            }
        )


# ---------------------------------------------------------------------- the pools of this process

_pools: dict[tuple[int, str, str], RankPool] = {}
_registry_lock = threading.Lock()


def rank_pool(world_size: int, backend: str, device: str) -> RankPool:
    """This process's pool of ``world_size`` ranks for (backend, device), started on first use and
    cached; :class:`~harness.errors.PoolStartError` when the ranks fail to start."""
    key = (world_size, backend, device)
    evicted: list[RankPool] = []
    with _registry_lock:
        pool = _pools.get(key)
        if pool is None:
            if shares_gpus(device, visible_gpu_count(), xdist_worker()):
                evicted = [_pools.pop(k) for k in [k for k in _pools if k[2] == "cuda"]]
            pool = RankPool(world_size, backend, device)
            _pools[key] = pool
            install_parent_hooks(shutdown_rank_pools)
    for old in evicted:  # one CUDA pool at a time on a shared GPU (harness.devices.shares_gpus)
        old.shutdown()
    pool.start()
    return pool


def active_pools() -> list[RankPool]:
    """Every pool this process created (running or not)."""
    with _registry_lock:
        return list(_pools.values())


def shutdown_rank_pools() -> None:
    """Stop every pool of this process; safe to call
    more than once (session end, atexit, signals)."""
    shutdown_pools(_pools, _registry_lock)
