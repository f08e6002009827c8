"""Proof that the strategy suite catches the head-parallel bugs users reported: each broken
strategy of meta_tests/broken_strategies.py makes the strategy axis fail with a message
that matches its own ``expect`` pattern and no other broken implementation's (rings, APIs,
strategies), so the message names the cause. Run as separate pytest processes, as
test_suite_catches_bugs.py does."""

from __future__ import annotations

import pytest

from meta_tests.broken import BROKEN as BROKEN_RINGS
from meta_tests.broken_api import BROKEN_API
from meta_tests.broken_strategies import BROKEN_STRATEGIES
from meta_tests.test_suite_catches_bugs import assert_names_its_cause, failure_text, run_suites

EVERY_BROKEN = {**BROKEN_RINGS, **BROKEN_API, **BROKEN_STRATEGIES}


@pytest.mark.parametrize("name", sorted(BROKEN_STRATEGIES))
def test_strategy_suite_fails_on_broken_strategy(name: str) -> None:
    broken = BROKEN_STRATEGIES[name]
    proc = run_suites(
        f"meta_tests.broken_strategies:{name}",
        "--report-dir",
        "none",
        *broken.select,
        suites=broken.suites,
    )
    text = failure_text(proc, name).replace(f"meta_tests.broken_strategies:{name}", "<impl>")
    assert_names_its_cause(proc, text, name, EVERY_BROKEN, suite="the strategy suite")
