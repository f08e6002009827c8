"""Rank pools (parent side): persistent rank processes that run one case after another.

``get_pool(world_size, backend, device)`` returns the pool for that key, starting it the first
time; it is cached for the life of the process (one per pytest or xdist worker) and reused by
every case. A case is ``pool.run(fn, *args, timeout=None, seed=0, **kwargs)``: ``fn(ctx, *args,
**kwargs)`` runs on every rank and the per-rank return values come back (index = rank).

Why it is fast: ranks are forked from multiprocessing's forkserver, which imports torch once for
the whole process; a pool start is then one fork plus a FileStore rendezvous per rank, and a case
is one pickled message to each rank and one back.

What happens when a case fails (see :mod:`harness.errors` for the statuses):

* a rank raises: the others get ``grace`` seconds to finish (they may be blocked in a collective
  the failed rank never joined); ranks still running then have their Python stacks dumped
  (SIGUSR1 -> faulthandler) and the pool is killed and rebuilt before the next case. When every
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

import multiprocessing
import multiprocessing.connection
import os
import shutil
import signal
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Sequence
from multiprocessing.context import BaseContext
from typing import Any, Protocol

from harness import wire
from harness.devices import rank_devices, visible_gpu_count, worker_gpus, xdist_worker
from harness.errors import (
    ABORTED,
    CRASHED,
    ERROR,
    OK,
    TIMEOUT,
    CaseFailure,
    CaseTimeout,
    HarnessError,
    PoolStartError,
    PoolUnavailable,
    RankCrashed,
    RankError,
    RankOutcome,
)
from harness.procs import install_parent_hooks, pid_alive, signal_name
from harness.settings import BACKENDS, DEVICES, current, default_backend

# Modules the forkserver imports once so every rank (and every rebuilt rank) starts with them
# loaded. torch._dynamo is imported by the first TorchDispatchMode (CollectiveLog) or
# torch.compile a rank runs: about 2 s of CPU per rank otherwise.
_FORKSERVER_PRELOAD = ["torch", "torch.distributed", "torch._dynamo", "numpy", "harness.rank_main",
                       "harness.accounting"]
_START_TIMEOUT_S = 180.0
_PROBE_TIMEOUT_S = 5.0
_STOP_TIMEOUT_S = 5.0
_OUTPUT_TAIL_CHARS = 4000
# Process-group timeout inside the ranks: the harness enforces case timeouts itself by killing
# ranks, so the backend's own timeout only has to be longer than any case.
_PG_TIMEOUT_S = 3600.0


class Pool(Protocol):
    """What suites use: a pool of ``world_size`` ranks that runs cases (rank processes or torchrun)."""

    world_size: int
    backend: str
    device: str

    @property
    def pids(self) -> list[int]:
        """Process ids of the ranks this pool drives (torchrun: this process only)."""
        ...

    def run(self, fn: Callable[..., Any], *args: Any, timeout: float | None = None,
            seed: int = 0, **kwargs: Any) -> list[Any]: ...

    def run_outcomes(self, fn: Callable[..., Any], *args: Any, timeout: float | None = None,
                     seed: int = 0, **kwargs: Any) -> list[RankOutcome]: ...

    def shutdown(self) -> None: ...


def mp_context(method: str | None = None) -> BaseContext:
    """The multiprocessing context ranks start from: the forkserver with torch preloaded (default)
    or spawn (``--rank-start spawn``)."""
    method = method or current().rank_start
    if method == "forkserver" and "forkserver" in multiprocessing.get_all_start_methods():
        ctx = multiprocessing.get_context("forkserver")
        ctx.set_forkserver_preload(_FORKSERVER_PRELOAD)
        _ensure_forkserver()
        return ctx
    return multiprocessing.get_context("spawn")


def _ensure_forkserver() -> None:
    """Start the forkserver if it is not running, with CUDA kept uninitialised in it.

    Ranks are forked from it, and CUDA does not survive a fork once the driver is initialised:
    any ``torch.cuda.is_available()`` during the preload must ask NVML, not the CUDA runtime.
    """
    from multiprocessing import forkserver

    key = "PYTORCH_NVML_BASED_CUDA_CHECK"
    previous = os.environ.get(key)
    os.environ[key] = "1"
    try:
        forkserver.ensure_running()
    finally:
        if previous is None:
            os.environ.pop(key, None)
        else:
            os.environ[key] = previous


def warm_up() -> None:
    """Start the forkserver now so its torch import overlaps with test collection.

    Returns at once: the forkserver imports torch in the background and the first pool start
    waits for it only if it has not finished.
    """
    if current().rank_start == "forkserver":
        mp_context("forkserver")


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
        owner = name[len(_TMP_PREFIX):].split("-", 1)[0] if name.startswith(_TMP_PREFIX) else ""
        if owner.isdigit() and not pid_alive(int(owner)):
            shutil.rmtree(os.path.join(root, name), ignore_errors=True)


def case_label(fallback: str) -> str:
    """The current pytest node id (from PYTEST_CURRENT_TEST), or ``fallback`` outside pytest."""
    current_test = os.environ.get("PYTEST_CURRENT_TEST", "")
    if current_test:
        return current_test.rsplit(" (", 1)[0]
    return fallback


def _rank_env(rank: int, world_size: int) -> dict[str, str]:
    env = dict(os.environ)
    # Rendezvous and data stay on this machine: listen on loopback unless told otherwise.
    if "GLOO_SOCKET_IFNAME" not in env and "GLOO_DEVICE_TRANSPORT" not in env:
        env["GLOO_SOCKET_IFNAME"] = "lo"
    env.setdefault("NCCL_SOCKET_IFNAME", "lo")
    for key in ("MASTER_ADDR", "MASTER_PORT", "TORCHELASTIC_RUN_ID", "GROUP_RANK"):
        env.pop(key, None)  # a rank is not a torchrun rank, whatever launched pytest
    env.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world_size),
               LOCAL_WORLD_SIZE=str(world_size), PYTHONUNBUFFERED="1")
    env.pop("PYTEST_CURRENT_TEST", None)
    return env


class RankPool:
    """``world_size`` rank processes sharing one process group, reused across cases.

    Use :func:`get_pool` rather than constructing one: it caches pools per process and makes sure
    they are shut down at exit. ``case_timeout``, ``rank_threads`` and ``grace`` default to the
    installed :mod:`harness.settings` (set by the pytest options) at the time of each case.
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
    ) -> None:
        if not isinstance(world_size, int) or world_size < 1:
            raise ValueError(f"world_size must be a positive int, got {world_size!r}")
        if backend not in BACKENDS:
            raise ValueError(f"backend must be one of {', '.join(BACKENDS)}, got {backend!r}")
        if device not in DEVICES:
            raise ValueError(f"device must be one of {', '.join(DEVICES)}, got {device!r}")
        if backend == "nccl" and device != "cuda":
            raise ValueError("backend 'nccl' needs device 'cuda'; use backend 'gloo' for CPU ranks")
        self.world_size = world_size
        self.backend = backend
        self.device = device
        self.case_timeout = case_timeout
        self.rank_threads = rank_threads
        self.grace = grace
        self.start_timeout = start_timeout
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
        self._log_offsets: list[int] = []
        self._healthy = False
        self._case_counter = 0

    # ------------------------------------------------------------------ lifecycle

    def __repr__(self) -> str:
        state = "running" if self._healthy else "stopped"
        return f"RankPool(world_size={self.world_size}, {self.backend}/{self.device}, {state}, pids={self._pids})"

    @property
    def pids(self) -> list[int]:
        """Process ids of the ranks (index = rank); empty while stopped."""
        return list(self._pids)

    @property
    def running(self) -> bool:
        return self._healthy

    def _paths(self, rank: int) -> tuple[str, str]:
        assert self._tmp_dir is not None
        return (os.path.join(self._tmp_dir, f"rank{rank}.log"),
                os.path.join(self._tmp_dir, f"rank{rank}.stack"))

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

        ctx: Any = mp_context()
        _remove_stale_tmp_dirs()
        self._tmp_dir = tempfile.mkdtemp(prefix=f"{_TMP_PREFIX}{os.getpid()}-w{self.world_size}-")
        store_path = os.path.join(self._tmp_dir, "store")
        threads = self.rank_threads or current().rank_threads
        for rank in range(self.world_size):
            log_path, stack_path = self._paths(rank)
            boot = RankBoot(
                rank=rank, world_size=self.world_size, backend=self.backend,
                device=self.rank_devices[rank], store_path=store_path, owner_pid=os.getpid(),
                env=_rank_env(rank, self.world_size), sys_path=list(sys.path), cwd=os.getcwd(),
                rank_threads=threads, stack_path=stack_path, log_path=log_path,
                tmp_dir=self._tmp_dir, pg_timeout_s=_PG_TIMEOUT_S,
            )
            parent_end, child_end = ctx.Pipe(duplex=True)
            proc = ctx.Process(target=main, args=(child_end, boot), name=f"ring-rank{rank}", daemon=True)
            proc.start()
            child_end.close()
            self._procs.append(proc)
            self._conns.append(parent_end)
        self._pids = [p.pid for p in self._procs]
        self._log_offsets = [0] * self.world_size
        self._wait_for_hello()
        self._healthy = True

    def _wait_for_hello(self) -> None:
        """Wait until every rank joined the process group; on failure kill them all and raise."""
        deadline = time.monotonic() + self.start_timeout
        outcomes: dict[int, RankOutcome] = {}
        started: set[int] = set()
        failed_at: float | None = None
        grace = self.grace if self.grace is not None else current().grace
        while len(started) + len(outcomes) < self.world_size:
            limit = deadline if failed_at is None else min(deadline, failed_at + grace)
            if time.monotonic() >= limit:
                break
            waiting = [r for r in range(self.world_size) if r not in started and r not in outcomes]
            ready = multiprocessing.connection.wait(
                [self._conns[r] for r in waiting], timeout=max(0.0, limit - time.monotonic()))
            for ready_conn in ready:
                rank = self._conns.index(ready_conn)
                try:
                    message = wire.loads(self._conns[rank].recv_bytes())
                except (EOFError, OSError):
                    outcomes[rank] = self._crashed(rank, "died while starting")
                else:
                    if message[0] == "hello":
                        started.add(rank)
                        continue
                    outcomes[rank] = RankOutcome(rank, False, None, "harness.RankStartError",
                                                 "could not join the process group", message[3],
                                                 status=ERROR)
                if failed_at is None:
                    failed_at = time.monotonic()
        if len(started) == self.world_size:
            return
        unfinished = [r for r in range(self.world_size) if r not in started and r not in outcomes]
        for rank in unfinished:
            if failed_at is None:
                outcomes[rank] = RankOutcome(rank, False, None, "harness.RankStartTimeout",
                                             f"had not joined the process group after {self.start_timeout:g} s",
                                             status=TIMEOUT)
            else:
                outcomes[rank] = RankOutcome(rank, False, None, "harness.RankStartAborted",
                                             f"was still joining the process group {grace:g} s after "
                                             "another rank failed to start", status=ABORTED)
        for rank in started:
            outcomes[rank] = RankOutcome(rank, True, status=OK)
        stacks = self._dump_stacks(unfinished)
        self._kill()
        for rank, outcome in outcomes.items():
            outcome.stack = stacks.get(rank, "")
            if not outcome.ok:
                outcome.output = self._tail_output(rank)
        self._remove_tmp_dir()
        raise PoolStartError(
            case="pool start", fn_name="harness.rank_main.main", world_size=self.world_size,
            backend=self.backend, device=self.device,
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

    # ------------------------------------------------------------------ cases

    def run(self, fn: Callable[..., Any], *args: Any, timeout: float | None = None,
            seed: int = 0, **kwargs: Any) -> list[Any]:
        """Run ``fn(ctx, *args, **kwargs)`` on every rank; return the values, index = rank.

        Raises :class:`RankError`, :class:`RankCrashed` or :class:`CaseTimeout` (all
        :class:`CaseFailure`) when any rank did not return.
        """
        __tracebackhide__ = True  # pytest: show the test's line, not the harness internals
        outcomes, failure = self._execute(fn, args, kwargs, timeout, seed)
        if failure is not None:
            raise failure
        return [o.value for o in outcomes]

    def run_outcomes(self, fn: Callable[..., Any], *args: Any, timeout: float | None = None,
                     seed: int = 0, **kwargs: Any) -> list[RankOutcome]:
        """Run like :meth:`run` but return every rank's :class:`RankOutcome`, raised or not.

        For tests that expect ranks to raise. A rank that died or a case that timed out still
        raises (:class:`RankCrashed`, :class:`CaseTimeout`): those are never an expected result.
        """
        __tracebackhide__ = True
        outcomes, failure = self._execute(fn, args, kwargs, timeout, seed)
        if failure is not None and not isinstance(failure, RankError):
            raise failure
        return outcomes

    def _execute(self, fn: Callable[..., Any], args: Sequence[Any], kwargs: dict[str, Any],
                 timeout: float | None, seed: int) -> tuple[list[RankOutcome], CaseFailure | None]:
        fn_name = wire.qualified_name(fn)
        timeout = float(timeout if timeout is not None else (self.case_timeout or current().case_timeout))
        if not timeout > 0:
            raise ValueError(f"timeout must be a positive number of seconds, got {timeout!r}")
        grace = min(self.grace if self.grace is not None else current().grace, timeout)
        try:
            inner = wire.dumps((fn, tuple(args), dict(kwargs)))
        except Exception as exc:
            raise TypeError(
                f"cannot send {fn_name} and its arguments to the ranks: {exc}. The function must be "
                f"defined at module level (not a lambda or closure) and every argument picklable"
            ) from exc
        with self._lock:
            self._case_counter += 1
            case_id = self._case_counter
            label = case_label(f"{fn_name} #{case_id}")
            if not self._healthy:
                try:
                    self.start()
                except PoolStartError as exc:
                    raise PoolStartError(
                        case=label, fn_name=fn_name, world_size=self.world_size, backend=self.backend,
                        device=self.device, outcomes=exc.outcomes, note=exc.note,
                        headline="the ranks could not be (re)started for this case") from None
            message = wire.dumps(("case", case_id, int(seed), label, inner))
            results: dict[int, RankOutcome] = {}
            try:
                for conn in self._conns:
                    try:
                        conn.send_bytes(message)
                    except OSError:
                        pass  # the rank is gone: its sentinel tells the loop below
                note = self._collect(case_id, results, timeout, grace)
            except BaseException:
                # Interrupted (Ctrl-C) mid-case: the ranks are in an unknown state.
                self._kill()
                raise
            self.cases_run += 1
            outcomes = [results[r] for r in range(self.world_size)]
            self._forward_output(outcomes)
        return outcomes, self._failure(label, fn_name, outcomes, timeout, note)

    def _collect(self, case_id: int, results: dict[int, RankOutcome], timeout: float,
                 grace: float) -> str:
        """Gather every rank's result; deal with hangs and crashes. Returns a note for reports."""
        start = time.monotonic()
        deadline = start + timeout
        failed_at: float | None = None
        sentinels = {proc.sentinel: rank for rank, proc in enumerate(self._procs)}
        conns = {id(conn): rank for rank, conn in enumerate(self._conns)}
        while len(results) < self.world_size:
            limit = deadline if failed_at is None else min(deadline, failed_at + grace)
            now = time.monotonic()
            if now >= limit:
                break
            pending = [r for r in range(self.world_size) if r not in results]
            waitables = [self._conns[r] for r in pending] + [self._procs[r].sentinel for r in pending]
            for ready in multiprocessing.connection.wait(waitables, timeout=limit - now):
                if isinstance(ready, int):
                    rank = sentinels[ready]
                    if rank in results or self._conns[rank].poll(0):
                        continue  # unread data (a result, or EOF) is read through the connection
                    results[rank] = self._crashed(rank, "died while running the case")
                else:
                    rank = conns[id(ready)]
                    if rank in results:
                        continue
                    outcome = self._receive(rank, case_id)
                    if outcome is None:
                        continue
                    results[rank] = outcome
                if failed_at is None and not results[rank].ok:
                    failed_at = time.monotonic()

        unfinished = [r for r in range(self.world_size) if r not in results]
        crashed = any(o.status == CRASHED for o in results.values())
        if unfinished:
            first = min((r for r, o in results.items() if not o.ok), default=None)
            stacks = self._dump_stacks(unfinished)
            for rank in unfinished:
                if first is None:
                    text = f"had not finished when the {timeout:g} s case timeout ran out"
                    status = TIMEOUT
                else:
                    text = (f"was still running {grace:g} s after rank {first} failed "
                            f"(blocked in a collective rank {first} never joined?)")
                    status = ABORTED
                results[rank] = RankOutcome(rank, False, None, f"harness.{status.title()}", text,
                                            status=status, stack=stacks.get(rank, ""))
        if unfinished or crashed:
            self._attach_output(results)
            self._kill()
            return "the pool's rank processes were killed; the next case starts a fresh pool"
        if any(not o.ok for o in results.values()):
            if self._probe(case_id):
                return "every rank reported and a probe all_reduce passed: the pool is kept"
            self._attach_output(results)
            self._kill()
            return "the process group failed a probe all_reduce after the case; the pool was killed and will be rebuilt"
        return ""

    def _receive(self, rank: int, case_id: int) -> RankOutcome | None:
        try:
            message = wire.loads(self._conns[rank].recv_bytes())
        except (EOFError, OSError):
            return self._crashed(rank, "died while running the case")
        if message[0] != "result" or message[1] != case_id:
            return None  # a late reply to an earlier request: not this case's
        _, _, _, ok, value_bytes, exc_type, exc_message, tb, duration = message
        if not ok:
            return RankOutcome(rank, False, None, exc_type, exc_message, tb, status=ERROR,
                               duration_s=duration)
        try:
            value = wire.loads(value_bytes)
        except Exception as exc:
            return RankOutcome(rank, False, None, "harness.UnpicklableResult",
                               f"the rank's return value cannot be unpickled in the pytest process: {exc}",
                               status=ERROR, duration_s=duration)
        return RankOutcome(rank, True, value, status=OK, duration_s=duration)

    def _crashed(self, rank: int, what: str) -> RankOutcome:
        proc = self._procs[rank]
        proc.join(1.0)
        return RankOutcome(rank, False, None, "harness.RankCrashed",
                           f"(pid {proc.pid}) {what}: {signal_name(proc.exitcode)}", status=CRASHED)

    def _probe(self, case_id: int) -> bool:
        message = wire.dumps(("probe", case_id))
        try:
            for conn in self._conns:
                conn.send_bytes(message)
        except OSError:
            return False
        deadline = time.monotonic() + _PROBE_TIMEOUT_S
        answered: set[int] = set()
        while len(answered) < self.world_size:
            remaining = deadline - time.monotonic()
            pending = [self._conns[r] for r in range(self.world_size) if r not in answered]
            ready = multiprocessing.connection.wait(pending, timeout=max(0.0, remaining))
            if not ready:
                return False
            for ready_conn in ready:
                try:
                    reply = wire.loads(self._conns[self._conns.index(ready_conn)].recv_bytes())
                except (EOFError, OSError):
                    return False
                if reply[0] == "probe_ok" and reply[1] == case_id:
                    if not reply[3]:
                        return False
                    answered.add(reply[2])
        return True

    # ------------------------------------------------------------------ diagnostics

    def _dump_stacks(self, ranks: Sequence[int]) -> dict[int, str]:
        """Ask each rank for every thread's Python stack (SIGUSR1 -> faulthandler) and read it."""
        if not ranks or self._tmp_dir is None:
            return {}
        before = {}
        for rank in ranks:
            stack_path = self._paths(rank)[1]
            before[rank] = os.path.getsize(stack_path) if os.path.exists(stack_path) else 0
            try:
                os.kill(self._pids[rank], signal.SIGUSR1)
            except (ProcessLookupError, IndexError):
                pass
        deadline = time.monotonic() + 2.0
        grown: set[int] = set()
        while time.monotonic() < deadline and len(grown) < len(ranks):
            time.sleep(0.02)
            for rank in ranks:
                stack_path = self._paths(rank)[1]
                if os.path.exists(stack_path) and os.path.getsize(stack_path) > before[rank]:
                    grown.add(rank)
        time.sleep(0.05)  # let a dump that started finish writing
        stacks = {}
        for rank in ranks:
            try:
                with open(self._paths(rank)[1], errors="replace") as f:
                    f.seek(before[rank])
                    stacks[rank] = f.read()
            except OSError:
                stacks[rank] = ""
            if not stacks[rank]:
                stacks[rank] = "(the rank did not dump its stack within 2 s of SIGUSR1)"
        return stacks

    def _new_output(self, rank: int) -> str:
        if self._tmp_dir is None or rank >= len(self._log_offsets):
            return ""
        log_path = self._paths(rank)[0]
        try:
            size = os.path.getsize(log_path)
        except OSError:
            return ""
        if size <= self._log_offsets[rank]:
            return ""
        with open(log_path, "rb") as f:
            f.seek(self._log_offsets[rank])
            data = f.read()
        self._log_offsets[rank] = size
        return data.decode(errors="replace")

    def _tail_output(self, rank: int) -> str:
        text = self._new_output(rank)
        return text[-_OUTPUT_TAIL_CHARS:]

    def _attach_output(self, results: dict[int, RankOutcome]) -> None:
        # Give a dying rank a moment to flush what it wrote (an abort message, a fatal error).
        time.sleep(0.05)
        for rank, outcome in results.items():
            if not outcome.ok:
                outcome.output = self._tail_output(rank)

    def _forward_output(self, outcomes: Sequence[RankOutcome]) -> None:
        """Copy what the ranks printed during the case to this process's stderr (pytest captures it)."""
        for outcome in outcomes:
            text = self._new_output(outcome.rank)
            if outcome.ok and text:
                outcome.output = text[-_OUTPUT_TAIL_CHARS:]
            if text:
                prefix = f"[rank {outcome.rank}] "
                sys.stderr.write("".join(prefix + line + "\n" for line in text.rstrip("\n").split("\n")))

    def _failure(self, label: str, fn_name: str, outcomes: list[RankOutcome], timeout: float,
                 note: str) -> CaseFailure | None:
        statuses = {o.status for o in outcomes}
        if statuses == {OK}:
            return None
        cls: type[CaseFailure]
        if CRASHED in statuses:
            cls, headline = RankCrashed, "a rank process died"
        elif ERROR in statuses:
            cls, headline = RankError, "a rank raised"
        else:
            cls, headline = CaseTimeout, f"did not finish within {timeout:g} s"
        return cls(case=label, fn_name=fn_name, world_size=self.world_size, backend=self.backend,
                   device=self.device, outcomes=outcomes, note=note, headline=headline)


# ---------------------------------------------------------------------- registry

_pools: dict[tuple[int, str, str], RankPool] = {}
_registry_lock = threading.Lock()


def get_pool(world_size: int, backend: str | None = None, device: str | None = None) -> Pool:
    """The pool of ``world_size`` ranks for (backend, device), started on first use and cached.

    ``device`` defaults to the session's ``--device``; ``backend`` to the session's
    ``--dist-backend`` when the device is the session's, else the device's natural backend. When
    pytest runs under torchrun (``--launcher torchrun``, or its environment), returns the
    in-process torchrun pool instead. Raises :class:`PoolUnavailable` when the pool cannot exist
    here (the pytest fixture ``rank_pool`` turns that into a skip) and :class:`PoolStartError`
    when the ranks fail to start.
    """
    settings = current()
    device = device or settings.device
    backend = backend or (settings.backend if device == settings.device else default_backend(device))
    if settings.launcher == "torchrun":
        from harness.torchrun import get_torchrun_pool

        return get_torchrun_pool(world_size, backend, device)
    key = (world_size, backend, device)
    with _registry_lock:
        pool = _pools.get(key)
        if pool is None:
            pool = RankPool(world_size, backend, device)
            _pools[key] = pool
            install_parent_hooks(shutdown_all_pools)
    pool.start()
    return pool


def active_pools() -> list[RankPool]:
    """Every pool this process created (running or not)."""
    with _registry_lock:
        return list(_pools.values())


def shutdown_all_pools() -> None:
    """Stop every pool of this process; safe to call more than once (session end, atexit, signals)."""
    with _registry_lock:
        pools = list(_pools.values())
        _pools.clear()
    for pool in pools:
        try:
            pool.shutdown()
        except Exception:
            pass


__all__ = [
    "HarnessError",
    "Pool",
    "PoolUnavailable",
    "RankPool",
    "active_pools",
    "get_pool",
    "mp_context",
    "shutdown_all_pools",
    "warm_up",
]
