"""What a diagnosis says: a divergence at a (rank, step), and the rules every diagnosis shares.

A hypothesis (a replayed bug) explains a result when it reproduces it ``EXPLAINS_BY`` times
closer than the correct result is; errors are measured against an absolute tolerance of
``step_rel * max(1, max|R|)`` (:func:`_atol`), ``step_rel`` from reference.budget.TOLERANCES.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

__all__ = ["EXPLAINS_BY", "Finding"]

# A hypothesis explains a result when it reproduces it this many times better than the reference.
EXPLAINS_BY = 10.0


@dataclass(frozen=True)
class Finding:
    """One divergence at (rank, step); step is None when it cannot be pinned to a step."""

    rank: int
    step: int | None
    what: str
    max_err: float = math.nan


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
