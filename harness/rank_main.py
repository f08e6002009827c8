"""The rank process: joins the pool's process group once, then runs cases until told to stop.

Started by :mod:`harness.pool` through multiprocessing's forkserver, which has ``torch`` (and this
module) imported already, so a rank costs a fork plus a process-group handshake rather than a
fresh interpreter importing torch.

Each rank:

* dies with its parent (``PR_SET_PDEATHSIG``), and a watchdog thread ends it when the control
  connection to the pool closes or the owning pytest process disappears;
* ignores SIGINT (Ctrl-C reaches the whole process group; the parent decides what to do);
* writes its stdout/stderr to a per-rank log file the parent reads after each case, and dumps
  every thread's Python stack to a per-rank file on SIGUSR1 (``faulthandler``), which the parent
  sends to a rank that hangs;
* before each case seeds ``random``, ``numpy`` and ``torch`` with the case seed, so every rank
  draws the same inputs; after each case restores the default dtype, grad mode and thread count.
"""

from __future__ import annotations

import faulthandler
import os
import random
import select
import signal
import sys
import threading
import time
import traceback
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from harness import wire
from harness.context import RankContext
from harness.procs import pid_alive, set_parent_death_signal

EXIT_ORPHANED = 70
EXIT_START_FAILED = 71


@dataclass(frozen=True)
class RankBoot:
    """Everything a rank needs to start; pickled to the rank by the pool."""

    rank: int
    world_size: int
    backend: str
    device: str
    store_path: str
    owner_pid: int
    env: dict[str, str]
    sys_path: list[str]
    cwd: str
    rank_threads: int
    stack_path: str
    log_path: str
    tmp_dir: str
    pg_timeout_s: float


def seed_everything(seed: int) -> None:
    """Seed every generator a case may draw from, identically on every rank."""
    random.seed(seed)
    torch.manual_seed(seed)  # also seeds every CUDA device
    numpy = sys.modules.get("numpy")
    if numpy is not None:
        numpy.random.seed(seed % 2**32)


def _watchdog(conn_fd: int, owner_pid: int, parent_pid: int) -> None:
    """End this rank when the pool's end of the control connection closes or its owner is gone.

    Runs in a daemon thread; covers the cases PR_SET_PDEATHSIG cannot (a parent that is not the
    owner: the forkserver) and non-Linux systems. Polls without reading, so it never competes with
    the main thread for messages.
    """
    hangup = select.POLLHUP | select.POLLERR | getattr(select, "POLLRDHUP", 0)
    poller = select.poll()
    poller.register(conn_fd, hangup)
    while True:
        events = poller.poll(1000)
        if any(mask & hangup for _, mask in events):
            os._exit(EXIT_ORPHANED)
        if os.getppid() != parent_pid or not pid_alive(owner_pid):
            os._exit(EXIT_ORPHANED)


def _redirect_output(log_path: str) -> None:
    fd = os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
    sys.stdout.flush()
    sys.stderr.flush()
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)
    # Line buffering so what a rank printed before it hung or died is in the log for the report.
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.reconfigure(line_buffering=True)  # type: ignore[union-attr]
        except (AttributeError, ValueError):
            pass


def _flush_output() -> None:
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except Exception:
            pass


def _init_rank(boot: RankBoot) -> tuple[RankContext, dict[str, Any]]:
    torch.set_num_threads(boot.rank_threads)
    try:
        torch.set_num_interop_threads(1)
    except RuntimeError:  # already set or inter-op pool already started: harmless
        pass
    device = torch.device(boot.device)
    if device.type == "cuda":
        if torch.cuda._is_in_bad_fork():
            raise RuntimeError(
                "CUDA was initialised in the process this rank was forked from, so it cannot be "
                "used here; start ranks with --rank-start spawn (RING_RANK_START=spawn)"
            )
        torch.cuda.set_device(device)
    store = dist.FileStore(boot.store_path, boot.world_size)
    kwargs: dict[str, Any] = {}
    if boot.backend == "nccl":
        kwargs["device_id"] = device
    dist.init_process_group(
        boot.backend,
        store=store,
        rank=boot.rank,
        world_size=boot.world_size,
        timeout=timedelta(seconds=boot.pg_timeout_s),
        **kwargs,
    )
    ctx = RankContext(
        rank=boot.rank,
        world_size=boot.world_size,
        group=dist.group.WORLD,
        device=device,
        backend=boot.backend,
        tmp_dir=boot.tmp_dir,
    )
    info = {"device": str(device), "threads": torch.get_num_threads(), "torch": torch.__version__}
    return ctx, info


def _run_case(ctx: RankContext, seed: int, label: str, inner: bytes) -> tuple[Any, ...]:
    start = time.perf_counter()
    try:
        fn, args, kwargs = wire.loads(inner)
    except BaseException as exc:
        return (
            False,
            b"",
            wire.exception_type_name(exc),
            f"could not unpickle the case on rank {ctx.rank} (is the function's module importable "
            f"from the rank's sys.path?): {exc}",
            traceback.format_exc(),
            time.perf_counter() - start,
        )
    ctx.case, ctx.seed = label, seed
    seed_everything(seed)
    try:
        value = fn(ctx, *args, **kwargs)
    except BaseException as exc:  # SystemExit and KeyboardInterrupt included: the rank lives on
        tb = traceback.format_exc()
        return (
            False,
            b"",
            wire.exception_type_name(exc),
            str(exc),
            tb,
            time.perf_counter() - start,
        )
    try:
        value_bytes = wire.dumps_to_host(value)
    except BaseException as exc:
        return (
            False,
            b"",
            "harness.UnpicklableResult",
            f"{wire.qualified_name(fn)} returned a value that cannot be pickled "
            f"({type(value).__name__}): {exc}; return plain data or tensors",
            traceback.format_exc(),
            time.perf_counter() - start,
        )
    return (True, value_bytes, "", "", "", time.perf_counter() - start)


def _probe(ctx: RankContext) -> bool:
    """One all_reduce that checks the process group still agrees after a failed case."""
    try:
        t = torch.tensor([float(ctx.rank + 1)], device=ctx.device)
        dist.all_reduce(t, group=ctx.group)
        return float(t.item()) == ctx.world_size * (ctx.world_size + 1) / 2
    except Exception:
        return False


def main(conn: Any, boot: RankBoot) -> None:
    """Rank process entry point (the target of the pool's multiprocessing.Process)."""
    set_parent_death_signal(signal.SIGKILL)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    _redirect_output(boot.log_path)
    os.environ.clear()
    os.environ.update(boot.env)
    sys.path[:] = boot.sys_path
    os.chdir(boot.cwd)
    stack_file = open(boot.stack_path, "w")  # stays open: faulthandler writes to it on SIGUSR1
    faulthandler.register(signal.SIGUSR1, file=stack_file, all_threads=True, chain=False)
    faulthandler.enable(file=sys.stderr, all_threads=True)
    threading.Thread(
        target=_watchdog,
        args=(conn.fileno(), boot.owner_pid, os.getppid()),
        name="harness-watchdog",
        daemon=True,
    ).start()

    try:
        ctx, info = _init_rank(boot)
    except BaseException as exc:
        _flush_output()
        conn.send_bytes(
            wire.dumps(
                (
                    "start_error",
                    boot.rank,
                    os.getpid(),
                    f"{wire.exception_type_name(exc)}: {exc}\n{traceback.format_exc()}",
                )
            )
        )
        os._exit(EXIT_START_FAILED)
    conn.send_bytes(wire.dumps(("hello", boot.rank, os.getpid(), info)))

    default_dtype = torch.get_default_dtype()
    while True:
        try:
            message = wire.loads(conn.recv_bytes())
        except (EOFError, OSError):
            break
        kind = message[0]
        if kind == "case":
            _, case_id, seed, label, inner = message
            result = _run_case(ctx, seed, label, inner)
            torch.set_default_dtype(default_dtype)
            torch.set_grad_enabled(True)
            torch.set_num_threads(boot.rank_threads)
            _flush_output()
            conn.send_bytes(wire.dumps(("result", case_id, boot.rank, *result)))
        elif kind == "probe":
            conn.send_bytes(wire.dumps(("probe_ok", message[1], boot.rank, _probe(ctx))))
        elif kind == "stop":
            break
    _flush_output()
    # destroy_process_group can block if a peer is gone; never let it keep the rank alive.
    threading.Timer(5.0, os._exit, args=(0,)).start()
    try:
        dist.destroy_process_group()
    except Exception:
        pass
    _flush_output()
    os._exit(0)
