"""torchrun mode: each rank is a pytest process; rank
0 reports every rank's failures (real processes)."""

from __future__ import annotations

import subprocess

from harness.procs import run_tree
from tests.harness.subproc import (
    ISOLATION_ARGS,
    REPO_ROOT,
    TARGETS,
    clean_env,
    torchrun_command,
)

SUMMARY = "1 failed, 2 passed, 1 skipped"


def test_torchrun_two_ranks_run_the_same_cases_in_lockstep() -> None:
    command = torchrun_command(
        "-m", "pytest", *ISOLATION_ARGS, "-rA", str(TARGETS / "target_torchrun.py")
    )
    result = run_tree(
        command,
        cwd=REPO_ROOT,
        env=clean_env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        timeout=240,
    )
    out = result.stdout
    assert result.returncode != 0, out  # one case fails, so torchrun reports failure
    # only rank 0 prints a report, and it has the verdicts every rank agreed on
    assert out.count("test session starts") == 1, out
    assert out.count(SUMMARY) == 1, out
    assert "torchrun: rank 0 of 2" in out
    assert "launcher=torchrun" in out
    # rank 0's report carries rank 1's exception and traceback
    assert "rank 1 raised RuntimeError: rank 1 rejects this case (torchrun)" in out
    assert "in _raise_on_rank_1" in out and "Traceback (most recent call last)" in out
    assert "reported by torchrun rank 0 of 2" in out
    # world sizes other than the launched one skip with a reason that says how to run them
    assert "needs world_size 4 but torchrun launched 2 ranks" in out
