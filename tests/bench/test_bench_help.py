"""ci/bench_ring.py --help describes what the benchmark reports."""

from __future__ import annotations

import os
import sys

from harness.procs import run_tree

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_repeat_help_names_the_statistic_reported() -> None:
    """The reported time is the fastest repetition (ci/bench_ring.py's docstring,
    docs/benchmarks.md); the median is printed beside it."""
    done = run_tree(
        [sys.executable, os.path.join(ROOT, "ci", "bench_ring.py"), "--help"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    help_text = " ".join(done.stdout.split())
    start = help_text.index("--repeat REPEAT ")
    repeat = help_text[start : help_text.index("--", start + 2)]
    assert "fastest is reported" in repeat, repeat
    assert "(median;" not in repeat, repeat
