"""Sparse key/value gather: each rank receives only the key/value rows its queries see.

Under a mask most ranks' queries see few of another rank's keys: packed documents see only
their own document's, so under a balanced layout a rank needs the keys of the documents split
across ranks and nothing else. The ring still sends every block to every rank (``W - 1``
blocks per rank, forward, and again with their dK/dV backward). This path sends each row once,
to the ranks whose queries see it:

forward    from the mask on global positions (the layout's runs) every rank knows, for every
           pair (receiver, sender), which of the sender's local rows some of the receiver's
           queries see. One ``all_to_all_single`` (split sizes: those row counts) sends them;
           the rank's own rows and the received ones, ordered by global position, are one
           extended key/value block, cut by :mod:`ring_impl.tiling` into exact kernel calls as
           a ring step's (a document split across ranks becomes one causal call again).
backward   the kernel's backward on the same block (the received rows were kept from the
           forward, not sent again); dQ stays; the received rows' dK/dV go home in one
           ``all_to_all_single`` in the accumulation dtype (float32, float64 for float64: the
           ring's accumulators), added to the owner's own rows before the cast to the input dtype.

Every rank calls both all-to-alls, with zero rows where it has nothing to send. Key/value bytes
are the minimum of any exchange (each row a receiver's queries see, once); the ring's are
``(W - 1) S`` rows per rank forward and again backward. What it costs: no overlap of transfer
and compute (the ring's next block travels while a step computes) and the received rows held
from forward to backward. :func:`gather_schedule` declares the collectives per rank.

Any layout, any mask (a head-dependent one: the union over heads travels), ``seq_q != seq_kv``
when not causal, W >= 2. ``rotate_method`` and ``head_chunks`` do not apply (there is no ring).
The ring's seams (``pack_kv``, ``block_forward``, ``block_backward``, the NaN propagation) run
the blocks, as on the halo path (:func:`ring_impl.halo.extended_forward`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from .halo import extended_backward, extended_forward
from .layout import layout_runs
from .ops import accumulation_dtype
from .plan import Block, cached_by_mask, visibility_blocks
from .ring import RingAttention, RingConfig
from .validate import exchange_nbytes

__all__ = ["GatherPath", "GatherPlan", "gather_path", "gather_plan", "gather_refusal", "gather_schedule"]


def gather_refusal(mask, *, world_size: int, head_chunks: int, strategy: str) -> str | None:
    """Why ``sparse_kv=True`` cannot serve a call, or None."""
    if mask is None:
        return "sparse_kv=True needs a mask (without one every query sees every key: the ring serves it)"
    if strategy != "ring":
        return f"sparse_kv=True runs with strategy='ring' only, got {strategy!r}"
    if head_chunks != 1:
        return f"sparse_kv=True sends no blocks around a ring for head_chunks to split; pass head_chunks=1, got {head_chunks}"
    return None


@dataclass(frozen=True)
class GatherPlan:
    """What one rank sends and receives, and its kernel calls.

    ``send_rows[t]``: this rank's local key/value rows (ascending) that rank ``t``'s queries see
    (empty for itself). ``recv_counts[s]``: rows received from rank ``s`` (0 for itself), in
    rank order after this rank's own ``seq_kv`` rows in the extended block before ``order``.
    ``order``: the permutation putting [own rows | received rows] in global position order, or
    None when they already are. ``blocks``: local query rows x extended rows.
    """

    send_rows: tuple[torch.Tensor, ...]
    recv_counts: tuple[int, ...]
    order: torch.Tensor | None
    blocks: tuple[Block, ...]

    @property
    def send_counts(self) -> tuple[int, ...]:
        return tuple(int(t.numel()) for t in self.send_rows)


def _positions(layout: str, length: int, world_size: int, rank: int) -> torch.Tensor:
    return torch.cat([torch.arange(a, b) for a, b in layout_runs(layout, length * world_size, world_size, rank)])


def _seen_rows(mask, q_pos: torch.Tensor, kv_pos: torch.Tensor, batch: int, heads: int) -> torch.Tensor:
    """Local indices (ascending) of the keys at ``kv_pos`` that some query at ``q_pos`` sees,
    for some batch entry and head."""
    from .masks import visibility

    vis = visibility(mask, q_pos, kv_pos, batch=batch, heads=heads)
    return vis.any(-2).flatten(0, 1).any(0).nonzero().flatten()


def gather_plan(mask, *, rank: int, world_size: int, layout: str, seq_q: int, seq_kv: int, batch: int, heads: int,
                device: torch.device | None = None) -> GatherPlan:
    """The :class:`GatherPlan` of ``rank`` (``seq_q``/``seq_kv``: local lengths). Costs ``2W - 1``
    mask evaluations of a shard against a shard; cached by mask digest as the ring's plans are."""
    device = torch.device(device or "cpu")

    def build() -> GatherPlan:
        from .masks import visibility

        q_pos = [_positions(layout, seq_q, world_size, r) for r in range(world_size)]
        kv_pos = [_positions(layout, seq_kv, world_size, r) for r in range(world_size)]
        empty = torch.zeros(0, dtype=torch.int64)
        send = tuple(empty if t == rank else _seen_rows(mask, q_pos[t], kv_pos[rank], batch, heads)
                     for t in range(world_size))
        recv = tuple(empty if s == rank else _seen_rows(mask, q_pos[rank], kv_pos[s], batch, heads)
                     for s in range(world_size))
        ext_pos = torch.cat([kv_pos[rank]] + [kv_pos[s][recv[s]] for s in range(world_size)])
        order = torch.argsort(ext_pos, stable=True)
        identity = bool(torch.equal(order, torch.arange(order.numel())))
        vis = visibility(mask, q_pos[rank], ext_pos[order], batch=batch, heads=heads)
        return GatherPlan(send_rows=tuple(t.to(device) for t in send), recv_counts=tuple(int(t.numel()) for t in recv),
                          order=None if identity else order.to(device),
                          blocks=visibility_blocks(vis, 0, rank, device))

    # The layouts' runs, not only its name: a layout registered again under the same name is replanned.
    key = ("gather", rank, world_size, layout, seq_q, seq_kv, batch, heads, str(device),
           *(tuple(layout_runs(layout, n * world_size, world_size, r) for r in range(world_size)) for n in (seq_q, seq_kv)))
    return cached_by_mask(mask, key, build)


def gather_schedule(plan: GatherPlan, *, world_size: int, batch: int, heads_kv: int, head_dim: int,
                    dtype: torch.dtype) -> dict[str, dict[str, dict[str, int]]]:
    """The collectives of one sparse-gather call on the rank ``plan`` is for, eager: forward,
    the input check's all_reduce and one all_to_all whose input is the rows sent (packed key and
    value, input dtype); backward, one all_to_all whose input is the received rows' dK/dV
    (accumulation dtype)."""
    row = 2 * batch * heads_kv * head_dim
    sent, received = sum(plan.send_counts), sum(plan.recv_counts)
    return {
        "forward": {"all_reduce": {"calls": 1, "bytes": exchange_nbytes(world_size)},
                    "all_to_all": {"calls": 1, "bytes": sent * row * dtype.itemsize}},
        "backward": {"all_to_all": {"calls": 1, "bytes": received * row * accumulation_dtype(dtype).itemsize}},
    }


def _all_to_all(g, send: torch.Tensor, send_counts, recv_counts) -> torch.Tensor:
    """Rows-first ``send`` (rows, ...) split by ``send_counts`` over the ranks; returns the rows
    received, split by ``recv_counts``. Host copies on gloo with CUDA tensors."""
    device = send.device
    host = g.stage_on_host and device.type != "cpu"
    buf = send.cpu() if host else send
    out = torch.empty((sum(recv_counts), *send.shape[1:]), dtype=send.dtype, device=buf.device)
    dist.all_to_all_single(out, buf.contiguous(), output_split_sizes=list(recv_counts),
                           input_split_sizes=list(send_counts), group=g.pg)
    return out.to(device) if host else out


def _rows_first(kv: torch.Tensor) -> torch.Tensor:
    """(2, batch, heads_kv, rows, head_dim) viewed rows first: (rows, 2, batch, heads_kv, head_dim)."""
    return kv.permute(3, 0, 1, 2, 4)


@dataclass(frozen=True)
class GatherPath:
    """The sparse gather as a :class:`ring_impl.ring.Path` for ``plan`` (:func:`gather_plan`).
    Saved for the backward: the extended key/value block (the received rows are not sent again)."""

    cfg: RingConfig
    impl: RingAttention
    plan: GatherPlan

    def forward(self, query, key, value):
        cfg, impl, plan = self.cfg, self.impl, self.plan
        kv = impl.pack_kv(key, value)  # (2, batch, heads_kv, seq_kv, head_dim)
        rows = _rows_first(kv)
        send = rows.index_select(0, torch.cat(plan.send_rows)) if sum(plan.send_counts) else rows[:0]
        received = _all_to_all(cfg.group, send, plan.send_counts, plan.recv_counts)  # (received, 2, b, hkv, d)
        del send
        ext_rows = torch.cat([rows, received]) if received.shape[0] else rows
        if plan.order is not None:
            ext_rows = ext_rows.index_select(0, plan.order)
        ext = ext_rows.permute(1, 2, 3, 0, 4).contiguous()  # (2, batch, heads_kv, extended, head_dim)
        del kv, rows, ext_rows
        out, lse = extended_forward(impl, cfg, query, ext, plan.blocks)
        return out, lse, (query, out, lse, ext), ((key.dtype, value.dtype), key.shape[2])

    def backward(self, saved, meta, grad_out, grad_lse):
        query, out, lse, ext = saved
        cfg, impl, plan = self.cfg, self.impl, self.plan
        (dk_dtype, dv_dtype), seq = meta
        dq, dext = extended_backward(impl, cfg, query, ext, out, lse, grad_out, grad_lse, plan.blocks)
        del ext
        d_rows = _rows_first(dext)  # extended rows in global order
        if plan.order is not None:  # back to [own rows | received rows]
            unordered = torch.empty_like(d_rows)
            unordered.index_copy_(0, plan.order, d_rows)
            d_rows = unordered
        own = d_rows[:seq].contiguous()
        # The received rows' dK/dV go home; this rank's rows that others saw come back.
        back = _all_to_all(cfg.group, d_rows[seq:], plan.recv_counts, plan.send_counts)
        if back.shape[0]:
            own.index_add_(0, torch.cat(plan.send_rows), back)
        dkv = own.permute(1, 2, 3, 0, 4)  # (2, batch, heads_kv, seq_kv, head_dim)
        return dq.to(query.dtype), dkv[0].to(dk_dtype), dkv[1].to(dv_dtype)


def gather_path(query, key, cfg: RingConfig, impl: RingAttention) -> GatherPath:
    """The sparse gather's :class:`GatherPath` for a validated masked config (its plan for these shapes)."""
    g = cfg.group
    plan = gather_plan(cfg.mask, rank=g.rank, world_size=g.world_size, layout=cfg.layout, seq_q=query.shape[2],
                       seq_kv=key.shape[2], batch=cfg.mask_dims[0], heads=cfg.mask_dims[1], device=query.device)
    return GatherPath(cfg, impl, plan)
