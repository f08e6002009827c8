"""The hybrid: Ulysses inside each row of a ``(ulysses, ring)`` mesh, the ring across rows.

Rank ``(u, r)`` holds piece ``u`` of row ``r``'s ring shard (see
:mod:`ring_impl.planning.mesh_layout`). The row's sequence-to-head all-to-all gives every rank of
the row the whole ring shard for ``heads / U`` query heads (and their key/value heads, replicated as
:mod:`.ulysses` describes), already in the ring's local order. The ring then runs across the rows,
among the ranks that hold the same head slice (the ring group of column ``u``), with every rotation
method, layout, op and ``head_chunks`` of :func:`ring_impl.ring_attention`: it is ``ring_impl``'s
own ring (:class:`ring_impl.RingAttention`, forward and explicit backward) on the ring sub-group.
The output (and LSE) go back to sequence pieces by the row's all-to-all; the backward mirrors it.

Load balance is the ring's: under causal attention a ``head_tail`` layout balances the rows,
and every rank of a row computes the whole row for its heads, so ranks are balanced too.
"""

from __future__ import annotations

from . import heads as ring_heads
from .ulysses import HeadParallelConfig, Ulysses

__all__ = ["Hybrid"]


class Hybrid(Ulysses):
    """Ulysses x ring on a 2-D mesh (``strategy="hybrid"``). Stateless between calls."""

    name = "hybrid"

    def gathered_order(self, cfg: HeadParallelConfig) -> list[int] | None:
        return None  # the row's all-to-all rebuilds the ring shard in the ring's own order

    def ring_config(self, cfg: HeadParallelConfig):
        """The ring's config for the ring dimension (the caller's layout,
        rotation, op, head_chunks)."""
        return cfg.ring

    def inner_forward(self, cfg: HeadParallelConfig, q, k, v):
        return ring_heads.run_forward(cfg.ring_impl, self.ring_config(cfg), q, k, v)

    def inner_backward(self, cfg: HeadParallelConfig, grad_out, q, k, v, out, lse, grad_lse):
        return ring_heads.run_backward(
            cfg.ring_impl, self.ring_config(cfg), grad_out, q, k, v, out, lse, grad_lse
        )
