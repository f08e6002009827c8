"""Every benchmark imports on a CPU-only machine and answers ``--help``, as a module
(``python -m benchmarks.<name>``); benchmarks/ring.py also as a script, and its help describes
what the benchmark reports."""

from __future__ import annotations

import os
import sys

import pytest

from harness.procs import run_tree

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

#: every benchmark script in benchmarks/ (the CUDA ones included: their --help needs no GPU)
BENCHMARKS = (
    "compiled_masks",
    "compiled_ring",
    "cuda_masks",
    "cuda_ops",
    "halo",
    "harnesses",
    "host_work",
    "masks",
    "mesh_pools",
    "profile_masks",
    "ring",
    "strategies",
)


def test_every_benchmark_script_is_listed() -> None:
    scripts = {
        name[:-3]
        for name in os.listdir(os.path.join(ROOT, "benchmarks"))
        if name.endswith(".py")
        and name not in ("__init__.py", "common.py", "runner.py", "tables.py")
    }
    assert scripts == set(BENCHMARKS)


@pytest.mark.parametrize("name", BENCHMARKS)
def test_module_help(name: str) -> None:
    done = run_tree(
        [sys.executable, "-m", f"benchmarks.{name}", "--help"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith("usage:"), done.stdout[:500]


def test_repeat_help_names_the_statistic_reported() -> None:
    """The reported time is the fastest repetition (benchmarks/ring.py's docstring,
    docs/benchmarks.md); the median is printed beside it."""
    done = run_tree(
        [sys.executable, os.path.join(ROOT, "benchmarks", "ring.py"), "--help"],
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
