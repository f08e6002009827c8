"""Stacks of ranks that hang: every thread's Python stack, asked for with SIGUSR1.

Each rank registers :mod:`faulthandler` for SIGUSR1 with a per-rank stack file
(:mod:`harness.rank_main`); the pool signals the ranks that did not finish and reads what each
appended to its file.
"""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Mapping

__all__ = ["dump_stacks"]

#: How long a rank gets to write its stack after the signal.
DUMP_TIMEOUT_S = 2.0


def dump_stacks(ranks: Mapping[int, tuple[int, str]]) -> dict[int, str]:
    """Every thread's stack of each rank in ``ranks`` (rank -> (pid, stack file)), by rank.

    A rank that wrote nothing within :data:`DUMP_TIMEOUT_S` gets a line that says so.
    """
    if not ranks:
        return {}
    before = {}
    for rank, (pid, stack_path) in ranks.items():
        before[rank] = os.path.getsize(stack_path) if os.path.exists(stack_path) else 0
        try:
            os.kill(pid, signal.SIGUSR1)
        except ProcessLookupError:
            pass
    deadline = time.monotonic() + DUMP_TIMEOUT_S
    grown: set[int] = set()
    while time.monotonic() < deadline and len(grown) < len(ranks):
        time.sleep(0.02)
        for rank, (_, stack_path) in ranks.items():
            if os.path.exists(stack_path) and os.path.getsize(stack_path) > before[rank]:
                grown.add(rank)
    time.sleep(0.05)  # let a dump that started finish writing
    stacks = {}
    for rank, (_, stack_path) in ranks.items():
        try:
            with open(stack_path, errors="replace") as f:
                f.seek(before[rank])
                stacks[rank] = f.read()
        except OSError:
            stacks[rank] = ""
        if not stacks[rank]:
            stacks[rank] = (
                f"(the rank did not dump its stack within {DUMP_TIMEOUT_S:g} s of SIGUSR1)"
            )
    return stacks
