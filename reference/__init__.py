"""Float64 oracle for ring attention: attention with LSE and gradients, sequence layouts, a
chunked single-process ring simulation, the numerics policy (error budgets) and diagnosis.

Independent of ring_impl on purpose: the oracle must not reuse the code under test.
"""

from __future__ import annotations

from reference.attention import (
    AttentionOutput,
    ReferenceResult,
    attention,
    attention_grads,
    masked_attention,
)
from reference.budget import TOLERANCES, Tolerance, Verdict, assert_close, assert_verdict, check
from reference.diagnose import Diagnosis, Finding, diagnose
from reference.layout import LAYOUTS, locate, positions, shard, unshard
from reference.simulate import RingSimulation, StepRecord, merge_partials, simulate_ring

__all__ = [
    "LAYOUTS",
    "TOLERANCES",
    "AttentionOutput",
    "Diagnosis",
    "Finding",
    "ReferenceResult",
    "RingSimulation",
    "StepRecord",
    "Tolerance",
    "Verdict",
    "assert_close",
    "assert_verdict",
    "attention",
    "attention_grads",
    "check",
    "diagnose",
    "locate",
    "masked_attention",
    "merge_partials",
    "positions",
    "shard",
    "simulate_ring",
    "unshard",
]
