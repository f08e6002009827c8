"""benchmarks/ring.py end to end at a tiny size: it runs, and its traffic accounting holds.

Timings at this size mean nothing and are not asserted; what is asserted is what the benchmark
measures exactly: every ring phase sends the minimum bytes, the declared collective schedule
equals the recorded one (also with head_chunks), and ``--analyse`` reprints a saved run.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from harness.procs import run_tree  # the command's process tree dies with the test

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _bench(*args: str) -> subprocess.CompletedProcess:
    return run_tree(
        [sys.executable, os.path.join(ROOT, "benchmarks", "ring.py"), *args],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory) -> tuple[str, dict]:
    out = tmp_path_factory.mktemp("bench")
    proc = _bench(
        "--seq",
        "256",
        "--world-sizes",
        "2",
        "--repeat",
        "1",
        "--warmup",
        "0",
        "--heads",
        "2",
        "--head-dim",
        "8",
        "--rotations",
        "alltoall",
        "p2p",
        "--lean-head-chunks",
        "2",
        "--skip-scaling",
        "--out",
        str(out),
    )
    assert proc.returncode == 0, (
        f"benchmarks/ring.py failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    )
    with open(out / "bench.json") as f:
        return str(out / "bench.json"), json.load(f)


def test_ring_traffic_is_the_minimum_and_declared(tiny_run) -> None:
    _, data = tiny_run
    ring = [t for t in data["analysis"]["traffic"] if t["impl"] == "ring"]
    # alltoall, p2p and alltoall with head_chunks=2, forward and backward each
    assert {(t["rotate"], t["head_chunks"], t["phase"]) for t in ring} == {
        (r, c, p)
        for r, c in (("alltoall", 1), ("p2p", 1), ("alltoall", 2))
        for p in ("forward", "backward")
    }
    for t in ring:
        assert t["sent_bytes"] == t["minimum_bytes"], t
        assert t["declared_equals_measured"] is True, t


def test_analyse_reprints_a_saved_run(tiny_run) -> None:
    path, data = tiny_run
    proc = _bench("--analyse", path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    for aim in data["analysis"]["aims"]:
        assert aim["aim"] in proc.stdout
