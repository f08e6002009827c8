"""Multiprocess test harness: persistent rank pools, fault handling, collective accounting.

Suites use::

    from harness import get_pool, RankContext, CaseFailure

    def my_case(ctx: RankContext, n: int) -> float:      # module level: it is pickled to the ranks
        x = torch.full((n,), float(ctx.rank), device=ctx.device)
        torch.distributed.all_reduce(x, group=ctx.group)
        return x.sum().item()

    values = get_pool(world_size=2).run(my_case, 4)     # [4.0, 4.0], index = rank

``pool.run`` raises a :class:`CaseFailure` subclass (:class:`RankError`, :class:`RankCrashed`,
:class:`CaseTimeout`) naming every failed rank with its traceback or stack; ``pool.run_outcomes``
returns every rank's :class:`RankOutcome` for tests that expect ranks to raise.
:class:`CollectiveLog` counts the collectives a rank issues, per phase.

Modules by role: :mod:`harness.launchers` (``get_pool``: the launchers by name),
:mod:`harness.pool_base` (what every pool does), :mod:`harness.pool` (rank processes owned by this
process) with :mod:`harness.rank_start`, :mod:`harness.rank_main`, :mod:`harness.waiting`,
:mod:`harness.stacks` and :mod:`harness.rank_output`; :mod:`harness.torchrun` (this process is one
torchrun rank); :mod:`harness.simulated` with :mod:`harness.simulated_group` (every rank a
thread of this process, exact collectives: world sizes up to 64 on one machine);
:mod:`harness.errors`, :mod:`harness.context`, :mod:`harness.wire`; :mod:`harness.settings`,
:mod:`harness.devices`, :mod:`harness.procs` (process trees that die with their owner),
:mod:`harness.accounting` and the pytest plugin :mod:`harness.pytest_plugin`. The harness knows
ranks, pools, faults, accounting and pytest, and nothing of what the ranks compute.

Importing this package does not import torch; the parts that need it import it when used.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from harness.context import RankContext
from harness.errors import (
    CaseFailure,
    CaseTimeout,
    HarnessError,
    PoolStartError,
    PoolUnavailable,
    RankCrashed,
    RankError,
    RankOutcome,
)
from harness.launchers import get_pool, shutdown_all_pools
from harness.pool import RankPool, active_pools
from harness.pool_base import Pool

if TYPE_CHECKING:
    from harness.accounting import CollectiveCall, CollectiveLog


def __getattr__(name: str) -> Any:
    # CollectiveLog needs torch; keep `import harness` light for the pytest controller.
    if name in ("CollectiveLog", "CollectiveCall"):
        from harness import accounting

        return getattr(accounting, name)
    raise AttributeError(f"module 'harness' has no attribute {name!r}")


__all__ = [
    "CaseFailure",
    "CaseTimeout",
    "CollectiveCall",
    "CollectiveLog",
    "HarnessError",
    "Pool",
    "PoolStartError",
    "PoolUnavailable",
    "RankContext",
    "RankCrashed",
    "RankError",
    "RankOutcome",
    "RankPool",
    "active_pools",
    "get_pool",
    "shutdown_all_pools",
]
