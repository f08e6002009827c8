"""Nightly matrix: run the conformance suites over tiers, world sizes, ops and implementations,
and collect every job's report into one summary.

    python ci/nightly.py                 # every job for this machine (CPU jobs; CUDA jobs if a GPU is seen)
    python ci/nightly.py --list          # the jobs, without running them
    python ci/nightly.py --only ring_impl-nightly torch_cp-quick
    python ci/nightly.py --only ring_impl-simulated-W8-16 ring_impl-simulated-W32 ring_impl-simulated-W64
    python ci/nightly.py --out reports/nightly -- -x   # arguments after -- go to every pytest run

Each job is one ``pytest suites`` process writing its own report under ``<out>/<job>/``;
``<out>/summary.md`` and ``<out>/summary.json`` gather the scores. A job marked informational
(PyTorch's own context parallel, judged against expectations in ci/vendor/) does not make the
nightly fail. Progress is printed as each job starts and ends.
"""  # noqa: E501

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from harness.procs import pytest_command, run_tree  # noqa: E402  (each job's process tree dies with the script)


@dataclass(frozen=True)
class Job:
    name: str
    args: tuple[str, ...]
    informational: bool = False
    env: dict[str, str] = field(default_factory=dict)
    paths: tuple[str, ...] = ("suites",)


#: The simulated tier (harness/simulated.py: every rank a thread, exact collectives): the ring
#: (every rotation, both layouts, causal, its steps, collectives, balance and the balancers'
#: work), masks with the balancers, Ulysses and the hybrid, at world sizes the process pool does
#: not run. No torch.compile (dynamo is not thread-safe); a case may take minutes at W=64.
SIMULATED = (
    "--launcher",
    "simulated",
    "--tier",
    "nightly",
    "--case-timeout",
    "900",
    "-m",
    "not compile",
)
SIMULATED_CASES = (
    "forward_backward or collectives or causal_layouts or rotation or test_balance "
    "or masked_attention_matches or strategy_matches or strategy_collectives"
)
#: From W=32 on: float16 left out, the float64 ring cases and the masks in float32 only (each
#: case costs W^2 ring steps, and a float64 oracle of the whole sequence).
SIMULATED_LARGE = (
    f"({SIMULATED_CASES}) and not -f16- and not (forward_backward and -f64-) "
    "and not (masked_attention and (-f64- or -bf16-))"
)


def simulated_jobs() -> list[Job]:
    return [
        Job(
            "ring_impl-simulated-W8-16",
            (*SIMULATED, "--world-sizes", "8,16", "-k", SIMULATED_CASES),
        ),
        Job("ring_impl-simulated-W32", (*SIMULATED, "--world-sizes", "32", "-k", SIMULATED_LARGE)),
        Job("ring_impl-simulated-W64", (*SIMULATED, "--world-sizes", "64", "-k", SIMULATED_LARGE)),
    ]


def jobs(cuda: bool) -> list[Job]:
    torch_cp = "conformance.adapters.torch_cp:IMPLEMENTATION"
    out = [
        Job("ring_impl-nightly", ("--tier", "nightly")),
        Job("ring_impl-op-math", ("--op", "math", "--world-sizes", "1,2,4")),
        Job(
            "ring_impl-op-efficient-layout",
            ("--op", "cpu_efficient_layout", "--world-sizes", "2,3,4"),
        ),
        Job("ring_impl-op-cudnn-layout", ("--op", "cpu_cudnn_layout", "--world-sizes", "2,3,4")),
        # The CPU stand-ins of the masked CUDA ops: their bias and packing on every suite.
        Job(
            "ring_impl-op-efficient-masked-layout",
            ("--op", "cpu_efficient_masked_layout", "--world-sizes", "2,3,4"),
        ),
        Job(
            "ring_impl-op-flash-varlen-layout",
            ("--op", "cpu_flash_varlen_layout", "--world-sizes", "2,3,4"),
        ),
        Job(
            "ring_impl-W5-8",
            (
                "--tier",
                "nightly",
                "--world-sizes",
                "5,6,7,8",
                "-k",
                "forward_backward or collectives",
            ),
        ),
        Job(
            "torch_cp-quick",
            ("--impl", torch_cp, "--vendor-file", str(ROOT / "ci" / "vendor" / "torch_cp.txt")),
            informational=True,
        ),
        Job("project-tests", ("--tier", "nightly"), paths=("tests", "meta_tests")),
        *simulated_jobs(),
    ]
    if cuda:
        out += [
            Job("cuda-ring_impl", ("--device", "cuda", "--tier", "nightly")),
            Job("cuda-op-flash", ("--device", "cuda", "--op", "cuda_flash")),
            Job("cuda-op-efficient", ("--device", "cuda", "--op", "cuda_efficient")),
            Job("cuda-op-cudnn", ("--device", "cuda", "--op", "cudnn")),
            # Written without a GPU: informational until a GPU run has them green.
            Job(
                "cuda-op-efficient-masked",
                ("--device", "cuda", "--op", "cuda_efficient_masked"),
                informational=True,
            ),
            Job(
                "cuda-op-flash-varlen",
                ("--device", "cuda", "--op", "cuda_flash_varlen"),
                informational=True,
            ),
            Job("cuda-torch_cp", ("--device", "cuda", "--impl", torch_cp), informational=True),
        ]
    return out


def run_job(job: Job, out: Path, extra: list[str], workers: str) -> dict:
    job_dir = out / job.name
    job_dir.mkdir(parents=True, exist_ok=True)
    cmd = pytest_command(*job.paths, "-n", workers, "--report-dir", str(job_dir), *job.args, *extra)
    env = {**os.environ, **job.env}
    started = time.time()
    with open(job_dir / "pytest.log", "w") as log:
        proc = run_tree(cmd, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT)
    report_file = job_dir / "conformance.json"
    report = json.loads(report_file.read_text()) if report_file.exists() else {}
    return {
        "job": job.name,
        "command": " ".join(cmd),
        "exit_code": proc.returncode,
        "informational": job.informational,
        "seconds": round(time.time() - started, 1),
        "score": report.get("score"),
        "counts": report.get("counts"),
        "log": str(job_dir / "pytest.log"),
    }


def summary_markdown(results: list[dict]) -> str:
    lines = [
        "## Nightly conformance matrix",
        "",
        "| job | exit | score (passes only) | failed | xfailed | xpassed | N/A | skipped | time |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in results:
        score = f"{r['score']['passed']}/{r['score']['total']}" if r.get("score") else "-"
        counts = r.get("counts") or {}
        exit_text = f"{r['exit_code']}" + (" (informational)" if r["informational"] else "")
        shown = " | ".join(
            str(counts.get(k, "-")) for k in ("failed", "xfailed", "xpassed", "n/a", "skipped")
        )
        lines.append(f"| {r['job']} | {exit_text} | {score} | {shown} | {r['seconds']} s |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    extra: list[str] = []
    if "--" in argv:
        i = argv.index("--")
        argv, extra = argv[:i], argv[i + 1 :]
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--out",
        default=str(ROOT / "reports" / "nightly"),
        help="Directory for job reports and the summary",
    )
    parser.add_argument("--only", nargs="*", default=None, help="Run only these jobs")
    parser.add_argument("--list", action="store_true", help="List the jobs and exit")
    parser.add_argument(
        "--workers", default="auto", help="pytest-xdist workers per job (default auto)"
    )
    parser.add_argument(
        "--cuda", choices=("auto", "yes", "no"), default="auto", help="Include CUDA jobs"
    )
    args = parser.parse_args(argv)

    cuda = args.cuda == "yes"
    if args.cuda == "auto":
        import torch

        cuda = torch.cuda.is_available()
    selected = jobs(cuda)
    if args.only:
        unknown = set(args.only) - {j.name for j in selected}
        if unknown:
            parser.error(f"unknown job(s) {sorted(unknown)}; --list shows the jobs")
        selected = [j for j in selected if j.name in args.only]
    if args.list:
        for j in selected:
            print(
                f"{j.name:32s} pytest {' '.join(j.paths)} "
                f"{' '.join(j.args)}{'  [informational]' if j.informational else ''}"
            )
        return 0

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    results = []
    for i, job in enumerate(selected, start=1):
        print(f"[{i}/{len(selected)}] {job.name} ...", flush=True)
        r = run_job(job, out, extra, args.workers)
        score = f"{r['score']['passed']}/{r['score']['total']}" if r.get("score") else "no report"
        print(
            f"[{i}/{len(selected)}] {job.name}: exit {r['exit_code']}, {score}, {r['seconds']} s "
            f"(log: {r['log']})",
            flush=True,
        )
        results.append(r)
    (out / "summary.json").write_text(json.dumps(results, indent=1))
    markdown = summary_markdown(results)
    (out / "summary.md").write_text(markdown)
    if os.environ.get("GITHUB_STEP_SUMMARY"):
        with open(os.environ["GITHUB_STEP_SUMMARY"], "a") as fh:
            fh.write(markdown)
    print(markdown)
    failed = [r["job"] for r in results if r["exit_code"] != 0 and not r["informational"]]
    if failed:
        print(f"nightly: {len(failed)} job(s) failed: {', '.join(failed)}", file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
