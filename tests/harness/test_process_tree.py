"""harness.procs.ProcessTree / run_tree: every process a test starts dies with the test.

The tree under test is torchrun-like (tests/harness/targets/launcher_like.py): workers in
sessions of their own that ignore SIGTERM, SIGINT and SIGHUP, one with a grandchild. The
control test shows that such a tree outlives its launcher when run the plain subprocess way,
so the other tests exercise something real. Then every way a run can end: the command exits
and leaves workers behind, a timeout, an exception in the owner, and the owning pytest killed
by SIGINT, SIGTERM or SIGKILL (with the launcher and with a real torchrun).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from harness.procs import ProcessTree, descendants, pid_alive, run_tree
from tests.harness.subproc import REPO_ROOT, TARGETS, clean_env, pytest_command, wait_until

LAUNCHER = str(TARGETS / "launcher_like.py")


def _read_pids(
    path: Path, what: str, alive: subprocess.Popen | ProcessTree | None = None
) -> list[int]:
    def ready() -> bool:
        return path.exists() or (isinstance(alive, subprocess.Popen) and alive.poll() is not None)

    if not wait_until(ready, timeout=60) or not path.exists():
        pytest.fail(f"{what} never wrote {path.name}")
    pids: list[int] = json.loads(path.read_text())
    assert len(pids) == 4 and all(pid_alive(p) for p in pids), (
        f"{what}: not all of {pids} are running"
    )
    return pids


def _assert_gone(pids: list[int], what: str, within: float = 15.0) -> None:
    __tracebackhide__ = True
    if not wait_until(lambda: not any(pid_alive(p) for p in pids), timeout=within):
        survivors = [p for p in pids if pid_alive(p)]
        for pid in survivors:
            os.kill(pid, signal.SIGKILL)
        pytest.fail(f"{what}: processes {survivors} of the tree {pids} survived {within:g} s")


def test_control_a_plain_subprocess_leaves_its_workers_behind(tmp_path: Path) -> None:
    """subprocess.run's own cleanup (SIGKILL to the launcher on a timeout or KeyboardInterrupt)
    orphans workers that left the launcher's session: what the helper exists for."""
    pids_file = tmp_path / "pids.json"
    launcher = subprocess.Popen([sys.executable, LAUNCHER, str(pids_file)])
    pids = _read_pids(pids_file, "the launcher", launcher)
    try:
        launcher.kill()
        launcher.wait(timeout=10)
        assert not wait_until(lambda: not any(pid_alive(p) for p in pids[1:]), timeout=2), (
            "the workers died with their launcher: this control no longer shows the orphaning the "
            "process-tree tests rely on"
        )
    finally:
        for pid in pids[1:]:
            if pid_alive(pid):
                os.kill(pid, signal.SIGKILL)


def test_leftovers_of_a_finished_command_are_killed(tmp_path: Path) -> None:
    pids_file = tmp_path / "pids.json"
    result = run_tree(
        [sys.executable, LAUNCHER, str(pids_file), "--exit"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 0, result.stderr
    pids = json.loads(pids_file.read_text())
    _assert_gone(pids, "after the launcher exited", within=0.5)


def test_leftovers_are_reported(tmp_path: Path) -> None:
    pids_file = tmp_path / "pids.json"
    with ProcessTree([sys.executable, LAUNCHER, str(pids_file), "--exit"]) as tree:
        assert tree.wait(timeout=60) == 0
        tree.communicate(timeout=30)
        pids = json.loads(pids_file.read_text())
        assert sorted(tree.leftovers) == sorted(pids[1:]), (
            f"reported {tree.leftovers}, left behind {pids[1:]}"
        )


def test_return_code_output_and_signal_death_pass_through() -> None:
    done = run_tree(
        ["sh", "-c", "echo out; echo err >&2; exit 3"], capture_output=True, text=True, timeout=30
    )
    assert (done.returncode, done.stdout, done.stderr) == (3, "out\n", "err\n")
    killed = run_tree(["sh", "-c", "kill -TERM $$"], timeout=30)
    assert killed.returncode == -signal.SIGTERM
    missing = run_tree(["no-such-command-here"], capture_output=True, text=True, timeout=30)
    assert missing.returncode == 127 and "cannot start 'no-such-command-here'" in missing.stderr


def test_a_timeout_kills_the_tree(tmp_path: Path) -> None:
    pids_file = tmp_path / "pids.json"
    with pytest.raises(subprocess.TimeoutExpired):
        run_tree([sys.executable, LAUNCHER, str(pids_file)], timeout=8)
    pids = json.loads(pids_file.read_text())
    _assert_gone(pids, "after run_tree's timeout", within=0.5)


@pytest.mark.parametrize("error", [KeyboardInterrupt, RuntimeError])
def test_an_exception_in_the_owner_kills_the_tree(
    tmp_path: Path, error: type[BaseException]
) -> None:
    pids_file = tmp_path / "pids.json"
    with pytest.raises(error), ProcessTree([sys.executable, LAUNCHER, str(pids_file)]) as tree:
        pids = _read_pids(pids_file, "the launcher")
        assert pids[0] == tree.pid
        raise error("interrupted")
    _assert_gone(pids, f"after {error.__name__} in the owner", within=0.5)


def _start_owner(tmp_path: Path, command: str) -> tuple[ProcessTree, Path, Path]:
    """A pytest that runs the tree with run_tree (tests/harness/targets/target_tree.py).

    Itself under a ProcessTree, whose linger leaves the inner pytest's cleanup to be tested:
    the outer one kills leftovers only after the assertions had their chance."""
    pids_file, log = tmp_path / "pids.json", tmp_path / "pytest.log"
    tree = ProcessTree(
        pytest_command(str(TARGETS / "target_tree.py"), "-q"),
        linger=120.0,
        cwd=REPO_ROOT,
        env=clean_env({"HARNESS_TEST_PIDS_FILE": str(pids_file), "HARNESS_TREE_COMMAND": command}),
        stdout=log.open("w"),
        stderr=subprocess.STDOUT,
    )
    return tree, pids_file, log


@pytest.mark.parametrize(
    "sig", [signal.SIGINT, signal.SIGTERM, signal.SIGKILL], ids=lambda s: s.name
)
def test_no_descendant_outlives_an_interrupted_pytest(tmp_path: Path, sig: signal.Signals) -> None:
    tree, pids_file, log = _start_owner(tmp_path, "launcher")
    with tree:
        pids = _read_pids(pids_file, "the launcher under pytest")
        everything = descendants(tree.pid)  # the supervisor, the launcher and its workers
        assert set(pids) <= set(everything), (pids, everything)
        os.kill(tree.pid, sig)
        try:
            tree.wait(timeout=60)
        except subprocess.TimeoutExpired:
            pytest.fail(f"pytest did not exit within 60 s of {sig.name}:\n{log.read_text()}")
        _assert_gone(everything, f"after {sig.name} to pytest")


def test_no_torchrun_rank_outlives_an_interrupted_pytest(tmp_path: Path) -> None:
    """The real thing: torchrun's ranks live in sessions of their own."""
    tree, pids_file, log = _start_owner(tmp_path, "torchrun")
    with tree:
        ranks = [Path(f"{pids_file}.{r}") for r in range(2)]
        if not wait_until(lambda: all(p.exists() for p in ranks), timeout=120):
            pytest.fail(f"torchrun's ranks did not start within 120 s:\n{log.read_text()}")
        rank_pids = [int(p.read_text()) for p in ranks]
        everything = descendants(tree.pid)
        assert set(rank_pids) <= set(everything), (rank_pids, everything)
        assert all(os.getsid(p) == p for p in rank_pids), (
            "torchrun no longer starts ranks in sessions of their own"
        )
        os.kill(tree.pid, signal.SIGINT)
        try:
            tree.wait(timeout=60)
        except subprocess.TimeoutExpired:
            pytest.fail(f"pytest did not exit within 60 s of SIGINT:\n{log.read_text()}")
        _assert_gone(everything, "after SIGINT to pytest running torchrun")
