"""Two independently written correct ring attentions, the false-failure side of the proof that
the conformance suites judge rightly: each must pass the whole quick tier
(``pytest suites --impl meta_tests.correct:<name>``) with no failure.

- :data:`math_ring`: plain torch math per step, online-softmax merge in float32, explicit
  backward from the float32 LSE; ring rotations, and masks, sinks, score_mods and packed
  ``cu_seqlens`` read through the protocol's plain data; an attention-op object per block
  piece, and a ``document_head_tail`` balancer (``meta_tests/correct/math_ring.py``).
- :data:`flash_ring`: the CPU flash kernel per step, every block fetched at once, one
  LSE-weighted merge at the end in float64 (``meta_tests/correct/flash_ring.py``).

For the strategies, ``meta_tests/correct/gather_strategies.py`` (Ulysses and the hybrid by one
all-gather of the key/value sequence per mesh dim) passes the strategy axis
(``suites/meshes.py``); it runs no ``strategy="ring"``, so it is not in :data:`CORRECT`.

None of them imports ring_impl; they share only what holds no attention math, in
``meta_tests/correct/common.py``: the layouts, the accumulation dtype, the input checks, the
capabilities all of them declare, the bytes of a key/value block, the step recording, and what
an attention-op object's call needs checked and its LSE normalised.
"""

from meta_tests.correct.flash_ring import flash_ring
from meta_tests.correct.math_ring import math_ring

__all__ = ["CORRECT", "flash_ring", "math_ring"]

#: name -> implementation object, for ``--impl meta_tests.correct:<name>``.
CORRECT = {"math_ring": math_ring, "flash_ring": flash_ring}
