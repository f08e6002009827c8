"""Parent-side verdicts of the strategy suite: per-rank results against the float64 oracle.

The same policy as every ring case (:mod:`suites.judge`): each of out, lse, dq, dk, dv, unsharded
with the oracle's layout of the strategy (:mod:`reference.strategies`), is judged by
:func:`reference.budget.check` against the float64 reference and the single-device baseline of
the same kernel. ``world_size`` of the policy is the number of key/value blocks a row's result
merges: the ring degree R (Ulysses' kernel sees the whole sequence: 1). A failure is diagnosed
by replaying the strategies' known bugs in float64 (:func:`reference.diagnose.diagnose_strategy`)
and by matching the output's heads against the reference's
(:func:`reference.diagnose.heads_permutation`: the head slices put back in the wrong order); an
LSE returned in the head-sharded layout is named as such (:func:`lse_layout_problem`) before the
shape contract.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from reference import strategies as ref_strategies
from reference.budget import Verdict, check, compute_dtype
from reference.diagnose import diagnose_strategy, head_sharded_lse, heads_permutation
from suites.cases_strategies import StrategyCase
from suites.inputs import make_inputs
from suites.judge import QUANTITIES, baseline_for, contract_violations, reference_for, scales_for

__all__ = [
    "diagnose_strategy_case",
    "judge_strategy",
    "lse_layout_problem",
    "unshard_strategy_results",
    "worst_location",
]


def unshard_strategy_results(
    case: StrategyCase, results: Sequence[dict[str, Any]]
) -> dict[str, torch.Tensor | None]:
    """Global tensors from per-rank results (index = mesh rank); None where a rank returned None."""
    merged: dict[str, torch.Tensor | None] = {}
    for name in QUANTITIES:
        parts = [r.get(name) for r in results]
        if any(p is None for p in parts):
            merged[name] = None
            continue
        if name == "lse":
            parts = [p.unsqueeze(-1) for p in parts]
        t = ref_strategies.unshard(parts, case.strategy, case.layout, case.mesh_shape)
        merged[name] = t.squeeze(-1) if name == "lse" else t
    return merged


def worst_location(case: StrategyCase, verdict: Verdict) -> str:
    """Where the worst element of a verdict lives: mesh rank, its coordinates and local index."""
    seq = case.inputs.seq_q if verdict.name in ("out", "lse", "dq") else case.inputs.seq_kv
    if len(verdict.worst_index) < 3:
        return ""
    rank, local = ref_strategies.locate(
        verdict.worst_index, case.strategy, case.layout, case.mesh_shape, seq
    )
    u = case.mesh_shape[0]
    return (
        f"{verdict.name}: worst element on mesh rank {rank} (ulysses {rank % u}, ring "
        f"{rank // u}) at local {local}"
    )


def lse_layout_problem(case: StrategyCase, results: Sequence[dict[str, Any]]) -> str | None:
    """In words, when the ranks returned the LSE in the head-sharded layout of the inner
    attention instead of the sequence shard; else None (:func:`reference.diagnose.head_sharded_lse`
    on the shapes the ranks returned)."""
    spec = case.inputs
    return head_sharded_lse(
        [None if r.get("lse") is None else tuple(r["lse"].shape) for r in results],
        batch=spec.batch,
        heads=spec.heads,
        seq_local=spec.seq_q // case.world_size,
        ulysses=case.mesh_shape[0],
    )


def judge_strategy(
    case: StrategyCase, results: Sequence[dict[str, Any]], *, baseline_op: str | None = None
) -> list[Verdict]:
    """Verdicts for every quantity; AssertionError for a missing result or a broken contract."""
    __tracebackhide__ = True
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
            f"gradient did not reach that input [{case.label}]"
        )
    broken = contract_violations(case, results)  # type: ignore[arg-type]
    layout_problem = lse_layout_problem(case, results)
    if layout_problem:
        broken = [layout_problem, *broken]
    if broken:
        raise AssertionError("\n".join([*broken, f"[{case.label}]"]))
    spec = case.inputs
    ref, scales = reference_for(spec, case.is_causal), scales_for(spec, case.is_causal)
    base = baseline_for(spec, case.is_causal, case.op or baseline_op)
    got = unshard_strategy_results(case, results)
    blocks = ref_strategies.kv_blocks(case.strategy, case.mesh_shape)
    verdicts = []
    for name in QUANTITIES:
        x = got[name]
        if x is None:
            continue
        verdicts.append(
            check(
                name,
                x,
                ref[name],
                base[name],
                dtype=spec.torch_dtype,
                result_dtype=compute_dtype(spec.torch_dtype) if name == "lse" else spec.torch_dtype,
                scales=scales[name],
                world_size=blocks,
                context=f"[{case.label}]",
            )
        )
    return verdicts


def diagnose_strategy_case(
    case: StrategyCase, results: Sequence[dict[str, Any]], verdicts: Sequence[Verdict]
) -> str:
    """The strategy diagnosis of a failed case (from its output),
    and where the worst elements are."""
    g = make_inputs(case.inputs)
    got = unshard_strategy_results(case, results)
    out_verdict = next((v for v in verdicts if v.name == "out"), None)
    tolerance = None if out_verdict is None else max(out_verdict.max_bound, 1e-300)
    lines = []
    if got["out"] is not None:
        lines.append(
            diagnose_strategy(
                g.query,
                g.key,
                g.value,
                got["out"],
                strategy=case.strategy,
                layout=case.layout,
                mesh_shape=case.mesh_shape,
                is_causal=case.is_causal,
                scale=case.inputs.scale,
                tolerance=tolerance,
            )
        )
    if got["out"] is not None and tolerance is not None:
        ref_out = reference_for(case.inputs, case.is_causal)["out"]
        permuted = heads_permutation(got["out"], ref_out, tolerance)
        if permuted:
            lines.insert(0, permuted)
    lines += [worst_location(case, v) for v in verdicts if not v.passed]
    return "; ".join(line for line in lines if line)
