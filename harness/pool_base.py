"""What every launcher's pool is: ``run`` and ``run_outcomes`` over one ``_execute``.

A launcher starts ranks its own way (:mod:`harness.pool`: rank processes per pytest process;
:mod:`harness.torchrun`: this process is one rank of a torchrun job) and implements
:meth:`Pool._execute`: run a :class:`CaseCall` (``fn(ctx, *args, **kwargs)``) on every rank and
return every rank's :class:`~harness.errors.RankOutcome` with the
:class:`~harness.errors.CaseFailure` they amount to (None when every rank returned). ``run`` and
``run_outcomes`` are written once, here, on top of it.
"""

from __future__ import annotations

import os
import threading
from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TypeVar

from harness import wire
from harness.errors import (
    CRASHED,
    ERROR,
    OK,
    CaseFailure,
    CaseTimeout,
    RankCrashed,
    RankError,
    RankOutcome,
)
from harness.settings import current

__all__ = ["CaseCall", "Pool", "case_failure", "case_label", "shutdown_pools"]


@dataclass(frozen=True)
class CaseCall:
    """One case as :meth:`Pool.run` hands it to a launcher: ``fn(ctx, *args, **kwargs)`` on every
    rank, seeded with ``seed``, within ``timeout`` seconds (None: the pool's or the session's
    limit)."""

    fn: Callable[..., Any]
    args: tuple[Any, ...]
    kwargs: dict[str, Any]
    timeout: float | None
    seed: int

    @property
    def fn_name(self) -> str:
        """``module.qualname`` of ``fn``, as failures and reports name the case's function."""
        return wire.qualified_name(self.fn)

    def timeout_s(self, pool_timeout: float | None = None) -> float:
        """The case's time limit in seconds: its own ``timeout``, else the pool's
        ``pool_timeout``, else the session's ``case_timeout`` setting."""
        if self.timeout is not None:
            return float(self.timeout)
        return float(pool_timeout or current().case_timeout)

    def label(self, case_id: int) -> str:
        """The case's name in failures: the running pytest node id, or ``fn_name #case_id``
        outside pytest (``case_id`` counts the pool's cases)."""
        return case_label(f"{self.fn_name} #{case_id}")


class Pool(ABC):
    """A pool of ``world_size`` ranks that runs cases; what suites use, whatever the launcher."""

    world_size: int
    backend: str
    device: str

    @property
    @abstractmethod
    def pids(self) -> list[int]:
        """Process ids of the ranks this pool drives (torchrun: this process only)."""

    @abstractmethod
    def _execute(self, case: CaseCall) -> tuple[list[RankOutcome], CaseFailure | None]:
        """Run ``case.fn(ctx, *case.args, **case.kwargs)`` on every rank: each rank's outcome
        (index = rank) and the failure they amount to, or None when every rank returned."""

    @abstractmethod
    def shutdown(self) -> None:
        """Stop the ranks and release what the pool holds; safe to call more than once."""

    def run(
        self,
        fn: Callable[..., Any],
        *args: Any,
        timeout: float | None = None,
        seed: int = 0,
        **kwargs: Any,
    ) -> list[Any]:
        """Run ``fn(ctx, *args, **kwargs)`` on every rank; return the values, index = rank.

        Raises :class:`RankError`, :class:`RankCrashed` or :class:`CaseTimeout` (all
        :class:`CaseFailure`) when any rank did not return.
        """
        __tracebackhide__ = True  # pytest: show the test's line, not the harness internals
        outcomes, failure = self._execute(CaseCall(fn, args, kwargs, timeout, seed))
        if failure is not None:
            raise failure
        return [o.value for o in outcomes]

    def run_outcomes(
        self,
        fn: Callable[..., Any],
        *args: Any,
        timeout: float | None = None,
        seed: int = 0,
        **kwargs: Any,
    ) -> list[RankOutcome]:
        """Run like :meth:`run` but return every rank's :class:`RankOutcome`, raised or not.

        For tests that expect ranks to raise. A rank that died or a case that timed out still
        raises (:class:`RankCrashed`, :class:`CaseTimeout`): those are never an expected result.
        """
        __tracebackhide__ = True
        outcomes, failure = self._execute(CaseCall(fn, args, kwargs, timeout, seed))
        if failure is not None and not isinstance(failure, RankError):
            raise failure
        return outcomes


_P = TypeVar("_P", bound=Pool)


def shutdown_pools(pools: dict[Any, _P], lock: threading.Lock) -> None:
    """Empty a launcher's registry of this process's pools (``pools``, guarded by ``lock``) and
    shut down every pool it held, each whatever the others raise: safe to call more than once
    (session end, atexit, signals)."""
    with lock:
        held = list(pools.values())
        pools.clear()
    for pool in held:
        try:
            pool.shutdown()
        except Exception:
            pass


def case_label(fallback: str) -> str:
    """The current pytest node id (from PYTEST_CURRENT_TEST), or ``fallback`` outside pytest."""
    current_test = os.environ.get("PYTEST_CURRENT_TEST", "")
    if current_test:
        return current_test.rsplit(" (", 1)[0]
    return fallback


def case_failure(
    pool: Pool,
    label: str,
    fn_name: str,
    outcomes: list[RankOutcome],
    *,
    timeout: float,
    note: str = "",
    headline: str = "",
) -> CaseFailure | None:
    """The failure that ``outcomes`` amount to (None when every rank returned).

    A rank that died makes it :class:`RankCrashed`; else a rank that raised :class:`RankError`;
    else (ranks timed out or were aborted) :class:`CaseTimeout`. ``headline`` replaces the
    default one-line summary of what happened.
    """
    statuses = {o.status for o in outcomes}
    if statuses == {OK}:
        return None
    cls: type[CaseFailure]
    if CRASHED in statuses:
        cls, default = RankCrashed, "a rank process died"
    elif ERROR in statuses:
        cls, default = RankError, "a rank raised"
    else:
        cls, default = CaseTimeout, f"did not finish within {timeout:g} s"
    return cls(
        case=label,
        fn_name=fn_name,
        world_size=pool.world_size,
        backend=pool.backend,
        device=pool.device,
        outcomes=outcomes,
        note=note,
        headline=headline or default,
    )
