"""Distributed correctness check of an implementation (default ``ring_impl``) against float64.

Run:  python ci/check_ring_numerics.py [--world-sizes 2 3 4] [--compile] [--impl SPEC]
          [--undeclared]

A development tool for changes to ring_impl, one line per case; the conformance suites are the
product's verdict, and this check judges exactly as they do. For each world size it runs a fixed
list of cases on a pool of CPU + gloo ranks of the harness (``harness.get_pool``): dtypes float64,
float32, bfloat16, float16; causal and non-causal; layouts ``contiguous`` and ``head_tail``;
rotations ``allgather``, ``alltoall``, ``p2p``; GQA; cross attention (seq_kv != seq_q); the CPU
ops with the CUDA kernels' LSE layouts; with ``--compile`` also ``torch.compile(fullgraph=True)``
with aot_eager and inductor. Each case is a :class:`suites.cases.RingCase` run by the suites' rank
function (the suites' inputs, sharded with the reference's layout code) and judged by
:func:`suites.judge.judge`: out, lse, dq, dk, dv against

- R: the float64 reference (:mod:`reference.attention`) on the dtype-rounded global inputs, and
- B: the same kernel on one process over the full sequence in the same dtype (the suites'
  baseline),

with the numerics policy of :mod:`reference.budget`; and the collectives each rank issued
(``harness.accounting.CollectiveLog``) with the declared ``collective_schedule``. With ``--impl``
(e.g. ``conformance.adapters.torch_cp:IMPLEMENTATION``) only the cases the implementation's
capabilities declare run, unless ``--undeclared``; a case whose ranks raise, die or hang is
reported as ERROR with the first rank's error. Exit status 1 on any failure of a declared case.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from dataclasses import dataclass
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from conformance.implementation import Implementation, load_implementation
from harness import CaseFailure, Pool, get_pool, shutdown_all_pools
from harness.settings import current
from suites.cases import RingCase, ring_case
from suites.inputs import InputSpec
from suites.judge import judge


@dataclass(frozen=True)
class Case:
    dtype: str = "float64"
    is_causal: bool = False
    layout: str = "contiguous"
    rotate: str = "allgather"
    heads: int = 4
    heads_kv: int = 4
    kv_factor: int = 1  # seq_kv = kv_factor * seq_q (cross attention when > 1)
    op: str = "auto"
    compile: str | None = None

    @property
    def label(self) -> str:
        extra = []
        if self.heads_kv != self.heads:
            extra.append(f"gqa {self.heads}/{self.heads_kv}")
        if self.kv_factor != 1:
            extra.append(f"kv x{self.kv_factor}")
        if self.op != "auto":
            extra.append(self.op)
        if self.compile:
            extra.append(f"compile={self.compile}")
        causal = "causal" if self.is_causal else "full"
        return f"{self.dtype:8s} {causal:6s} {self.layout:10s} {self.rotate:9s} " + " ".join(extra)


def cases(world_size: int, with_compile: bool) -> list[Case]:
    """Every case for ``world_size``; see :func:`declared` for the filter by capabilities."""
    out = []
    for dtype in ("float64", "float32"):
        for is_causal in (False, True):
            for layout in ("contiguous", "head_tail"):
                for rotate in ("allgather", "alltoall", "p2p"):
                    out.append(Case(dtype, is_causal, layout, rotate))
    for rotate in ("allgather", "alltoall", "p2p"):
        out.append(Case("bfloat16", True, "head_tail", rotate))
        out.append(Case("bfloat16", False, "contiguous", rotate))
        out.append(Case("float16", True, "contiguous", rotate))
        out.append(Case("float64", True, "head_tail", rotate, heads=4, heads_kv=2))
        out.append(Case("float32", False, "contiguous", rotate, heads=4, heads_kv=1))
        out.append(Case("float64", False, "head_tail", rotate, kv_factor=2))
        out.append(Case("float32", False, "contiguous", rotate, kv_factor=2))
    for op in ("math", "cpu_efficient_layout", "cpu_cudnn_layout"):
        out.append(
            Case("float64" if op == "math" else "float32", True, "head_tail", "alltoall", op=op)
        )
        out.append(Case("float32", True, "contiguous", "p2p", heads=4, heads_kv=2, op=op))
    if with_compile:
        for backend in ("aot_eager", "inductor"):
            for rotate in ("allgather", "alltoall", "p2p"):
                out.append(Case("float32", True, "head_tail", rotate, compile=backend))
            out.append(
                Case("float64", False, "contiguous", "alltoall", heads_kv=2, compile=backend)
            )
            out.append(Case("float32", True, "contiguous", "allgather", compile=backend))
    return out


def declared(case: Case, caps) -> bool:
    """True if the implementation's capabilities cover the case (undeclared ones are N/A)."""
    checks = [
        caps.declares("layouts", case.layout),
        caps.declares("rotate_methods", case.rotate),
        caps.declares("dtypes", case.dtype),
    ]
    if case.heads_kv != case.heads:
        checks.append(caps.declares("gqa"))
    if case.kv_factor != 1:
        checks.append(caps.declares("cross_attention"))
    if case.op != "auto":
        checks.append(caps.declares("ops", "*"))
    if case.compile:
        checks.append(caps.declares("compile"))
    return all(bool(c) for c in checks)


def ring_case_of(case: Case, world_size: int, impl: Implementation) -> RingCase:
    """The suites' description of ``case`` at ``world_size``: 8 query rows per layout chunk,
    batch 2, head_dim 16, inputs drawn from seed 1234."""
    seq = 2 * world_size * 8
    inputs = InputSpec(
        batch=2,
        heads=case.heads,
        heads_kv=case.heads_kv,
        seq_q=seq,
        seq_kv=seq * case.kv_factor,
        head_dim=16,
        dtype=case.dtype,
        seed=1234,
    )
    return RingCase(
        inputs,
        world_size,
        is_causal=case.is_causal,
        layout=case.layout,
        rotate_method=case.rotate,
        op=None if case.op == "auto" else case.op,
        impl=impl.spec,
        return_lse=impl.capabilities.claims("lse"),
        compile=case.compile,
        account=not case.compile,
    )


def schedule_problems(
    impl: Implementation, case: RingCase, results: list[dict[str, Any]]
) -> list[str]:
    """Every rank's recorded collectives against the implementation's declared schedule."""
    schedule = case.declared_schedule(impl.obj.collective_schedule)
    declared = {phase: schedule.get(phase, {}) for phase in ("forward", "backward")}
    problems = []
    for rank, r in enumerate(results):
        issued = {phase: r["collectives"].get(phase, {}) for phase in ("forward", "backward")}
        if issued != declared:
            problems.append(f"rank {rank}: declared {declared}, issued {issued}")
    return problems


@dataclass
class Outcome:
    """One case's result: ``status`` ok / FAIL / ERROR, the max error of each quantity and the
    baseline's (``errors``), lines that say what failed, and whether the collectives matched."""

    status: str
    errors: dict[str, tuple[float, float]]
    problems: list[str]
    schedule: str = ""  # "schedule ok" when the collectives matched the declared schedule

    def line(self) -> str:
        text = " ".join(
            [
                *(f"{name}={err:.1e}({base:.1e})" for name, (err, base) in self.errors.items()),
                self.schedule,
            ]
        ).strip()
        return "\n    ".join([text, *self.problems]).strip()


def check_case(pool: Pool, impl: Implementation, case: RingCase) -> Outcome:
    """Run ``case`` on every rank of ``pool`` and judge it as the suites do."""
    try:
        results = pool.run(
            ring_case, case, timeout=current().timeout_for(compiles=bool(case.compile))
        )
    except CaseFailure as exc:
        first = exc.failed[0]
        message = (first.exc_message.strip().splitlines() or [""])[0]
        return Outcome("ERROR", {}, [f"rank {first.rank}: {first.exc_type}: {message}"[:200]])
    try:
        verdicts = judge(case, results, baseline_op=getattr(impl.obj, "baseline_op", None))
    except AssertionError as exc:  # a broken contract: a wrong dtype or shape, a missing result
        return Outcome("FAIL", {}, str(exc).splitlines()[:1])
    errors = {v.name: (v.max_err, v.base_max_err) for v in verdicts}
    problems = [v.message.splitlines()[0] for v in verdicts if not v.passed]
    schedule = ""
    if not case.compile and impl.capabilities.claims("collective_schedule"):
        mismatch = schedule_problems(impl, case, results)
        problems += ["SCHEDULE MISMATCH", *mismatch] if mismatch else []
        schedule = "" if mismatch else "schedule ok"
    return Outcome("FAIL" if problems else "ok", errors, problems, schedule)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description="Distributed correctness check of ring attention against float64"
    )
    parser.add_argument("--world-sizes", type=int, nargs="+", default=[2, 3, 4])
    parser.add_argument(
        "--compile",
        action="store_true",
        help="Also check torch.compile with aot_eager and inductor",
    )
    parser.add_argument(
        "--impl", default=None, help="Implementation spec (default: ring_impl's adapter)"
    )
    parser.add_argument(
        "--undeclared",
        action="store_true",
        help="Also run the cases the implementation's capabilities do not declare (compile "
        "excepted: a compile failure on one rank can leave the others waiting)",
    )
    args = parser.parse_args(argv)
    impl = load_implementation(args.impl)
    caps = impl.capabilities
    failures = 0
    try:
        for w in args.world_sizes:
            t0 = time.perf_counter()
            case_list = [
                c
                for c in cases(w, args.compile)
                if declared(c, caps) or (args.undeclared and not c.compile)
            ]
            pool = get_pool(w, backend="gloo", device="cpu")
            worst = 0.0
            for case in case_list:
                outcome = check_case(pool, impl, ring_case_of(case, w, impl))
                mark = "" if declared(case, caps) else " [undeclared]"
                print(
                    f"W={w} {outcome.status:5s} {case.label:55s} {outcome.line()}{mark}", flush=True
                )
                failures += outcome.status != "ok" and not mark
                if case.dtype == "float64" and outcome.errors:
                    worst = max(worst, *(err for err, _ in outcome.errors.values()))
            print(
                f"W={w}: {len(case_list)} cases in {time.perf_counter() - t0:.0f} s; worst "
                f"float64 error {worst:.2e}"
            )
    finally:
        shutdown_all_pools()
    print("FAILED" if failures else "all cases pass", f"({failures} failing)")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
