"""The per-step plan of the ring: which block pairs each step computes, and how.

Convention: at ring step ``s`` (``0 <= s < W``) rank ``r`` holds the key/value shard of rank
``(r - s) mod W``. For each step the plan says whether the step is computed in full, with a
causal mask, or skipped, and which local query rows and key/value rows take part:

contiguous, causal
    step 0: the rank's own block, causal. kv from an earlier rank (``kv_rank < rank``): full.
    kv from a later rank: skipped (those keys are in every query's future).
head_tail, causal (local rows are [chunk r | chunk 2W-1-r], each ``n`` rows)
    step 0: causal over the whole local block; top-left causal over the concatenation is
    exactly right because chunk r precedes chunk 2W-1-r.
    ``kv_rank < rank``: every query sees only the kv's first chunk (``kv_rank`` precedes both
    query chunks; ``2W-1-kv_rank`` follows both): all query rows x kv rows ``[0, n)``, full.
    ``kv_rank > rank``: only the query tail chunk sees the kv rank's chunks, and it sees both in
    full: query rows ``[n, 2n)`` x all kv rows, full.
non-causal: every step full, any layout.

Under head_tail every non-skipped step costs ``n x 2n`` score entries on every rank, which is
what balances the work.
"""

from __future__ import annotations

from dataclasses import dataclass

from .layout import check_layout

__all__ = ["StepPlan", "ring_plan"]


@dataclass(frozen=True)
class StepPlan:
    """What one rank does at one ring step.

    ``q_rows`` / ``kv_rows`` are half-open ``(start, stop)`` ranges of local rows (sequence dim).
    """

    step: int
    kv_rank: int
    kind: str  # "full" | "causal" | "skip"
    q_rows: tuple[int, int]
    kv_rows: tuple[int, int]

    @property
    def is_causal(self) -> bool:
        return self.kind == "causal"

    @property
    def skipped(self) -> bool:
        return self.kind == "skip"


def ring_plan(rank: int, world_size: int, *, layout: str, is_causal: bool, seq_q: int, seq_kv: int) -> list[StepPlan]:
    """The plan of every ring step for ``rank``; ``seq_q``/``seq_kv`` are local lengths."""
    check_layout(layout)
    plans = []
    for step in range(world_size):
        kv_rank = (rank - step) % world_size
        all_q, all_kv = (0, seq_q), (0, seq_kv)
        if not is_causal:
            plans.append(StepPlan(step, kv_rank, "full", all_q, all_kv))
        elif step == 0:
            plans.append(StepPlan(step, kv_rank, "causal", all_q, all_kv))
        elif layout == "contiguous":
            kind = "full" if kv_rank < rank else "skip"
            plans.append(StepPlan(step, kv_rank, kind, all_q, all_kv))
        elif kv_rank < rank:
            plans.append(StepPlan(step, kv_rank, "full", all_q, (0, seq_kv // 2)))
        else:
            plans.append(StepPlan(step, kv_rank, "full", (seq_q // 2, seq_q), all_kv))
    return plans
