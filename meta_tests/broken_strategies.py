"""Deliberately broken head-parallel strategies: one per bug users reported in Ulysses and
hybrid (USP-style) context parallelism.

Each is ``ring_impl``'s Ulysses and hybrid with one seam overridden the way a real implementation
got it wrong, wrapped as an implementation under test (``--impl
meta_tests.broken_strategies:<NAME>``; its ring is ring_impl's, correct).
``meta_tests/test_suite_catches_bugs.py`` runs the strategy cases of
``suites/test_forward_backward.py`` (its strategy axis; the mask suite for a mask bug) against
each and requires a failure whose message matches the bug's own ``expect`` pattern and no other
broken implementation's.
"""

from __future__ import annotations

from dataclasses import replace

from conformance.adapters.ring_impl import RingImplAdapter
from meta_tests.broken import Broken, by_name, function_adapter
from ring_impl import RingAttention, bind
from ring_impl.exchanges.head_alltoall import _exchange, _pack, _unpack, _widest_first
from ring_impl.exchanges.hybrid import Hybrid
from ring_impl.exchanges.ulysses import Ulysses
from ring_impl.ops import accumulation_dtype

__all__ = ["BROKEN_STRATEGIES"]


class HeadsAndSequenceSwapped:
    """The sequence-to-heads all-to-all splits the sequence dim where it must split heads (the
    all-to-all on the wrong dim after a transpose); the receiver reads the pieces as head slices."""

    def to_heads(self, parts, g):
        if g.size == 1:
            return list(parts)
        u = g.size
        staged = [
            t.reshape(t.shape[0], t.shape[1], u, t.shape[2] // u, t.shape[3]).permute(2, 0, 1, 3, 4)
            for t in parts
        ]
        rows, layout = _pack(staged, g)
        out = []
        for t, r in zip(parts, _unpack(_exchange(rows, g), layout)):
            b, h, s, f = t.shape
            out.append(
                r.reshape(u, b, h // u, s, f).permute(1, 2, 0, 3, 4).reshape(b, h // u, u * s, f)
            )
        return out


class HeadsInterleavedBack:
    """The heads-to-sequence all-to-all puts the received head slices back interleaved: the
    ``(U, h/U)`` head index read as ``(h/U, U)`` (a reshape without the transpose), so output head
    ``i * U + j`` holds head ``j * h/U + i``. Every part goes back that way (the output, the LSE,
    the gradients): one shared helper."""

    def to_sequence(self, parts, g):
        if g.size == 1:
            return list(parts)
        u = g.size
        order = _widest_first(parts)
        staged = [parts[i].unflatten(2, (u, -1)).permute(2, 0, 1, 3, 4) for i in order]
        rows, layout = _pack(staged, g)
        out = [None] * len(parts)
        for i, r in zip(order, _unpack(_exchange(rows, g), layout)):
            b, hu, us, f = parts[i].shape
            # the bug: (h/U, U) where the head index is (U, h/U)
            r = r.reshape(u, b, hu, us // u, f).permute(1, 2, 0, 3, 4)
            out[i] = r.reshape(b, u * hu, us // u, f)
        return out


class LseLeftInHeadShards:
    """The output goes back through the heads-to-sequence all-to-all, the LSE does not: it is
    returned as the inner attention produced it, the rank's head slice over its Ulysses group's
    whole sequence, ``(batch, heads/U, U * seq_local)``."""

    def forward(self, cfg, query, key, value):
        if not cfg.return_lse:
            return super().forward(cfg, query, key, value)  # type: ignore[misc]
        out, _, saved = super().forward(cfg, query, key, value)  # type: ignore[misc]
        order = self.gathered_order(cfg)  # type: ignore[attr-defined]
        lse_h = self._permute(saved[4].unsqueeze(-1), order, inverse=True)  # type: ignore[attr-defined]
        lse_h = lse_h.squeeze(-1)
        return out, lse_h, saved


class KVHeadsTiled:
    """Key/value heads fewer than the degree replicated as a block (``repeat``) instead of each
    head next to its copies (``repeat_interleave``); the gradients summed back the same way."""

    def expand_kv(self, t, factor):
        return t if factor == 1 else t.repeat(1, factor, 1, 1)

    def reduce_kv(self, t, factor):
        if factor == 1:
            return t
        b, h, s, d = t.shape
        return t.reshape(b, factor, h // factor, s, d).sum(1)


class RingDimWithoutReorder:
    """The hybrid's ring dimension runs the contiguous plan whatever the layout: head_tail shards
    attended as if they were contiguous ones."""

    def ring_config(self, cfg):
        return replace(cfg.ring, layout="contiguous")


class LocalOnly:
    """No all-to-all, no ring: each rank attends to its own shard with the local kernel, and
    returns shapes and dtypes that look right."""

    def forward(self, cfg, query, key, value):
        out, lse = Ulysses.inner_forward(self, cfg, query, key, value)  # type: ignore[arg-type]
        return out, (lse if cfg.return_lse else None), (query, key, value, out, lse)

    def backward(self, cfg, grad_out, grad_lse, saved, key_dtype, heads_kv):
        q, k, v, out, lse = saved
        acc = accumulation_dtype(q.dtype)
        dlse = None if grad_lse is None else grad_lse.to(acc)
        dq, dk, dv = Ulysses.inner_backward(self, cfg, grad_out, q, k, v, out, lse, dlse)  # type: ignore[arg-type]
        return dq.to(q.dtype), dk.to(key_dtype), dv.to(key_dtype)


class MaskAtLocalHeadIndex:
    """A head-dependent mask evaluated at each rank's own head index (0 .. H/U - 1) instead of
    the global head: Ulysses' kernel and the hybrid's ring plan every rank as if it held heads
    0 .. H/U - 1 (caught by the mask suite's strategy cases)."""

    def visible(self, cfg, q, k):
        from ring_impl.layout import permutation
        from ring_impl.masks import visibility

        if cfg.mask is None:
            return None
        u, h = cfg.heads.size, q.shape[1]
        pos_q, pos_kv = (
            permutation(cfg.layout, q.shape[2], u),
            permutation(cfg.layout, k.shape[2], u),
        )
        vis = visibility(cfg.mask, pos_q, pos_kv, batch=q.shape[0], heads=h * u)
        return (vis[:, :h] if vis.shape[1] > 1 else vis).to(q.device)

    def ring_config(self, cfg):
        ring = super().ring_config(cfg)  # type: ignore[misc]
        if ring is None or ring.mask_heads is None:
            return ring
        start, stop = ring.mask_heads
        return replace(ring, mask_heads=(0, stop - start))


def _strategies(bug: type) -> dict[str, Ulysses]:
    """The bug applied to both head-parallel strategies (where it has a seam in them)."""
    return {
        "ulysses": type(f"{bug.__name__}Ulysses", (bug, Ulysses), {})(),
        "hybrid": type(f"{bug.__name__}Hybrid", (bug, Hybrid), {})(),
    }


def _adapter(name: str, bug: type) -> RingImplAdapter:
    return function_adapter(name, bind(RingAttention(), strategies=_strategies(bug)))


#: The strategy cases of a capability suite (their ids start with the strategy).
STRATEGY_AXIS = ("-k", "ulysses or hybrid")

BROKEN_STRATEGIES: dict[str, Broken] = by_name(
    Broken(
        "heads_sequence_swapped",
        "Ulysses/hybrid: all-to-all on the wrong dimension after a transpose",
        r"heads and sequence swapped in the all-to-all",
        _adapter("heads_sequence_swapped", HeadsAndSequenceSwapped),
        suites="suites/test_forward_backward.py",
        select=STRATEGY_AXIS,
    ),
    Broken(
        "out_heads_interleaved",
        "Ulysses/hybrid: head slices put back in the wrong order after the output all-to-all",
        r"output's heads are permuted",
        _adapter("out_heads_interleaved", HeadsInterleavedBack),
        suites="suites/test_forward_backward.py",
        select=STRATEGY_AXIS,
    ),
    Broken(
        "lse_in_head_shards",
        "Ulysses/hybrid: the LSE returned in the head-sharded layout, not the sequence shard",
        r"LSE is returned in the head-sharded layout",
        _adapter("lse_in_head_shards", LseLeftInHeadShards),
        suites="suites/test_forward_backward.py",
        select=STRATEGY_AXIS,
    ),
    Broken(
        "kv_heads_wrong_order",
        "Ulysses/hybrid: key/value heads fewer than the degree replicated in the wrong order",
        r"key/value heads replicated in the wrong order",
        _adapter("kv_heads_wrong_order", KVHeadsTiled),
        suites="suites/test_forward_backward.py",
        select=STRATEGY_AXIS,
    ),
    Broken(
        "hybrid_without_head_tail_reorder",
        "hybrid: the ring dimension missing the load-balancing reorder",
        r"head_tail reorder is missing",
        _adapter("hybrid_without_head_tail_reorder", RingDimWithoutReorder),
        suites="suites/test_forward_backward.py",
        select=STRATEGY_AXIS,
    ),
    Broken(
        "local_attention_only",
        "silent fallback: a strategy that runs local attention only",
        r"local attention, context parallelism silently off",
        _adapter("local_attention_only", LocalOnly),
        suites="suites/test_forward_backward.py",
        select=STRATEGY_AXIS,
    ),
    Broken(
        "mask_at_local_head_index",
        "Ulysses/hybrid: a head-dependent mask evaluated at the rank's own head index",
        r"mask evaluated at each rank's own head index",
        _adapter("mask_at_local_head_index", MaskAtLocalHeadIndex),
        suites="suites/test_masks.py",
    ),
)

# Module attributes, so each is loadable as --impl meta_tests.broken_strategies:<name>.
globals().update({name: b.impl for name, b in BROKEN_STRATEGIES.items()})
