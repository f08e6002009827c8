"""Proof that the conformance suites catch real bugs: each broken implementation of
meta_tests/broken.py (one per bug class of shared/bug-classes.md) makes ``pytest suites`` fail,
with a failure message that points at the cause. The correct implementation passing is the main
run of the suites itself.

Each run is a separate pytest process (``-x``: the first failure is enough) so a broken
implementation can hang or crash its ranks without touching this session's pools.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from meta_tests.broken import BROKEN

ROOT = Path(__file__).resolve().parents[1]


def run_suites(impl: str, *extra: str, timeout: float = 600) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PYTEST_XDIST", "PYTEST_CURRENT"))}
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")])
    cmd = [sys.executable, "-m", "pytest", "suites", "-x", "-q", "-p", "no:cacheprovider", "-p", "no:xdist",
           "--impl", impl, "--case-timeout", "20", *extra]
    return subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)


def failure_text(proc: subprocess.CompletedProcess) -> str:
    """The part of the output that explains the failure (failures section and summary)."""
    out = proc.stdout
    start = out.find("= FAILURES =")
    return out[start:] if start >= 0 else out


@pytest.mark.parametrize("name", sorted(BROKEN))
def test_suite_fails_on_broken_implementation(name: str) -> None:
    broken = BROKEN[name]
    proc = run_suites(f"meta_tests.broken:{name}")
    text = failure_text(proc)
    assert proc.returncode == 1, (
        f"the suites did not fail on {name!r} ({broken.bug_class}): exit code {proc.returncode}\n{proc.stdout[-4000:]}\n{proc.stderr[-2000:]}"
    )
    assert re.search(broken.expect, text, re.IGNORECASE), (
        f"the suites failed on {name!r} ({broken.bug_class}) but the failure does not point at the cause "
        f"(no match for /{broken.expect}/):\n{text[-4000:]}"
    )
