"""The printed repro line carries every ring option of the session (command line or RING_*
variable) and, run as printed in a shell without RING_* variables, reproduces the failure."""

from __future__ import annotations

import os
import re
import shlex
import sys
from pathlib import Path

from harness.procs import pytest_command, run_tree  # the command's process tree dies with the test

ROOT = Path(__file__).resolve().parents[2]
CASE = (
    "suites/test_forward_backward.py::test_forward_backward_match_reference"
    "[W3-f32-causal-alltoall-contiguous]"
)


def _env(extra: dict[str, str]) -> dict[str, str]:
    env = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith(("PYTEST_XDIST", "PYTEST_CURRENT", "RING_"))
    }
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")])
    return {**env, **extra}


def test_repro_line_reproduces_the_failure_with_every_option(tmp_path: Path) -> None:
    vendor = tmp_path / "vendor.txt"
    vendor.write_text("skip suites/test_compile.py  not part of this check\n")
    options = {
        "--op": "math",
        "--world-sizes": "2,3",
        "--tier": "quick",
        "--device": "cpu",
        "--dist-backend": "gloo",
        "--vendor-file": str(vendor),
    }
    from_env = {
        "RING_IMPL": "meta_tests.broken:needed_step_skipped",
        "RING_CASE_TIMEOUT": "45",
        "RING_RANK_THREADS": "1",
    }
    cmd = pytest_command(CASE, "-p", "no:xdist", "--report-dir", "none")
    for flag, value in options.items():
        cmd += [flag, value]
    first = run_tree(cmd, cwd=ROOT, env=_env(from_env), capture_output=True, text=True, timeout=300)
    assert first.returncode == 1, first.stdout[-3000:]
    line = re.search(r"^repro: (.*)$", first.stdout, re.M)
    assert line, first.stdout[-3000:]
    words = shlex.split(line.group(1))
    assert words[:2] == ["pytest", CASE]
    given = dict(zip(words[2::2], words[3::2]))
    for flag, value in {
        **options,
        "--impl": from_env["RING_IMPL"],
        "--case-timeout": "45",
        "--rank-threads": "1",
    }.items():
        assert given.get(flag) == value, (flag, line.group(1))
    assert "--report-dir" not in given  # where report files go does not change a verdict
    # Run it as printed (pytest as this interpreter's module), with no RING_* variable set.
    again = run_tree(
        [sys.executable, "-m", *words, "-p", "no:cacheprovider", "--report-dir", "none"],
        cwd=ROOT,
        env=_env({}),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert again.returncode == 1, again.stdout[-3000:]
    assert f"FAILED {CASE}" in again.stdout
    # the same failure: the same verdicts, word for word
    verdicts = re.compile(r"^\w+\[rank=\d+\] max err .*$", re.M)
    assert verdicts.findall(first.stdout) and verdicts.findall(first.stdout) == verdicts.findall(
        again.stdout
    )
