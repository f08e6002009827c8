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

Ulysses and the hybrid are diagnosed from their global output: their known bugs replayed in
float64, the output's heads matched against the reference's, an LSE in the head-sharded layout.

One module per role:

``ring``        :func:`diagnose`, the whole diagnosis of a ring result, and its summary
``steps``       per-step records against the simulation (:func:`compare_records`)
``outputs``     final outputs only: single-step hypotheses replayed (:func:`explain_rank`)
``values``      what the values tell by themselves: a narrower dtype, an exp overflow
``lse``         the LSE's form (base 2, a constant shift) and layout (head-sharded)
``backward``    wrong gradients: backward bugs replayed
``strategies``  Ulysses and the hybrid (:func:`diagnose_strategy`, :func:`heads_permutation`)
``findings``    what a diagnosis says (:class:`Finding`) and the rules the others share
"""

from __future__ import annotations

from reference.diagnose.backward import _replay_backward
from reference.diagnose.findings import EXPLAINS_BY, Finding
from reference.diagnose.lse import head_sharded_lse
from reference.diagnose.outputs import Hypothesis, explain_rank
from reference.diagnose.ring import Diagnosis, diagnose
from reference.diagnose.steps import EMPTY_LSE, compare_records, explain_partial
from reference.diagnose.strategies import diagnose_strategy, heads_permutation
from reference.diagnose.values import narrowest_dtype

__all__ = [
    "EMPTY_LSE",
    "EXPLAINS_BY",
    "Diagnosis",
    "Finding",
    "Hypothesis",
    "_replay_backward",
    "compare_records",
    "diagnose",
    "diagnose_strategy",
    "explain_partial",
    "explain_rank",
    "head_sharded_lse",
    "heads_permutation",
    "narrowest_dtype",
]
