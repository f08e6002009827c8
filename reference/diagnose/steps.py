"""Diagnosis from per-step records: each (rank, step) partial of the implementation against the
simulation's.

Records come from the implementation when it exposes them (ring_impl.debug's format). A step
computed that should be skipped, skipped that was needed, or fed the wrong key/value block is
reported. A partial that differs is explained when a replayed bug reproduces it within the step
tolerance: computed in full or with a diagonal mask, with the causal mask though attention is not
causal, with the other chunk of a head_tail pair, with another rank's block, another scale,
key/value heads tiled instead of repeated, or only the LSE wrong (the kernel's LSE misread:
padding not trimmed, a trailing dim, the wrong layout).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence

import torch
from torch import Tensor

from reference.attention import causal_visibility, default_scale, masked_attention
from reference.budget import abs_error, fmt_err, tolerance_for
from reference.diagnose.findings import Finding, _atol, _ranges
from reference.diagnose.values import _dtype_name, narrowest_dtype
from reference.simulate import RingSimulation, StepRecord, lower_triangular, merge_two

__all__ = ["EMPTY_LSE", "compare_records", "explain_partial"]

# An implementation's LSE below this counts as "no key seen" (kernels use -inf or a huge negative).
EMPTY_LSE = -1e30


def _step_label(rec: StepRecord) -> str:
    return f"rank {rec.rank} step {rec.step} (kv from rank {rec.kv_rank}, expected {rec.kind})"


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
