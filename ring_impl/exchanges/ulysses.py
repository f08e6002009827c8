"""Ulysses: attention parallel over heads, with the sequence gathered by all-to-all.

Forward, on each rank of a Ulysses group of ``U`` ranks:

1. one all-to-all turns the sequence shards of query, key and value into head shards: this rank
   gets the whole (gathered) sequence of ``heads / U`` query heads and of the key/value heads
   they read;
2. the *inner* attention runs on them: the local kernel on the full sequence (``ulysses``), or
   the ring across the hybrid's rows (:mod:`.hybrid`);
3. one all-to-all turns the output (and the LSE when it is returned) back into sequence shards.

The backward is explicit and mirrors it: one all-to-all brings the output gradient (and the
LSE's) to head shards, the inner backward runs, one all-to-all takes dQ, dK and dV back to
sequence shards. Every rank issues the same collectives in the same order (2 forward, 2 backward).

Key/value heads. Query head ``h`` reads key/value head ``h // (heads / heads_kv)`` (SDPA's GQA).
Rank ``j`` holds query heads ``[j*heads/U, (j+1)*heads/U)``. When ``U`` divides ``heads_kv`` it
also holds key/value heads ``[j*heads_kv/U, ...)``, exactly what its query heads read. Otherwise
(GQA or MQA with fewer key/value heads than the degree) each key/value head is replicated ``e =
U / gcd(heads_kv, U)`` times *in place* (``repeat_interleave``: head ``i`` becomes heads ``i*e ..
i*e + e - 1``), which makes ``lcm(heads_kv, U)`` heads that split evenly and keep the mapping:
query head ``h`` reads replica ``h // (heads / (e * heads_kv))``, a copy of key/value head ``h //
(heads / heads_kv)``. The gradients of the replicas are summed back (in the accumulation dtype)
after the last all-to-all. When ``heads_kv`` divides ``U`` (MQA included) every rank receives
exactly the one key/value head it needs. Query heads must be divisible by ``U``: a rank cannot
hold part of a head (InputError on every rank otherwise).

The class holds the algorithm; its methods are the seams a variant overrides (the project's
meta-tests build deliberately broken strategies this way).
"""

from __future__ import annotations

import math
import operator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

from ..layout import chunk_ids
from ..numerics.nonfinite import finite_parts, poison_backward, poison_forward
from ..ops import AttentionOp, accumulation_dtype, call_backward, call_forward
from .head_alltoall import heads_to_sequence, sequence_to_heads
from .mesh_groups import HeadGroup
from .ring import RingAttention, RingConfig, blank_hidden_rows, blank_hidden_rows_grad, block_lse

if TYPE_CHECKING:
    from ..masks import Mask
    from ..score_mods import ScoreMod

__all__ = ["HeadParallelConfig", "HeadParallelPath", "Ulysses", "kv_replication"]


def kv_replication(heads_kv: int, degree: int) -> int:
    """How many times each key/value head is replicated before the all-to-all:
    ``U / gcd(heads_kv, U)``. (A head count traced as a symbol, under ``dynamic=True``, is
    specialised: the split is structure.)"""
    heads_kv, degree = operator.index(heads_kv), operator.index(degree)
    return degree // math.gcd(heads_kv, degree)


@dataclass(frozen=True)
class HeadParallelConfig:
    """Everything a head-parallel call needs besides tensors; plain values, fixed per call.

    ``ring``: the ring's config for the hybrid's ring dimension (a
    ``ring_impl.exchanges.ring.RingConfig``), None for Ulysses. ``ring_impl``: the ``RingAttention``
    that runs it."""

    heads: HeadGroup
    is_causal: bool
    scale: float
    layout: str
    op: AttentionOp
    return_lse: bool
    ring: RingConfig | None = None
    ring_impl: RingAttention | None = None
    #: a ring_impl.masks.Mask on global positions (is_causal folded in), Ulysses only
    mask: Mask | None = None
    #: the call's evaluations of a mask known only by evaluating it
    #: (ring_impl.planning.plan.cached_by_mask)
    plan_memo: dict | None = field(default=None, compare=False, repr=False)
    #: a ring_impl.score_mods.ScoreMod on global positions and heads, Ulysses only (the hybrid's
    #: ring carries its own in ``ring``)
    score_mod: ScoreMod | None = None


class Ulysses:
    """Ulysses over one process group (``strategy="ulysses"``). Stateless between calls."""

    name = "ulysses"

    # ------------------------------------------------------------------ key/value heads

    def expand_kv(self, t: torch.Tensor, factor: int) -> torch.Tensor:
        """(b, hkv, s, d) -> (b, hkv * factor, s, d), each head's replicas next to each other."""
        return t if factor == 1 else t.repeat_interleave(factor, dim=1)

    def reduce_kv(self, t: torch.Tensor, factor: int) -> torch.Tensor:
        """The inverse of :meth:`expand_kv` for gradients: the replicas of each head summed (in
        ``t``'s dtype; the caller passes the accumulation dtype)."""
        if factor == 1:
            return t
        b, h, s, d = t.shape
        return t.reshape(b, h // factor, factor, s, d).sum(2)

    # ------------------------------------------------------------------ all-to-all

    def to_heads(self, parts: list[torch.Tensor], g: HeadGroup) -> list[torch.Tensor]:
        return sequence_to_heads(parts, g)

    def to_sequence(self, parts: list[torch.Tensor], g: HeadGroup) -> list[torch.Tensor]:
        return heads_to_sequence(parts, g)

    # ------------------------------------------------------------------ sequence order

    def gathered_order(self, cfg: HeadParallelConfig) -> list[int] | None:
        """Chunk ids, in sequence order, of the gathered sequence's ``2U`` chunks when the
        inner attention needs it reordered (causal ``head_tail``); None when it needs no reorder."""
        u = cfg.heads.size
        if cfg.mask is not None or not cfg.is_causal or cfg.layout != "head_tail" or u == 1:
            return None
        held = [c for rank in range(u) for c in chunk_ids("head_tail", u, rank)]  # gathered order
        return [held.index(c) for c in range(2 * u)]  # position in the gathered order of chunk c

    @staticmethod
    def _permute(
        t: torch.Tensor, order: list[int] | None, *, inverse: bool = False
    ) -> torch.Tensor:
        """Reorder the equal chunks of dim 2: chunk ``i`` of the result is chunk ``order[i]``."""
        if order is None:
            return t
        if inverse:
            order = [order.index(i) for i in range(len(order))]
        chunks = t.chunk(len(order), dim=2)
        return torch.cat([chunks[i] for i in order], dim=2)

    # ------------------------------------------------------------------ inner attention

    def visible(
        self, cfg: HeadParallelConfig, q: torch.Tensor, k: torch.Tensor
    ) -> torch.Tensor | None:
        """The mask on the gathered sequence (every rank's shard in rank order) for this rank's
        query heads: (batch or 1, heads or 1, s_q, s_kv) bool, or None without a mask."""
        if cfg.mask is None:
            return None
        return self.visible_for(cfg, q.shape[0], q.shape[1], q.shape[2], k.shape[2], q.device)

    def visible_for(
        self,
        cfg: HeadParallelConfig,
        batch: int,
        heads: int,
        seq_q: int,
        seq_kv: int,
        device: torch.device,
    ) -> torch.Tensor:
        """:meth:`visible` for ``heads`` gathered query heads and gathered lengths; one evaluation
        per call (the forward's serves the backward; ring_impl.planning.plan.cached_by_mask).
        Shared: never modify the result."""
        from ..layout import permutation
        from ..masks import visibility
        from ..planning.plan import cached_by_mask

        u, rank, mask = cfg.heads.size, cfg.heads.rank, cfg.mask
        # asked for a call with a mask only (:meth:`visible` checks; planning ahead, for a mask)
        assert mask is not None

        def build() -> torch.Tensor:
            pos_q, pos_kv = permutation(cfg.layout, seq_q, u), permutation(cfg.layout, seq_kv, u)
            vis = visibility(
                mask, pos_q, pos_kv, batch=batch, heads=heads * u, device=device, keep=True
            )
            if vis.shape[1] > 1:  # a head-dependent mask: this rank's heads are slice rank of U
                vis = vis[:, rank * heads : (rank + 1) * heads]
            return vis.to(device)

        key = ("ulysses", cfg.layout, u, rank, batch, heads, seq_q, seq_kv, str(device))
        return cached_by_mask(mask, key, build, memo=cfg.plan_memo)

    def scores(self, cfg: HeadParallelConfig, q: torch.Tensor, k: torch.Tensor):
        """The call's score_mod bound to the gathered sequence (ring_impl.score_mods.BlockScores):
        the global positions of the gathered rows (the layout's over the group, or the sequence
        order when :meth:`gathered_order` reorders them) and the global indices of this rank's
        query heads (slice ``rank`` of ``U``); None without a score_mod."""
        if cfg.score_mod is None:
            return None
        from ..layout import permutation
        from ..score_mods import block_scores

        u, rank, h = cfg.heads.size, cfg.heads.rank, q.shape[1]
        ordered = self.gathered_order(cfg) is not None

        def runs(n: int):
            if ordered:
                return ((0, n),)
            return tuple((int(p), int(p) + 1) for p in permutation(cfg.layout, n, u).tolist())

        return block_scores(
            cfg.score_mod,
            batch=q.shape[0],
            heads=(rank * h, (rank + 1) * h),
            q_pos=runs(q.shape[2]),
            kv_pos=runs(k.shape[2]),
            device=q.device,
        )

    def inner_forward(
        self, cfg: HeadParallelConfig, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor
    ):
        """(out in the input dtype, lse (b, h, s) in the accumulation dtype) of the gathered heads:
        the local kernel on the whole sequence (with the mask: rows that see nothing give out 0,
        LSE -inf)."""
        vis = self.visible(cfg, q, k)
        kind = "masked" if vis is not None else "causal" if cfg.is_causal else "full"
        causal = cfg.is_causal and vis is None
        # The kernel on finite numbers; NaN goes exactly
        # where the inputs take it (ring_impl.numerics.nonfinite).
        scores = self.scores(cfg, q, k)
        call: dict[str, Any] = {
            "is_causal": causal,
            "scale": cfg.scale,
            "visible": vis,
            "score_mod": scores,
        }
        out, lse = call_forward(cfg.op, *finite_parts(q, k, v), **call)
        lse = block_lse(cfg.op, lse, q, **call)
        if vis is not None:  # rows that see nothing: nothing
            out, lse = blank_hidden_rows(~vis.any(-1).expand(lse.shape), out, lse)
        out, lse = poison_forward(out, lse, q, k, v, kind, vis)
        return out.to(q.dtype), lse.to(accumulation_dtype(q.dtype))

    def inner_backward(self, cfg: HeadParallelConfig, grad_out, q, k, v, out, lse, grad_lse):
        vis = self.visible(cfg, q, k)
        kind = "masked" if vis is not None else "causal" if cfg.is_causal else "full"
        if vis is not None:  # rows that see nothing: zero terms (their LSE -inf would give NaN)
            grad_out, lse, grad_lse = blank_hidden_rows_grad(
                ~vis.any(-1).expand(lse.shape), grad_out, lse, grad_lse
            )
        fq, fk, fv, fo, fl, fdo, fglse = finite_parts(q, k, v, out, lse, grad_out, grad_lse)
        dq, dk, dv = call_backward(
            cfg.op,
            fdo,
            fq,
            fk,
            fv,
            fo,
            fl,
            is_causal=cfg.is_causal and vis is None,
            scale=cfg.scale,
            grad_lse=fglse,
            visible=vis,
            score_mod=self.scores(cfg, q, k),
        )
        return poison_backward(
            dq, dk, dv, q, k, v, out, lse, grad_out, kind, vis, grad_lse=grad_lse
        )

    # ------------------------------------------------------------------ the algorithm

    def forward(
        self, cfg: HeadParallelConfig, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor
    ):
        """Local (out (b, h, s_q, d) in the input dtype, lse (b, h, s_q) in the accumulation dtype,
        saved) where ``saved`` is what :meth:`backward` needs."""
        g = cfg.heads
        factor = kv_replication(key.shape[1], g.size)
        q, k, v = self.to_heads(
            [query, self.expand_kv(key, factor), self.expand_kv(value, factor)], g
        )
        order = self.gathered_order(cfg)
        q, k, v = (self._permute(t, order) for t in (q, k, v))
        out_h, lse_h = self.inner_forward(cfg, q, k, v)
        back = [self._permute(out_h, order, inverse=True)]
        if cfg.return_lse:
            back.append(self._permute(lse_h.unsqueeze(-1), order, inverse=True))
        back = self.to_sequence(back, g)
        out = back[0]
        lse = back[1].squeeze(-1) if cfg.return_lse else None
        return out, lse, (q, k, v, out_h, lse_h)

    def backward(
        self,
        cfg: HeadParallelConfig,
        grad_out,
        grad_lse,
        saved,
        key_dtype: torch.dtype,
        heads_kv: int,
    ):
        """(dq, dk, dv) as sequence shards; dk/dv with ``heads_kv`` heads in ``key_dtype``.

        grad_out (b, h, s_q, d); grad_lse (b, h, s_q) or None (zeros travel when the LSE was
        returned, so every rank sends the same bytes whether or not its loss used the LSE)."""
        q, k, v, out_h, lse_h = saved
        g = cfg.heads
        order = self.gathered_order(cfg)
        acc = accumulation_dtype(q.dtype)
        parts = [grad_out]
        if cfg.return_lse:
            lse_grad = (
                torch.zeros(grad_out.shape[:3], dtype=acc, device=grad_out.device)
                if grad_lse is None
                else grad_lse.to(acc)
            )
            parts.append(lse_grad.unsqueeze(-1))
        parts = self.to_heads(parts, g)
        dout_h = self._permute(parts[0], order)
        dlse_h = self._permute(parts[1], order).squeeze(-1) if cfg.return_lse else None
        dq_h, dk_h, dv_h = self.inner_backward(cfg, dout_h, q, k, v, out_h, lse_h, dlse_h)
        grads = [self._permute(t.to(q.dtype), order, inverse=True) for t in (dq_h, dk_h, dv_h)]
        dq, dk, dv = self.to_sequence(grads, g)
        factor = kv_replication(heads_kv, g.size)
        if factor > 1:  # replicas summed in the accumulation dtype, rounded once
            dk, dv = self.reduce_kv(dk.to(acc), factor), self.reduce_kv(dv.to(acc), factor)
        return dq, dk.to(key_dtype), dv.to(key_dtype)


@dataclass(frozen=True)
class HeadParallelPath:
    """A head-parallel strategy (``algo``: Ulysses or the hybrid) as a
    :class:`ring_impl.exchanges.ring.Path`; its LSE is an empty tensor unless ``cfg.return_lse``."""

    cfg: HeadParallelConfig
    algo: Ulysses

    def forward(self, query, key, value):
        out, lse, saved = self.algo.forward(self.cfg, query, key, value)
        return out, (out.new_empty(0) if lse is None else lse), saved, (key.dtype, key.shape[1])

    def backward(self, saved, meta, grad_out, grad_lse):
        cfg, (key_dtype, heads_kv) = self.cfg, meta
        return self.algo.backward(
            cfg, grad_out, grad_lse if cfg.return_lse else None, saved, key_dtype, heads_kv
        )
