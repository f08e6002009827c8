"""benchmarks/runner.py: candidates run interleaved, only the recorded rounds kept, setup and the
barrier hook outside the timed span, statistics and ratios to a baseline of the same run.

A scripted clock (every ``stop`` returns the next value of a list) makes the recorded times exact,
so nothing here depends on the machine's speed.
"""

from __future__ import annotations

import json

import pytest

from benchmarks import runner


class ScriptedClock:
    """A clock whose readings are given; it logs its start and stop beside the candidates."""

    def __init__(self, log: list[str], readings: list[float]) -> None:
        self.log, self.readings = log, iter(readings)

    def start(self) -> None:
        self.log.append("start")

    def stop(self) -> float:
        self.log.append("stop")
        return next(self.readings)


def test_rounds_interleave_candidates_and_warmup_is_not_recorded() -> None:
    log: list[str] = []
    samples = runner.interleave(
        {"a": lambda: log.append("a"), "b": lambda: log.append("b")}, rounds=2, warmup=1
    )
    assert log == ["a", "b"] * 3
    assert {name: len(times) for name, times in samples.times.items()} == {"a": 2, "b": 2}
    assert {name: len(cpu) for name, cpu in samples.cpu.items()} == {"a": 2, "b": 2}


def test_times_are_the_clocks_readings_of_the_recorded_rounds() -> None:
    log: list[str] = []
    clock = ScriptedClock(log, [9.0, 9.0, 1.0, 2.0, 3.0, 4.0])
    samples = runner.interleave({"a": lambda: None, "b": lambda: None}, 2, 1, clock=clock)
    assert samples.times == {"a": [1.0, 3.0], "b": [2.0, 4.0]}


def test_setup_and_before_run_outside_the_timed_span() -> None:
    log: list[str] = []
    candidate = runner.Candidate(
        lambda x: log.append(f"call {x}"), setup=lambda: log.append("setup") or [7]
    )
    runner.interleave(
        {"a": candidate},
        rounds=1,
        before=lambda: log.append("before"),
        clock=ScriptedClock(log, [0.5]),
    )
    assert log == ["setup", "before", "start", "call 7", "stop"]


def test_returned_mappings_are_recorded_as_extras_of_recorded_rounds() -> None:
    calls = iter(range(10))
    samples = runner.interleave({"a": lambda: {"forward": next(calls)}}, rounds=3, warmup=2)
    assert samples.extra == {"a": {"forward": [2.0, 3.0, 4.0]}}


def test_an_exception_in_a_candidate_propagates() -> None:
    def fails() -> None:
        raise RuntimeError("kernel failed")

    with pytest.raises(RuntimeError, match="kernel failed"):
        runner.interleave({"ok": lambda: None, "bad": fails}, rounds=1)


def test_measure_is_one_candidates_times() -> None:
    log: list[str] = []
    times = runner.measure(lambda: None, 1, 3, clock=ScriptedClock(log, [5.0, 1.0, 2.0, 3.0]))
    assert times == [1.0, 2.0, 3.0]


def test_summarize_gives_median_spread_and_ratios_to_the_baseline() -> None:
    stats = runner.summarize({"base": [2.0, 4.0, 3.0], "new": [1.0, 3.0, 1.5]}, baseline="base")
    assert stats["base"] == runner.Stats(
        n=3, min=2.0, median=3.0, max=4.0, spread=2.0 / 3.0, ratio=1.0, ratio_min=1.0
    )
    new = stats["new"]
    assert (new.min, new.median, new.max) == (1.0, 1.5, 3.0)
    assert new.ratio == pytest.approx(0.5)
    assert new.ratio_min == pytest.approx(0.5)
    assert new.spread == pytest.approx(2.0 / 1.5)
    assert runner.summarize({"x": [1.0]})["x"].ratio is None


def test_summarize_refuses_a_baseline_that_was_not_measured() -> None:
    with pytest.raises(KeyError, match="sdpa"):
        runner.summarize({"ring": [1.0]}, baseline="sdpa")


def test_across_ranks_reduces_each_round_over_the_ranks() -> None:
    per_rank = [[1.0, 5.0, 2.0], [3.0, 4.0, 2.5]]
    assert runner.across_ranks(per_rank) == [3.0, 5.0, 2.5]
    assert runner.across_ranks(per_rank, sum) == [4.0, 9.0, 4.5]
    with pytest.raises(ValueError, match="different numbers of rounds"):
        runner.across_ranks([[1.0], [1.0, 2.0]])


def test_clock_for_picks_cuda_events_on_a_cuda_device() -> None:
    assert isinstance(runner.clock_for("cuda:0"), runner.CudaClock)
    assert isinstance(runner.clock_for("cpu"), runner.WallClock)
    assert isinstance(runner.clock_for(None), runner.WallClock)


def test_wall_clock_measures_a_positive_time() -> None:
    (elapsed,) = runner.measure(lambda: sum(range(1000)), 0, 1)
    assert elapsed > 0.0


def test_write_json_creates_the_directory_and_reads_back(tmp_path) -> None:
    path = tmp_path / "out" / "bench.json"
    stats = runner.summarize({"a": [1.0, 2.0]})["a"]
    runner.write_json(str(path), {"rows": [stats.as_dict()]})
    assert json.loads(path.read_text()) == {"rows": [stats.as_dict()]}
    assert not (tmp_path / "out" / "bench.json.tmp").exists()
