"""Assertions on the per-rank outcomes of a case whose ranks are expected to raise
(``pool.run_outcomes``): an error a user can cause must be raised on every rank, without a hang."""

from __future__ import annotations

from collections.abc import Sequence

from harness.errors import RankOutcome


def assert_every_rank_raised(
    outcomes: Sequence[RankOutcome], error: str | None = None, *, clip: int | None = None
) -> list[tuple]:
    """Assert that every rank raised, an exception whose type name ends with ``error`` when one
    is given (``"InputError"``, ``"ContextParallelError"``). Returns each rank's ``(rank, ok,
    exc_type, exc_message[:clip])``, the message of the caller's further assertions."""
    __tracebackhide__ = True
    summary = [(o.rank, o.ok, o.exc_type, o.exc_message[:clip]) for o in outcomes]
    assert all(not o.ok and (error is None or o.exc_type.endswith(error)) for o in outcomes), (
        summary
    )
    return summary


def assert_input_error_on_every_rank(outcomes: Sequence[RankOutcome], pattern: str) -> None:
    """Assert that every rank raised InputError and that some rank's message contains
    ``pattern`` (the rank that found the bad input says what it is; the others may only say
    that a peer rejected it)."""
    __tracebackhide__ = True
    summary = assert_every_rank_raised(outcomes, "InputError")
    assert any(pattern in o.exc_message for o in outcomes), summary
