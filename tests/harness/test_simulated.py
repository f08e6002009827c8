"""The simulated launcher (harness/simulated.py): its collectives equal a gloo pool's, failures
are attributed as a process pool attributes them, a deadlock is reported at once."""

from __future__ import annotations

import time

import pytest

from harness import CaseTimeout, RankError, get_pool
from harness.errors import ABORTED, ERROR, TIMEOUT
from harness.simulated import shutdown_simulated_pools, simulated_pool
from tests.harness import rank_fns


@pytest.fixture(scope="module", autouse=True)
def _simulated_pools_end_with_the_module():
    """The simulated world swaps in per-thread torch.distributed state while a pool lives: leave
    the process as the other tests of this worker expect it."""
    yield
    shutdown_simulated_pools()


@pytest.mark.parametrize("w", [2, 3])
def test_collectives_equal_a_gloo_pool(w: int) -> None:
    """Values and the accounting of every collective the ring and the suites use (eager calls,
    which a Python process group serves without the dispatcher, counted as gloo's are)."""
    simulated = simulated_pool(w).run(rank_fns.collectives_round)
    real = get_pool(w, backend="gloo", device="cpu").run(rank_fns.collectives_round)
    assert simulated == real


def test_world_of_64_ranks() -> None:
    results = simulated_pool(64).run(rank_fns.collectives_round)
    assert results[5]["all_reduce"] == [64 * 65 / 2] * 2
    assert results[5]["recv"] == [4.0] * 3 and results[0]["recv"] == [63.0] * 3
    assert results[5]["all_to_all"] == [10.0 * r + 5 for r in range(64)]
    assert results[0]["collectives"]["default"]["send"] == {"calls": 1, "bytes": 12}


def test_mesh_groups_of_an_8x8_mesh() -> None:
    results = simulated_pool(64).run(rank_fns.mesh_groups, (8, 8))
    ranks, total = results[9]["b"]  # rank 9 = row 1, column 1: its row is ranks 8..15
    assert ranks == list(range(8, 16)) and total == sum(range(8, 16))
    ranks, total = results[9]["a"]
    assert ranks == list(range(1, 64, 8)) and total == sum(range(1, 64, 8))


def test_deadlock_is_reported_at_once_with_what_each_rank_waits_for() -> None:
    start = time.monotonic()
    with pytest.raises(CaseTimeout) as info:
        simulated_pool(4).run(rank_fns.skip_all_reduce_on_rank0, timeout=60)
    assert time.monotonic() - start < 30
    text = str(info.value)
    assert "deadlocked" in text and "rank 1 waits for all_reduce #0" in text, text
    assert [o.status for o in info.value.outcomes] == ["ok", ABORTED, ABORTED, ABORTED]
    # the pool is kept and runs the next case
    assert simulated_pool(4).run(rank_fns.all_reduce_sum, 1) == [10.0] * 4


def test_a_rank_that_raises_aborts_the_ranks_waiting_for_it() -> None:
    with pytest.raises(RankError) as info:
        simulated_pool(3).run(rank_fns.raise_on_rank1_then_all_reduce, timeout=60)
    statuses = [o.status for o in info.value.outcomes]
    assert statuses == [ABORTED, ERROR, ABORTED]
    assert "rank 1 raised ValueError: rank 1 rejects its input" in str(info.value)


def test_collectives_that_differ_between_ranks_fail_on_every_rank() -> None:
    with pytest.raises(RankError) as info:
        simulated_pool(3).run(rank_fns.mismatched_collectives, timeout=60)
    assert [o.status for o in info.value.outcomes] == [ERROR] * 3
    assert "rank 0 all_gather, rank 1 all_reduce, rank 2 all_reduce" in str(info.value)


def test_each_rank_keeps_its_own_generator_state() -> None:
    """As in a process: every rank seeded alike draws the same numbers whatever the others drew."""
    results = simulated_pool(3).run(rank_fns.draw_random, seed=11)
    assert results[0] == results[1] == results[2]


def test_a_case_past_its_timeout_fails_with_stacks_and_the_next_gets_a_fresh_pool() -> None:
    pool = simulated_pool(2)
    start = time.monotonic()
    with pytest.raises(CaseTimeout) as info:
        pool.run(rank_fns.compute_past_the_timeout_on_rank0, 4.0, timeout=1.0)
    assert time.monotonic() - start < 3.5  # the pytest side does not wait for the stuck rank
    assert info.value.outcomes[0].status == TIMEOUT
    assert "compute_past_the_timeout_on_rank0" in info.value.outcomes[0].stack
    assert simulated_pool(2) is not pool
    assert simulated_pool(2).run(rank_fns.all_reduce_sum, 1) == [3.0, 3.0]
