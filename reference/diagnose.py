"""Diagnosis: when a ring result fails, say which rank and which ring step first diverges.

Two sources of evidence, both judged against the float64 RingSimulation of the same inputs:

- Per-step partials from the implementation (records), when it exposes them: each (rank, step)
  partial is compared with the simulation's; a step computed that should be skipped, skipped that
  was needed, or fed the wrong key/value block is reported too. A partial that differs is
  explained when a replayed bug reproduces it within the step tolerance: computed in full or
  with a diagonal mask, with the causal mask though attention is not causal, with the other
  chunk of a head_tail pair, with another rank's block, another scale, key/value heads tiled
  instead of repeated, or only the LSE wrong (the kernel's LSE misread).
- Otherwise, final per-rank outputs only: for each rank whose rows are wrong, hypotheses about one
  ring step (dropped, computed as full or causal, wrong key/value block, wrong scale) are replayed
  on the simulation's blocks, and the one that reproduces the observed output far better than the
  observed error is reported.

Beside the steps: a result whose every value is exactly a number of a narrower dtype than its own
(a float64 output holding float32 values, a float32 LSE or gradient holding bfloat16 values) was
computed or rounded in that dtype; NaN/inf on rows whose LSE exceeds what ``exp`` can hold is an
overflow; a forward that matches while the gradients do not is replayed against backward bugs
(each step using the rank's own key/value block; dK/dV left a hop short of their owner).

"First" means in ring time: the lowest step, then the lowest rank. Tolerances come from
reference.budget.TOLERANCES (step_rel), as there is no single-device baseline per step.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

import torch
from torch import Tensor

from reference import layout as layouts
from reference.attention import (
    attention_grads,
    causal_visibility,
    default_scale,
    expand_kv_heads,
    masked_attention,
)
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


# Narrower dtypes a result may have been computed or rounded in, narrowest first.
_NARROWER = {
    torch.float64: (torch.bfloat16, torch.float16, torch.float32),
    torch.float32: (torch.bfloat16, torch.float16),
}
# Fewer finite nonzero values than this say nothing about the dtype they went through.
_MIN_VALUES_FOR_DTYPE = 16


def narrowest_dtype(
    t: Tensor, ref: Tensor | None = None, *, wider: torch.dtype | None = None
) -> torch.dtype | None:
    """The narrowest dtype (bfloat16, float16, float32) narrower than ``wider`` (default
    ``t.dtype``: the dtype the values should have been computed in) in which every finite nonzero
    value of ``t`` is exactly representable, or None.

    A float32 result computed in float32 from random inputs is not exactly bfloat16 everywhere;
    one that is was rounded to bfloat16 somewhere. ``ref`` (the float64 truth), when given, must
    not be representable in that dtype itself, so exact results (small integers) are not blamed.
    """
    values = t.detach()
    values = values[torch.isfinite(values) & (values != 0)]
    if values.numel() < _MIN_VALUES_FOR_DTYPE:
        return None
    for narrow in _NARROWER.get(wider or t.dtype, ()):
        if torch.equal(values.to(narrow).to(values.dtype), values):
            if ref is not None:
                r = ref.detach().to(torch.float64)
                r = r[torch.isfinite(r) & (r != 0)]
                if r.numel() and torch.equal(r.to(narrow).to(torch.float64), r):
                    return None
            return narrow
    return None


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _step_hypotheses(sim: RingSimulation, rec: StepRecord) -> list[tuple[str, Tensor, Tensor]]:
    """(what, out, lse) of one step's partial under each replayable bug of that step."""
    q = sim.query_shard(rec.rank)
    k, v = sim.key_shard(rec.kv_rank), sim.value_shard(rec.kv_rank)
    mask = rec.visible
    hyps: list[tuple[str, Tensor, Tensor]] = []

    def add(
        what: str, key: Tensor, value: Tensor, visible: Tensor | None, scale: float = sim.scale
    ) -> None:
        out, lse = masked_attention(q, key, value, visible, scale=scale)
        hyps.append((what, out, lse))

    if not bool(mask.all()):
        add("computed in full, though part of the block must be masked", k, v, None)
    if not sim.is_causal and sim.query.shape[2] == sim.key.shape[2]:
        causal = causal_visibility(sim.q_positions(rec.rank), sim.k_positions(rec.kv_rank))
        if not torch.equal(causal, mask):
            add(
                "computed with the causal mask of these positions, though attention is not causal "
                "(the step plan or load balancing assumed is_causal=True)",
                k,
                v,
                causal,
            )
    if mask.shape[0] == mask.shape[1]:
        tril = lower_triangular(mask.shape[0])
        if not torch.equal(mask, tril):
            shape = "full" if bool(mask.all()) else "not a diagonal block"
            add(f"computed with a causal (diagonal) mask, though this block is {shape}", k, v, tril)
    n = k.shape[2] // 2
    if sim.layout == "head_tail" and n and k.shape[2] == 2 * n:
        swap = torch.cat([torch.arange(n, 2 * n), torch.arange(0, n)])
        add(
            "paired the queries with the wrong key/value chunk of the head_tail pair (head and "
            "tail chunks swapped)",
            k[..., swap, :],
            v[..., swap, :],
            mask,
        )
    for other in range(sim.world_size):
        if other != rec.kv_rank:
            add(
                f"used the key/value block of rank {other} instead of rank {rec.kv_rank}",
                sim.key_shard(other),
                sim.value_shard(other),
                mask,
            )
    for c in sorted({1.0, default_scale(q.shape[-1]), sim.scale**2} - {sim.scale}):
        add(f"used scale {c:.6g} instead of {sim.scale:.6g}", k, v, mask, c)
    heads, heads_kv = q.shape[1], k.shape[1]
    if heads_kv not in (heads, 1):
        tiled = k.repeat(1, heads // heads_kv, 1, 1), v.repeat(1, heads // heads_kv, 1, 1)
        add(
            f"tiled the key/value heads (query head h read key/value head h % {heads_kv}, not "
            f"h // {heads // heads_kv})",
            *tiled,
            mask,
        )
    return hyps


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
            raw = [e["out"] for e in entries if isinstance(e.get("out"), Tensor)]
            finding = _compare_partial(sim, rec, *assembled, step_rel, raw, dtype)
            if finding is not None:
                findings.append(finding)
    return sorted(findings, key=lambda f: (f.step if f.step is not None else math.inf, f.rank))


def _partial_errors(
    out: Tensor, lse: Tensor, want_out: Tensor, want_lse: Tensor
) -> tuple[Tensor, Tensor]:
    """Per-element |out - want_out| and per-row |lse - want_lse|; a row that sees no key on both
    sides (lse -inf, out 0) has error 0, one that sees keys on one side only an infinite one."""
    empty = lse <= EMPTY_LSE
    lse = torch.where(empty, torch.full_like(lse, -math.inf), lse)
    return abs_error(out, want_out), abs_error(lse, want_lse)


def explain_partial(
    sim: RingSimulation, rec: StepRecord, out: Tensor, lse: Tensor, step_rel: float
) -> str:
    """The replayed bug that reproduces a step's observed partial within the step tolerance
    ("" if none does). out (batch, heads, rows, head_dim_v), lse (batch, heads, rows)."""
    out_tol, lse_tol = _atol(rec.partial_out, step_rel), _atol(rec.partial_lse, step_rel)
    for what, h_out, h_lse in _step_hypotheses(sim, rec):
        h_out_err, h_lse_err = _partial_errors(out, lse, h_out, h_lse)
        if float(h_out_err.max()) <= out_tol and float(h_lse_err.max()) <= lse_tol:
            return what
    # Checked after the replays: a block of one key gives the same output at any scale.
    out_err, lse_err = _partial_errors(out, lse, rec.partial_out, rec.partial_lse)
    if float(out_err.max()) <= out_tol and float(lse_err.max()) > lse_tol:
        return (
            "the partial output matches but its LSE does not: the kernel's LSE was misread "
            "(padding not trimmed, a trailing dim, or the wrong layout)"
        )
    return ""


def _compare_partial(
    sim: RingSimulation,
    rec: StepRecord,
    out: Tensor,
    lse: Tensor,
    step_rel: float,
    raw_outs: list[Tensor],
    dtype: torch.dtype,
) -> Finding | None:
    """Judge one assembled partial (out (batch, heads, rows, head_dim_v), lse (batch, heads,
    rows)) against the simulation's; rows that see no key need only an empty lse. raw_outs: the
    records' outputs as recorded; dtype: the dtype the ring computes in."""
    seen = rec.partial_lse > -math.inf  # (batch, heads, rows)
    stray = (~seen) & (lse > EMPTY_LSE)
    if bool(stray.any()):
        rows = sorted({int(i) for i in stray.nonzero()[:, 2]})
        why = explain_partial(sim, rec, out, lse, step_rel)
        return Finding(
            rec.rank,
            rec.step,
            f"{_step_label(rec)}: local query rows {_ranges(rows)} see no key in this block "
            "but got a finite lse (wrong mask?)" + (f"; explained by: {why}" if why else ""),
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
    narrow = next(
        (d for d in (narrowest_dtype(o, wider=dtype) for o in raw_outs) if d is not None), None
    )
    if narrow is not None:
        why = (
            f"every value of the recorded partial of this {_dtype_name(dtype)} ring is a "
            f"{_dtype_name(narrow)} number: the step was computed in {_dtype_name(narrow)}"
        )
    else:
        why = explain_partial(sim, rec, out, lse, step_rel)
    return Finding(
        rec.rank,
        rec.step,
        f"{_step_label(rec)}: partial out max err {fmt_err(out_max)} (tol {fmt_err(out_tol)}), "
        f"lse max err {fmt_err(lse_max)} (tol {fmt_err(lse_tol)}) "
        f"on local query rows {_ranges(rows)}" + (f"; explained by: {why}" if why else ""),
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
    findings += _dtype_findings(sim, out_by_rank, lse_by_rank, grads_by_rank, dtype)
    findings += _overflow_findings(sim, out_by_rank, lse_by_rank, dtype)
    if lse_by_rank is not None:
        findings += _lse_form_findings(sim, lse_by_rank, dtype)
    if any(grad_bad.values()) and grads_by_rank is not None and grad_out is not None:
        forward_ok = not findings and not bad_rows and out_by_rank is not None
        findings += _backward_findings(
            sim, grads_by_rank, grad_out, grad_errs, grad_bad, forward_ok, findings
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


def _dtype_findings(
    sim: RingSimulation,
    out_by_rank: Sequence[Tensor] | None,
    lse_by_rank: Sequence[Tensor] | None,
    grads_by_rank: Mapping[str, Sequence[Tensor]] | None,
    dtype: torch.dtype,
) -> list[Finding]:
    """Results whose every value is a number of a narrower dtype than the one they should have
    been computed in (``dtype``; for the LSE float32, float64 for float64): computed or rounded
    in that dtype (see :func:`narrowest_dtype`). One finding per quantity, naming the ranks."""
    found: list[Finding] = []
    lse_dtype = torch.float64 if dtype == torch.float64 else torch.float32
    named: list[tuple[str, Sequence[Tensor], Callable[[int], Tensor | None], torch.dtype]] = []
    if out_by_rank is not None:
        named.append(("out", out_by_rank, sim.local_out, dtype))
    if lse_by_rank is not None:
        named.append(("lse", lse_by_rank, sim.local_lse, lse_dtype))
    for name, shards in (grads_by_rank or {}).items():
        named.append((name, shards, lambda r: None, dtype))
    for name, shards, truth, wider in named:
        hits: list[tuple[int, torch.dtype]] = []
        for r, t in enumerate(shards):
            d = narrowest_dtype(t, truth(r), wider=wider)
            if d is not None:
                hits.append((r, d))
        if not hits:
            continue
        narrow, own = hits[0][1], _dtype_name(wider)
        ranks = _ranges([r for r, d in hits if d == narrow])
        what = (
            f"{name} on rank {ranks}: every value of the {own} result is a {_dtype_name(narrow)} "
            f"number: {name} was computed, accumulated or cast in {_dtype_name(narrow)} on its way"
        )
        if name == "lse":
            what += " (the LSE's contract is float32, float64 for float64 inputs)"
        found.append(Finding(hits[0][0], None, what))
    return found


def _overflow_findings(
    sim: RingSimulation,
    out_by_rank: Sequence[Tensor] | None,
    lse_by_rank: Sequence[Tensor] | None,
    dtype: torch.dtype,
) -> list[Finding]:
    """NaN/inf on rows whose true LSE is beyond log(max) of the dtype: an exp overflowed."""
    found = []
    limit = math.log(torch.finfo(dtype).max)
    for rank in range(sim.world_size):
        ref_out, ref_lse = sim.local_merge(rank)
        bad = torch.zeros_like(ref_lse, dtype=torch.bool)
        if out_by_rank is not None:
            o = out_by_rank[rank].to(torch.float64).to(ref_out.device)
            bad |= (~torch.isfinite(o) & torch.isfinite(ref_out)).any(-1)
        if lse_by_rank is not None:
            lse = lse_by_rank[rank].to(torch.float64).to(ref_lse.device)
            bad |= ~torch.isfinite(lse) & torch.isfinite(ref_lse)
        if not bool(bad.any()):
            continue
        reach = float(ref_lse[bad & torch.isfinite(ref_lse)].abs().max())
        if reach > limit:
            found.append(
                Finding(
                    rank,
                    None,
                    (
                        f"rank {rank}: NaN/inf on rows whose LSE reaches {reach:.3g}, beyond "
                        f"log(max {dtype}) = {limit:.1f}: an exp of the LSE (or of raw scores) "
                        "overflowed; merge in the stable form (subtract the running maximum, or "
                        "use logsigmoid)"
                    ),
                )
            )
    return found


def _lse_form_findings(
    sim: RingSimulation, lse_by_rank: Sequence[Tensor], dtype: torch.dtype
) -> list[Finding]:
    """An LSE in base 2 (the natural one divided by ln 2), or shifted by one constant on every
    row. Judged with the float32 step tolerance for bfloat16/float16 runs: the LSE is float32."""
    lse_dtype = torch.float64 if dtype == torch.float64 else torch.float32
    step_rel = tolerance_for(lse_dtype).step_rel
    base2: list[int] = []
    shifts: dict[int, float] = {}
    for rank, got in enumerate(lse_by_rank):
        ref = sim.local_lse(rank)
        got64 = got.detach().to(torch.float64).to(ref.device)
        finite = torch.isfinite(ref) & torch.isfinite(got64)
        if int(finite.sum()) < 4:
            continue
        tol = _atol(ref, step_rel)
        err = (got64 - ref)[finite]
        if float(err.abs().max()) <= tol:
            continue
        if float((got64[finite] * math.log(2) - ref[finite]).abs().max()) <= tol:
            base2.append(rank)
        elif float((err - err.mean()).abs().max()) <= tol:
            shifts[rank] = float(err.mean())
    found = []
    if base2:
        found.append(
            Finding(
                base2[0],
                None,
                (
                    f"lse on rank {_ranges(base2)} is the natural-log LSE divided by ln 2: it is "
                    "in base 2, the contract (and every merge) is base e"
                ),
            )
        )
    if shifts:
        shown = ", ".join(f"{fmt_err(v)} on rank {r}" for r, v in shifts.items())
        found.append(
            Finding(
                min(shifts),
                None,
                (
                    f"lse is shifted by a constant on every row ({shown}): an offset added to the "
                    "LSE"
                ),
            )
        )
    return found


def _block_grads(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    visible: Tensor,
    out: Tensor,
    lse: Tensor,
    dout: Tensor,
    scale: float,
) -> tuple[Tensor, Tensor, Tensor]:
    """float64 (dq, dk, dv) contribution of one (query shard, key/value block) pair to the
    gradient of the whole attention, given the final out and lse of the query rows.

    q, out, dout (batch, heads, sq, d); k, v (batch, heads_kv, sk, d); lse (batch, heads, sq);
    visible (sq, sk). dk, dv come back with heads_kv heads (query groups summed).
    """
    heads, heads_kv = q.shape[1], k.shape[1]
    ke, ve = expand_kv_heads(k, heads), expand_kv_heads(v, heads)
    scores = (q @ ke.transpose(-2, -1) * scale).masked_fill(~visible, -math.inf)
    seen = torch.isfinite(lse).unsqueeze(-1)
    p = torch.where(seen, torch.exp(scores - torch.where(seen, lse.unsqueeze(-1), 0.0)), 0.0)
    dp = dout @ ve.transpose(-2, -1)
    ds = p * (dp - (dout * out).sum(-1, keepdim=True))
    dq = ds @ ke * scale
    dk, dv = ds.transpose(-2, -1) @ q * scale, p.transpose(-2, -1) @ dout
    b, _, sk, _ = dk.shape

    def fold(t: Tensor) -> Tensor:
        return t.reshape(b, heads_kv, heads // heads_kv, sk, t.shape[-1]).sum(2)

    return dq, fold(dk), fold(dv)


def _replay_backward(
    sim: RingSimulation,
    grad_out: Tensor,
    kv_source: Callable[[StepRecord], int],
    *,
    step_output: bool = False,
) -> dict[str, list[Tensor]]:
    """Per-rank dq, dk, dv of a ring whose backward computes step ``rec`` with the key/value block
    of rank ``kv_source(rec)`` (the contribution still goes to block ``rec.kv_rank``). With
    ``step_output`` its ``dO . O`` row term takes the step's own partial output instead of the
    merged one (the LSE stays the merged one)."""
    w = sim.world_size
    grads: dict[str, list[Tensor]] = {
        "dq": [torch.zeros_like(sim.query_shard(r)) for r in range(w)],
        "dk": [torch.zeros_like(sim.key_shard(r)) for r in range(w)],
        "dv": [torch.zeros_like(sim.value_shard(r)) for r in range(w)],
    }
    dout64 = grad_out.to(torch.float64).to(sim.query.device)
    for rank in range(w):
        out, lse = sim.local_merge(rank)
        dout = layouts.shard(dout64, sim.layout, w, rank)
        q = sim.query_shard(rank)
        for rec in sim.rank_steps(rank):
            if rec.kind == "skip":
                continue
            src = kv_source(rec)
            row_out = rec.partial_out.to(q.device) if step_output else out
            dq, dk, dv = _block_grads(
                q,
                sim.key_shard(src),
                sim.value_shard(src),
                rec.visible.to(q.device),
                row_out,
                lse,
                dout,
                sim.scale,
            )
            grads["dq"][rank] += dq
            grads["dk"][rec.kv_rank] += dk
            grads["dv"][rec.kv_rank] += dv
    return grads


def _backward_findings(
    sim: RingSimulation,
    grads_by_rank: Mapping[str, Sequence[Tensor]],
    grad_out: Tensor,
    grad_errs: dict[str, dict[int, tuple[float, float]]],
    grad_bad: dict[str, tuple[int, ...]],
    forward_ok: bool,
    earlier: list[Finding],
) -> list[Finding]:
    """Explain wrong gradients by a replayed backward bug; say the backward is at fault when the
    forward matched and nothing explains them."""
    if any(
        "every value of the" in f.what and f.what.startswith(("dq", "dk", "dv")) for f in earlier
    ):
        return []  # already explained by the dtype the gradients went through
    w = sim.world_size

    def matches(observed: Mapping[str, Sequence[Tensor]], names: Sequence[str]) -> bool:
        for name in names:
            for r in range(w):
                tol = grad_errs[name][r][1]
                got = grads_by_rank[name][r]
                if (
                    float(abs_error(got.to(observed[name][r].device), observed[name][r]).max())
                    > tol
                ):
                    return False
        return True

    names = [n for n in ("dq", "dk", "dv") if n in grads_by_rank]
    if w > 1 and forward_ok:
        own = _replay_backward(sim, grad_out, lambda rec: rec.rank)
        if matches(own, names):
            return [
                Finding(
                    0,
                    None,
                    "the backward used each rank's own key/value block at every ring step "
                    "(the step-0 block reused): dq, dk and dv equal that replay",
                )
            ]
        if matches(
            _replay_backward(sim, grad_out, lambda rec: rec.kv_rank, step_output=True), names
        ):
            return [
                Finding(
                    0,
                    None,
                    "the backward took the dO.O row term from each ring step's own partial output "
                    "instead of the merged output of all steps: dq, dk and dv equal that replay",
                )
            ]
        if "dq" in grads_by_rank and not grad_bad.get("dq") and {"dk", "dv"} & set(grads_by_rank):
            truth = _replay_backward(sim, grad_out, lambda rec: rec.kv_rank)
            kv_names = [n for n in ("dk", "dv") if n in grads_by_rank]
            for t in range(1, w):
                shifted = {n: [truth[n][(r + t) % w] for r in range(w)] for n in kv_names}
                if matches(shifted, kv_names):
                    return [
                        Finding(
                            0,
                            None,
                            (
                                "dq matches on every rank, but rank r holds the dk/dv of rank "
                                f"r+{t}'s block: the dK/dV accumulators stopped {t} hop(s) short "
                                "of their owners (the return hop is missing)"
                            ),
                        )
                    ]
            return [
                Finding(
                    0,
                    None,
                    (
                        "dq matches on every rank, but dk/dv do not: the dK/dV accumulators did "
                        "not reach their owners complete (a missing, extra or misrouted hop of "
                        "the gradient ring)"
                    ),
                )
            ]
    if forward_ok:
        wrong = ", ".join(n for n in names if grad_bad.get(n))
        return [
            Finding(
                0,
                None,
                f"the forward matches the simulation on every rank but {wrong} do not: "
                "the backward is at fault (its blocks, masks or the routing of dK/dV)",
            )
        ]
    return []


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
