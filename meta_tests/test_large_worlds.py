"""Proof that the simulated tier catches what only many ranks show, and that nothing else does:
each ring of meta_tests/broken_large_worlds.py fails the suites on the simulated world at W=16
with a message that names its cause at a ring step past 8, and passes the same cases on the
process-pool harness at every world size it runs (1..8, nightly tier). Nightly: each proof runs
a pytest of its own (about a minute, and two to three on the process pool)."""

from __future__ import annotations

import re
import subprocess

import pytest

from meta_tests.broken_large_worlds import BROKEN_LARGE
from meta_tests.test_suite_catches_bugs import failure_text, run_suites

SIMULATED = (
    "--launcher",
    "simulated",
    "--tier",
    "nightly",
    "--world-sizes",
    "16",
    "--case-timeout",
    "600",
)
PROCESS_POOL = ("--launcher", "pool", "--tier", "nightly", "--world-sizes", "1,2,3,4,5,6,7,8")


def _run(name: str, launcher: tuple[str, ...], **options) -> subprocess.CompletedProcess:
    """The suite and cases of the broken ring ``name`` on ``launcher`` (:data:`SIMULATED` or
    :data:`PROCESS_POOL`); ``options`` go to :func:`run_suites`."""
    broken = BROKEN_LARGE[name]
    return run_suites(
        f"meta_tests.broken_large_worlds:{name}",
        "--report-dir",
        "none",
        *launcher,
        *broken.select,
        suites=broken.suites,
        **options,
    )


@pytest.mark.nightly
@pytest.mark.parametrize("name", sorted(BROKEN_LARGE))
def test_simulated_tier_catches_the_bug_by_name(name: str) -> None:
    broken = BROKEN_LARGE[name]
    proc = _run(name, SIMULATED)
    assert proc.returncode == 1, (
        f"the simulated tier did not fail on {name!r} ({broken.bug_class}): "
        f"exit code {proc.returncode}\n{proc.stdout[-4000:]}\n{proc.stderr[-2000:]}"
    )
    text = failure_text(proc, name)
    assert re.search(r"^FAILED \S+\[W16-", proc.stdout, re.MULTILINE), proc.stdout[-3000:]
    assert re.search(broken.expect, text), (
        f"the simulated tier failed on {name!r} but the failure does not name the cause "
        f"(no match for /{broken.expect}/):\n{text[-4000:]}"
    )


@pytest.mark.nightly
@pytest.mark.parametrize("name", sorted(BROKEN_LARGE))
def test_process_pool_up_to_w8_passes_it(name: str) -> None:
    """The bug escapes every world size the process-pool harness runs: only the simulated tier
    sees it."""
    proc = _run(name, PROCESS_POOL, exitfirst=False, timeout=900)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-2000:]
    passed = re.search(r"(\d+) passed", proc.stdout)
    assert passed and int(passed.group(1)) >= 16, proc.stdout[-2000:]
