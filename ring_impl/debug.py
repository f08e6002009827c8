"""Recording each ring step's partial result, for diagnosis.

While :func:`record_steps` is active (eager mode only), the forward appends one record per
computed step in the plain-data format that :mod:`reference.diagnose` reads, so a failing
result can be pinned to the rank and ring step that first diverges from the float64
simulation.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch

__all__ = ["StepRecorder", "active_recorder", "join_head_chunks", "record_steps"]


class StepRecorder:
    """Collects ``{"rank", "step", "kv_rank", "kind", "q_rows", "out", "lse"}`` dicts.

    ``out`` is (batch, heads, rows, head_dim) and ``lse`` (batch, heads, rows), both float64
    copies; ``q_rows`` is the (start, stop) range of local query rows the partial covers.
    """

    def __init__(self) -> None:
        self.records: list[dict] = []

    def add(self, rank: int, plan, out: torch.Tensor, lse: torch.Tensor) -> None:
        self.records.append(
            {
                "rank": rank,
                "step": plan.step,
                "kv_rank": plan.kv_rank,
                "kind": plan.kind,
                "q_rows": tuple(plan.q_rows),
                "out": out.detach().to(torch.float64, copy=True).cpu(),
                "lse": lse.detach().to(torch.float64, copy=True).cpu(),
            }
        )


def join_head_chunks(rec: StepRecorder, start: int, chunks: int) -> None:
    """Join the records from ``start`` on, written by ``chunks`` rings over consecutive head
    groups (``head_chunks``; every chunk's ring has the same plan), into one record per step
    over all heads, as one ring over every head would have written them."""
    tail = rec.records[start:]
    per_chunk = len(tail) // chunks
    if per_chunk * chunks != len(tail):
        raise RuntimeError(
            f"join_head_chunks: {len(tail)} records do not split into {chunks} equal chunks"
        )
    groups = [tail[i * per_chunk : (i + 1) * per_chunk] for i in range(chunks)]
    joined = []
    for parts in zip(*groups):
        first = parts[0]
        assert all(
            (p["rank"], p["step"], p["q_rows"]) == (first["rank"], first["step"], first["q_rows"])
            for p in parts
        )
        joined.append(
            {
                **first,
                "out": torch.cat([p["out"] for p in parts], dim=1),
                "lse": torch.cat([p["lse"] for p in parts], dim=1),
            }
        )
    rec.records[start:] = joined


_ACTIVE: list[StepRecorder] = []


def active_recorder() -> StepRecorder | None:
    if not _ACTIVE or torch.compiler.is_compiling():
        return None
    return _ACTIVE[-1]


@contextlib.contextmanager
def record_steps() -> Iterator[StepRecorder]:
    """``with record_steps() as rec: ring_attention(...)``; then ``rec.records``."""
    rec = StepRecorder()
    _ACTIVE.append(rec)
    try:
        yield rec
    finally:
        _ACTIVE.remove(rec)
