"""pytest plugin of ci/gpu_check.py: every test's outcome as one JSON line, written as it happens.

Loaded with ``-p gpu_check_results`` (ci/ on ``PYTHONPATH``), writing to the file named by
``GPU_CHECK_RESULTS``. Lines are appended as reports arrive (in the xdist controller under
``-n``), so a job stopped at its deadline still leaves every outcome it reached; a line
``{"collected": N}`` records how many tests the job runs, so the rest count as not run.

``GPU_CHECK_SAMPLE=i/m`` keeps the tests whose node id hashes (CRC-32) to ``i`` modulo ``m``:
the same deterministic share on every run and every xdist worker; a line ``{"sampled_out": n,
"of": N}`` says how many were left out.
"""

from __future__ import annotations

import json
import os
import zlib

import pytest

_PATH = os.environ.get("GPU_CHECK_RESULTS")


def _write(record: dict) -> None:
    if _PATH:
        with open(_PATH, "a") as f:
            f.write(json.dumps(record) + "\n")


def _reason(report) -> str:
    if report.skipped and isinstance(report.longrepr, tuple):
        return str(report.longrepr[2]).removeprefix("Skipped: ")
    text = getattr(report, "longreprtext", "") or ""
    lines = [line for line in text.splitlines() if line.strip()]
    errors = [line for line in lines if line.startswith("E ")]
    return "\n".join((errors or lines)[:12])[:2000]


def _sample() -> tuple[int, int] | None:
    raw = os.environ.get("GPU_CHECK_SAMPLE", "").strip()
    if not raw:
        return None
    share, modulus = (int(x) for x in raw.split("/"))
    if not 0 <= share < modulus:
        raise ValueError(f"GPU_CHECK_SAMPLE={raw!r}: want i/m with 0 <= i < m")
    return share, modulus


@pytest.hookimpl(trylast=True)  # after -m and -k have deselected theirs
def pytest_collection_modifyitems(config, items) -> None:
    sample = _sample()
    if sample is None:
        return
    share, modulus = sample
    kept = [item for item in items if zlib.crc32(item.nodeid.encode()) % modulus == share]
    left = [item for item in items if zlib.crc32(item.nodeid.encode()) % modulus != share]
    if left:
        config.hook.pytest_deselected(items=left)
    if os.environ.get("PYTEST_XDIST_WORKER", "gw0") == "gw0":  # once per job
        _write({"sampled_out": len(left), "of": len(items)})
    items[:] = kept


def pytest_collection_finish(session) -> None:
    if (
        not hasattr(session.config, "workerinput") and session.items
    ):  # without xdist: this process collected
        _write({"collected": len(session.items)})


@pytest.hookimpl(optionalhook=True)  # a hook of xdist, absent under -p no:xdist
def pytest_xdist_node_collection_finished(node, ids) -> None:
    _write({"collected": len(ids), "node": str(getattr(node, "gateway", node).id)})


def pytest_runtest_logreport(report) -> None:
    if os.environ.get("PYTEST_XDIST_WORKER"):
        return  # an xdist worker: its controller writes the line
    final = (
        report.when == "call"
        or (report.when == "setup" and not report.passed)
        or (report.when == "teardown" and report.failed)
    )
    if not final:
        return
    outcome = "xfailed" if hasattr(report, "wasxfail") and report.skipped else report.outcome
    if hasattr(report, "wasxfail") and report.passed:
        outcome = "xpassed"
    _write(
        {
            "nodeid": report.nodeid,
            "when": report.when,
            "outcome": outcome,
            "duration": round(report.duration, 3),
            "reason": "" if report.passed else _reason(report),
        }
    )
