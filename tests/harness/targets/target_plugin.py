"""Exercises markers, skip reasons, fixtures and hypothesis profiles (see
tests/harness/test_plugin.py)."""

from __future__ import annotations

from collections.abc import Callable

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from harness import Pool
from tests.harness import rank_fns


@pytest.mark.nightly
def test_nightly_only() -> None:
    assert True


@pytest.mark.gpu
def test_gpu_only() -> None:
    assert True


@pytest.mark.world_size(8)
def test_marked_world_size_8() -> None:
    assert True


@pytest.mark.world_size(n=8)
def test_marked_world_size_n8() -> None:
    assert True


def test_pool_world_size_8(rank_pool: Callable[[int], Pool]) -> None:
    rank_pool(8)


def test_pool_world_size_2(
    rank_pool: Callable[[int], Pool], case_timeout: float, device: str
) -> None:
    assert case_timeout == 30.0 and device == "cpu"
    assert rank_pool(2).run(rank_fns.all_reduce_sum, 1) == [3.0, 3.0]


@given(st.integers())
def test_hypothesis_profile(x: int) -> None:
    current = settings.default
    assert current is not None
    print(f"PROFILE max_examples={current.max_examples} derandomize={current.derandomize}")
    assert current.deadline is None


@pytest.mark.compile
def test_compile_marked_gets_the_compile_timeout(case_timeout: float) -> None:
    assert case_timeout == 600.0  # RING_CASE_TIMEOUT=30 stays for the other tests
