"""What the ranks print: per-rank log files, read after each case.

Each rank writes its stdout and stderr to its own log file (:mod:`harness.rank_main`). After a
case the pool copies what each rank wrote during the case to its own stderr, prefixed with the
rank (pytest captures it with the test), and attaches the tail to the outcome of a failed rank.
"""

from __future__ import annotations

import os
import sys
import time
from collections.abc import Mapping, Sequence

from harness.errors import RankOutcome

__all__ = ["OUTPUT_TAIL_CHARS", "RankOutput"]

#: How much of a rank's output an outcome keeps.
OUTPUT_TAIL_CHARS = 4000


class RankOutput:
    """The log files of a pool's ranks (index = rank) and how far each has been read."""

    def __init__(self, log_paths: Sequence[str]) -> None:
        self.log_paths = list(log_paths)
        self.offsets = [0] * len(self.log_paths)

    def new(self, rank: int) -> str:
        """What ``rank`` wrote since the last read."""
        if rank >= len(self.log_paths):
            return ""
        try:
            size = os.path.getsize(self.log_paths[rank])
        except OSError:
            return ""
        if size <= self.offsets[rank]:
            return ""
        with open(self.log_paths[rank], "rb") as f:
            f.seek(self.offsets[rank])
            data = f.read()
        self.offsets[rank] = size
        return data.decode(errors="replace")

    def tail(self, rank: int) -> str:
        """The end of what ``rank`` wrote since the last read."""
        return self.new(rank)[-OUTPUT_TAIL_CHARS:]

    def attach(self, outcomes: Mapping[int, RankOutcome]) -> None:
        """Give every failed outcome the tail of its rank's output."""
        # Give a dying rank a moment to flush what it wrote (an abort message, a fatal error).
        time.sleep(0.05)
        for rank, outcome in outcomes.items():
            if not outcome.ok:
                outcome.output = self.tail(rank)

    def forward(self, outcomes: Sequence[RankOutcome]) -> None:
        """Copy what the ranks printed during the case to
        this process's stderr (pytest captures it)."""
        for outcome in outcomes:
            text = self.new(outcome.rank)
            if outcome.ok and text:
                outcome.output = text[-OUTPUT_TAIL_CHARS:]
            if text:
                prefix = f"[rank {outcome.rank}] "
                sys.stderr.write(
                    "".join(prefix + line + "\n" for line in text.rstrip("\n").split("\n"))
                )
