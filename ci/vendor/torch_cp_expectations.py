"""Write ci/vendor/torch_cp.txt, the expected failures of PyTorch's context parallel, from a run's
report, each attributed to its cause and the standalone reproduction of that cause.

    pytest suites -n auto --impl conformance.adapters.torch_cp:IMPLEMENTATION --report-dir reports/torch_cp
    python ci/vendor/torch_cp_expectations.py reports/torch_cp/conformance.json

A failure no cause explains stops the script: attribute it (a new cause, with its reproduction
under ci/vendor/torch_repro/) before it can be expected.
"""  # noqa: E501

from __future__ import annotations

import argparse
import json
import sys
from collections import Counter
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
OUT = HERE / "torch_cp.txt"

#: cause -> (who, what, reproduction script under torch_repro/)
CAUSES = {
    "load-balance-noncausal": (
        "PyTorch's ring",
        "raises 'Load balancing requires `is_causal=True`' for non-causal attention with head_tail",
        "cp_load_balance_requires_causal.py",
    ),
    "float64-merged-in-float32": (
        "PyTorch's ring",
        "merges and accumulates float64 in float32 (convert_to_f32=True): errors ~1e-7, not ~1e-15",
        "cp_float64_merged_in_float32.py",
    ),
    "kernel-nonpositive-scale": (
        "the CPU flash kernel",
        "returns NaN for causal attention with scale <= 0 (one device too)",
        "cpu_flash_nonpositive_scale.py",
    ),
    "kernel-hides-nan": (
        "the CPU flash kernel",
        "hides NaN: a query row holding NaN gets 0, a causal first row whose "
        "one key is NaN a finite output (one device too)",
        "cpu_flash_hides_nan.py",
    ),
    "kernel-strided-head-dim": (
        "PyTorch's ring",
        "hands the CPU flash op the caller's tensors, whose strided head "
        "dim the op reads wrongly, silently",
        "cpu_flash_op_strided_head_dim.py",
    ),
}


def cause_of(case: dict) -> str | None:
    """The cause of one failed case, from its id and message."""
    nodeid, message = case["nodeid"], case.get("message") or ""
    if "Load balancing requires" in message:
        return "load-balance-noncausal"
    if "strided-head-dim" in nodeid:
        return "kernel-strided-head-dim"
    if "test_nonpositive_scale" in nodeid:
        return "kernel-nonpositive-scale"
    if "test_nan_in_the_inputs" in nodeid:
        return "kernel-hides-nan"
    if "-f64-" in nodeid or "test_any_shape_matches_reference" in nodeid:
        # (the property test draws float64 and non-causal head_tail cases, both causes above)
        return "float64-merged-in-float32"
    return None


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("report", help="conformance.json of a torch_cp run")
    args = parser.parse_args()
    report = json.loads(Path(args.report).read_text())
    failed = [c for c in report["cases"] if c["outcome"] in ("failed", "xfailed")]
    unexplained = [c["nodeid"] for c in failed if cause_of(c) is None]
    if unexplained:
        print(
            "failures no cause explains (attribute them first):\n  " + "\n  ".join(unexplained),
            file=sys.stderr,
        )
        return 1
    causes = Counter(cause_of(c) for c in failed)
    counts = report["counts"]
    lines = [
        "# Expected failures of PyTorch's own context parallel (conformance.adapters.torch_cp) on "
        "CPU + gloo,",
        f"# torch {torch.__version__.split('+')[0]}, CPU capability "
        f"{torch.backends.cpu.get_cpu_capability()}, quick tier; written by "
        "ci/vendor/torch_cp_expectations.py from:",
        "#   pytest suites -n auto --impl conformance.adapters.torch_cp:IMPLEMENTATION "
        "--report-dir reports/torch_cp",
        f"# {counts.get('passed', 0)} pass, {len(failed)} fail, {counts.get('n/a', 0)} N/A, "
        f"{counts.get('skipped', 0)} skipped. Causes (each reproduced without this project by its "
        "script):",
    ]
    for name, n in sorted(causes.items(), key=lambda kv: -kv[1]):
        who, what, script = CAUSES[name]
        lines.append(f"#   {name} ({n}): {who} {what}; ci/vendor/torch_repro/{script}")
    lines += [
        "# A line that no longer fails turns into an XPASS (strict); one that matches no test "
        "fails",
        "# tests/ci/test_vendor_file.py.",
        "",
    ]
    for case in sorted(failed, key=lambda c: c["nodeid"]):
        name = cause_of(case)
        lines.append(f"xfail {case['nodeid']}  [{name}] {CAUSES[name][0]} {CAUSES[name][1]}")
    OUT.write_text("\n".join(lines) + "\n")
    print(f"wrote {OUT}: {len(failed)} expected failures, {dict(causes)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
