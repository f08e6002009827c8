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
           extended key/value block, cut by :mod:`ring_impl.planning.tiling` into exact kernel calls
           as a ring step's (a document split across ranks becomes one causal call again). The
           calls on the rank's own rows alone run while the rows travel, the rest after.
backward   the kernel's backward on the same block (the received rows were kept from the
           forward, not sent again), the calls on received rows first; dQ stays; the received
           rows' dK/dV go home in one ``all_to_all_single`` in the accumulation dtype (float32,
           float64 for float64: the ring's accumulators) while the calls on own rows alone run,
           and are added to the owner's own rows before the cast to the input dtype.

Every rank calls both all-to-alls, with zero rows where it has nothing to send. Key/value bytes
are the minimum of any exchange (each row a receiver's queries see, once); the ring's are
``(W - 1) S`` rows per rank forward and again backward. What it costs: the received rows held
from forward to backward; a transfer is overlapped only by the calls on own rows (under a
balanced layout, the documents whole on the rank).
:func:`ring_impl.schedule.kv_gather.gather_schedule` declares the collectives per rank.

Any layout, any mask (a head-dependent one: the union over heads travels), ``seq_q != seq_kv``
when not causal, W >= 2. ``rotate_method`` and ``head_chunks`` do not apply (there is no ring).
The ring's seams (``pack_kv``, ``block_forward``, ``block_backward``, the NaN propagation) run
the blocks, as on the halo path (:func:`ring_impl.exchanges.halo.extended_forward`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from ..group import as_device
from ..layout import layout_runs
from ..numerics.nonfinite import gradient_flags
from ..planning.plan import Block, cached_by_mask, visibility_blocks
from .halo import extended_backward, extended_forward
from .ring import RingAttention, RingConfig, split_kv

__all__ = [
    "GatherPath",
    "GatherPlan",
    "gather_path",
    "gather_plan",
    "gather_refusal",
]


def gather_refusal(mask, *, world_size: int, head_chunks: int, strategy: str) -> str | None:
    """Why the sparse gather (``exchange="gather"``, alias ``sparse_kv=True``) cannot serve a
    call, or None."""
    if mask is None:
        return (
            "exchange='gather' (sparse_kv=True) needs a mask (without one every query sees every "
            "key: the ring serves it)"
        )
    if strategy != "ring":
        return f"exchange='gather' (sparse_kv=True) runs alone, not with strategy {strategy!r}"
    if head_chunks != 1:
        return (
            "exchange='gather' (sparse_kv=True) sends no blocks around a ring for head_chunks to "
            f"split; pass head_chunks=1, got {head_chunks}"
        )
    return None


@dataclass(frozen=True)
class GatherPlan:
    """What one rank sends and receives, and its kernel calls.

    ``send_rows[t]``: this rank's local key/value rows (ascending) that rank ``t``'s queries see
    (empty for itself); ``send_index`` all of them, in rank order (what the all-to-all sends).
    ``recv_counts[s]``: rows received from rank ``s`` (0 for itself), in rank order.
    The extended block holds this rank's own rows and the received ones in global position
    order: ``own_at``/``received_at`` are the extended rows that hold them. ``blocks``: local
    query rows x extended rows, those on this rank's own rows alone first (``own_blocks`` of
    them: computed while the rows travel).
    """

    send_rows: tuple[torch.Tensor, ...]
    send_index: torch.Tensor
    recv_counts: tuple[int, ...]
    blocks: tuple[Block, ...]
    own_blocks: int
    own_at: torch.Tensor
    received_at: torch.Tensor

    @property
    def send_counts(self) -> tuple[int, ...]:
        return tuple(int(t.numel()) for t in self.send_rows)


def _positions(layout: str, length: int, world_size: int, rank: int) -> torch.Tensor:
    return torch.cat(
        [torch.arange(a, b) for a, b in layout_runs(layout, length * world_size, world_size, rank)]
    )


def _seen_rows(
    mask, q_pos: torch.Tensor, kv_pos: torch.Tensor, batch: int, heads: int, device
) -> torch.Tensor:
    """Local indices (ascending) of the keys at ``kv_pos`` that some query at ``q_pos`` sees,
    for some batch entry and head (the mask evaluated on ``device``, the inputs')."""
    from ..masks import visibility

    vis = visibility(mask, q_pos, kv_pos, batch=batch, heads=heads, device=device)
    return vis.any(-2).flatten(0, 1).any(0).nonzero().flatten()


def gather_plan(
    mask,
    *,
    rank: int,
    world_size: int,
    layout: str,
    seq_q: int,
    seq_kv: int,
    batch: int,
    heads: int,
    device: torch.device | None = None,
) -> GatherPlan:
    """The :class:`GatherPlan` of ``rank`` (``seq_q``/``seq_kv``: local lengths). Costs ``2W - 1``
    mask evaluations of a shard against a shard; cached by mask digest as the ring's plans are."""
    device = as_device(device)

    def build() -> GatherPlan:
        from ..masks import visibility

        q_pos = [_positions(layout, seq_q, world_size, r) for r in range(world_size)]
        kv_pos = [_positions(layout, seq_kv, world_size, r) for r in range(world_size)]
        empty = torch.zeros(0, dtype=torch.int64)
        send = tuple(
            empty if t == rank else _seen_rows(mask, q_pos[t], kv_pos[rank], batch, heads, device)
            for t in range(world_size)
        )
        recv = tuple(
            empty if s == rank else _seen_rows(mask, q_pos[rank], kv_pos[s], batch, heads, device)
            for s in range(world_size)
        )
        ext_pos = torch.cat([kv_pos[rank]] + [kv_pos[s][recv[s]] for s in range(world_size)])
        order = torch.argsort(ext_pos, stable=True)  # extended row -> its [own | received] row
        vis = visibility(mask, q_pos[rank], ext_pos[order], batch=batch, heads=heads, device=device)
        at = torch.argsort(order)  # [own | received] row -> its extended row
        own_row = order < seq_kv  # extended row -> whether it is one of this rank's own
        own: list[Block] = []
        remote: list[Block] = []
        for b in visibility_blocks(vis, 0, rank, device):
            (own if bool(own_row[b.kv_rows[0] : b.kv_rows[1]].all()) else remote).append(b)
        return GatherPlan(
            send_rows=tuple(t.to(device) for t in send),
            send_index=torch.cat(send).to(device),
            recv_counts=tuple(int(t.numel()) for t in recv),
            blocks=(*own, *remote),
            own_blocks=len(own),
            own_at=at[:seq_kv].to(device),
            received_at=at[seq_kv:].to(device),
        )

    # The layouts' runs, not only its name: a layout
    # registered again under the same name is replanned.
    key = (
        "gather",
        rank,
        world_size,
        layout,
        seq_q,
        seq_kv,
        batch,
        heads,
        str(device),
        *(
            tuple(layout_runs(layout, n * world_size, world_size, r) for r in range(world_size))
            for n in (seq_q, seq_kv)
        ),
    )
    return cached_by_mask(mask, key, build)


class _Exchange:
    """An ``all_to_all_single`` in flight: rows-first ``send`` (rows, ...) split by ``send_counts``
    over the ranks; :meth:`result` waits and returns the rows received, split by ``recv_counts``.
    Host copies on gloo with CUDA tensors."""

    def __init__(self, g, send: torch.Tensor, send_counts, recv_counts):
        self._device = send.device
        self._host = g.stage_on_host and self._device.type != "cpu"
        self._send: torch.Tensor | None = (send.cpu() if self._host else send).contiguous()
        self._out = torch.empty(
            (sum(recv_counts), *send.shape[1:]), dtype=send.dtype, device=self._send.device
        )
        self._work = dist.all_to_all_single(
            self._out,
            self._send,
            output_split_sizes=list(recv_counts),
            input_split_sizes=list(send_counts),
            group=g.pg,
            async_op=True,
        )

    def result(self) -> torch.Tensor:
        self._work.wait()
        self._send = None
        return self._out.to(self._device) if self._host else self._out


def _rows_first(kv: torch.Tensor) -> torch.Tensor:
    """A packed key/value tensor (rows on dim -2, ring_impl.exchanges.ring.split_kv) viewed rows
    first: (rows, 2, batch, heads_kv, head_dim) or (rows, batch, heads_kv, head_dim +
    head_dim_v)."""
    return kv.movedim(-2, 0)


@dataclass(frozen=True)
class GatherPath:
    """The sparse gather as a :class:`ring_impl.exchanges.ring.Path` for ``plan``
    (:func:`gather_plan`). Saved for the backward: the extended key/value block (the received rows
    are not sent again)."""

    cfg: RingConfig
    impl: RingAttention
    plan: GatherPlan

    def forward(self, query, key, value):
        cfg, impl, plan = self.cfg, self.impl, self.plan
        kv = impl.pack_kv(key, value)  # rows on dim -2 (ring_impl.exchanges.ring.split_kv)
        rows = _rows_first(kv)
        send = rows.index_select(0, plan.send_index)
        exchange = _Exchange(cfg.group, send, plan.send_counts, plan.recv_counts)
        del send, rows
        # The extended block (kv's shape with ``extended`` rows), rows in global order: the own
        # rows now, the blocks on them alone computed while the received rows travel.
        n_ext = key.shape[2] + sum(plan.recv_counts)
        ext = kv.new_empty((*kv.shape[:-2], n_ext, kv.shape[-1]))
        ext.index_copy_(ext.dim() - 2, plan.own_at, kv)
        del kv
        own, remote = plan.blocks[: plan.own_blocks], plan.blocks[plan.own_blocks :]
        # every rank's finite (the group's verdict), or read where that is free
        known = impl.inputs_known_finite(cfg) is True
        finite = known or impl.all_finite(query, key, value)
        out, lse = extended_forward(impl, cfg, query, ext, own, finite=finite, result=False)
        received = exchange.result()  # rows first (_rows_first)
        if received.shape[0]:
            ext.index_copy_(ext.dim() - 2, plan.received_at, received.movedim(0, -2))
        finite = finite and (known or impl.all_finite(received))
        del received
        out, lse = extended_forward(impl, cfg, query, ext, remote, finite=finite, into=(out, lse))
        return out, lse, (query, out, lse, ext), (key.dtype, value.dtype, key.shape[-1])

    def backward(self, saved, meta, grad_out, grad_lse):
        query, out, lse, ext = saved
        cfg, impl, plan = self.cfg, self.impl, self.plan
        dk_dtype, dv_dtype, head_dim = meta
        own, remote = plan.blocks[: plan.own_blocks], plan.blocks[plan.own_blocks :]
        pending = impl.speculated_gradients(cfg, grad_out, lse, grad_lse)
        if pending is None:
            finite, flags = impl.gradient_decision(
                cfg, query, out, lse, grad_out, grad_lse, kv=(ext,)
            )
        else:  # the kernels first, the gradients' flag read before their results are sent
            finite, flags = True, None
        # The blocks on received rows first: their dK/dV go home while the own blocks compute.
        inputs = (impl, cfg, query, ext, out, lse, grad_out, grad_lse, remote)
        dq, dext = extended_backward(*inputs, finite=finite, flags=flags)
        if pending is not None and not bool(pending):
            finite, flags = False, gradient_flags(grad_out, grad_lse)
            dq, dext = extended_backward(*inputs, finite=finite, flags=flags)
        del inputs
        rows = dext.dim() - 2
        d_received = _rows_first(dext.index_select(rows, plan.received_at))
        exchange = _Exchange(cfg.group, d_received, plan.recv_counts, plan.send_counts)
        del d_received
        dq, dext = extended_backward(
            impl,
            cfg,
            query,
            ext,
            out,
            lse,
            grad_out,
            grad_lse,
            own,
            finite=finite,
            flags=flags,
            into=(dq, dext),
        )
        del ext
        dkv = dext.index_select(rows, plan.own_at)  # pack_kv's shape, seq_kv rows
        del dext
        back = exchange.result()  # this rank's rows that others saw: their dK/dV, rows first
        if back.shape[0]:
            dkv.index_add_(rows, plan.send_index, back.movedim(0, -2))
        dk, dv = split_kv(dkv, head_dim)
        return dq.to(query.dtype), dk.to(dk_dtype), dv.to(dv_dtype)


def gather_path(query, key, cfg: RingConfig, impl: RingAttention) -> GatherPath:
    """The sparse gather's :class:`GatherPath` for a validated masked config
    (its plan for these shapes)."""
    g = cfg.group
    plan = gather_plan(
        cfg.mask,
        rank=g.rank,
        world_size=g.world_size,
        layout=cfg.layout,
        seq_q=query.shape[2],
        seq_kv=key.shape[2],
        batch=cfg.mask_dims[0],
        heads=cfg.mask_dims[1],
        device=query.device,
    )
    return GatherPath(cfg, impl, plan)
