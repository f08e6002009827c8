"""Acceptance tests of rank pools: results, attribution, seeds, reuse,
isolation (real processes)."""

from __future__ import annotations

import os
import sys

import pytest
import torch

from harness import CaseFailure, PoolStartError, RankError, RankOutcome, get_pool, settings
from harness.pool import RankPool
from harness.procs import run_tree
from tests.harness import rank_fns
from tests.harness.subproc import clean_env


def test_values_come_back_indexed_by_rank() -> None:
    pool = get_pool(3, backend="gloo", device="cpu")
    infos = pool.run(rank_fns.rank_info)
    assert [i["rank"] for i in infos] == [0, 1, 2]
    assert [i["dist_rank"] for i in infos] == [0, 1, 2]
    assert {i["world_size"] for i in infos} == {3}
    assert {i["dist_world_size"] for i in infos} == {3}
    assert [i["pid"] for i in infos] == pool.pids
    assert len(set(pool.pids)) == 3 and os.getpid() not in pool.pids
    assert {i["device"] for i in infos} == {"cpu"}
    assert {i["backend"] for i in infos} == {"gloo"}
    assert all(i["tmp_dir_exists"] for i in infos)


def test_case_label_is_the_pytest_node_id() -> None:
    infos = get_pool(2).run(rank_fns.rank_info, seed=7)
    assert {i["case"] for i in infos} == {
        "tests/harness/test_pool.py::test_case_label_is_the_pytest_node_id"
    }
    assert {i["seed"] for i in infos} == {7}


def test_cpu_ranks_default_to_one_thread() -> None:
    infos = get_pool(2).run(rank_fns.rank_info)
    assert {i["threads"] for i in infos} == {1}


def test_ranks_get_the_parent_sys_path_and_cwd(monkeypatch: pytest.MonkeyPatch) -> None:
    infos = get_pool(2).run(rank_fns.rank_info)
    for info in infos:
        assert info["sys_path"] == sys.path
        assert info["cwd"] == os.getcwd()


def test_all_reduce_result() -> None:
    # ranks contribute 1 and 2, four elements each: every rank sees 4 * 3 = 12
    assert get_pool(2).run(rank_fns.all_reduce_sum, 4) == [12.0, 12.0]


def test_args_kwargs_and_tensor_results_round_trip() -> None:
    tensor = torch.arange(6, dtype=torch.float64).reshape(2, 3)
    results = get_pool(2).run(rank_fns.echo, tensor, scale=2.0)
    for rank, result in enumerate(results):
        assert isinstance(result, torch.Tensor)
        assert result.dtype == torch.float64
        torch.testing.assert_close(result, tensor * 2.0 + rank)


def test_same_seed_gives_identical_draws_on_every_rank() -> None:
    pool = get_pool(3)
    first = pool.run(rank_fns.draw_random, seed=123)
    assert first[0] == first[1] == first[2], "ranks drew different inputs from the same seed"
    again = pool.run(rank_fns.draw_random, seed=123)
    assert again == first, "the same seed must give the same draws in a later case"
    other = pool.run(rank_fns.draw_random, seed=124)
    assert other[0] != first[0]


def test_pool_is_cached_and_its_processes_reused() -> None:
    pool = get_pool(2, backend="gloo", device="cpu")
    assert get_pool(2) is pool
    pids = pool.pids
    for _ in range(5):
        pool.run(rank_fns.all_reduce_sum, 1)
    assert pool.pids == pids, "a healthy pool must not restart between cases"
    assert [i["pid"] for i in pool.run(rank_fns.rank_info)] == pids


def test_rank_exception_is_attributed_to_its_rank() -> None:
    pool = get_pool(2)
    with pytest.raises(RankError) as info:
        pool.run(rank_fns.raise_on, 1, False)
    failure = info.value
    assert failure.failed_ranks == [1]
    assert failure.outcomes[0].ok and failure.outcomes[0].value == 0.0
    bad = failure.outcomes[1]
    assert (bad.status, bad.exc_type) == ("error", "ValueError")
    assert bad.exc_message == "bad input detected on rank 1"
    assert "rank_fns.py" in bad.traceback and "raise ValueError" in bad.traceback
    text = str(failure)
    assert "rank 1 raised ValueError: bad input detected on rank 1" in text
    assert "tests.harness.rank_fns.raise_on" in text
    assert "test_rank_exception_is_attributed_to_its_rank" in text
    assert "Traceback (most recent call last)" in text


def test_run_outcomes_when_every_rank_raises_keeps_the_pool() -> None:
    pool = get_pool(2)
    pool.run(rank_fns.all_reduce_sum, 1)
    pids = pool.pids
    outcomes = pool.run_outcomes(rank_fns.raise_everywhere)
    assert all(isinstance(o, RankOutcome) for o in outcomes)
    assert [(o.rank, o.ok, o.exc_type) for o in outcomes] == [
        (0, False, "ValueError"),
        (1, False, "ValueError"),
    ]
    assert [o.exc_message for o in outcomes] == [
        "head_dim must be positive (rank 0)",
        "head_dim must be positive (rank 1)",
    ]
    assert all("raise_everywhere" in o.traceback for o in outcomes)
    # every rank reported and the probe all_reduce passed: no restart for a bad-input test
    assert pool.pids == pids
    assert pool.run(rank_fns.all_reduce_sum, 1) == [3.0, 3.0]


def test_run_outcomes_of_a_passing_case() -> None:
    outcomes = get_pool(2).run_outcomes(rank_fns.all_reduce_sum, 2)
    assert [(o.rank, o.ok, o.value, o.status) for o in outcomes] == [
        (0, True, 6.0, "ok"),
        (1, True, 6.0, "ok"),
    ]


def test_function_that_cannot_be_pickled_is_refused_with_the_fix() -> None:
    with pytest.raises(TypeError, match="module level"):
        get_pool(2).run(lambda ctx: ctx.rank)


def test_result_that_cannot_be_pickled_fails_on_that_rank() -> None:
    with pytest.raises(CaseFailure, match="cannot be pickled") as info:
        get_pool(2).run(rank_fns.return_unpicklable)
    assert info.value.failed_ranks == [0, 1]


def test_rank_output_is_forwarded_with_a_rank_prefix(capfd: pytest.CaptureFixture[str]) -> None:
    assert get_pool(2).run(rank_fns.print_and_return, "hello") == [0, 1]
    err = capfd.readouterr().err
    assert "[rank 0] hello from rank 0" in err
    assert "[rank 1] hello from rank 1" in err


def test_global_torch_state_does_not_leak_into_the_next_case() -> None:
    pool = get_pool(2)
    assert pool.run(rank_fns.leak_global_state) == ["torch.float64"] * 2
    assert pool.run(rank_fns.global_state) == [("torch.float32", True, 1)] * 2


def test_case_failure_survives_pickling() -> None:
    import pickle

    with pytest.raises(RankError) as info:
        get_pool(2).run(rank_fns.raise_on, 0, False)
    clone = pickle.loads(pickle.dumps(info.value))
    assert type(clone) is RankError
    assert str(clone) == str(info.value)
    assert clone.failed_ranks == [0]


def test_world_size_one_pool() -> None:
    assert get_pool(1).run(rank_fns.all_reduce_sum, 3) == [3.0]


def test_spawn_start_method_runs_the_same_cases() -> None:
    previous = settings.current()
    settings.install(previous.with_(rank_start="spawn"))
    pool = RankPool(2, "gloo", "cpu")  # not cached: this test owns and stops it
    try:
        pool.start()
        assert pool.run(rank_fns.all_reduce_sum, 2) == [6.0, 6.0]
        assert [i["pid"] for i in pool.run(rank_fns.rank_info)] == pool.pids
    finally:
        settings.install(previous)
        pool.shutdown()
    assert pool.pids == []


def test_ranks_that_cannot_form_a_process_group_fail_the_start_with_their_tracebacks(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("GLOO_SOCKET_IFNAME", "nonexistent0")  # gloo cannot create its device
    pool = RankPool(2, "gloo", "cpu")
    try:
        with pytest.raises(PoolStartError) as info:
            pool.start()
        text = str(info.value)
        assert "pool start failed" in text
        assert "could not join the process group" in text
        assert "nonexistent0" in text
        assert pool.pids == [] and not pool.running
    finally:
        pool.shutdown()


def test_a_script_starting_a_pool_at_import_time_is_told_the_fix(tmp_path) -> None:
    """The start methods import the parent's main module again in each rank: a script that starts
    a pool outside ``if __name__ == "__main__":`` kills every rank before the harness runs."""
    script = tmp_path / "unguarded.py"
    script.write_text(
        "from harness import PoolStartError, get_pool\n"
        "try:\n"
        "    get_pool(2)\n"
        "except PoolStartError as exc:\n"
        "    print('REPORT', exc)\n"
    )
    done = run_tree(
        [sys.executable, str(script)],
        env=clean_env(),
        capture_output=True,
        text=True,
        timeout=120,
    )
    report = done.stdout[done.stdout.index("REPORT") :] if "REPORT" in done.stdout else ""
    assert "before the harness's entry point ran" in report, done.stdout + done.stderr
    assert 'if __name__ == "__main__":' in report
