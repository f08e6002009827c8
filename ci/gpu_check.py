"""The whole GPU check in one command: kernel contracts, every suite's quick tier on CUDA, the
compile tier, and the GPU benchmarks, within one time budget, with one JSON and one Markdown
summary.

Run from the repository root on a machine with one CUDA GPU; nothing is installed (the machine's
own torch, the project from the checkout)::

    PYTHONPATH=$PWD python ci/gpu_check.py --out reports/gpu          # budget 510 s
    PYTHONPATH=$PWD python ci/gpu_check.py --budget 300 --no-bench    # tests only, shorter
    python ci/gpu_check.py --list                                     # the jobs, without running

What runs, in two phases:

1. The benchmarks alone on the GPU (timings need a quiet device): ``benchmarks/cuda_masks.py``
   (packed documents and a sliding window at 16k and 64k tokens: the ring against
   FlashAttention's varlen and window calls and compiled flex; each row's profiler table under
   ``--out``/profiles) and ``benchmarks/cuda_ops.py --seqs 16384,65536`` (the unmasked kernels
   through the ring at W=1): about 45 and 30 s on an H200; then ``benchmarks/host_work.py
   --device cuda`` (a one-rank call's host work, its kernels stubbed). ``--quick-bench`` runs
   their ``--quick`` forms (fewer rounds). At most ``--bench-budget`` seconds.
2. The test jobs side by side, each a pytest process with its own xdist workers: the CUDA kernel
   contracts and the compiled-gradient test; the suites' quick tier with ``--device cuda`` at
   W=1 on NCCL and at W=2, 3, 4 on gloo (one GPU: NCCL refuses two ranks on one device), one job
   per world size so that each worker keeps one pool of ranks; and the compile tier
   (``-m compile``) on gloo; the mask suite on the two CUDA kernels that take a mask in one
   call. The mask suite is listed first in every suite job, so it runs before the deadline can
   stop a job.

The whole quick tier does not fit one call on one GPU: ranks sharing a GPU over gloo are
CPU-bound (NVIDIA H200, 16 cores, torch 2.11: the W=4 mask suite alone, ``-n 4``, ran 76 cases
in 98 s with 11.5 cores busy; every job at once reached 1,177 cases in 370 s). So W=1 and W=2
run whole and W=3 and W=4 a deterministic share (``--sample-w3 0/3``, ``--sample-w4 0/6``: the
cases whose node id hashes to 0 modulo 3 or 6, the same on every run; ``1/6`` runs another
sixth), about 1,130 cases in all, which the jobs of that run reached in 370 s. Cases left out by
sampling are counted apart from those a deadline stopped.

Every test outcome is streamed to a file as it happens (ci/gpu_check_results.py), so a job stopped
at the deadline still reports what it ran; what it did not reach is reported as **not run**,
never as passed. The summary (``gpu_check.json``, ``gpu_check.md`` under ``--out``) gives the
device, torch, CUDA and Python versions, per job and per suite module the tests collected,
passed, failed, skipped (with reasons), not run, and the benchmark rows. Exit status: 0 when
nothing failed and every test ran, 1 when a test failed, 3 when a job ran out of time, broke or
left tests not run. The ``torch_cp-*`` jobs judge PyTorch's own context parallel (its public API
runs only on CUDA): their failures are that implementation's verdict, listed apart, and never
fail the check.
"""

from __future__ import annotations

import argparse
import collections
import datetime
import json
import os
import platform
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

#: suite modules in the order a job lists them: the mask suite first (it has the most
#: CUDA-only kernels), then the rest as pytest would find them
FIRST_SUITES = ("test_masks.py", "test_forward_backward.py")


TORCH_CP = "conformance.adapters.torch_cp:IMPLEMENTATION"
#: the suites of PyTorch's context parallel verdict on CUDA (what its public API can be asked)
TORCH_CP_SUITES = tuple(
    f"suites/{f}"
    for f in (
        "test_forward_backward.py",
        "test_shapes.py",
        "test_rotation.py",
        "test_edge_values.py",
        "test_collectives.py",
    )
)


def suite_files() -> list[str]:
    files = sorted(p.name for p in (ROOT / "suites").glob("test_*.py"))
    ordered = [f for f in FIRST_SUITES if f in files] + [f for f in files if f not in FIRST_SUITES]
    return [f"suites/{f}" for f in ordered]


@dataclass
class Job:
    name: str
    argv: list[str]  # after "python -m pytest" for tests, or a script's argv
    workers: int = 0  # xdist workers (0: none)
    # "tests", "bench", or "verdict" (another implementation judged:
    # reported, never failing the check)
    kind: str = "tests"
    json_out: str | None = None  # a bench's JSON rows
    share: float = 1.0  # a bench's weight in the benchmarks' time
    sample: str | None = None  # GPU_CHECK_SAMPLE: the deterministic share of the tests run ("0/3")
    # filled in by the run
    rc: int | None = None
    wall_s: float = 0.0
    status: str = "not started"
    log: str = ""
    results: list[dict] = field(default_factory=list)
    collected: int = 0
    sampled_out: int = 0


def jobs(args) -> list[Job]:
    out = Path(args.out)
    w1_backend = ["--dist-backend", "nccl" if args.device == "cuda" else "gloo"]
    common = [
        "--device",
        args.device,
        "-p",
        "gpu_check_results",
        "-p",
        "no:cacheprovider",
        "-q",
        "-rfEs",
        "--report-dir",
        "none",
    ]
    suites = suite_files()
    test_jobs = [
        Job(
            "kernels",
            [
                "tests/ring_impl/test_cuda_kernels.py",
                "tests/ring_impl/test_compile_versions.py",
                "tests/conformance/test_session_device.py",
                *common,
                "-p",
                "no:xdist",
            ],
        ),
        Job(
            "suites-W1-nccl",
            [*suites, *common, *w1_backend, "--world-sizes", "1", "-m", "not compile"],
            workers=3,
        ),
        Job(
            "suites-W2-gloo",
            [*suites, *common, "--dist-backend", "gloo", "--world-sizes", "2", "-m", "not compile"],
            workers=4,
        ),
        Job(
            "suites-W3-gloo",
            [*suites, *common, "--dist-backend", "gloo", "--world-sizes", "3", "-m", "not compile"],
            workers=3,
            sample=args.sample_w3,
        ),
        Job(
            "suites-W4-gloo",
            [*suites, *common, "--dist-backend", "gloo", "--world-sizes", "4", "-m", "not compile"],
            workers=3,
            sample=args.sample_w4,
        ),
        Job("compile", [*suites, *common, "--dist-backend", "gloo", "-m", "compile"], workers=3),
        # the mask suite on the two CUDA kernels that take a
        # mask in one call (their CPU emulations run in CI)
        *[
            Job(
                f"masks-{op}",
                [
                    "suites/test_masks.py",
                    *common,
                    "--dist-backend",
                    "gloo",
                    "--world-sizes",
                    "1,2",
                    "--op",
                    op,
                ],
                workers=2,
            )
            for op in ("cuda_efficient_masked", "cuda_flash_varlen")
        ],
        # PyTorch's public context_parallel API judged on CUDA (on CPU it cannot run): W=1 on NCCL,
        # W=2 sharing the GPU over gloo; its failures are its verdict (docs/pytorch-cp.md)
        *[
            Job(
                f"torch_cp-{tag}",
                [*TORCH_CP_SUITES, *common, *backend, "--world-sizes", w, "--impl", TORCH_CP],
                workers=2,
                kind="verdict",
                sample="0/2",
            )
            for tag, backend, w in (
                ("W1-nccl", w1_backend, "1"),
                ("W2-gloo", ["--dist-backend", "gloo"], "2"),
            )
        ],
    ]
    masks_args = ["--quick"] if args.quick_bench else ["--profile-dir", str(out / "profiles")]
    ops_args = ["--quick"] if args.quick_bench else ["--seqs", "16384,65536"]
    bench_jobs = [
        Job(
            "bench-masks",
            ["benchmarks/cuda_masks.py", *masks_args, "--json", str(out / "bench_cuda_masks.json")],
            kind="bench",
            json_out=str(out / "bench_cuda_masks.json"),
            share=3.0,
        ),
        Job(
            "bench-ops",
            ["benchmarks/cuda_ops.py", *ops_args, "--json", str(out / "bench_cuda_ops.json")],
            kind="bench",
            json_out=str(out / "bench_cuda_ops.json"),
        ),
        Job(
            "bench-host",
            [
                "benchmarks/host_work.py",
                "--device",
                "cuda",
                *(["--repeat", "50"] if args.quick_bench else []),
                "--json",
                str(out / "bench_host_work.json"),
            ],
            kind="bench",
            json_out=str(out / "bench_host_work.json"),
            share=0.5,
        ),
    ]
    return ([] if args.no_bench else bench_jobs) + test_jobs


def _command(job: Job) -> list[str]:
    if job.kind == "bench":
        return [sys.executable, *job.argv]
    workers = ["-n", str(job.workers)] if job.workers else []
    return [sys.executable, "-m", "pytest", *job.argv, *workers]


def _env(results: Path, sample: str | None = None) -> dict[str, str]:
    # (not an xdist worker's or a test's variables: a
    # check started from inside pytest is a fresh run)
    env = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith(("PYTEST_XDIST", "PYTEST_CURRENT_TEST"))
    }
    env.pop("GPU_CHECK_SAMPLE", None)
    if sample:
        env["GPU_CHECK_SAMPLE"] = sample
    paths = [
        str(ROOT),
        str(ROOT / "ci"),
        *filter(None, env.get("PYTHONPATH", "").split(os.pathsep)),
    ]
    env["PYTHONPATH"] = os.pathsep.join(dict.fromkeys(paths))
    env["GPU_CHECK_RESULTS"] = str(results)
    env["PYTHONUNBUFFERED"] = "1"
    env.setdefault("TORCHINDUCTOR_CACHE_DIR", str(results.parent / "inductor-cache"))
    return env


def run_phase(phase: list[Job], deadline: float, out: Path) -> None:
    """Start every job of the phase, wait until all end or the deadline passes, stop the rest."""
    procs = {}
    for job in phase:
        results = out / f"{job.name}.jsonl"
        results.unlink(missing_ok=True)
        log = out / f"{job.name}.log"
        job.log = str(log)
        handle = open(log, "w")
        procs[job.name] = (
            subprocess.Popen(
                _command(job),
                cwd=ROOT,
                env=_env(results, job.sample),
                stdout=handle,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            ),
            handle,
            time.monotonic(),
        )
        job.status = "running"
        print(f"[gpu_check] started {job.name}: {' '.join(_command(job)[1:])}", flush=True)
    pending = dict(procs)
    while pending and time.monotonic() < deadline:
        time.sleep(1.0)
        for name, (proc, handle, start) in list(pending.items()):
            if proc.poll() is not None:
                job = next(j for j in phase if j.name == name)
                job.rc, job.wall_s, job.status = (
                    proc.returncode,
                    time.monotonic() - start,
                    "finished",
                )
                handle.close()
                del pending[name]
                print(
                    f"[gpu_check] {name} finished: rc {proc.returncode} after {job.wall_s:.0f} s",
                    flush=True,
                )
    for name, (proc, handle, start) in pending.items():  # out of time: stop the whole process group
        job = next(j for j in phase if j.name == name)
        _stop(proc)
        job.rc, job.wall_s, job.status = (
            proc.returncode,
            time.monotonic() - start,
            "stopped at the deadline",
        )
        handle.close()
        print(f"[gpu_check] {name} stopped at the deadline after {job.wall_s:.0f} s", flush=True)


def _stop(proc: subprocess.Popen) -> None:
    for sig, wait in ((signal.SIGINT, 10.0), (signal.SIGTERM, 5.0), (signal.SIGKILL, 5.0)):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            return
        try:
            proc.wait(wait)
            return
        except subprocess.TimeoutExpired:
            continue


def read_results(job: Job, out: Path) -> None:
    path = out / f"{job.name}.jsonl"
    if not path.exists():
        return
    finals: dict[str, dict] = {}
    for line in path.read_text().splitlines():
        try:
            record = json.loads(line)
        except json.JSONDecodeError:  # a line cut by the stop
            continue
        if "collected" in record:
            job.collected = max(job.collected, int(record["collected"]))
        elif "sampled_out" in record:
            job.sampled_out = int(record["sampled_out"])
        elif record.get("nodeid"):
            prior = finals.get(record["nodeid"])
            if (
                prior is None or record["outcome"] == "failed"
            ):  # a teardown failure after a pass counts
                finals[record["nodeid"]] = record
    job.results = list(finals.values())


def summarize(all_jobs: list[Job], args, started: str, elapsed: float) -> dict:
    import torch

    device = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "no CUDA device"
    summary: dict = {
        "started": started,
        "elapsed_s": round(elapsed, 1),
        "budget_s": args.budget,
        "device": device,
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "python": platform.python_version(),
        "command": " ".join(["python", "ci/gpu_check.py", *sys.argv[1:]]),
        "jobs": [],
        "suites": {},
        "benchmarks": {},
        "failures": [],
    }
    per_suite: dict[str, collections.Counter] = collections.defaultdict(collections.Counter)
    for job in all_jobs:
        entry = {
            "name": job.name,
            "status": job.status,
            "rc": job.rc,
            "wall_s": round(job.wall_s, 1),
            "log": job.log,
        }
        if job.kind == "bench":
            rows = None
            if job.json_out and os.path.exists(job.json_out):
                with open(job.json_out) as f:
                    rows = json.load(f)
            summary["benchmarks"][job.name] = rows
            entry["ran"] = rows is not None
        else:
            counts = collections.Counter(r["outcome"] for r in job.results)
            reported = sum(counts.values())
            entry.update(
                collected=job.collected,
                **{
                    k: counts.get(k, 0)
                    for k in ("passed", "failed", "skipped", "xfailed", "xpassed")
                },
                not_run=max(0, job.collected - reported),
                sampled_out=job.sampled_out,
                sample=job.sample,
            )
            skips = collections.Counter(
                r["reason"] for r in job.results if r["outcome"] == "skipped"
            )
            entry["skip_reasons"] = dict(skips.most_common())
            entry["kind"] = job.kind
            if (
                job.kind == "verdict"
            ):  # another implementation's verdict: its failures by test, apart
                failed = collections.Counter(
                    r["nodeid"].split("[")[0] for r in job.results if r["outcome"] == "failed"
                )
                summary.setdefault("verdicts", {})[job.name] = dict(failed.most_common())
            else:
                for r in job.results:
                    module = r["nodeid"].split("::")[0]
                    per_suite[module][r["outcome"]] += 1
                    if r["outcome"] == "failed":
                        summary["failures"].append(
                            {"job": job.name, "nodeid": r["nodeid"], "reason": r["reason"]}
                        )
        summary["jobs"].append(entry)
    summary["suites"] = {m: dict(c) for m, c in sorted(per_suite.items())}
    for counts in summary["suites"].values():
        counts["executed_on_cuda"] = (
            counts.get("passed", 0)
            + counts.get("failed", 0)
            + counts.get("xfailed", 0)
            + counts.get("xpassed", 0)
        )
    tests = [j for j in summary["jobs"] if "collected" in j and j.get("kind") != "verdict"]
    summary["verdict"] = {
        "failed": sum(j["failed"] for j in tests),
        "not_run": sum(j["not_run"] for j in tests),
        "sampled_out": sum(j["sampled_out"] for j in tests),
        "jobs_out_of_time": [j["name"] for j in summary["jobs"] if j["status"] != "finished"],
        "jobs_without_results": [j["name"] for j in tests if j["collected"] == 0],
        # pytest's status 0: all passed, 1: some failed;
        # anything else is a run that broke (see its log)
        "jobs_broken": [
            j["name"] for j in tests if j["status"] == "finished" and j["rc"] not in (0, 1)
        ],
    }
    return summary


def markdown(summary: dict) -> str:
    v = summary["verdict"]
    lines = [
        f"# GPU check: {summary['device']}, torch {summary['torch']} (CUDA {summary['cuda']}), "
        f"Python {summary['python']}",
        "",
        f"Started {summary['started']}, {summary['elapsed_s']} s of a {summary['budget_s']} s "
        f"budget: **{v['failed']} failed, {v['not_run']} not run** ({v['sampled_out']} more left "
        "out by sampling)"
        + (f"; out of time: {', '.join(v['jobs_out_of_time'])}" if v["jobs_out_of_time"] else "")
        + (
            f"; no results from: {', '.join(v['jobs_without_results'])}"
            if v["jobs_without_results"]
            else ""
        )
        + (
            f"; broken runs (exit status other than 0 or 1): {', '.join(v['jobs_broken'])}"
            if v["jobs_broken"]
            else ""
        )
        + ".",
        "",
        f"Command: `{summary['command']}`",
        "",
        "| job | status | wall s | run (sampled out) | passed | failed | skipped | not run |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for j in summary["jobs"]:
        if "collected" in j:
            sampled = f" ({j['sampled_out']}, share {j['sample']})" if j["sample"] else ""
            name = f"{j['name']} (verdict)" if j.get("kind") == "verdict" else j["name"]
            lines.append(
                f"| {name} | {j['status']} | {j['wall_s']} | {j['collected']}{sampled} | "
                f"{j['passed']} | {j['failed']} | {j['skipped']} | {j['not_run']} |"
            )
        else:
            lines.append(f"| {j['name']} | {j['status']} | {j['wall_s']} | | | | | |")
    lines += [
        "",
        "Per suite module (all jobs): cases executed on CUDA, and their outcomes",
        "",
        "| module | executed on CUDA | passed | failed | skipped |",
        "|---|---|---|---|---|",
    ]
    for module, c in summary["suites"].items():
        lines.append(
            f"| {module} | {c['executed_on_cuda']} | {c.get('passed', 0)} | {c.get('failed', 0)} | "
            f"{c.get('skipped', 0)} |"
        )
    for name, failed in summary.get("verdicts", {}).items():
        lines += ["", f"## {name} (a verdict on another implementation; not counted above)", ""]
        lines += [f"- {n} failed: `{test}`" for test, n in failed.items()] or ["- no failure"]
    if summary["failures"]:
        lines += ["", "## Failures", ""]
        for f in summary["failures"][:40]:
            lines += [
                f"- `{f['nodeid']}` ({f['job']})",
                "",
                "  ```",
                *("  " + x for x in f["reason"].splitlines()[:8]),
                "  ```",
            ]
    skip_reasons: collections.Counter = collections.Counter()
    for j in summary["jobs"]:
        skip_reasons.update(j.get("skip_reasons", {}))
    if skip_reasons:
        lines += ["", "## Skip reasons", "", "| count | reason |", "|---|---|"]
        lines += [
            f"| {n} | {r.splitlines()[0][:200] if r else '(none)'} |"
            for r, n in skip_reasons.most_common(25)
        ]
    for name, rows in summary["benchmarks"].items():
        lines += ["", f"## {name}", ""]
        if not rows:
            lines.append("not run (see its log)")
            continue
        body = rows["rows"] if isinstance(rows, dict) else rows
        if body:
            keys = [k for k in body[0] if k not in ("error",)]
            lines += ["| " + " | ".join(keys) + " | error |", "|" + "---|" * (len(keys) + 1)]
            for r in body:
                cells = [
                    f"{r.get(k):.3g}" if isinstance(r.get(k), float) else str(r.get(k, ""))
                    for k in keys
                ]
                lines.append("| " + " | ".join(cells) + f" | {r.get('error', '')} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--budget", type=float, default=510.0, help="seconds for everything (default 510)"
    )
    parser.add_argument(
        "--sample-w3",
        default="0/3",
        help="share of the W=3 suite cases run, i/m (default 0/3: a third)",
    )
    parser.add_argument(
        "--sample-w4",
        default="0/6",
        help="share of the W=4 suite cases run, i/m (default 0/6: a sixth)",
    )
    parser.add_argument(
        "--bench-budget", type=float, default=120.0, help="seconds for the benchmarks (default 120)"
    )
    parser.add_argument("--no-bench", action="store_true", help="skip the benchmarks")
    parser.add_argument(
        "--quick-bench",
        action="store_true",
        help="the benchmarks' --quick forms (seq 16k / 4k-8k only, fewer repetitions)",
    )
    parser.add_argument(
        "--only", default=None, help="comma-separated job names to run (see --list)"
    )
    parser.add_argument(
        "--out", default="reports/gpu", help="directory for the logs and the summary"
    )
    parser.add_argument("--list", action="store_true", help="print the jobs and exit")
    parser.add_argument(
        "--device",
        default="cuda",
        choices=("cuda", "cpu"),
        help="the suites' --device (cpu: a rehearsal of the check on a machine without a GPU)",
    )
    args = parser.parse_args(argv)
    out = Path(args.out).resolve()
    args.out = str(out)
    all_jobs = jobs(args)
    if args.only:
        wanted = set(args.only.split(","))
        unknown = wanted - {j.name for j in all_jobs}
        if unknown:
            parser.error(
                f"--only: no job named {sorted(unknown)}; jobs: {[j.name for j in all_jobs]}"
            )
        all_jobs = [j for j in all_jobs if j.name in wanted]
    if args.list:
        for job in all_jobs:
            print(f"{job.name}: {' '.join(_command(job)[1:])}")
        return 0
    out.mkdir(parents=True, exist_ok=True)
    start = time.monotonic()
    started = datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds")
    end = start + args.budget - 20.0  # room for the stop and the summary
    benches = [j for j in all_jobs if j.kind == "bench"]
    bench_end = min(end, start + args.bench_budget)
    for i, bench in enumerate(
        benches
    ):  # one at a time: each needs the GPU to itself; its share of what is left
        share = bench.share / sum(b.share for b in benches[i:])
        run_phase([bench], time.monotonic() + (bench_end - time.monotonic()) * share, out)
    run_phase([j for j in all_jobs if j.kind in ("tests", "verdict")], end, out)
    for job in all_jobs:
        read_results(job, out)
    summary = summarize(all_jobs, args, started, time.monotonic() - start)
    (out / "gpu_check.json").write_text(json.dumps(summary, indent=1))
    (out / "gpu_check.md").write_text(markdown(summary))
    print(markdown(summary), flush=True)
    if summary["verdict"]["failed"]:
        return 1
    v = summary["verdict"]
    return (
        3
        if v["jobs_out_of_time"] or v["jobs_without_results"] or v["jobs_broken"] or v["not_run"]
        else 0
    )


if __name__ == "__main__":
    sys.exit(main())
