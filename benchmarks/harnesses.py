"""Speed benchmark: one trivial 2-rank gloo all_reduce case through three harnesses.

Runs the same case (each rank all_reduces ``torch.ones(1)`` and checks the sum) through

* ``harness``: this project's rank pool (``harness.get_pool(2).run(case)``), in a plain script;
* ``harness+pytest``: the same through pytest and the ``rank_pool`` fixture (what suites pay);
* ``MultiProcessTestCase``: torch's per-test spawning harness
  (``torch.testing._internal.common_distributed``);
* ``MultiProcContinuousTest``: torch's per-class persistent harness.

Each is run as a fresh subprocess with a small suite of ``n`` cases, for two values of ``n``; the
per-case time is the slope ``(T(n2) - T(n1)) / (n2 - n1)`` and the start-up time ``T(n1) - n1 x
per-case`` (interpreter, torch import, process spawning and process-group set-up included). The
harness is also timed in-process: pool start (``get_pool`` until every rank joined its process
group) and the median of many cases.

Usage: ``python benchmarks/harnesses.py [--json reports/bench_harness.json] [--quick]``. Needs the
``expecttest`` package for torch's harnesses (``pip install expecttest``); without it those rows
are reported as unavailable. Prints a table and writes JSON.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path
from typing import Any

REPO_ROOT = Path(__file__).resolve().parents[1]
if str(REPO_ROOT) not in sys.path:
    sys.path.insert(0, str(REPO_ROOT))

from benchmarks import runner  # noqa: E402
from harness.procs import pytest_command, run_tree  # noqa: E402  (each command's process tree dies with the script)

CASE_BODY = """\
    x = torch.ones(1)
    dist.all_reduce(x)
    assert x.item() == 2.0, x
"""

HARNESS_SCRIPT = """\
import sys
import torch
import torch.distributed as dist
from harness import get_pool


def case(ctx):
{body}

if __name__ == "__main__":
    pool = get_pool(2, backend="gloo", device="cpu")
    for _ in range({n}):
        pool.run(case)
"""

PYTEST_FILE = """\
import pytest
import torch
import torch.distributed as dist


def case(ctx):
{body}

@pytest.mark.parametrize("i", range({n}))
def test_case(rank_pool, i):
    rank_pool(2).run(case)
"""

MULTIPROCESS_TESTCASE = """\
import os
import unittest
import torch
import torch.distributed as dist
from torch.testing._internal.common_distributed import MultiProcessTestCase


class Bench(MultiProcessTestCase):
    @property
    def world_size(self):
        return 2

    def setUp(self):
        super().setUp()
        self._spawn_processes()

    def tearDown(self):
        super().tearDown()
        try:
            os.remove(self.file_name)
        except OSError:
            pass


def _case(self):
    store = dist.FileStore(self.file_name, self.world_size)
    dist.init_process_group("gloo", store=store, rank=self.rank, world_size=self.world_size)
{body_indented}
    dist.destroy_process_group()


for _i in range({n}):
    setattr(Bench, f"test_case_{{_i:04d}}", _case)

if __name__ == "__main__":
    unittest.main()
"""

CONTINUOUS_TEST = """\
import unittest
import torch
import torch.distributed as dist
from torch.testing._internal.common_distributed import MultiProcContinuousTest


class Bench(MultiProcContinuousTest):
    world_size = 2

    @classmethod
    def backend_str(cls):
        return "gloo"

    @classmethod
    def device_type(cls):
        return "cpu"


def _case(self):
{body}

for _i in range({n}):
    setattr(Bench, f"test_case_{{_i:04d}}", _case)

if __name__ == "__main__":
    unittest.main()
"""


def _env() -> dict[str, str]:
    env = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith(("PYTEST_", "RING_"))
        and k not in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
    }
    env["PYTHONPATH"] = os.pathsep.join([str(REPO_ROOT), env.get("PYTHONPATH", "")]).rstrip(
        os.pathsep
    )
    return env


def _run(command: list[str], cwd: Path, timeout: float) -> None:
    result = run_tree(
        command,
        cwd=cwd,
        env=_env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        timeout=timeout,
        check=False,
    )
    if result.returncode != 0:
        raise RuntimeError(
            f"{' '.join(command)} failed ({result.returncode}):\n{result.stdout[-4000:]}"
        )


def _write(directory: Path, name: str, text: str) -> Path:
    path = directory / name
    path.write_text(text)
    return path


def _command(kind: str, directory: Path, n: int) -> list[str]:
    body = CASE_BODY
    indented = textwrap.indent(textwrap.dedent(CASE_BODY), "    ")
    if kind == "harness":
        path = _write(directory, f"bench_harness_{n}.py", HARNESS_SCRIPT.format(body=body, n=n))
        return [sys.executable, str(path)]
    if kind == "harness+pytest":
        path = _write(directory, f"test_bench_{n}.py", PYTEST_FILE.format(body=body, n=n))
        return pytest_command("-p", "harness.pytest_plugin", "--rootdir", str(directory), str(path))
    if kind == "MultiProcessTestCase":
        path = _write(
            directory,
            f"bench_mptc_{n}.py",
            MULTIPROCESS_TESTCASE.format(body_indented=indented, n=n),
        )
        return [sys.executable, str(path)]
    if kind == "MultiProcContinuousTest":
        path = _write(directory, f"bench_cont_{n}.py", CONTINUOUS_TEST.format(body=body, n=n))
        return [sys.executable, str(path)]
    raise ValueError(kind)


def measure_subprocess(
    kind: str, n_small: int, n_large: int, repeat: int, timeout: float
) -> dict[str, Any]:
    """Wall time of fresh processes running n_small and n_large cases; slope and intercept.

    Each size runs ``repeat`` times, interleaved (``benchmarks.runner``), and the minimum is kept:
    on a shared machine the minimum is the least disturbed run.
    """
    with tempfile.TemporaryDirectory(prefix="bench-harness-") as tmp:
        directory = Path(tmp)
        small_cmd = _command(kind, directory, n_small)
        large_cmd = _command(kind, directory, n_large)
        times = runner.interleave(
            {
                "small": lambda: _run(small_cmd, directory, timeout),
                "large": lambda: _run(large_cmd, directory, timeout),
            },
            repeat,
        ).times
    smalls, larges = times["small"], times["large"]
    t_small, t_large = min(smalls), min(larges)
    per_case = (t_large - t_small) / (n_large - n_small)
    return {
        "n_small": n_small,
        "n_large": n_large,
        "repeat": repeat,
        "wall_small_s": [round(t, 3) for t in smalls],
        "wall_large_s": [round(t, 3) for t in larges],
        "per_case_s": per_case,
        "startup_s": t_small - n_small * per_case,
        "first_case_wall_s": t_small,
    }


def _trivial_case(ctx: Any) -> None:
    import torch
    import torch.distributed as dist

    x = torch.ones(1)
    dist.all_reduce(x)
    assert x.item() == 2.0, x


def measure_in_process(cases: int) -> dict[str, Any]:
    """Pool start (cold forkserver, then warm with another world size) and per-case times."""
    from harness import get_pool, shutdown_all_pools

    began = time.perf_counter()
    pool = get_pool(2, backend="gloo", device="cpu")
    cold_start = time.perf_counter() - began
    times = runner.measure(lambda: pool.run(_trivial_case), warmup=20, repeat=cases)
    shutdown_all_pools()
    began = time.perf_counter()
    pool = get_pool(2, backend="gloo", device="cpu")
    warm_start = time.perf_counter() - began
    pool.run(_trivial_case)
    shutdown_all_pools()
    return {
        "pool_start_cold_s": cold_start,
        "pool_start_warm_forkserver_s": warm_start,
        "cases": cases,
        "per_case_median_s": runner.median(times),
        "per_case_mean_s": statistics.fmean(times),
        "per_case_p90_s": sorted(times)[int(0.9 * len(times))],
    }


def _available(module: str) -> bool:
    try:
        __import__(module)
    except ImportError:
        return False
    return True


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--json",
        default=str(REPO_ROOT / "reports" / "bench_harness.json"),
        help="Where to write the figures as JSON",
    )
    parser.add_argument(
        "--quick",
        action="store_true",
        help="Fewer cases and one repeat (a smoke run, noisier figures)",
    )
    parser.add_argument(
        "--repeat",
        type=int,
        default=3,
        help="Runs per suite size; the minimum wall time is kept (default 3)",
    )
    args = parser.parse_args(argv)

    scale = 0.2 if args.quick else 1.0
    plans = {
        "harness": (1, int(1000 * scale)),
        "harness+pytest": (1, int(300 * scale)),
        "MultiProcContinuousTest": (1, int(500 * scale)),
        "MultiProcessTestCase": (1, 3 if args.quick else 4),
    }
    results: dict[str, Any] = {
        "case": "2 ranks, gloo, CPU: all_reduce(torch.ones(1)) and check the sum",
        "machine": {
            "python": platform.python_version(),
            "cpus": os.cpu_count(),
            "platform": platform.platform(),
        },
    }
    import torch

    results["machine"]["torch"] = torch.__version__
    have_expecttest = _available("expecttest")
    for kind, (n_small, n_large) in plans.items():
        if kind.startswith("MultiProc") and not have_expecttest:
            results[kind] = {
                "unavailable": "torch.testing._internal needs expecttest: pip install expecttest"
            }
            print(f"{kind}: unavailable (pip install expecttest)", flush=True)
            continue
        print(f"{kind}: timing {n_small} and {n_large} cases in fresh processes ...", flush=True)
        repeat = 1 if args.quick else max(1, args.repeat)
        results[kind] = measure_subprocess(kind, n_small, n_large, repeat, timeout=1800)
    print("harness in-process: pool start and per-case times ...", flush=True)
    results["harness_in_process"] = measure_in_process(int(2000 * scale))

    rows = []
    for kind in plans:
        r = results[kind]
        if "unavailable" in r:
            rows.append((kind, "n/a", "n/a", r["unavailable"]))
        else:
            rows.append(
                (
                    kind,
                    f"{r['per_case_s'] * 1e3:10.2f}",
                    f"{r['startup_s']:7.2f}",
                    f"T({r['n_small']})={min(r['wall_small_s']):.2f}s "
                    f"T({r['n_large']})={min(r['wall_large_s']):.2f}s",
                )
            )
    ip = results["harness_in_process"]
    print()
    print(
        f"{'harness':26s} {'per case ms':>12s} {'start-up s':>11s}  raw (min wall time of each "
        "suite size)"
    )
    for kind, per_case, startup, raw in rows:
        print(f"{kind:26s} {per_case:>12s} {startup:>11s}  {raw}")
    print()
    print(
        f"harness in-process: pool start {ip['pool_start_cold_s']:.2f} s cold (forkserver imports "
        f"torch), {ip['pool_start_warm_forkserver_s'] * 1e3:.0f} ms with the forkserver warm; per "
        f"case median {ip['per_case_median_s'] * 1e3:.2f} ms, mean "
        f"{ip['per_case_mean_s'] * 1e3:.2f} ms, p90 {ip['per_case_p90_s'] * 1e3:.2f} ms over "
        f"{ip['cases']} cases"
    )
    mptc = results.get("MultiProcessTestCase", {})
    cont = results.get("MultiProcContinuousTest", {})
    if "per_case_s" in mptc:
        results["speedup_per_case_vs_MultiProcessTestCase"] = (
            mptc["per_case_s"] / ip["per_case_median_s"]
        )
        print(
            "per-case speed-up vs MultiProcessTestCase: "
            f"{results['speedup_per_case_vs_MultiProcessTestCase']:.0f}x"
        )
    if "startup_s" in cont:
        results["startup_vs_MultiProcContinuousTest_s"] = {
            "harness": results["harness"]["startup_s"],
            "continuous": cont["startup_s"],
        }
        print(
            f"start-up: harness {results['harness']['startup_s']:.2f} s vs MultiProcContinuousTest "
            f"{cont['startup_s']:.2f} s (fresh process, torch import included); one-case suite: "
            f"{results['harness']['first_case_wall_s']:.2f} s vs {cont['first_case_wall_s']:.2f} s"
        )
    out = Path(args.json)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(results, indent=2) + "\n")
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
