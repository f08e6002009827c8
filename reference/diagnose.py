"""Diagnosis: when a ring result fails, say which rank and which ring step first diverges.

Two sources of evidence, both judged against the float64 RingSimulation of the same inputs:

- Per-step partials from the implementation (records), when it exposes them: each (rank, step)
  partial is compared with the simulation's; a step computed that should be skipped, skipped that
  was needed, or fed the wrong key/value block is reported too.
- Otherwise, final per-rank outputs only: for each rank whose rows are wrong, hypotheses about one
  ring step (dropped, computed as full or causal, wrong key/value block, wrong scale) are replayed
  on the simulation's blocks, and the one that reproduces the observed output far better than the
  observed error is reported.

"First" means in ring time: the lowest step, then the lowest rank. Tolerances come from
reference.budget.TOLERANCES (step_rel), as there is no single-device baseline per step.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import torch
from torch import Tensor

from reference import layout as layouts
from reference.attention import attention_grads, default_scale, masked_attention
from reference.budget import abs_error, fmt_err, tolerance_for
from reference.simulate import (
    RingSimulation,
    StepRecord,
    lower_triangular,
    merge_partials,
    merge_two,
)

__all__ = ["Diagnosis", "Finding", "Hypothesis", "compare_records", "diagnose", "explain_rank"]

# An implementation's LSE below this counts as "no key seen" (kernels use -inf or a huge negative).
EMPTY_LSE = -1e30
# A hypothesis explains a result when it reproduces it this many times better than the reference.
EXPLAINS_BY = 10.0


@dataclass(frozen=True)
class Finding:
    """One divergence at (rank, step); step is None when it cannot be pinned to a step."""

    rank: int
    step: int | None
    what: str
    max_err: float = math.nan


@dataclass(frozen=True)
class Hypothesis:
    """A replayed bug on one rank: `partials` is that rank's per-step (out, lse) list under the
    bug; `step` is the first ring step the bug touches."""

    step: int
    what: str
    partials: list[tuple[Tensor, Tensor]] = field(repr=False)


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


def _atol(ref: Tensor, step_rel: float) -> float:
    finite = ref[torch.isfinite(ref)]
    return step_rel * max(1.0, float(finite.abs().max()) if finite.numel() else 0.0)


def _ranges(values: Sequence[int]) -> str:
    """[0, 1, 2, 5, 7, 8] -> "0-2, 5, 7-8"."""
    out: list[str] = []
    for v in sorted(values):
        if out and v == int(out[-1].split("-")[-1]) + 1:
            out[-1] = f"{out[-1].split('-')[0]}-{v}"
        else:
            out.append(str(v))
    return ", ".join(out)


def _step_label(rec: StepRecord) -> str:
    return f"rank {rec.rank} step {rec.step} (kv from rank {rec.kv_rank}, expected {rec.kind})"


# ---------------------------------------------------------------- with per-step records


def _assemble(
    rec: StepRecord, entries: list[Mapping], findings: list[Finding]
) -> tuple[Tensor, Tensor] | None:
    """Merge the implementation's records of one (rank, step) into full-height (out, lse);
    rows no record covers saw no key. None (and a finding) when a record is malformed."""
    ref_out, ref_lse = rec.partial_out, rec.partial_lse
    out, lse = torch.zeros_like(ref_out), torch.full_like(ref_lse, -math.inf)
    for e in entries:
        start, stop = (int(i) for i in e["q_rows"])
        want_out = (*ref_out.shape[:2], stop - start, ref_out.shape[3])
        r_out, r_lse = e["out"].to(out), e["lse"].to(lse)
        if (
            not (0 <= start <= stop <= ref_out.shape[2])
            or tuple(r_out.shape) != want_out
            or tuple(r_lse.shape) != want_out[:3]
        ):
            findings.append(
                Finding(
                    rec.rank,
                    rec.step,
                    f"{_step_label(rec)}: record covers rows {start}:{stop} of {ref_out.shape[2]} "
                    f"with out {tuple(r_out.shape)} and lse {tuple(r_lse.shape)}, expected out "
                    f"{want_out} and lse {want_out[:3]} (LSE padding not trimmed, or a trailing "
                    "dim left on?)",
                )
            )
            return None
        merged = merge_two(out[..., start:stop, :], lse[..., start:stop], r_out, r_lse)
        out[..., start:stop, :], lse[..., start:stop] = merged
    return out, lse


def compare_records(
    sim: RingSimulation, records: Sequence[Mapping], *, dtype: torch.dtype = torch.float64
) -> list[Finding]:
    """Compare an implementation's per-step partials with the simulation's.

    records: dicts {"rank", "step", "kv_rank", "q_rows": (start, stop), "out": (batch, heads,
    stop - start, head_dim_v), "lse": (batch, heads, stop - start)}; a skipped step has no record,
    a step may have several (disjoint row ranges). Returns findings sorted by (step, rank).
    """
    step_rel = tolerance_for(dtype).step_rel
    by_step: dict[tuple[int, int], list[Mapping]] = {}
    for e in records:
        by_step.setdefault((int(e["rank"]), int(e["step"])), []).append(e)
    findings: list[Finding] = []
    for key in sorted(set(by_step) - {(r.rank, r.step) for r in sim.steps}):
        findings.append(
            Finding(
                key[0],
                key[1],
                f"record for rank {key[0]} step {key[1]} is outside a ring of size "
                f"{sim.world_size}",
            )
        )
    for rec in sim.steps:
        entries = by_step.get((rec.rank, rec.step), [])
        if not entries:
            if rec.kind != "skip":
                findings.append(
                    Finding(
                        rec.rank,
                        rec.step,
                        f"{_step_label(rec)}: skipped, but {rec.work} query-key pairs are visible",
                    )
                )
            continue
        if rec.kind == "skip":
            findings.append(
                Finding(
                    rec.rank,
                    rec.step,
                    f"{_step_label(rec)}: computed, but no query of this rank sees any key of "
                    "that block: must be skipped",
                )
            )
            continue
        kv_ranks = sorted({int(e["kv_rank"]) for e in entries})
        if kv_ranks != [rec.kv_rank]:
            findings.append(
                Finding(
                    rec.rank,
                    rec.step,
                    f"{_step_label(rec)}: computed with the key/value block of rank {kv_ranks} "
                    "(rotation to the wrong neighbour, or a stale block?)",
                )
            )
            continue
        assembled = _assemble(rec, entries, findings)
        if assembled is not None:
            finding = _compare_partial(rec, *assembled, step_rel)
            if finding is not None:
                findings.append(finding)
    return sorted(findings, key=lambda f: (f.step if f.step is not None else math.inf, f.rank))


def _compare_partial(rec: StepRecord, out: Tensor, lse: Tensor, step_rel: float) -> Finding | None:
    """Judge one assembled partial (out (batch, heads, rows, head_dim_v), lse (batch, heads,
    rows)) against the simulation's; rows that see no key need only an empty lse."""
    seen = rec.partial_lse > -math.inf  # (batch, heads, rows)
    stray = (~seen) & (lse > EMPTY_LSE)
    if bool(stray.any()):
        rows = sorted({int(i) for i in stray.nonzero()[:, 2]})
        return Finding(
            rec.rank,
            rec.step,
            f"{_step_label(rec)}: local query rows {_ranges(rows)} see no key in this block "
            "but got a finite lse (wrong mask?)",
        )
    out_err = torch.where(seen.unsqueeze(-1), abs_error(out, rec.partial_out), 0.0)
    lse_err = torch.where(seen, abs_error(lse, rec.partial_lse), 0.0)
    out_tol, lse_tol = _atol(rec.partial_out, step_rel), _atol(rec.partial_lse, step_rel)
    out_max, lse_max = float(out_err.max()), float(lse_err.max())
    if out_max <= out_tol and lse_max <= lse_tol:
        return None
    rows = sorted(
        {int(i) for i in ((out_err.amax(-1) > out_tol) | (lse_err > lse_tol)).nonzero()[:, 2]}
    )
    return Finding(
        rec.rank,
        rec.step,
        f"{_step_label(rec)}: partial out max err {fmt_err(out_max)} (tol {fmt_err(out_tol)}), "
        f"lse max err {fmt_err(lse_max)} (tol {fmt_err(lse_tol)}) "
        f"on local query rows {_ranges(rows)}",
        out_max,
    )


# ------------------------------------------------------------ from final outputs only


def _hypotheses(sim: RingSimulation, rank: int) -> list[Hypothesis]:
    """Every single-step bug we can replay for `rank`, plus "wrong scale from step s on"."""
    recs = sim.rank_steps(rank)
    base = [(r.partial_out, r.partial_lse) for r in recs]
    q = sim.query_shard(rank)

    def block(j: int, visible: Tensor | None, scale: float = sim.scale) -> tuple[Tensor, Tensor]:
        return masked_attention(q, sim.key_shard(j), sim.value_shard(j), visible, scale=scale)

    def replace(s: int, partial: tuple[Tensor, Tensor]) -> list[tuple[Tensor, Tensor]]:
        return [partial if i == s else p for i, p in enumerate(base)]

    # Scales a buggy step plausibly uses: none passed (1.0), the default, or applied twice.
    other_scales = sorted({1.0, default_scale(sim.query.shape[-1]), sim.scale**2} - {sim.scale})
    hyps: list[Hypothesis] = []
    for rec in recs:
        s, j = rec.step, rec.kv_rank
        label = f"step {s} (kv from rank {j}, {rec.kind})"
        if rec.kind != "skip":  # dropped: the step contributes the merge's neutral element
            empty = (torch.zeros_like(rec.partial_out), torch.full_like(rec.partial_lse, -math.inf))
            hyps.append(Hypothesis(s, f"{label} was skipped", replace(s, empty)))
        if rec.kind != "full":
            hyps.append(Hypothesis(s, f"{label} was computed as full", replace(s, block(j, None))))
        if rec.kind != "causal" and rec.visible.shape[0] == rec.visible.shape[1]:
            tril = lower_triangular(rec.visible.shape[0])
            hyps.append(
                Hypothesis(s, f"{label} was computed as causal", replace(s, block(j, tril)))
            )
        for other in range(sim.world_size):
            if other == j:
                continue
            # The wrong block under the mask this step expects, or under the block's true mask.
            own_mask = sim.step(rank, (rank - other) % sim.world_size).visible
            for mask, how in ((rec.visible, "this step's mask"), (own_mask, "its own mask")):
                what = f"{label} used the key/value block of rank {other} with {how}"
                hyps.append(Hypothesis(s, what, replace(s, block(other, mask))))
        for c in other_scales:
            what = f"{label} used scale {c:.6g} instead of {sim.scale:.6g}"
            hyps.append(Hypothesis(s, what, replace(s, block(j, rec.visible, c))))
    for c in other_scales:  # a scale that reaches step 0 only
        for first in range(1, sim.world_size):
            wrong = [
                p if r.step < first else block(r.kv_rank, r.visible, c)
                for r, p in zip(recs, base, strict=True)
            ]
            what = (
                f"steps {first}..{sim.world_size - 1} used scale {c:.6g} instead of {sim.scale:.6g}"
            )
            hyps.append(Hypothesis(first, what, wrong))
    return hyps


def explain_rank(sim: RingSimulation, rank: int, observed: Tensor) -> Finding:
    """Replay every hypothesis for `rank` and return the one that explains `observed`
    (batch, heads, seq_q_local, head_dim_v) best, or a finding with step None if none does.
    Explaining means reproducing observed EXPLAINS_BY times closer than the correct output is."""
    observed = observed.to(torch.float64).to(sim.query.device)
    actual = float(abs_error(observed, sim.local_out(rank)).max())
    scored = []
    for h in _hypotheses(sim, rank):
        out = merge_partials(h.partials)[0]
        scored.append((float(abs_error(observed, out).max()), h, out))
    residual, _, best_out = min(scored, key=lambda t: t[0]) if scored else (math.inf, None, None)
    if best_out is None or residual * EXPLAINS_BY > actual:
        return Finding(
            rank,
            None,
            f"rank {rank}: output max err {fmt_err(actual)}; no single-step hypothesis (dropped, "
            "full, causal, wrong block, wrong scale) explains it",
            actual,
        )
    # Some hypotheses coincide (e.g. on a full step, "block of rank j with its own mask" and
    # "computed as full"): among those equal to the best in float64, report the earliest step.
    coincide_tol = _atol(best_out, tolerance_for(torch.float64).step_rel)
    same = [h for _, h, out in scored if float((out - best_out).abs().max()) <= coincide_tol]
    same.sort(key=lambda h: h.step)  # stable: within a step, the listing order above
    also = "".join(f"; equally consistent: {h.what}" for h in same[1:3])
    return Finding(
        rank,
        same[0].step,
        f"output max err {fmt_err(actual)} is explained (residual {fmt_err(residual)}) by: "
        f"{same[0].what}{also}",
        actual,
    )


def _bad_rows(
    sim: RingSimulation, rank: int, observed: Tensor, ref: Tensor, tol: float
) -> list[int]:
    """Global query positions of `rank` whose row of observed differs from ref beyond tol."""
    err = abs_error(observed.to(torch.float64).to(ref.device), ref)
    if err.dim() == 4:  # out: (batch, heads, rows, head_dim_v); lse has no last dim
        err = err.amax(-1)
    row_err = err.amax((0, 1))
    pos = sim.q_positions(rank).tolist()
    return sorted(pos[i] for i in (row_err > tol).nonzero()[:, 0].tolist())


def diagnose(
    sim: RingSimulation,
    out_by_rank: Sequence[Tensor] | None,
    *,
    records: Sequence[Mapping] | None = None,
    dtype: torch.dtype = torch.float64,
    lse_by_rank: Sequence[Tensor] | None = None,
    grads_by_rank: Mapping[str, Sequence[Tensor]] | None = None,
    grad_out: Tensor | None = None,
) -> Diagnosis:
    """Say where a ring result diverges from the simulation.

    out_by_rank[r]: rank r's local output (batch, heads, seq_q_local, head_dim_v), any dtype;
    lse_by_rank[r]: (batch, heads, seq_q_local); records: see compare_records;
    grads_by_rank: {"dq"|"dk"|"dv": [per-rank local shard]} with grad_out (batch, heads, seq_q,
    head_dim_v), the global upstream gradient of the run. dtype: the dtype the ring computed in,
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

    grad_errs = _grad_errors(sim, grads_by_rank, grad_out, step_rel) if grads_by_rank else {}
    grad_bad = {
        name: tuple(r for r, (e, tol) in errs.items() if e > tol)
        for name, errs in grad_errs.items()
    }

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


def _grad_errors(
    sim: RingSimulation,
    grads_by_rank: Mapping[str, Sequence[Tensor]],
    grad_out: Tensor | None,
    step_rel: float,
) -> dict[str, dict[int, tuple[float, float]]]:
    """name -> rank -> (max error of that rank's shard, tolerance), against float64 autograd."""
    if grad_out is None:
        raise ValueError(
            "diagnose(grads_by_rank=...) needs grad_out, the global upstream gradient of the "
            "run, to compute the reference gradients"
        )
    ref = attention_grads(
        sim.query, sim.key, sim.value, grad_out, is_causal=sim.is_causal, scale=sim.scale
    )._asdict()
    result: dict[str, dict[int, tuple[float, float]]] = {}
    for name, shards in grads_by_rank.items():
        if name not in ("dq", "dk", "dv"):
            raise ValueError(f"grads_by_rank keys must be dq, dk or dv; got {name!r}")
        tol = _atol(ref[name], step_rel)
        result[name] = {}
        for r in range(sim.world_size):
            want = layouts.shard(ref[name], sim.layout, sim.world_size, r)
            result[name][r] = (float(abs_error(shards[r].to(want.device), want).max()), tol)
    return result


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
