"""Diagnoses of the LSE: its form (base 2 instead of base e, or shifted by one constant) and its
layout (the head-sharded layout of Ulysses' inner attention instead of the sequence shard)."""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
from torch import Tensor

from reference.budget import fmt_err, tolerance_for
from reference.diagnose.findings import Finding, _atol, _ranges
from reference.simulate import RingSimulation

__all__ = ["head_sharded_lse"]


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


def head_sharded_lse(
    lse_shapes: Sequence[tuple[int, ...] | None],
    *,
    batch: int,
    heads: int,
    seq_local: int,
    ulysses: int,
) -> str | None:
    """In words, when the ranks returned the LSE in the head-sharded layout of the inner
    attention, ``(batch, heads/U, U * seq_local)`` (the rank's head slice over its Ulysses
    group's sequence), instead of the sequence shard ``(batch, heads, seq_local)``; else None.

    lse_shapes[rank]: the shape of the LSE that mesh rank returned (None: it returned none);
    ulysses: U, the Ulysses degree of the mesh."""
    u, sq = ulysses, seq_local
    if u == 1 or heads % u:
        return None
    head_shard = (batch, heads // u, u * sq)
    ranks = [
        rank
        for rank, shape in enumerate(lse_shapes)
        if shape is not None and tuple(shape) == head_shard
    ]
    if not ranks:
        return None
    return (
        f"the LSE is returned in the head-sharded layout {head_shard} = (batch, heads/U, "
        f"U * seq_local) on rank(s) {ranks}: the rank's {heads // u} heads over its Ulysses "
        f"group's whole sequence, as the inner attention produced it, not the sequence shard "
        f"{(batch, heads, sq)}; send the LSE back through the heads-to-sequence "
        "all-to-all with the output"
    )
