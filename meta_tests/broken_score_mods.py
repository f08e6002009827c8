"""Deliberately broken rings for score_mods (ring_impl.score_mods), each caught by the score_mod
suite (``suites/test_score_mods.py``) with a failure that names the bug:

- ``softcap_after_merge``: the blocks run without the soft-cap and the cap is applied to the
  merged LSE (``cap * tanh(lse / cap)``) after the last ring step: the output is attention
  without the cap.
- ``alibi_on_local_positions``: every block's score_mod reads the local row indices of its
  query and key/value rows (0 .. seq_local - 1 on each rank) instead of their global positions:
  right on one rank, wrong as soon as a key/value block comes from another rank.

Each is ring_impl with one part replaced, wrapped as an implementation under test
(``--impl meta_tests.broken_score_mods:<NAME>``); ``meta_tests/test_suite_catches_bugs.py``
runs the suite against each and requires every failure to match its ``expect`` pattern and no
other broken ring's.
"""

from __future__ import annotations

from dataclasses import replace

import torch

from meta_tests.broken import Broken, by_name, ring_adapter
from ring_impl.exchanges.ring import RingAttention
from ring_impl.planning.plan import StepPlan
from ring_impl.score_mods import SoftCap

__all__ = ["BROKEN_SCORE_MODS"]


class SoftCapAfterMerge(RingAttention):
    """The soft-cap left out of the blocks and applied to the merged LSE."""

    def block_scores(self, cfg, q, plan):
        if isinstance(cfg.score_mod, SoftCap):
            return None
        return super().block_scores(cfg, q, plan)

    def forward(self, cfg, query, key, value):
        out, lse = super().forward(cfg, query, key, value)
        if isinstance(cfg.score_mod, SoftCap):
            lse = torch.tanh(lse / cfg.score_mod.cap) * cfg.score_mod.cap
        return out, lse


class ScoreModOnLocalPositions(RingAttention):
    """Each block's positions are its local rows, not the layout's global positions."""

    def plan(self, cfg, seq_q, seq_kv):
        plans = super().plan(cfg, seq_q, seq_kv)
        if cfg.score_mod is None:
            return plans
        return [
            StepPlan(
                p.step,
                p.kv_rank,
                tuple(replace(b, q_pos=(b.q_rows,), kv_pos=(b.kv_rows,)) for b in p.blocks),
            )
            for p in plans
        ]


BROKEN_SCORE_MODS: dict[str, Broken] = by_name(
    Broken(
        "softcap_after_merge",
        "score_mod: soft-cap applied after the merge",
        r"soft-cap applied after the merge",
        ring_adapter("softcap_after_merge", SoftCapAfterMerge()),
        suites="suites/test_score_mods.py",
        select=("-k", "softcap"),
        min_failures=3,
    ),
    Broken(
        "alibi_on_local_positions",
        "score_mod: ALiBi on local instead of global positions",
        r"alibi\w* on local instead of global positions",
        ring_adapter("alibi_on_local_positions", ScoreModOnLocalPositions()),
        suites="suites/test_score_mods.py",
        select=("-k", "alibi and not W1 and not ulysses and not hybrid"),
        min_failures=3,
    ),
)

globals().update({name: b.impl for name, b in BROKEN_SCORE_MODS.items()})
