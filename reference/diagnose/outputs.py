"""Diagnosis from final per-rank outputs only (no per-step records).

For each rank whose rows are wrong, hypotheses about one ring step (dropped, computed as full or
causal, wrong key/value block, wrong scale) are replayed on the simulation's blocks, and the one
that reproduces the observed output far better than the observed error is reported.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch
from torch import Tensor

from reference.attention import default_scale, masked_attention
from reference.budget import abs_error, fmt_err, tolerance_for
from reference.diagnose.findings import EXPLAINS_BY, Finding, _atol
from reference.simulate import RingSimulation, lower_triangular, merge_partials

__all__ = ["Hypothesis", "explain_rank"]


@dataclass(frozen=True)
class Hypothesis:
    """A replayed bug on one rank: `partials` is that rank's per-step (out, lse) list under the
    bug; `step` is the first ring step the bug touches."""

    step: int
    what: str
    partials: list[tuple[Tensor, Tensor]] = field(repr=False)


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
