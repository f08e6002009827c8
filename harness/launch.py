"""What every launcher's pool is: ``run`` and ``run_outcomes`` over one ``_execute``.

A launcher starts ranks its own way (:mod:`harness.pool`: rank processes per pytest process;
:mod:`harness.torchrun`: this process is one rank of a torchrun job) and implements
:meth:`Pool._execute`: run ``fn(ctx, *args, **kwargs)`` on every rank and return every rank's
:class:`~harness.errors.RankOutcome` with the :class:`~harness.errors.CaseFailure` they amount to
(None when every rank returned). ``run`` and ``run_outcomes`` are written once, here, on top of it.
"""

from __future__ import annotations

import os
import threading
from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

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

__all__ = ["Pool", "case_failure", "case_label", "shutdown_pools"]


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
    def _execute(
        self,
        fn: Callable[..., Any],
        args: Sequence[Any],
        kwargs: dict[str, Any],
        timeout: float | None,
        seed: int,
    ) -> tuple[list[RankOutcome], CaseFailure | None]:
        """Run ``fn(ctx, *args, **kwargs)`` on every rank: each rank's outcome (index = rank) and
        the failure they amount to, or None when every rank returned."""

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
        outcomes, failure = self._execute(fn, args, kwargs, timeout, seed)
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
        outcomes, failure = self._execute(fn, args, kwargs, timeout, seed)
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
