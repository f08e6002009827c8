"""Per-rank outcomes and the exceptions a failed case raises.

A case runs one function on every rank; each rank ends in a :class:`RankOutcome`. When any rank
did not end well, the pool raises a :class:`CaseFailure` subclass whose ``str()`` names the case,
the function, every failed rank and carries every failed rank's traceback or stack, so a pytest
failure report is enough to diagnose a distributed failure without re-running it.

Status of a rank, in :attr:`RankOutcome.status`:

``ok``        the function returned; ``value`` holds its return value.
``error``     the function raised; ``exc_type`` / ``exc_message`` / ``traceback`` describe it.
``crashed``   the rank process died (``os._exit``, a signal, a C++ abort).
``timeout``   the rank had not finished when the case timeout ran out; ``stack`` holds its stack.
``aborted``   the rank was still running after another rank failed and the grace period ran out
              (typically blocked in a collective its failed peer never joined); ``stack`` holds it.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

OK = "ok"
ERROR = "error"
CRASHED = "crashed"
TIMEOUT = "timeout"
ABORTED = "aborted"


@dataclass
class RankOutcome:
    """What one rank did in one case.

    The first six fields are the stable contract the suites use; ``status``, ``stack``,
    ``output`` and ``duration_s`` add detail for reports.
    """

    rank: int
    ok: bool
    value: Any = None
    exc_type: str = ""
    exc_message: str = ""
    traceback: str = ""
    status: str = OK
    stack: str = ""
    output: str = ""
    duration_s: float = 0.0

    def describe(self) -> str:
        """One line: what happened on this rank."""
        if self.status == OK:
            return f"rank {self.rank} finished"
        if self.status == ERROR:
            return f"rank {self.rank} raised {self.exc_type}: {_first_line(self.exc_message)}"
        return f"rank {self.rank} {self.exc_message}"

    def details(self) -> str:
        """The traceback, the stack and the captured output of a failed rank, for reports."""
        parts: list[str] = []
        if self.traceback:
            parts.append(self.traceback.rstrip())
        if self.stack:
            parts.append(
                "Python stack of every thread (most recent call first):\n" + self.stack.rstrip()
            )
        if self.output:
            parts.append("last output of the rank:\n" + self.output.rstrip())
        return "\n".join(parts) if parts else "(no traceback or stack available)"


def unfinished_outcome(
    rank: int, stack: str, *, timeout: float, grace: float = 0.0, failed_rank: int | None = None
) -> RankOutcome:
    """The outcome of a rank that had not answered when the wait for a case ended: ``timeout``
    when no rank had failed (the case timeout ran out), ``aborted`` when rank ``failed_rank``
    failed and the ``grace`` seconds after it ran out. ``stack``: the rank's stack, if dumped."""
    if failed_rank is None:
        text = f"had not finished when the {timeout:g} s case timeout ran out"
        status = TIMEOUT
    else:
        text = (
            f"was still running {grace:g} s after rank {failed_rank} failed "
            f"(blocked in a collective rank {failed_rank} never joined?)"
        )
        status = ABORTED
    return RankOutcome(
        rank, False, None, f"harness.{status.title()}", text, status=status, stack=stack
    )


def _first_line(text: str, limit: int = 300) -> str:
    line = text.strip().splitlines()[0] if text.strip() else ""
    return line if len(line) <= limit else line[: limit - 3] + "..."


class HarnessError(Exception):
    """Base class of every error the harness raises."""


class PoolUnavailable(HarnessError):
    """The requested pool cannot exist here (too few GPUs, a world size torchrun did not launch).

    The pytest fixtures turn this into a skip whose reason is this message, so the message says
    what is missing and how to enable it.
    """


class CaseFailure(HarnessError):
    """A case failed on at least one rank.

    Attributes: ``case`` (the case label, normally the pytest node id), ``fn_name`` (qualified
    name of the rank function), ``world_size``, ``backend``, ``device``, ``outcomes`` (one
    :class:`RankOutcome` per rank, index = rank) and ``note`` (what the harness did about it).
    """

    kind = "case failed"

    def __init__(
        self,
        *,
        case: str,
        fn_name: str,
        world_size: int,
        backend: str,
        device: str,
        outcomes: Sequence[RankOutcome],
        note: str = "",
        headline: str = "",
    ) -> None:
        self.case = case
        self.fn_name = fn_name
        self.world_size = world_size
        self.backend = backend
        self.device = device
        self.outcomes = list(outcomes)
        self.note = note
        self.headline = headline
        super().__init__(self._render())

    @property
    def failed(self) -> list[RankOutcome]:
        """Outcomes of the ranks that did not finish normally."""
        return [o for o in self.outcomes if not o.ok]

    @property
    def failed_ranks(self) -> list[int]:
        return [o.rank for o in self.failed]

    def _render(self) -> str:
        where = (
            f"case {self.case!r} (fn {self.fn_name}, world_size={self.world_size}, "
            f"{self.backend}/{self.device})"
        )
        summary = "; ".join(o.describe() for o in self.failed)
        head = f"{self.kind}: {where}"
        if self.headline:
            head += f": {self.headline}"
        lines = [head, summary]
        if self.note:
            lines.append(self.note)
        for outcome in self.failed:
            lines.append("")
            lines.append(f"--- rank {outcome.rank} ({outcome.status}) ---")
            lines.append(outcome.details())
        return "\n".join(lines)

    def __reduce__(self) -> tuple[Any, ...]:
        # Keyword-only __init__ does not survive the default exception pickling (torchrun mode and
        # xdist both pickle exceptions).
        return (
            _rebuild_case_failure,
            (
                type(self),
                dict(
                    case=self.case,
                    fn_name=self.fn_name,
                    world_size=self.world_size,
                    backend=self.backend,
                    device=self.device,
                    outcomes=self.outcomes,
                    note=self.note,
                    headline=self.headline,
                ),
            ),
        )


def _rebuild_case_failure(cls: type[CaseFailure], kwargs: dict[str, Any]) -> CaseFailure:
    return cls(**kwargs)


class RankError(CaseFailure):
    """At least one rank raised an exception (and no rank process died)."""

    kind = "rank error"


class RankCrashed(CaseFailure):
    """At least one rank process died while running the case."""

    kind = "rank crashed"


class CaseTimeout(CaseFailure):
    """The case did not finish within its timeout and no rank raised or died first."""

    kind = "case timeout"


class PoolStartError(CaseFailure):
    """The rank processes could not be started or could not form their process group."""

    kind = "pool start failed"
