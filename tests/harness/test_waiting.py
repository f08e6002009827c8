"""The pool's one wait loop (harness.waiting.gather) on real pipes: answers, late replies, the
deadline, and the grace period after a failure."""

from __future__ import annotations

import multiprocessing
import time
from typing import Any

from harness.errors import ERROR, OK, RankOutcome
from harness.waiting import gather


def _pipes(n: int) -> tuple[list[Any], list[Any]]:
    ends = [multiprocessing.Pipe(duplex=True) for _ in range(n)]
    return [ours for ours, _ in ends], [theirs for _, theirs in ends]


def _reader(conns: list[Any], wanted: str = "now"):
    def receive(rank: int, ready: Any) -> RankOutcome | None:
        tag, ok = conns[rank].recv()
        if tag != wanted:
            return None  # a late reply to an earlier request
        return RankOutcome(rank, ok, status=OK if ok else ERROR)

    return receive


def test_every_rank_answers() -> None:
    ours, theirs = _pipes(3)
    for conn in theirs:
        conn.send(("now", True))
    gathered = gather(3, lambda rank: [ours[rank]], _reader(ours), timeout=5.0, grace=1.0)
    assert (
        sorted(gathered.outcomes) == [0, 1, 2] and gathered.unfinished == [] and not gathered.failed
    )


def test_a_late_reply_is_not_an_answer() -> None:
    ours, theirs = _pipes(2)
    theirs[0].send(("earlier", False))
    theirs[0].send(("now", True))
    theirs[1].send(("now", True))
    gathered = gather(2, lambda rank: [ours[rank]], _reader(ours), timeout=5.0, grace=1.0)
    assert gathered.outcomes[0].ok and not gathered.failed


def test_silent_ranks_are_left_unfinished_at_the_deadline() -> None:
    ours, theirs = _pipes(2)
    theirs[1].send(("now", True))
    began = time.monotonic()
    gathered = gather(2, lambda rank: [ours[rank]], _reader(ours), timeout=0.5, grace=10.0)
    assert 0.5 <= time.monotonic() - began < 5.0
    assert gathered.unfinished == [0] and list(gathered.outcomes) == [1] and not gathered.failed


def test_after_a_failure_the_others_get_the_grace_period_only() -> None:
    ours, theirs = _pipes(3)
    theirs[2].send(("now", False))
    theirs[0].send(("now", True))
    began = time.monotonic()
    gathered = gather(3, lambda rank: [ours[rank]], _reader(ours), timeout=60.0, grace=0.3)
    assert time.monotonic() - began < 10.0, "the silent rank was waited on for the whole timeout"
    assert gathered.failed and gathered.unfinished == [1]
    assert not gathered.outcomes[2].ok and gathered.outcomes[0].ok
