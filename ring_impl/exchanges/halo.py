"""Halo exchange: attention under a mask that reaches less than a shard, without the ring.

With the ``contiguous`` layout rank ``r`` holds global positions ``[r S, (r + 1) S)``. A mask
whose :meth:`~ring_impl.masks.Mask.reach` is ``(left, right)`` with ``left, right <= S`` (a
``SlidingWindow``, alone, with ``Causal`` or ``Documents`` by ``&``; a ``ChunkedCausal`` of
chunks up to ``S + 1``) lets rank ``r``'s queries see only

    [last ``left`` keys of rank r-1 | its own S keys | first ``right`` keys of rank r+1]

so only those halos travel, once, instead of every block around the ring:

forward    rank r sends its first ``right`` key/value rows to r-1 and its last ``left`` to r+1
           (none past the ends of the sequence: no wrap-around), receives the two halos, and
           runs the kernel on [halo | local | halo] with the mask on global positions, cut as
           a ring step's block (:mod:`ring_impl.planning.tiling`: a window's band in tiles).
backward   the kernel's backward on the same block (the halos were kept from the forward, not
           sent again); dQ stays; the dK/dV rows of each halo go home to their owner in the
           accumulation dtype (float32, float64 for float64: the ring's accumulator dtype), where
           they are added to the owner's own part before the cast to the input dtype.

Each exchange is one batched isend/irecv with the neighbours (``c10d`` p2p; host copies on
gloo with CUDA tensors, as :mod:`ring_impl.transports.link`). What a rank sends is exactly what
its neighbours' queries need, so the key/value bytes are the minimum of any exchange; the
dK/dV bytes are the same rows in the accumulation dtype (a 16-bit transfer would halve them for
16-bit inputs at the cost of a rounding before the sum).
:func:`ring_impl.schedule.halo.halo_schedule` declares them per rank (the two end ranks have one
neighbour).

The seams of :class:`ring_impl.exchanges.ring.RingAttention` the block goes through are the ring's
own (``pack_kv``, ``block_forward``, ``block_backward``, ``nonfinite_forward``, and through
``block_grads`` ``nonfinite_backward`` and ``nonfinite_gradients``), so a variant's kernel
handling and non-finite decisions apply to both paths; its plan and transports do not (there is
no ring). The step recorder (:mod:`ring_impl.debug`) records nothing here: the block mixes three
ranks' keys, which the ring simulation has no step for.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from ..numerics.nonfinite import GradientFlags, finite_parts, gradient_flags
from ..planning.plan import Block, cached_by_mask, mask_blocks
from ..transports.link import stage_on_host
from .ring import RingAttention, RingConfig, block_rows, split_kv

__all__ = ["HaloPath", "HaloRows", "halo_reach", "halo_refusal", "halo_rows"]


def halo_refusal(mask, *, layout: str, world_size: int, seq_q: int, seq_kv: int) -> str | None:
    """Why the halo path cannot serve a call, or None when it can. Never raises.

    ``mask``: the call's mask with ``is_causal`` folded in; ``seq_q``/``seq_kv``: local lengths.
    """
    try:
        if mask is None:
            return "there is no mask: every query sees every shard"
        if layout != "contiguous":
            return (
                f"layout {layout!r} holds positions that are not one run per rank; the halo path "
                "needs layout='contiguous'"
            )
        if seq_q != seq_kv:
            return (
                f"local query and key/value lengths differ ({seq_q} and {seq_kv}); the halo path "
                "needs them equal"
            )
        left, right = mask.reach()
        for side, n in (("back", left), ("forward", right)):
            if n is None:
                return f"mask {mask.describe()} does not bound how far a query looks {side}"
            if isinstance(n, bool) or not isinstance(n, int):
                return f"mask {mask.describe()}: reach() gave {n!r}, not an int"
        if max(left, right) > seq_kv:
            return (
                f"mask {mask.describe()} reaches {left} keys back and {right} forward, more than "
                f"a shard ({seq_kv} tokens): queries need keys beyond the neighbours; the ring "
                "serves it"
            )
    except Exception as exc:  # a user's Mask whose reach fails is served by the ring
        return f"mask reach could not be read ({type(exc).__name__}: {exc})"
    return None


def halo_reach(
    mask, *, layout: str, world_size: int, seq_q: int, seq_kv: int
) -> tuple[int, int] | None:
    """``(left, right)`` rows (clamped at 0) when the halo path can serve the call, else None."""
    if (
        halo_refusal(mask, layout=layout, world_size=world_size, seq_q=seq_q, seq_kv=seq_kv)
        is not None
    ):
        return None
    left, right = mask.reach()
    return max(0, left), max(0, right)


@dataclass(frozen=True)
class HaloRows:
    """Key/value rows one rank exchanges: ``left`` received from rank - 1 (its last rows),
    ``right`` from rank + 1 (its first rows); ``to_prev`` of its first rows sent to rank - 1,
    ``to_next`` of its last rows to rank + 1. Zero past the ends of the sequence."""

    left: int
    right: int
    to_prev: int
    to_next: int


def halo_rows(rank: int, world_size: int, left: int, right: int) -> HaloRows:
    first, last = rank == 0, rank == world_size - 1
    return HaloRows(
        left=0 if first else left,
        right=0 if last else right,
        to_prev=0 if first else right,
        to_next=0 if last else left,
    )


def _exchange(
    g,
    to_prev: torch.Tensor | None,
    to_next: torch.Tensor | None,
    from_prev: torch.Size | None,
    from_next: torch.Size | None,
    like: torch.Tensor,
):
    """Send ``to_prev`` to rank - 1 and ``to_next`` to rank + 1, receive tensors of the shapes
    ``from_prev`` / ``from_next`` (dtype and device of ``like``); None: nothing that way. One
    batched isend/irecv; returns (received from rank - 1, received from rank + 1)."""
    ops: list[dist.P2POp] = []
    recvs: list[torch.Tensor | None] = []
    sends = []  # the send buffers stay alive until the works finish
    for t, peer in ((to_prev, g.prev_global), (to_next, g.next_global)):
        if t is not None:
            buf, _ = stage_on_host(t.contiguous(), g)
            sends.append(buf)
            ops.append(dist.P2POp(dist.isend, buf, peer, g.pg))
    for shape, peer in ((from_prev, g.prev_global), (from_next, g.next_global)):
        if shape is None:
            recvs.append(None)
            continue
        buf = torch.empty(shape, dtype=like.dtype, device="cpu" if g.stage_on_host else like.device)
        recvs.append(buf)
        ops.append(dist.P2POp(dist.irecv, buf, peer, g.pg))
    if ops:
        for work in dist.batch_isend_irecv(ops):
            work.wait()
    del sends
    return tuple(None if r is None else r.to(like.device) for r in recvs)


def _shape(t: torch.Tensor, rows: int) -> torch.Size | None:
    """The shape of ``rows`` rows of a packed key/value tensor (ring_impl.exchanges.ring.split_kv:
    the sequence is dim -2), or None."""
    return None if rows == 0 else torch.Size((*t.shape[:-2], rows, t.shape[-1]))


def _extended(
    kv: torch.Tensor, from_prev: torch.Tensor | None, from_next: torch.Tensor | None
) -> torch.Tensor:
    parts = [p for p in (from_prev, kv, from_next) if p is not None]
    return parts[0] if len(parts) == 1 else torch.cat(parts, dim=-2)


def halo_blocks(
    cfg: RingConfig, seq: int, h: HaloRows, device: torch.device | None = None
) -> tuple[Block, ...]:
    """The kernel calls of a halo call: local query rows x [left halo | local | right halo]
    rows, cut as a ring step's (:func:`ring_impl.planning.tiling.split_visibility`: a window's band
    in tiles; for an op that takes row bounds, one ``ranges`` block; none when no query sees
    anything)."""
    r = cfg.group.rank
    ranges = cfg.op.capabilities.row_bounds

    def build() -> tuple[Block, ...]:
        q_pos = torch.arange(r * seq, (r + 1) * seq)
        kv_pos = torch.arange(r * seq - h.left, (r + 1) * seq + h.right)
        return mask_blocks(
            cfg.mask,
            q_pos,
            kv_pos,
            0,
            r,
            batch=cfg.mask_dims[0],
            heads=cfg.mask_dims[1],
            head_span=cfg.mask_heads,
            device=device,
            ranges=ranges,
        )

    key = ("halo", r, seq, h, cfg.mask_dims, cfg.mask_heads, str(device), ranges)
    return cached_by_mask(cfg.mask, key, build, memo=cfg.plan_memo)


def extended_forward(
    impl: RingAttention,
    cfg: RingConfig,
    query: torch.Tensor,
    ext: torch.Tensor,
    blocks: tuple[Block, ...],
    *,
    finite: bool | None = None,
    into: tuple[torch.Tensor, torch.Tensor] | None = None,
    result: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(out, lse) of ``query`` (batch, heads, seq, head_dim) against the packed key/value rows
    ``ext`` (RingAttention.pack_kv's shape, ``rows`` on dim -2) that ``blocks`` index (one kernel
    call each, through the ring's seams); rows no block covers: out 0, LSE -inf. Shared by the paths
    without a ring (the halo here, ring_impl.exchanges.kv_gather).

    ``finite``: whether every input the blocks read is finite (the NaN propagation is then
    skipped); checked here on ``query`` and ``ext`` when None. ``into``: (out, lse) accumulators
    in the accumulation dtype to merge into, instead of new ones. ``result``: out in the query's
    dtype; else the accumulators themselves, to merge more blocks into (a call whose ``ext``
    rows are not all there yet)."""
    acc = impl.accumulation_dtype(query.dtype)
    ext_k, ext_v = split_kv(ext, query.shape[-1])
    if into is None:
        out = torch.zeros((*query.shape[:3], ext_v.shape[-1]), dtype=acc, device=query.device)
        lse = torch.full(query.shape[:3], float("-inf"), dtype=acc, device=query.device)
    else:
        out, lse = into
    if finite is None:  # every rank's finite (the group's verdict), or read where that is free
        finite = len(blocks) > 0 and (
            impl.inputs_known_finite(cfg) is True or impl.all_finite(query, ext)
        )
    view = cfg.op.capabilities.row_views
    for block in blocks:
        (q0, q1) = block.q_rows
        q, k, v = (
            block_rows(query, block.q_rows, view),
            block_rows(ext_k, block.kv_rows, view),
            block_rows(ext_v, block.kv_rows, view),
        )
        if finite:
            block_out, block_lse = impl.block_forward(cfg, q, k, v, block)
        else:
            # the kernel on finite numbers, NaN put exactly where the inputs take it
            # (ring_impl.numerics.nonfinite)
            block_out, block_lse = impl.block_forward(cfg, *finite_parts(q, k, v), block)
            block_out, block_lse = impl.nonfinite_forward(block_out, block_lse, q, k, v, block)
        del q, k, v
        impl.merge(out[:, :, q0:q1], lse[:, :, q0:q1], block_out, block_lse)
        del block_out, block_lse
    return (out.to(query.dtype), lse) if result else (out, lse)


def extended_backward(
    impl: RingAttention,
    cfg: RingConfig,
    query: torch.Tensor,
    ext: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    grad_out: torch.Tensor,
    grad_lse: torch.Tensor | None,
    blocks: tuple[Block, ...],
    *,
    finite: bool | None = None,
    flags: GradientFlags | None = None,
    into: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(dq, d ext) in the accumulation dtype for :func:`extended_forward`'s call: ``out``/``lse``
    as it returned them, ``grad_lse`` the LSE's gradient or None. ``finite`` as there and
    ``flags`` as :meth:`RingAttention.gradient_decision` gives them (decided here when
    ``finite`` is None); ``into``: (dq, d ext) accumulators to add into, instead of new
    zeros."""
    acc = impl.accumulation_dtype(query.dtype)
    if into is None:
        dq = torch.zeros(query.shape, dtype=acc, device=query.device)
        dkv = torch.zeros(ext.shape, dtype=acc, device=query.device)
    else:
        dq, dkv = into
    if finite is None:
        finite, flags = impl.gradient_decision(cfg, query, out, lse, grad_out, grad_lse, kv=(ext,))
        finite = finite and len(blocks) > 0
    kv = split_kv(ext, query.shape[-1])
    dext_k, dext_v = split_kv(dkv, query.shape[-1])
    for block in blocks:
        (q0, q1), bq, bk, bv = impl.block_grads(
            cfg, block, grad_out, query, kv, out, lse, grad_lse, finite, flags
        )
        (k0, k1) = block.kv_rows
        dq[:, :, q0:q1] += bq
        dext_k[:, :, k0:k1] += bk
        dext_v[:, :, k0:k1] += bv
    return dq, dkv


@dataclass(frozen=True)
class HaloPath:
    """The halo exchange as a :class:`ring_impl.exchanges.ring.Path` for a mask reaching ``reach =
    (left, right)`` rows. Saved for the backward: the received halos (not sent again)."""

    cfg: RingConfig
    impl: RingAttention
    reach: tuple[int, int]

    def forward(self, query, key, value):
        cfg, impl = self.cfg, self.impl
        g, seq = cfg.group, query.shape[2]
        h = halo_rows(g.rank, g.world_size, *self.reach)
        kv = impl.pack_kv(key, value)  # rows on dim -2 (ring_impl.exchanges.ring.split_kv)
        from_prev, from_next = _exchange(
            g,
            kv[..., : h.to_prev, :] if h.to_prev else None,
            kv[..., seq - h.to_next :, :] if h.to_next else None,
            _shape(kv, h.left),
            _shape(kv, h.right),
            kv,
        )
        ext = _extended(kv, from_prev, from_next)
        del kv
        blocks = halo_blocks(cfg, seq, h, query.device)
        out, lse = extended_forward(impl, cfg, query, ext, blocks)
        return out, lse, (query, key, value, out, lse, from_prev, from_next), (h, blocks)

    def backward(self, saved, meta, grad_out, grad_lse):
        query, key, value, out, lse, from_prev, from_next = saved
        (cfg, impl), (h, blocks) = (self.cfg, self.impl), meta
        seq = query.shape[2]
        ext = _extended(impl.pack_kv(key, value), from_prev, from_next)
        inputs = (impl, cfg, query, ext, out, lse, grad_out, grad_lse, blocks)
        pending = impl.speculated_gradients(cfg, grad_out, lse, grad_lse)
        if pending is None:
            dq, dkv = extended_backward(*inputs)  # [left | local | right]
        else:  # the kernels first, the gradients' flag read before their results are sent
            dq, dkv = extended_backward(*inputs, finite=True)
            if not bool(pending):
                flags = gradient_flags(grad_out, grad_lse)
                dq, dkv = extended_backward(*inputs, finite=False, flags=flags)
        del ext, inputs
        # The halos' dK/dV go home; this rank's rows that its neighbours saw come back.
        to_prev = dkv[..., : h.left, :] if h.left else None
        to_next = dkv[..., h.left + seq :, :] if h.right else None
        back_prev, back_next = _exchange(
            cfg.group, to_prev, to_next, _shape(dkv, h.to_prev), _shape(dkv, h.to_next), dkv
        )
        local = dkv[..., h.left : h.left + seq, :]
        if back_prev is not None:
            local[..., : h.to_prev, :] += back_prev
        if back_next is not None:
            local[..., seq - h.to_next :, :] += back_next
        dk, dv = split_kv(local, key.shape[-1])
        return dq.to(query.dtype), dk.to(key.dtype), dv.to(value.dtype)
