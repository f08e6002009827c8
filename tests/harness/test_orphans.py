"""No rank process outlives its pytest process, however that process ends (real processes)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
from pathlib import Path
from typing import Any

import pytest

from harness.procs import ProcessTree, pid_alive
from tests.harness.subproc import REPO_ROOT, TARGETS, clean_env, pytest_command, wait_until

TARGET = str(TARGETS / "target_orphans.py")


def start_pytest(tmp_path: Path, *extra: str) -> tuple[ProcessTree, Path, Path]:
    """The target pytest as a process tree. Its supervisor would kill ranks left behind, so it
    lingers past the checks below: what is tested is the harness's own cleanup. The tree starts
    the target with SIGINT deliverable (an ignored or blocked SIGINT survives exec, and earlier
    tests in the same xdist worker can leave it so), as Ctrl-C on a terminal would find it."""
    pids_file = tmp_path / "pids.json"
    log = tmp_path / "pytest.log"
    tree = ProcessTree(
        pytest_command(TARGET, "-q", *extra),
        linger=120.0,
        cwd=REPO_ROOT,
        env=clean_env({"HARNESS_TEST_PIDS_FILE": str(pids_file)}),
        stdout=log.open("w"),
        stderr=subprocess.STDOUT,
        text=True,
    )
    return tree, pids_file, log


def read_pids(tree: ProcessTree, pids_file: Path, log: Path) -> dict[str, Any]:
    if not wait_until(lambda: pids_file.exists() or tree.returncode is not None, timeout=90):
        pytest.fail(f"the target never started its pool; its output:\n{log.read_text()}")
    if not pids_file.exists():
        pytest.fail(
            f"the target exited ({tree.returncode}) before starting its pool:\n{log.read_text()}"
        )
    info: dict[str, Any] = json.loads(pids_file.read_text())
    assert len(info["rank_pids"]) == 2 and all(pid_alive(p) for p in info["rank_pids"])
    return info


def assert_all_gone(pids: list[int], log: Path, what: str) -> None:
    __tracebackhide__ = True
    if not wait_until(lambda: not any(pid_alive(p) for p in pids), timeout=15):
        survivors = [p for p in pids if pid_alive(p)]
        for pid in survivors:
            os.kill(pid, signal.SIGKILL)
        pytest.fail(
            f"{what}: processes {survivors} outlived pytest by 15 s; pytest "
            f"output:\n{log.read_text()}"
        )


@pytest.mark.parametrize(
    "sig", [signal.SIGKILL, signal.SIGTERM, signal.SIGINT], ids=lambda s: s.name
)
def test_no_rank_outlives_a_killed_pytest(tmp_path: Path, sig: signal.Signals) -> None:
    tree, pids_file, log = start_pytest(tmp_path)
    with tree:
        info = read_pids(tree, pids_file, log)
        os.kill(tree.pid, sig)
        try:
            # pytest's KeyboardInterrupt path: session finish, pool shutdown (up to 5 s polite
            # stop + 5 s per rank to reap); generous for a loaded 2-core runner.
            tree.wait(timeout=60)
        except subprocess.TimeoutExpired:
            pytest.fail(
                f"pytest did not exit within 60 s of {sig.name}; its output:\n{log.read_text()}"
            )
        assert_all_gone(
            info["rank_pids"] + info["forkserver_pids"], log, f"after {sig.name} to pytest"
        )


def test_no_rank_outlives_a_dead_xdist_worker(tmp_path: Path) -> None:
    tree, pids_file, log = start_pytest(tmp_path, "-n", "1", "--max-worker-restart", "0")
    with tree:
        info = read_pids(tree, pids_file, log)
        assert info["pytest_pid"] != tree.pid, "the case should run in an xdist worker"
        os.kill(info["pytest_pid"], signal.SIGKILL)
        assert_all_gone(
            info["rank_pids"] + info["forkserver_pids"], log, "after SIGKILL to the xdist worker"
        )
