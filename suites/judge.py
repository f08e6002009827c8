"""Parent-side verdicts: a case's per-rank results against the float64 oracle.

For each of out, lse, dq, dk, dv the global result X (unsharded with the reference's layout
code) is judged by :func:`reference.budget.check` against the float64 reference R on the same
dtype-rounded inputs, relative to the single-device baseline B of the same kernel and dtype.
R and B depend only on the inputs (not on world size, rotation or layout), so they are
computed once per input spec and cached for the session.

A failure is re-run with per-step recording (when the implementation can record) and
diagnosed against the float64 ring simulation, so the message says which rank and ring step
first diverges, and ends with a copy-pasteable repro.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import Any

import torch

from conformance.baseline import session_device, single_device_baseline
from reference import layout as ref_layout
from reference.attention import attention_grads
from reference.budget import ErrorScale, Verdict, check, compute_dtype, error_scales
from reference.diagnose import diagnose
from reference.simulate import simulate_ring
from suites.cases import RingCase
from suites.inputs import InputSpec, make_inputs

__all__ = [
    "QUANTITIES",
    "baseline_for",
    "contract_violations",
    "diagnose_case",
    "format_failure",
    "judge",
    "reference_for",
    "scales_for",
    "unshard_results",
]

QUANTITIES = ("out", "lse", "dq", "dk", "dv")


@functools.lru_cache(maxsize=128)
def reference_for(spec: InputSpec, is_causal: bool) -> dict[str, torch.Tensor]:
    """float64 out, lse, dq, dk, dv of the global inputs."""
    g = make_inputs(spec)
    r = attention_grads(
        g.query,
        g.key,
        g.value,
        g.grad_out,
        is_causal=is_causal,
        scale=spec.scale,
        grad_lse=g.grad_lse,
    )
    return {"out": r.out, "lse": r.lse, "dq": r.dq, "dk": r.dk, "dv": r.dv}


@functools.lru_cache(maxsize=128)
def scales_for(spec: InputSpec, is_causal: bool) -> dict[str, ErrorScale]:
    """The numerics policy's per-element magnitudes of out, lse, dq, dk, dv for these inputs."""
    from reference.attention import causal_visibility

    g = make_inputs(spec)
    visible = (
        causal_visibility(torch.arange(spec.seq_q), torch.arange(spec.seq_kv))
        if is_causal
        else None
    )
    return error_scales(
        g.query, g.key, g.value, g.grad_out, visible=visible, scale=spec.scale, grad_lse=g.grad_lse
    )


def baseline_for(spec: InputSpec, is_causal: bool, op_spec: str | None) -> dict[str, torch.Tensor]:
    """The same kernel, same dtype, on one device of the session's kind (the ranks' ``--device``)
    and the whole sequence: the numerics policy's B, as CPU tensors (conformance.baseline)."""
    return _baseline_on(spec, is_causal, op_spec, str(session_device()))


@functools.lru_cache(maxsize=128)
def _baseline_on(
    spec: InputSpec, is_causal: bool, op_spec: str | None, device_name: str
) -> dict[str, torch.Tensor]:
    g = make_inputs(spec)
    return single_device_baseline(
        g.query,
        g.key,
        g.value,
        g.grad_out,
        op_spec=op_spec,
        is_causal=is_causal,
        scale=spec.scale,
        grad_lse=g.grad_lse,
    )


def unshard_results(
    results: Sequence[dict[str, Any]], layout: str
) -> dict[str, torch.Tensor | None]:
    """Global tensors from per-rank local results (None where a rank returned None)."""
    merged: dict[str, torch.Tensor | None] = {}
    for name in QUANTITIES:
        parts = [r.get(name) for r in results]
        if any(p is None for p in parts):
            merged[name] = None
            continue
        if name == "lse":
            parts = [p.unsqueeze(-1) for p in parts]
        t = ref_layout.unshard(parts, layout, dim=2)
        merged[name] = t.squeeze(-1) if name == "lse" else t
    return merged


def contract_violations(case: RingCase, results: Sequence[dict[str, Any]]) -> list[str]:
    """What each rank returned against the protocol's contract (conformance/implementation.py).

    Per rank: out has the input dtype and the shape (batch, heads, seq_q_local, head_dim_v)
    (value's head dim); the LSE is float32 (float64 for float64 inputs) of shape (batch, heads,
    seq_q_local); dq, dk, dv have the dtype and shape of query, key and value.
    """
    spec = case.inputs
    w = case.world_size
    in_dtype = spec.torch_dtype
    sq, skv = spec.seq_q // w, spec.seq_kv // w
    q_shape = (spec.batch, spec.heads, sq, spec.head_dim)
    k_shape = (spec.batch, spec.heads_kv, skv, spec.head_dim)
    v_shape = (spec.batch, spec.heads_kv, skv, spec.value_head_dim)
    expected = {
        "out": (in_dtype, (*q_shape[:3], spec.value_head_dim), "the input dtype"),
        "lse": (compute_dtype(in_dtype), q_shape[:3], "float32 (float64 for float64 inputs)"),
        "dq": (in_dtype, q_shape, "the dtype of query"),
        "dk": (in_dtype, k_shape, "the dtype of key"),
        "dv": (in_dtype, v_shape, "the dtype of value"),
    }
    problems = []
    for rank, r in enumerate(results):
        for name, (dtype, shape, dtype_words) in expected.items():
            t = r.get(name)
            if t is None:
                continue
            if t.dtype != dtype:
                problems.append(
                    f"contract: {name} must be {dtype_words}, {str(dtype).removeprefix('torch.')}; "
                    f"rank {rank} returned {str(t.dtype).removeprefix('torch.')}"
                )
            if tuple(t.shape) != shape:
                problems.append(
                    f"contract: {name} must have shape {shape} on every rank; rank {rank} "
                    f"returned {tuple(t.shape)}"
                )
    return problems


def detached_lse(case: RingCase, results: Sequence[dict[str, Any]]) -> str | None:
    """For a case whose loss uses the returned LSE: which ranks returned an LSE that does not
    require grad while query, key and value do (a loss through it backpropagates as if it were
    not there), in words; None when every rank's does."""
    detached = [rank for rank, r in enumerate(results) if not r.get("lse_requires_grad", True)]
    if not detached:
        return None
    return (
        f"the LSE returned on rank(s) {detached} does not require grad while query, key and value "
        f"do: a loss that uses it backpropagates as if it were not there [{case.label}]"
    )


def judge(
    case: RingCase, results: Sequence[dict[str, Any]], *, baseline_op: str | None = None
) -> list[Verdict]:
    """Verdicts for every quantity the case produced; AssertionError for a broken contract."""
    __tracebackhide__ = True
    spec = case.inputs
    expected = (
        {"out"}
        | ({"lse"} if case.return_lse else set())
        | ({"dq", "dk", "dv"} if case.backward else set())
    )
    missing = [
        f"{name}[rank={rank}]"
        for rank, r in enumerate(results)
        for name in sorted(expected)
        if r.get(name) is None
    ]
    if missing:
        raise AssertionError(
            f"no result for {', '.join(missing)}: the output or LSE was not returned, or the "
            "gradient did not reach that input (it was detached, or backward returned None for "
            f"it) [{case.label}]"
        )
    broken = contract_violations(case, results)
    if broken:
        raise AssertionError("\n".join([*broken, f"[{case.label}]"]))
    ref = reference_for(spec, case.is_causal)
    base = baseline_for(spec, case.is_causal, case.op or baseline_op)
    scales = scales_for(spec, case.is_causal)
    got = unshard_results(results, case.layout)
    verdicts = []
    for name in QUANTITIES:
        x = got[name]
        if x is None:
            continue
        if x.shape != ref[name].shape:
            raise AssertionError(
                f"{name}: the implementation returned global shape {tuple(x.shape)} (unsharded "
                f"from per-rank {tuple(results[0][name].shape)}), expected "
                f"{tuple(ref[name].shape)} [{case.label}]"
            )
        verdicts.append(
            check(
                name,
                x,
                ref[name],
                base[name],
                dtype=spec.torch_dtype,
                result_dtype=compute_dtype(spec.torch_dtype) if name == "lse" else spec.torch_dtype,
                scales=scales[name],
                layout=case.layout,
                world_size=case.world_size,
                context=f"[{case.label}]",
            )
        )
    return verdicts


def diagnose_case(
    case: RingCase, results: Sequence[dict[str, Any]], records: Sequence[dict] | None
) -> str:
    """A paragraph naming the rank and ring step that first diverge from the float64 simulation."""
    spec = case.inputs
    g = make_inputs(spec)
    try:
        sim = simulate_ring(
            g.query,
            g.key,
            g.value,
            world_size=case.world_size,
            layout=case.layout,
            is_causal=case.is_causal,
            scale=spec.scale,
        )
    except ValueError as exc:  # a shape the simulation cannot shard: nothing to compare
        return f"(no diagnosis: {exc})"
    grads = None
    if all(r.get("dq") is not None for r in results):
        grads = {n: [r[n] for r in results] for n in ("dq", "dk", "dv")}
    lses = [r["lse"] for r in results] if all(r.get("lse") is not None for r in results) else None
    d = diagnose(
        sim,
        [r["out"] for r in results],
        records=records,
        dtype=spec.torch_dtype,
        lse_by_rank=lses,
        grads_by_rank=grads,
        grad_out=g.grad_out if grads else None,
    )
    return d.summary


def format_failure(failed: Sequence[Verdict], diagnosis: str | None, repro: str | None) -> str:
    lines = [v.message for v in failed]
    if diagnosis:
        lines.append(f"diagnosis: {diagnosis}")
    if repro:
        lines.append(f"repro: {repro}")
    return "\n".join(lines)
