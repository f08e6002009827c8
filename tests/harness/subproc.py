"""Helpers for acceptance tests that run pytest (or torchrun) in a subprocess."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Callable, Mapping
from pathlib import Path

from harness.procs import run_tree

REPO_ROOT = Path(__file__).resolve().parents[2]
TARGETS = Path(__file__).resolve().parent / "targets"


def clean_env(extra: Mapping[str, str] | None = None) -> dict[str, str]:
    """This environment without the variables of the outer pytest, xdist, torchrun and RING_*."""
    env = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith(("PYTEST_", "RING_", "TORCHELASTIC_"))
        and k
        not in (
            "RANK",
            "WORLD_SIZE",
            "LOCAL_RANK",
            "LOCAL_WORLD_SIZE",
            "MASTER_ADDR",
            "MASTER_PORT",
            "GROUP_RANK",
            "CI",
        )
    }
    env["PYTHONPATH"] = str(REPO_ROOT)
    env.update(extra or {})
    return env


# Only the harness plugin: the root conftest also lists the conformance and suites plugins, which
# import the implementation under test and write reports; the harness's acceptance tests must
# depend on neither, nor pay for them in every run. An installed package (pip install -e .)
# registers them through entry points named after their modules: blocked by those names. No
# cache either (concurrent runs share the repo).
ISOLATION_ARGS = (
    "-p",
    "no:cacheprovider",
    "--noconftest",
    "-p",
    "harness.pytest_plugin",
    "-p",
    "no:conformance.plugin",
    "-p",
    "no:conformance.reporting",
    "-p",
    "no:suites.runner",
)


def pytest_command(*args: str) -> list[str]:
    return [sys.executable, "-m", "pytest", *ISOLATION_ARGS, *args]


def torchrun_command(*args: str) -> list[str]:
    """torchrun (``python -m torch.distributed.run``), standalone, two ranks each running
    ``args``."""
    return [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc-per-node=2",
        *args,
    ]


def run_pytest(
    *args: str, env: Mapping[str, str] | None = None, timeout: float = 120.0
) -> subprocess.CompletedProcess[str]:
    """Run pytest in the repository root; stdout and stderr are merged into ``stdout``.

    As a process tree (harness.procs.run_tree): its rank processes die with this test."""
    return run_tree(
        pytest_command(*args),
        cwd=REPO_ROOT,
        env=clean_env(env),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        timeout=timeout,
    )


def wait_until(predicate: Callable[[], bool], timeout: float, interval: float = 0.05) -> bool:
    """Poll ``predicate`` until it is true or ``timeout`` seconds passed; return its last value."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(interval)
    return predicate()
