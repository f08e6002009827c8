"""ci/gpu_check.py: what a stopped job ran is reported, what it did not reach is "not run", never
passed; a real (CPU) run of one job streams every outcome and counts add up."""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

import pytest

from harness.procs import run_tree

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "ci"))

import gpu_check  # noqa: E402


def _lines(path: Path, records: list[dict]) -> None:
    path.write_text(
        "".join(json.dumps(r) + "\n" for r in records) + '{"nodeid": "cut'
    )  # a line cut by the stop


def _args(out: Path) -> argparse.Namespace:
    """gpu_check's options for a CPU run without benchmarks, results under ``out``."""
    return argparse.Namespace(
        out=str(out),
        device="cpu",
        no_bench=True,
        quick_bench=False,
        budget=60.0,
        sample_w3="0/2",
        sample_w4="0/4",
    )


def test_a_stopped_job_reports_what_it_did_not_run(tmp_path: Path) -> None:
    args = _args(tmp_path)
    jobs = {j.name: j for j in gpu_check.jobs(args)}
    done, stopped = jobs["kernels"], jobs["suites-W4-gloo"]
    _lines(
        tmp_path / "kernels.jsonl",
        [
            {"collected": 3},
            {"nodeid": "tests/a.py::t1", "outcome": "passed", "reason": ""},
            {"nodeid": "tests/a.py::t2", "outcome": "skipped", "reason": "needs CUDA"},
            {"nodeid": "tests/b.py::t3", "outcome": "passed", "reason": ""},
            {
                "nodeid": "tests/b.py::t3",
                "outcome": "failed",
                "reason": "E teardown broke",
            },  # teardown after a pass
        ],
    )
    _lines(
        tmp_path / "suites-W4-gloo.jsonl",
        [
            {"sampled_out": 30, "of": 40},
            {"collected": 10},
            {"nodeid": "suites/test_masks.py::c[1]", "outcome": "passed", "reason": ""},
            {
                "nodeid": "suites/test_masks.py::c[2]",
                "outcome": "failed",
                "reason": "E out max err 1e0",
            },
        ],
    )
    done.status, done.rc = "finished", 1
    stopped.status, stopped.rc = "stopped at the deadline", -2
    for job in (done, stopped):
        gpu_check.read_results(job, tmp_path)
    summary = gpu_check.summarize([done, stopped], args, "now", 1.0)
    by_name = {j["name"]: j for j in summary["jobs"]}
    assert (
        by_name["kernels"]["passed"],
        by_name["kernels"]["failed"],
        by_name["kernels"]["skipped"],
        by_name["kernels"]["not_run"],
    ) == (1, 1, 1, 0)
    assert by_name["kernels"]["skip_reasons"] == {"needs CUDA": 1}
    w4 = by_name["suites-W4-gloo"]
    assert (w4["passed"], w4["failed"], w4["not_run"], w4["sampled_out"]) == (1, 1, 8, 30)
    assert summary["verdict"] == {
        "failed": 2,
        "not_run": 8,
        "sampled_out": 30,
        "jobs_out_of_time": ["suites-W4-gloo"],
        "jobs_without_results": [],
        "jobs_broken": [],
    }
    assert summary["suites"]["suites/test_masks.py"]["executed_on_cuda"] == 2
    text = gpu_check.markdown(summary)
    assert "**2 failed, 8 not run** (30 more left out by sampling)" in text
    assert (
        "| suites-W4-gloo | stopped at the deadline | 0.0 | 10 (30, share 0/4) | 1 | 1 | 0 | 8 |"
        in text
    )
    assert "E out max err 1e0" in text


def test_a_job_that_breaks_is_not_a_pass(tmp_path: Path) -> None:
    args = _args(tmp_path)
    job = next(j for j in gpu_check.jobs(args) if j.name == "kernels")
    job.status, job.rc = "finished", 4  # pytest's usage error: nothing ran
    gpu_check.read_results(job, tmp_path)
    summary = gpu_check.summarize([job], args, "now", 1.0)
    assert summary["verdict"]["jobs_broken"] == ["kernels"]
    assert summary["verdict"]["jobs_without_results"] == ["kernels"]


@pytest.mark.timeout(300)
def test_one_job_streams_every_outcome(tmp_path: Path) -> None:
    """The kernels job on the CPU (its CUDA tests skip with a reason): every collected test is
    reported, and the exit status says nothing failed."""
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    done = run_tree(
        [
            sys.executable,
            str(ROOT / "ci" / "gpu_check.py"),
            "--device",
            "cpu",
            "--no-bench",
            "--only",
            "kernels",
            "--budget",
            "240",
            "--out",
            str(tmp_path),
        ],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=280,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    summary = json.loads((tmp_path / "gpu_check.json").read_text())
    (job,) = summary["jobs"]
    assert job["status"] == "finished" and job["collected"] > 0 and job["not_run"] == 0
    assert job["passed"] + job["skipped"] == job["collected"] and job["failed"] == 0
    assert any("CUDA" in reason for reason in job["skip_reasons"]), job["skip_reasons"]
    assert (tmp_path / "gpu_check.md").read_text().startswith("# GPU check: ")
