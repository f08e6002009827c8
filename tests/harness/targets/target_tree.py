"""Runs a process tree with harness.procs.run_tree until killed (see
tests/harness/test_process_tree.py).

``HARNESS_TREE_COMMAND`` selects the tree: ``launcher`` (tests/harness/targets/launcher_like.py)
or ``torchrun`` (torchrun with two ranks of tests/harness/targets/rank_sleeper.py). The tree
writes its pids to ``HARNESS_TEST_PIDS_FILE``.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

from harness.procs import run_tree
from tests.harness.subproc import torchrun_command

TARGETS = Path(__file__).resolve().parent


def test_run_a_tree_until_killed() -> None:
    pids_file = os.environ["HARNESS_TEST_PIDS_FILE"]
    if os.environ["HARNESS_TREE_COMMAND"] == "torchrun":
        command = torchrun_command(str(TARGETS / "rank_sleeper.py"), pids_file)
    else:
        command = [sys.executable, str(TARGETS / "launcher_like.py"), pids_file]
    run_tree(command, timeout=600)
