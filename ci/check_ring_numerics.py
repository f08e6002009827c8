"""Distributed correctness check of ``ring_impl.ring_attention`` against float64.

Run:  python ci/check_ring_numerics.py [--world-sizes 2 3 4] [--compile] [--impl SPEC] [--undeclared]

For each world size, spawns the ranks (CPU + gloo) and runs every case on them: dtypes float64,
float32, bfloat16, float16; causal and non-causal; layouts ``contiguous`` and ``head_tail``; rotations
``allgather``, ``alltoall``, ``p2p``; GQA; cross attention (seq_kv != seq_q); the CPU ops with
the CUDA kernels' LSE layouts; with ``--compile`` also ``torch.compile(fullgraph=True)`` with
aot_eager and inductor. Each rank compares its local out, lse, dq, dk, dv with its shard of

- R: plain float64 attention (autograd) on the dtype-rounded global inputs, and
- B: the same op on one process over the full sequence in the same dtype (the baseline),

with the policy of reference/budget.py (``max|X-R| <= k*max|B-R| + floor`` and the same for the
mean), and the collectives it issued (harness.accounting.CollectiveLog) with the declared
``collective_schedule``. With ``--impl`` (e.g. ``conformance.adapters.torch_cp:IMPLEMENTATION``) only
the cases the implementation's capabilities declare run, unless ``--undeclared``; errors raised
on every rank are reported per case. Exit status 1 on any failure of a declared case. A
development tool for changes to ring_impl; the conformance suites are the product's verdict.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from dataclasses import asdict, dataclass

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from ci.bench_common import run_world


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
        out.append(Case("float64" if op == "math" else "float32", True, "head_tail", "alltoall", op=op))
        out.append(Case("float32", True, "contiguous", "p2p", heads=4, heads_kv=2, op=op))
    if with_compile:
        for backend in ("aot_eager", "inductor"):
            for rotate in ("allgather", "alltoall", "p2p"):
                out.append(Case("float32", True, "head_tail", rotate, compile=backend))
            out.append(Case("float64", False, "contiguous", "alltoall", heads_kv=2, compile=backend))
            out.append(Case("float32", True, "contiguous", "allgather", compile=backend))
    return out


def declared(case: Case, caps) -> bool:
    """True if the implementation's capabilities cover the case (undeclared ones are N/A)."""
    checks = [caps.declares("layouts", case.layout), caps.declares("rotate_methods", case.rotate),
              caps.declares("dtypes", case.dtype)]
    if case.heads_kv != case.heads:
        checks.append(caps.declares("gqa"))
    if case.kv_factor != 1:
        checks.append(caps.declares("cross_attention"))
    if case.op != "auto":
        checks.append(caps.declares("ops", "*"))
    if case.compile:
        checks.append(caps.declares("compile"))
    return all(bool(c) for c in checks)


def _reference(q, k, v, do, is_causal, scale):
    """float64 out, lse, dq, dk, dv by autograd through plain attention (GQA by repeat)."""
    import torch

    q, k, v = (t.detach().to(torch.float64).requires_grad_() for t in (q, k, v))
    g = q.shape[1] // k.shape[1]
    kk, vv = k.repeat_interleave(g, 1), v.repeat_interleave(g, 1)
    s = (q @ kk.transpose(-1, -2)) * scale
    if is_causal:
        sq, sk = s.shape[-2:]
        s = s.masked_fill(~torch.ones(sq, sk, dtype=torch.bool).tril(), float("-inf"))
    lse = s.logsumexp(-1)
    out = torch.exp(s - lse.unsqueeze(-1)) @ vv
    dq, dk, dv = torch.autograd.grad(out, (q, k, v), do.to(torch.float64))
    return out.detach(), lse.detach(), dq, dk, dv


def _baseline(op, q, k, v, do, is_causal, scale):
    """The same op on the full sequence, one process: out, lse, dq, dk, dv."""

    from ring_impl.lse import normalize_lse
    from ring_impl.ops import accumulation_dtype, call_backward, call_forward

    out, lse = call_forward(op, q, k, v, is_causal=is_causal, scale=scale)
    b, h, s, _ = q.shape
    lse = normalize_lse(lse, batch=b, heads=h, seq_q=s, layout=op.capabilities.lse_layout).to(accumulation_dtype(q.dtype))
    dq, dk, dv = call_backward(op, do, q, k, v, out, lse, is_causal=is_causal, scale=scale)
    return out, lse, dq, dk, dv


def _rank_cases(rank: int, world_size: int, case_list: list[Case], impl_spec: str | None) -> list[dict]:
    from conformance.implementation import load_implementation

    impl = load_implementation(impl_spec)
    takes_op = bool(impl.capabilities.declares("ops", "*"))
    results = []
    for case in case_list:
        try:
            results.append(_one_case(rank, world_size, case, impl, takes_op))
        except Exception as exc:  # PyTorch's own checks raise on every rank alike
            first = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
            results.append({"label": case.label, "rank": rank, "ok": False, "error": f"{type(exc).__name__}: {first}"[:200]})
    return results


def _one_case(rank: int, world_size: int, case: Case, impl, takes_op: bool) -> dict:
    import torch

    import ring_impl
    from harness.accounting import CollectiveLog
    from reference.attention import causal_visibility
    from reference.budget import ErrorScale, check, compute_dtype, error_scales
    from ring_impl.ops import resolve_op

    dtype = getattr(torch, case.dtype)
    n = 8  # rows per layout chunk
    seq = 2 * world_size * n
    b, d = 2, 16
    gen = torch.Generator().manual_seed(1234)
    q = torch.randn(b, case.heads, seq, d, generator=gen, dtype=torch.float64).to(dtype)
    k = torch.randn(b, case.heads_kv, seq * case.kv_factor, d, generator=gen, dtype=torch.float64).to(dtype)
    v = torch.randn(b, case.heads_kv, seq * case.kv_factor, d, generator=gen, dtype=torch.float64).to(dtype)
    do = torch.randn(b, case.heads, seq, d, generator=gen, dtype=torch.float64).to(dtype)
    scale = d**-0.5
    op = resolve_op(case.op, q.device, dtype, d)

    def sh(t, layout=case.layout):
        return ring_impl.shard(t, world_size, rank, layout=layout)

    ql, kl, vl = (sh(t).requires_grad_() for t in (q, k, v))
    extra = {"op": case.op} if takes_op else {}

    def call(ql, kl, vl):
        return impl.obj.ring_attention(
            ql, kl, vl, is_causal=case.is_causal, rotate_method=case.rotate, layout=case.layout,
            scale=scale, return_lse=True, **extra,
        )

    log = CollectiveLog()
    if case.compile:
        torch._dynamo.reset()
        fn = torch.compile(call, backend=case.compile, fullgraph=True)
        out, lse = fn(ql, kl, vl)
        out.backward(sh(do))
    else:
        with log:
            with log.phase("forward"):
                out, lse = call(ql, kl, vl)
            with log.phase("backward"):
                out.backward(sh(do))
    got = {"out": out, "lse": lse, "dq": ql.grad, "dk": kl.grad, "dv": vl.grad}
    ref = dict(zip(("out", "lse", "dq", "dk", "dv"), _reference(q, k, v, do, case.is_causal, scale)))
    base = dict(zip(("out", "lse", "dq", "dk", "dv"), _baseline(op, q, k, v, do, case.is_causal, scale)))
    visible = causal_visibility(torch.arange(q.shape[2]), torch.arange(k.shape[2])) if case.is_causal else None
    scales = error_scales(q, k, v, do, visible=visible, scale=scale)
    row = {"case": asdict(case), "label": case.label, "rank": rank, "ok": True, "errors": {}}
    for name in ("out", "lse", "dq", "dk", "dv"):
        # This rank's shard of everything, judged by the numerics policy (reference/budget.py).
        want = compute_dtype(dtype) if name == "lse" else dtype
        local_scales = ErrorScale(*(sh(t) for t in (scales[name].magnitude, scales[name].compute, scales[name].conditioning)))
        verdict = check(name, got[name], sh(ref[name]), sh(base[name].detach()), dtype=dtype, result_dtype=want,
                        scales=local_scales, world_size=world_size)
        ok = verdict.passed and got[name].dtype == want
        row["errors"][name] = {"max": verdict.max_err, "base": verdict.base_max_err, "ok": ok}
        row["ok"] &= ok
    if not case.compile:
        declared = impl.obj.collective_schedule(
            world_size, case.rotate, batch=b, heads_kv=case.heads_kv, seq_kv=kl.shape[2], head_dim=d,
            dtype=dtype, compiled=False,
        )
        measured = log.summary()
        measured = {p: measured.get(p, {}) for p in ("forward", "backward")}
        row["schedule_ok"] = measured == declared
        if not row["schedule_ok"]:
            row["schedule"] = {"declared": declared, "measured": measured}
        row["ok"] &= row["schedule_ok"]
    return row


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Distributed correctness check of ring attention against float64")
    parser.add_argument("--world-sizes", type=int, nargs="+", default=[2, 3, 4])
    parser.add_argument("--compile", action="store_true", help="Also check torch.compile with aot_eager and inductor")
    parser.add_argument("--impl", default=None, help="Implementation spec (default: ring_impl's adapter)")
    parser.add_argument("--undeclared", action="store_true",
                        help="Also run the cases the implementation's capabilities do not declare (compile "
                             "excepted: a compile failure on one rank can leave the others waiting)")
    args = parser.parse_args(argv)
    from conformance.implementation import load_implementation

    caps = load_implementation(args.impl).capabilities
    os.environ.setdefault("TORCHDYNAMO_ENABLE_P2P_COMPILATION", "1")
    failures = 0
    for w in args.world_sizes:
        t0 = time.perf_counter()
        case_list = [c for c in cases(w, args.compile)
                     if declared(c, caps) or (args.undeclared and not c.compile)]
        per_rank = run_world(w, _rank_cases, case_list, args.impl, timeout=3600)
        worst: dict[str, float] = {}
        for i, case in enumerate(case_list):
            rows = [per_rank[r][i] for r in range(w)]
            ok = all(row["ok"] for row in rows)
            mark = "" if declared(case, caps) else " [undeclared]"
            if any("error" in row for row in rows):
                failures += 0 if mark else 1
                print(f"W={w} FAIL {case.label:55s} {rows[0].get('error', '')}{mark}")
                continue
            err = {name: max(row["errors"][name]["max"] for row in rows) for name in ("out", "lse", "dq", "dk", "dv")}
            base = {name: max(row["errors"][name]["base"] for row in rows) for name in ("out", "lse", "dq", "dk", "dv")}
            if case.dtype == "float64":
                worst[case.dtype] = max(worst.get(case.dtype, 0.0), *err.values())
            sched = "" if case.compile else (" schedule ok" if all(row["schedule_ok"] for row in rows) else " SCHEDULE MISMATCH")
            status = "ok  " if ok else "FAIL"
            errs = " ".join(f"{k}={err[k]:.1e}({base[k]:.1e})" for k in err)
            print(f"W={w} {status} {case.label:55s} {errs}{sched}{mark}")
            if not ok and not mark:
                failures += 1
                for row in rows:
                    if "schedule" in row:
                        print(f"    rank {row['rank']}: {row['schedule']}")
        print(f"W={w}: {len(case_list)} cases in {time.perf_counter() - t0:.0f} s; worst float64 error {worst.get('float64', 0):.2e}")
    print("FAILED" if failures else "all cases pass", f"({failures} failing)")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
