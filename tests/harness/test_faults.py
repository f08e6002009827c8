"""Acceptance tests of fault handling with real rank processes.

Every fault must end the case within its timeout with every rank's traceback or stack, leave the
pool rebuilt, and let the next case pass. Timeouts are short so the suite stays quick.
"""

from __future__ import annotations

import time
from collections.abc import Iterator

import pytest

from harness import CaseTimeout, RankCrashed, RankError, get_pool, settings
from harness.pool import RankPool
from tests.harness import rank_fns

FAULT_TIMEOUT_S = 10.0


@pytest.fixture
def pool() -> RankPool:
    pool = get_pool(2)
    assert isinstance(pool, RankPool)
    return pool


def assert_next_case_passes(pool: RankPool, old_pids: list[int]) -> None:
    __tracebackhide__ = True
    assert pool.run(rank_fns.all_reduce_sum, 2, timeout=FAULT_TIMEOUT_S) == [6.0, 6.0]
    new_pids = pool.pids
    assert not set(new_pids) & set(old_pids), f"pool was not rebuilt: {old_pids} -> {new_pids}"


def test_rank_raises_while_peer_waits_in_collective(pool: RankPool) -> None:
    old = pool.pids
    began = time.monotonic()
    with pytest.raises(RankError) as info:
        pool.run(rank_fns.raise_on, 1, True, timeout=60.0)
    elapsed = time.monotonic() - began
    # the blocked peer is not waited on for the 60 s timeout, only for the grace period
    # (plus stack collection and slack for a loaded machine)
    assert elapsed < settings.current().grace + 10.0, f"took {elapsed:.1f} s"
    failure = info.value
    assert failure.outcomes[1].status == "error"
    assert failure.outcomes[1].exc_message == "bad input detected on rank 1"
    blocked = failure.outcomes[0]
    assert blocked.status == "aborted"
    assert "after rank 1 failed" in blocked.exc_message
    assert "all_reduce" in blocked.stack and "rank_fns.py" in blocked.stack
    text = str(failure)
    assert "rank 1 raised ValueError" in text and "rank 0 was still running" in text
    assert "test_rank_raises_while_peer_waits_in_collective" in text
    assert_next_case_passes(pool, old)


@pytest.mark.parametrize("code", [3, 0])
def test_rank_exits(pool: RankPool, code: int) -> None:
    old = pool.pids
    with pytest.raises(RankCrashed) as info:
        pool.run(rank_fns.exit_on, 1, code, timeout=FAULT_TIMEOUT_S)
    crashed = info.value.outcomes[1]
    assert crashed.status == "crashed"
    assert f"exited with code {code}" in crashed.exc_message
    assert f"pid {old[1]}" in crashed.exc_message
    assert "rank 1" in str(info.value) and "tests.harness.rank_fns.exit_on" in str(info.value)
    assert_next_case_passes(pool, old)


def test_rank_killed_by_sigkill(pool: RankPool) -> None:
    old = pool.pids
    began = time.monotonic()
    with pytest.raises(RankCrashed) as info:
        pool.run(rank_fns.sigkill_on, 0, timeout=FAULT_TIMEOUT_S)
    assert time.monotonic() - began < FAULT_TIMEOUT_S
    assert "killed by signal SIGKILL" in info.value.outcomes[0].exc_message
    # the survivor either saw gloo's connection error or was stopped after the grace period
    assert info.value.outcomes[1].status in ("error", "aborted")
    assert_next_case_passes(pool, old)


def test_segfault_report_carries_the_rank_output_and_fatal_error(pool: RankPool) -> None:
    old = pool.pids
    with pytest.raises(RankCrashed) as info:
        pool.run(rank_fns.segfault_on, 1, timeout=FAULT_TIMEOUT_S)
    crashed = info.value.outcomes[1]
    assert "killed by signal SIGSEGV" in crashed.exc_message
    # what the rank printed, and faulthandler's fatal-error stack, are in the report
    assert "rank 1 about to crash" in crashed.output
    assert "Fatal Python error: Segmentation fault" in crashed.output
    assert "segfault_on" in crashed.output
    assert "rank 1 about to crash" in str(info.value)
    assert_next_case_passes(pool, old)


def test_every_rank_hangs_in_a_collective(pool: RankPool) -> None:
    old = pool.pids
    timeout = 3.0
    began = time.monotonic()
    with pytest.raises(CaseTimeout) as info:
        pool.run(rank_fns.hang_in_collective, timeout=timeout)
    elapsed = time.monotonic() - began
    assert timeout <= elapsed < timeout + 10.0, f"took {elapsed:.1f} s for a {timeout} s timeout"
    for outcome in info.value.outcomes:
        assert outcome.status == "timeout"
        assert "hang_in_collective" in outcome.stack, outcome.stack
        assert "recv" in outcome.stack
    text = str(info.value)
    assert "did not finish within 3 s" in text
    assert "rank 0 had not finished" in text and "rank 1 had not finished" in text
    assert_next_case_passes(pool, old)


def test_one_rank_skips_a_collective(pool: RankPool) -> None:
    old = pool.pids
    with pytest.raises(CaseTimeout) as info:
        pool.run(rank_fns.skip_collective, 1, timeout=3.0)
    waiting, skipper = info.value.outcomes
    assert skipper.ok and skipper.value == 0.0
    assert waiting.status == "timeout"
    assert "skip_collective" in waiting.stack and "all_reduce" in waiting.stack
    assert info.value.failed_ranks == [0]
    assert_next_case_passes(pool, old)


@pytest.fixture
def short_default_timeout() -> Iterator[float]:
    previous = settings.current()
    settings.install(previous.with_(case_timeout=2.0))
    try:
        yield 2.0
    finally:
        settings.install(previous)


def test_default_timeout_comes_from_the_settings(
    pool: RankPool, short_default_timeout: float
) -> None:
    old = pool.pids
    began = time.monotonic()
    with pytest.raises(CaseTimeout, match="did not finish within 2 s"):
        pool.run(rank_fns.hang_in_collective)
    assert time.monotonic() - began < short_default_timeout + 10.0
    assert_next_case_passes(pool, old)


def test_slow_case_within_its_timeout_passes(pool: RankPool) -> None:
    assert pool.run(rank_fns.sleep_then_sum, 0.5, timeout=FAULT_TIMEOUT_S) == [3.0, 3.0]


def test_faults_in_a_row_each_rebuild(pool: RankPool) -> None:
    for code in (5, 6):
        old = pool.pids
        with pytest.raises(RankCrashed, match=f"exited with code {code}"):
            pool.run(rank_fns.exit_on, 0, code, timeout=FAULT_TIMEOUT_S)
        assert_next_case_passes(pool, old)
