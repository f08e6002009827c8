"""The pytest plugin end to end: header, markers, skip reasons, fixtures, hypothesis profiles."""

from __future__ import annotations

import re

import pytest

from harness import settings
from harness.pytest_plugin import default_hypothesis_profile, ring_environment_lines
from tests.harness.subproc import TARGETS, run_pytest

TARGET = str(TARGETS / "target_plugin.py")


@pytest.fixture(scope="module")
def quick_run() -> str:
    result = run_pytest(
        TARGET, "-rs", "-s", "-v", env={"CI": "1", "RING_CASE_TIMEOUT": "30", "RING_TYPO": "x"}
    )
    assert result.returncode == 0, result.stdout
    return result.stdout


def test_report_header_echoes_versions_devices_backends_and_ring_variables(quick_run: str) -> None:
    assert (
        "ring attention: device=cpu dist-backend=gloo world-sizes=1,2,3,4 tier=quick "
        "case-timeout=30s compile-timeout=600s"
    ) in quick_run
    assert re.search(
        r"versions: python 3\.\d+\.\d+, torch \S+, numpy \S+, hypothesis \S+", quick_run
    )
    assert re.search(r"devices: CPUs: \d+", quick_run)
    assert "dist backends: gloo" in quick_run
    assert "RING_CASE_TIMEOUT=30" in quick_run
    assert "RING_TYPO=x  <- not read by any ring attention option: a typo?" in quick_run


def test_skips_say_why_and_how_to_enable(quick_run: str) -> None:
    assert "nightly tier only: run with --tier nightly (or RING_TIER=nightly)" in quick_run
    assert "needs CUDA: run on a CUDA machine with --device cuda (or RING_DEVICE=cuda)" in quick_run
    # the world_size marker (world_size(8) and world_size(n=8))
    # and the rank_pool fixture give the same reason
    assert (
        quick_run.count(
            "world_size 8 not enabled (world sizes: 1,2,3,4): add it with --world-sizes 1,2,3,4,8"
        )
        == 3
    )
    assert "test_pool_world_size_2 PASSED" in quick_run
    assert "test_compile_marked_gets_the_compile_timeout PASSED" in quick_run
    assert "3 passed, 5 skipped" in quick_run


def test_ci_profile_is_derandomized_with_few_examples(quick_run: str) -> None:
    assert "hypothesis profile: ci" in quick_run
    assert "PROFILE max_examples=10 derandomize=True" in quick_run


def test_nightly_tier_runs_nightly_tests_with_the_nightly_profile() -> None:
    result = run_pytest(
        TARGET,
        "-s",
        "-q",
        "--tier",
        "nightly",
        "-k",
        "nightly_only or hypothesis_profile or marked_world_size_8",
    )
    assert result.returncode == 0, result.stdout
    assert "PROFILE max_examples=100 derandomize=True" in result.stdout
    assert "3 passed" in result.stdout


def test_explicit_hypothesis_profile_wins() -> None:
    result = run_pytest(
        TARGET,
        "-s",
        "-q",
        "--hypothesis-profile",
        "dev",
        "-k",
        "hypothesis_profile",
        env={"CI": "1"},
    )
    assert result.returncode == 0, result.stdout
    assert "PROFILE max_examples=20 derandomize=True" in result.stdout


def test_markers_are_registered_with_descriptions() -> None:
    result = run_pytest("--markers")
    assert result.returncode == 0, result.stdout
    for line in (
        "@pytest.mark.quick: a case of the quick tier",
        "@pytest.mark.nightly: a case only the nightly tier has",
        "@pytest.mark.gpu: needs CUDA",
        "@pytest.mark.compile: uses torch.compile; its case timeout is --compile-timeout",
        "@pytest.mark.world_size(n): needs world size n",
    ):
        assert line in result.stdout


def test_default_profile_follows_tier_and_ci() -> None:
    quick, nightly = settings.resolve({}, {}), settings.resolve({"tier": "nightly"}, {})
    assert default_hypothesis_profile(quick, {}) == "dev"
    assert default_hypothesis_profile(quick, {"CI": "true"}) == "ci"
    assert default_hypothesis_profile(quick, {"CI": "0"}) == "dev"
    assert default_hypothesis_profile(nightly, {"CI": "true"}) == "nightly"


def test_ring_environment_lines() -> None:
    assert ring_environment_lines({}) == ["RING_* environment: (none set)"]
    assert ring_environment_lines({"RING_TIER": "quick", "PATH": "/bin"}) == [
        "RING_* environment:",
        "  RING_TIER=quick",
    ]
