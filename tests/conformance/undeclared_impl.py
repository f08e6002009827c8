"""Implementations that declare nothing: an object with ``ring_attention`` and nothing else.

Undeclared is claimed, so every case runs: those that need a protocol piece this object lacks
(``collective_schedule``, ``record_steps``, ``api_module``) fail naming it; the rest pass.
"""

from __future__ import annotations

import ring_impl


class Bare:
    name = "bare-ring"
    ring_attention = staticmethod(ring_impl.ring_attention)


IMPLEMENTATION = Bare()
