"""torchrun mode: this pytest process is one rank; cases run here and verdicts are shared.

``torchrun --nproc-per-node=N [--nnodes ...] -m pytest suites`` starts N pytest processes (on each
node) that collect the same tests and run them in the same order. ``get_pool`` then returns the
:class:`TorchrunPool` of this process: ``run(fn, ...)`` calls ``fn`` on this rank directly and
gathers every rank's outcome (ok / value / exception and traceback) to every rank over a separate
gloo control group, so every rank reaches the same verdict and raises the same
:class:`~harness.errors.CaseFailure` (none waits on a peer that already gave up). Rank 0 prints the
pytest report with every rank's failures; the other ranks are quiet (see the pytest plugin).

A rank that hangs cannot be killed by a peer here: each case arms ``faulthandler`` to dump every
thread's stack to stderr and exit when the case timeout runs out; torchrun then ends the run. In
torchrun mode a hang therefore ends the session (with stacks), where a pool would rebuild.
"""

from __future__ import annotations

import faulthandler
import functools
import os
import sys
import time
import traceback
from datetime import timedelta
from typing import Any

from harness import wire
from harness.context import RankContext
from harness.errors import CRASHED, ERROR, OK, CaseFailure, PoolUnavailable, RankOutcome
from harness.pool_base import CaseCall, Pool, case_failure
from harness.settings import current

__all__ = ["TorchrunPool", "get_torchrun_pool", "shutdown_torchrun_pool", "torchrun_rank"]

# Margin past the case timeout before a hung rank kills itself: its peers report first.
_EXIT_MARGIN_S = 10.0


def torchrun_rank() -> tuple[int, int, int]:
    """(rank, world_size, local_rank) from the torchrun environment."""
    env = os.environ
    rank, world_size = int(env["RANK"]), int(env["WORLD_SIZE"])
    return rank, world_size, int(env.get("LOCAL_RANK", rank))


class TorchrunPool(Pool):
    """The in-process "pool" of a torchrun rank;
    ``run`` / ``run_outcomes`` as every :class:`Pool`."""

    def __init__(self, backend: str, device: str) -> None:
        import torch
        import torch.distributed as dist

        self.rank, self.world_size, self.local_rank = torchrun_rank()
        self.backend = backend
        self.device = device
        torch_device = (
            torch.device("cuda", self.local_rank) if device == "cuda" else torch.device("cpu")
        )
        if device == "cuda":
            torch.cuda.set_device(torch_device)
        else:
            torch.set_num_threads(current().rank_threads)
        self._owns_group = not dist.is_initialized()
        if self._owns_group:
            dist.init_process_group(backend, init_method="env://", timeout=timedelta(hours=1))
        # Outcomes travel on their own gloo group: a case that left the main group's collectives
        # out of step (a skipped collective) must not corrupt the verdict exchange.
        self._control = dist.new_group(backend="gloo", timeout=timedelta(hours=1))
        self.ctx = RankContext(
            rank=self.rank,
            world_size=self.world_size,
            group=dist.group.WORLD,
            device=torch_device,
            backend=backend,
        )
        self.cases_run = 0

    @property
    def pids(self) -> list[int]:
        """Only this rank's process is known here; the others live on their own hosts."""
        return [os.getpid()]

    def _execute(self, case: CaseCall) -> tuple[list[RankOutcome], CaseFailure | None]:
        """Run ``case.fn(ctx, *case.args, **case.kwargs)`` here, in lockstep with the other
        torchrun ranks, and share every rank's outcome with every rank."""
        import torch
        import torch.distributed as dist

        from harness.rank_main import seed_everything

        fn_name, timeout = case.fn_name, case.timeout_s()
        self.cases_run += 1
        label = case.label(self.cases_run)
        self.ctx.case, self.ctx.seed = label, case.seed
        default_dtype = torch.get_default_dtype()
        seed_everything(case.seed)
        faulthandler.dump_traceback_later(timeout + _EXIT_MARGIN_S, exit=True, file=sys.stderr)
        failure = functools.partial(case_failure, self, label, fn_name, timeout=timeout)
        start = time.perf_counter()
        try:
            try:
                value = case.fn(self.ctx, *case.args, **case.kwargs)
                mine: tuple[Any, ...] = (True, wire.dumps_to_host(value), "", "", "")
            except BaseException as exc:
                mine = (False, b"", wire.exception_type_name(exc), str(exc), traceback.format_exc())
            finally:
                torch.set_default_dtype(default_dtype)
                torch.set_grad_enabled(True)
            gathered: list[Any] = [None] * self.world_size
            try:
                dist.all_gather_object(
                    gathered, (*mine, time.perf_counter() - start), group=self._control
                )
            except Exception as exc:
                outcome = RankOutcome(
                    self.rank,
                    False,
                    None,
                    "harness.RankCrashed",
                    f"could not exchange results with the other ranks ({exc}); "
                    "a peer died or hung (its stack is on its stderr)",
                    status=CRASHED,
                )
                outcomes = [
                    outcome
                    if r == self.rank
                    else RankOutcome(
                        r, False, None, "harness.Unknown", "did not report", status=CRASHED
                    )
                    for r in range(self.world_size)
                ]
                return outcomes, failure(outcomes, headline="a torchrun rank stopped answering")
        finally:
            faulthandler.cancel_dump_traceback_later()
        outcomes = []
        for rank, (ok, value_bytes, exc_type, exc_message, tb, duration) in enumerate(gathered):
            if ok:
                outcomes.append(
                    RankOutcome(rank, True, wire.loads(value_bytes), status=OK, duration_s=duration)
                )
            else:
                outcomes.append(
                    RankOutcome(
                        rank,
                        False,
                        None,
                        exc_type,
                        exc_message,
                        tb,
                        status=ERROR,
                        duration_s=duration,
                    )
                )
        return outcomes, failure(
            outcomes, note=f"reported by torchrun rank {self.rank} of {self.world_size}"
        )

    def shutdown(self) -> None:
        import torch.distributed as dist

        if self._owns_group and dist.is_initialized():
            try:
                dist.destroy_process_group()
            except Exception:
                pass
            self._owns_group = False


_pool: TorchrunPool | None = None


def get_torchrun_pool(world_size: int, backend: str, device: str) -> TorchrunPool:
    """This process's torchrun pool; :class:`PoolUnavailable` for any other world size or device."""
    global _pool
    _, launched, _ = torchrun_rank()
    if world_size != launched:
        raise PoolUnavailable(
            f"this case needs world_size {world_size} but torchrun launched {launched} ranks: "
            f"launch torchrun with {world_size} ranks in total (e.g. "
            f"--nproc-per-node={world_size}) to run it, or pass --world-sizes {launched} to "
            "select only the cases that fit"
        )
    if _pool is None:
        _pool = TorchrunPool(backend, device)
    elif (_pool.backend, _pool.device) != (backend, device):
        raise PoolUnavailable(
            f"this torchrun session runs {_pool.backend}/{_pool.device}; a case asked for "
            f"{backend}/{device}: start another torchrun session with --dist-backend {backend} "
            f"--device {device}"
        )
    return _pool


def shutdown_torchrun_pool() -> None:
    global _pool
    if _pool is not None:
        _pool.shutdown()
        _pool = None
