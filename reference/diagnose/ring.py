"""Diagnosis of a ring result: which rank and which ring step first diverges, and why.

:func:`diagnose` gathers every source of evidence (reference.diagnose's package docstring)
into one :class:`Diagnosis` whose summary is appended to an assertion message.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from reference.budget import fmt_err, tolerance_for
from reference.diagnose.backward import _backward_findings, _grad_errors
from reference.diagnose.findings import Finding, _atol, _ranges
from reference.diagnose.lse import _lse_form_findings
from reference.diagnose.outputs import _bad_rows, explain_rank
from reference.diagnose.steps import compare_records
from reference.diagnose.values import _dtype_findings, _overflow_findings
from reference.simulate import RingSimulation

__all__ = ["Diagnosis", "diagnose"]


@dataclass(frozen=True)
class Diagnosis:
    """ok: nothing diverges. rank/step: the first divergence in ring time (None if unknown).
    bad_rows: rank -> global query positions with wrong output (or LSE).
    grad_bad_ranks: "dq"/"dk"/"dv" -> ranks whose local shard is wrong.
    summary: one paragraph to append to an assertion message."""

    ok: bool
    rank: int | None
    step: int | None
    findings: tuple[Finding, ...]
    bad_rows: dict[int, tuple[int, ...]]
    grad_bad_ranks: dict[str, tuple[int, ...]]
    summary: str


def diagnose(
    sim: RingSimulation,
    out_by_rank: Sequence[Tensor] | None,
    *,
    records: Sequence[Mapping] | None = None,
    dtype: torch.dtype = torch.float64,
    lse_by_rank: Sequence[Tensor] | None = None,
    grads_by_rank: Mapping[str, Sequence[Tensor]] | None = None,
    grad_out: Tensor | None = None,
    grad_lse: Tensor | None = None,
) -> Diagnosis:
    """Say where a ring result diverges from the simulation.

    out_by_rank[r]: rank r's local output (batch, heads, seq_q_local, head_dim_v), any dtype;
    lse_by_rank[r]: (batch, heads, seq_q_local); records: see compare_records;
    grads_by_rank: {"dq"|"dk"|"dv": [per-rank local shard]} with grad_out (batch, heads, seq_q,
    head_dim_v), the global upstream gradient of the run, and grad_lse (batch, heads, seq_q) the
    loss's gradient in the LSE where the loss used it. dtype: the dtype the ring computed in,
    which picks the tolerance.
    """
    step_rel = tolerance_for(dtype).step_rel
    findings: list[Finding] = []
    bad_rows: dict[int, tuple[int, ...]] = {}
    if records is not None:
        findings += compare_records(sim, records, dtype=dtype)
    explain = records is None  # per-step records pin the step directly; no need to guess
    for rank in range(sim.world_size):
        ref_out, ref_lse = sim.local_merge(rank)
        rows: set[int] = set()
        if out_by_rank is not None:
            tol = _atol(ref_out, step_rel)
            rows |= set(_bad_rows(sim, rank, out_by_rank[rank], ref_out, tol))
            if rows and explain:
                findings.append(explain_rank(sim, rank, out_by_rank[rank]))
            elif rows and not any(f.rank == rank for f in findings):
                what = (
                    f"rank {rank}: every recorded step matches the simulation but the local "
                    "output does not: the merge of the partials (or a final cast) is at fault"
                )
                findings.append(Finding(rank, None, what))
        if lse_by_rank is not None:
            rows |= set(_bad_rows(sim, rank, lse_by_rank[rank], ref_lse, _atol(ref_lse, step_rel)))
        if rows:
            bad_rows[rank] = tuple(sorted(rows))

    grad_errs = (
        _grad_errors(sim, grads_by_rank, grad_out, step_rel, grad_lse) if grads_by_rank else {}
    )
    grad_bad = {
        name: tuple(r for r, (e, tol) in errs.items() if e > tol)
        for name, errs in grad_errs.items()
    }
    findings += _dtype_findings(sim, out_by_rank, lse_by_rank, grads_by_rank, dtype)
    findings += _overflow_findings(sim, out_by_rank, lse_by_rank, dtype)
    if lse_by_rank is not None:
        findings += _lse_form_findings(sim, lse_by_rank, dtype)
    if any(grad_bad.values()) and grads_by_rank is not None and grad_out is not None:
        forward_ok = not findings and not bad_rows and out_by_rank is not None
        findings += _backward_findings(
            sim, grads_by_rank, grad_out, grad_errs, grad_bad, forward_ok, findings, grad_lse
        )

    findings.sort(key=lambda f: (f.step if f.step is not None else math.inf, f.rank))
    ok = not findings and not bad_rows and not any(grad_bad.values())
    first = findings[0] if findings else None
    # The rank to blame: the first divergence, else the first wrong rows, else the first bad
    # gradient shard.
    suspects = (
        [first.rank]
        if first
        else sorted(bad_rows) or sorted(r for ranks in grad_bad.values() for r in ranks)
    )
    first_rank = suspects[0] if suspects else None
    summary = _summary(sim, dtype, findings, bad_rows, grad_bad, grad_errs, ok)
    return Diagnosis(
        ok, first_rank, first.step if first else None, tuple(findings), bad_rows, grad_bad, summary
    )


def _summary(
    sim: RingSimulation,
    dtype: torch.dtype,
    findings: list[Finding],
    bad_rows: dict[int, tuple[int, ...]],
    grad_bad: dict[str, tuple[int, ...]],
    grad_errs: dict[str, dict[int, tuple[float, float]]],
    ok: bool,
) -> str:
    head = (
        f"Diagnosis against the float64 ring simulation (layout={sim.layout}, "
        f"W={sim.world_size}, causal={sim.is_causal}, tolerance {dtype}):"
    )
    if ok:
        return f"{head} every checked output and step matches; no divergence found."
    parts = [head]
    pinned = [f for f in findings if f.step is not None]
    if pinned:
        parts.append(
            f"first divergence at rank {pinned[0].rank}, ring step {pinned[0].step}: "
            f"{pinned[0].what}."
        )
        if len(pinned) > 1:
            more = ", ".join(f"(rank {f.rank}, step {f.step})" for f in pinned[1:6])
            parts.append(f"Also divergent: {more}{', ...' if len(pinned) > 6 else ''}.")
    parts += [f"{f.what}." for f in findings if f.step is None]
    if bad_rows:
        parts.append(
            "Wrong rows (out or lse): "
            + "; ".join(
                f"rank {r} at global query positions {_ranges(rows)}"
                for r, rows in bad_rows.items()
            )
            + "."
        )
    for name, ranks in grad_bad.items():
        if ranks:
            errs = ", ".join(f"rank {r} (max err {fmt_err(grad_errs[name][r][0])})" for r in ranks)
            parts.append(f"{name} shards wrong on {errs}.")
        else:
            parts.append(f"{name} shards match on every rank.")
    return " ".join(parts)
