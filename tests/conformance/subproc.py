"""The suites run by pytest in a subprocess, as a vendor runs them, for the acceptance tests of
the conformance layer."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from harness.procs import run_tree  # the command's process tree dies with the test

ROOT = Path(__file__).resolve().parents[2]


def run_pytest(
    *args: str, env: dict[str, str] | None = None, timeout: float = 600
) -> subprocess.CompletedProcess:
    """``pytest *args`` from the repository root, without this run's xdist, pytest and RING_*
    variables (``env`` added), its output captured."""
    clean = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith(("PYTEST_XDIST", "PYTEST_CURRENT", "RING_"))
    }
    clean["PYTHONPATH"] = os.pathsep.join([str(ROOT), clean.get("PYTHONPATH", "")])
    clean.update(env or {})
    return run_tree(
        [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-p", "no:xdist", *args],
        cwd=ROOT,
        env=clean,
        capture_output=True,
        text=True,
        timeout=timeout,
    )
