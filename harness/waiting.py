"""The pool's one wait loop: every rank's answer within a deadline, cut short after a failure.

Waiting for ranks to join their process group and waiting for a case's results follow one rule:
wait on every rank that has not answered until the deadline; once a rank failed, the others get
``grace`` seconds more (they may be blocked in a collective the failed rank never joined), and
whoever has not answered by then is left unfinished for the caller to deal with (dump its stack,
kill the ranks).
"""

from __future__ import annotations

import multiprocessing.connection
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from harness.errors import RankOutcome

__all__ = ["Gathered", "gather"]


@dataclass
class Gathered:
    """What :func:`gather` got: an outcome per rank that answered, and the ranks that did not."""

    outcomes: dict[int, RankOutcome]
    unfinished: list[int]

    @property
    def failed(self) -> bool:
        """True when a rank that answered did not end well."""
        return any(not o.ok for o in self.outcomes.values())


def _key(waitable: Any) -> tuple[str, int]:
    # Sentinels are file descriptors (ints); connections are objects.
    return ("fd", waitable) if isinstance(waitable, int) else ("object", id(waitable))


def gather(
    world_size: int,
    waitables: Callable[[int], Sequence[Any]],
    receive: Callable[[int, Any], RankOutcome | None],
    *,
    timeout: float,
    grace: float,
) -> Gathered:
    """Wait for an outcome from every rank ``0 .. world_size - 1``.

    ``waitables(rank)``: what to wait on for a rank (its connection, its process sentinel), for
    :func:`multiprocessing.connection.wait`. ``receive(rank, ready)``: called when one of them is
    ready; returns the rank's outcome, or None when that was not its answer (a late reply to an
    earlier request, a sentinel whose connection still holds unread data): keep waiting.

    Returns at the latest ``timeout`` seconds from now, or ``grace`` seconds after the first
    outcome that is not ok.
    """
    deadline = time.monotonic() + timeout
    failed_at: float | None = None
    outcomes: dict[int, RankOutcome] = {}
    while len(outcomes) < world_size:
        limit = deadline if failed_at is None else min(deadline, failed_at + grace)
        now = time.monotonic()
        if now >= limit:
            break
        owner: dict[tuple[str, int], int] = {}
        pending: list[Any] = []
        for rank in range(world_size):
            if rank not in outcomes:
                for waitable in waitables(rank):
                    owner[_key(waitable)] = rank
                    pending.append(waitable)
        for ready in multiprocessing.connection.wait(pending, timeout=limit - now):
            rank = owner[_key(ready)]
            if rank in outcomes:
                continue
            outcome = receive(rank, ready)
            if outcome is None:
                continue
            outcomes[rank] = outcome
            if failed_at is None and not outcome.ok:
                failed_at = time.monotonic()
    return Gathered(outcomes, [r for r in range(world_size) if r not in outcomes])
