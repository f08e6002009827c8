"""ci/check_ring_numerics.py judges as the suites do: a correct ring passes every case, a broken one
fails, one line per case.

The check has no numerics of its own (its cases run through the suites' rank function and are
judged by suites.judge with reference.budget), so it cannot drift from the policy; these runs
show that it still runs and that its verdict can go both ways.
"""

from __future__ import annotations

import re
import subprocess
import sys

from harness.procs import run_tree  # the command's process tree dies with the test
from tests.harness.subproc import REPO_ROOT, clean_env

SCRIPT = str(REPO_ROOT / "ci" / "check_ring_numerics.py")
CASE_LINE = re.compile(r"^W=2 (ok|FAIL|ERROR)\s", re.M)


def _check(*args: str) -> subprocess.CompletedProcess:
    return run_tree(
        [sys.executable, SCRIPT, "--world-sizes", "2", *args],
        cwd=REPO_ROOT,
        env=clean_env(),
        capture_output=True,
        text=True,
        timeout=600,
    )


def test_default_ring_passes_every_case() -> None:
    done = _check()
    assert done.returncode == 0, (
        f"exit {done.returncode}\n{done.stdout[-4000:]}\n{done.stderr[-3000:]}"
    )
    statuses = CASE_LINE.findall(done.stdout)
    summary = re.search(
        r"^W=2: (\d+) cases in \d+ s; worst float64 error (\S+)$", done.stdout, re.M
    )
    assert summary, done.stdout[-3000:]
    assert len(statuses) == int(summary.group(1)) > 0 and set(statuses) == {"ok"}, done.stdout[
        -4000:
    ]
    # float64 agrees with the float64 oracle to about 1e-12 (the numerics policy)
    assert 0.0 < float(summary.group(2)) < 1e-12, summary.group(0)
    assert "all cases pass (0 failing)" in done.stdout


def test_wrong_ring_fails_every_case_with_the_policy_message() -> None:
    """ring_impl's ring with its output shifted by 0.1 (tests/ci/shifted_ring.py): every case
    fails on ``out``, with the policy's message (quantity, rank, errors, bound), and only there."""
    done = _check("--impl", "tests.ci.shifted_ring:IMPLEMENTATION")
    assert done.returncode == 1, (
        f"exit {done.returncode}\n{done.stdout[-4000:]}\n{done.stderr[-3000:]}"
    )
    statuses = CASE_LINE.findall(done.stdout)
    assert statuses and set(statuses) == {"FAIL"}, done.stdout[-4000:]
    failed = re.findall(r"^    (\w+)\[rank=\d\] max err \S+ vs single-device", done.stdout, re.M)
    assert set(failed) == {"out"} and len(failed) == len(statuses), done.stdout[-4000:]
    assert re.search(rf"^FAILED \({len(statuses)} failing\)$", done.stdout, re.M), done.stdout[
        -1000:
    ]
