"""ring_impl's ring with every output element shifted by 0.1: a wrong ring that no dtype's
policy can pass, the negative control of ci/check_ring_numerics.py
(``--impl tests.ci.shifted_ring:IMPLEMENTATION``). Its gradients stay those of the true output."""

from __future__ import annotations

from conformance.adapters.ring_impl import RingImplAdapter

SHIFT = 0.1


class ShiftedOutput(RingImplAdapter):
    def __init__(self) -> None:
        super().__init__(name="shifted-output")
        inner = self.ring_attention

        def ring_attention(*args, **kwargs):
            result = inner(*args, **kwargs)
            if isinstance(result, tuple):  # (out, lse)
                return result[0] + SHIFT, result[1]
            return result + SHIFT

        self.ring_attention = ring_attention


IMPLEMENTATION = ShiftedOutput()
