"""The ring: forward and an explicit backward, a :class:`Path` behind one autograd Function.

Forward, on every rank, for each ring step of :func:`ring_impl.planning.plan.ring_plan`: take the
step's key/value block from the rotation (the next one is already in flight), run the local
op on each of the step's planned blocks (:mod:`ring_impl.planning.plan`), normalise its LSE and
merge into float32 (float64 for float64) accumulators with the stable sigmoid form.

Backward is explicit rather than autograd through the collectives: under causal attention
ranks skip different steps, and autograd would then never run the backward collective of a
block a rank received but did not use, while its partner waits for it. Here every rank issues
the same collectives in the same order. With the final output and LSE, each block's gradient
is exact (the FlashAttention backward): dQ stays local and accumulates; dK/dV accumulate in
the accumulation dtype and travel with their block until they are back with its owner. The
backward's own block (step 0) needs no transfer, so it covers the two that nothing else does
(:func:`backward_order`): an own step of several blocks is cut in two by kernel area, computed
before step 1 (while step 1's block travels) and after the last step (while this rank's dK/dV
accumulator travels home); an own step of one block goes last (``allgather`` at ``W >= 3``:
first, overlapping its all-gather).

One rank (W=1) holds the only key/value block: nothing is packed or rotated, the call's one
block over every row is the output itself (in its dtype, no accumulator) and its gradients
the gradients (:func:`_whole_block`), so the ring costs what its kernel costs.

Temporaries are released at the end of each step (``del``) rather than when the next step
rebinds them, so a step's kernel never runs while the previous step's partial results are
still held: per-rank memory is the algorithm's, and falls like ``1/W``.

The class :class:`RingAttention` holds the algorithm; its methods are the seams a variant
overrides (the project's meta-tests build deliberately broken rings this way).
"""

from __future__ import annotations

import itertools
import math
import operator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

import torch
from torch.autograd.function import once_differentiable

from .. import debug
from ..group import RingGroup
from ..layout import layout_runs
from ..masks import IdsCheck, StaleIds
from ..numerics.lse import normalize_lse
from ..numerics.max_logit import block_max_logit, reduce_max_logit
from ..numerics.merge import merge_into
from ..numerics.nonfinite import (
    GradientFlags,
    finite_parts,
    gradient_flags,
    poison_backward,
    poison_forward,
    poison_gradients,
)
from ..ops import AttentionOp, accumulation_dtype, block_op, call_backward, call_forward
from ..planning.plan import Block, StepPlan, masked_plan, ring_plan, with_positions
from ..transports import Link, Transport, after, get_transport
from . import heads

if TYPE_CHECKING:
    from ..masks import Mask
    from ..score_mods import ScoreMod

__all__ = [
    "Path",
    "PathFunction",
    "RingAttention",
    "RingConfig",
    "RingPath",
    "blank_hidden_rows",
    "blank_hidden_rows_grad",
    "block_lse",
    "split_kv",
]


@dataclass(frozen=True)
class RingConfig:
    """Everything a ring call needs besides tensors; plain values, fixed per call."""

    group: RingGroup
    is_causal: bool
    scale: float
    layout: str
    rotate_method: str
    op: AttentionOp
    head_chunks: int = 1  # rings run one after another over head groups (ring_impl.exchanges.heads)
    #: a ring_impl.masks.Mask on global positions (is_causal already folded in), or None
    mask: Mask | None = None
    #: (batch, heads) the mask is evaluated for (a MaskMod may depend on them)
    mask_dims: tuple[int, int] = (1, 1)
    #: the query heads [start, stop) of mask_dims this ring runs (a head chunk), or None: all
    mask_heads: tuple[int, int] | None = None
    #: plans of a mask known only by evaluating it (a MaskMod, alone or combined), made for this
    #: call before the cross-rank check (ring_impl.planning.plan.plan_ahead) and kept for its
    #: forward (and backward when small); None: no such plans kept
    plan_memo: dict | None = field(default=None, compare=False, repr=False)
    #: a ring_impl.score_mods.ScoreMod on global positions, or None; its blocks run on an op
    #: declaring OpCapabilities.score_mod, each with the global positions and heads of its rows
    score_mod: ScoreMod | None = None
    #: also compute the per-head maximum logit (ring_impl.numerics.max_logit): the forward returns
    #: it third
    max_logit: bool = False
    #: one call's dict where a one-rank forward keeps what it read of its inputs (whether all
    #: are finite) for its backward, which then reads only the gradients; None: nothing kept
    verdicts: dict | None = field(default=None, compare=False, repr=False)


def block_rows(t: torch.Tensor, rows: tuple[int, int], view: bool = False) -> torch.Tensor:
    """Rows ``[start, stop)`` of the sequence dim (2) of ``t`` (batch, heads, seq[, head_dim]) as a
    kernel's input: a contiguous tensor, or with ``view`` (the op declares
    ``capabilities.row_views``) a view with a unit stride on the last dim, which saves a copy per
    input per kernel call (1-3% of a packed-documents call at W=2, where blocks are many and
    small; benchmarks/masks.py)."""
    start, stop = rows
    part = t if start == 0 and stop == t.shape[2] else t.narrow(2, start, stop - start)
    if view and (part.stride(-1) == 1 or part.shape[-1] == 1):
        return part
    return part.contiguous()


def split_kv(kv: torch.Tensor, head_dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(key, value) views of a packed key/value tensor (:meth:`RingAttention.pack_kv`, or a block
    or accumulator of its shape): ``kv[0]``, ``kv[1]`` of a stacked ``(2, batch, heads_kv, seq,
    head_dim)``; the first ``head_dim`` columns and the rest of a ``(batch, heads_kv, seq,
    head_dim + head_dim_v)`` (value's head dim differs from key's). The sequence is dim -2 of
    either, which is how the paths that slice rows (the halo exchange, the sparse gather) index
    it."""
    if kv.dim() == 5:
        return kv[0], kv[1]
    return kv[..., :head_dim], kv[..., head_dim:]


def _gradient_inputs(grad_out, lse, grad_lse=None) -> tuple[torch.Tensor, ...]:
    """What a backward's non-finite decision reads besides query, key, value and out: grad_out,
    the LSE with -inf (rows that see nothing, which the propagation treats alike) lifted to 0,
    and grad_lse when there is one. Only finiteness is read of them: ``clamp`` keeps NaN and
    +inf, and is one kernel where ``masked_fill(isneginf(lse), 0)`` is two."""
    seen = lse.clamp(min=0.0)
    return (grad_out, seen) if grad_lse is None else (grad_out, seen, grad_lse)


def _wide_sum(t: torch.Tensor) -> torch.Tensor:
    """``t.sum()``, into float32 for 16-bit floats (whose own range a long sum leaves easily)."""
    return t.sum(dtype=torch.float32) if t.element_size() < 4 else t.sum()


def block_lse(op: AttentionOp, lse: torch.Tensor, q: torch.Tensor, **call: Any) -> torch.Tensor:
    """The LSE :func:`ring_impl.ops.call_forward` returned for ``op``, the block's queries ``q``
    (batch, heads, rows, head_dim) and its keywords ``call``, taken from the layout of the op that
    ran the block (:func:`ring_impl.ops.block_op`: ``op``, or the one that runs what ``op``
    cannot) to (batch, heads, rows). Called after the kernel, not around it: no frame is added
    between the ring and the kernel."""
    ran = block_op(op, **call)
    b, h, rows, _ = q.shape
    return normalize_lse(
        lse,
        batch=b,
        heads=h,
        seq_q=rows,
        layout=ran.capabilities.lse_layout,
        op_name=getattr(ran, "name", "math"),
    )


def _on_hidden(hidden: torch.Tensor, t: torch.Tensor, value: float) -> torch.Tensor:
    """``t`` (batch, heads, rows[, features]) with ``value`` on the ``hidden`` rows (batch, heads,
    rows)."""
    rows = hidden if t.dim() == hidden.dim() else hidden.unsqueeze(-1)
    return torch.where(rows, torch.full((), value, dtype=t.dtype, device=t.device), t)


def blank_hidden_rows(
    hidden: torch.Tensor, out: torch.Tensor, lse: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """A block's (out, lse) with its ``hidden`` rows, which see none of its keys, set to nothing:
    out 0, LSE -inf (kernels leave what they like there, LSE 0 for most).

    hidden, lse: (batch, heads, rows); out: (batch, heads, rows, head_dim_v)."""
    return _on_hidden(hidden, out, 0.0), _on_hidden(hidden, lse, float("-inf"))


def blank_hidden_rows_grad(
    hidden: torch.Tensor,
    grad_out: torch.Tensor,
    lse: torch.Tensor,
    grad_lse: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """A block backward's (grad_out, lse, grad_lse) with its ``hidden`` rows contributing
    nothing. Their final LSE may be -inf (rows that see nothing at all), which kernels would turn
    into NaN: a finite LSE (0) and zero output and LSE gradients make their terms exactly 0.

    hidden, lse, grad_lse: (batch, heads, rows); grad_out: (batch, heads, rows, head_dim_v)."""
    return (
        _on_hidden(hidden, grad_out, 0.0),
        _on_hidden(hidden, lse, 0.0),
        None if grad_lse is None else _on_hidden(hidden, grad_lse, 0.0),
    )


def _as_accumulator(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``t`` itself when it can be merged into in place (dtype ``dtype``,
    contiguous), else a copy."""
    return (
        t
        if t.dtype == dtype and t.is_contiguous()
        else t.to(dtype, memory_format=torch.contiguous_format)
    )


class RingAttention:
    """Ring attention over one process group. Stateless between calls."""

    def plan(self, cfg: RingConfig, seq_q: int, seq_kv: int) -> list[StepPlan]:
        g = cfg.group
        # The steps' blocks are Python structure (which rows, which kernel call): traced with
        # symbolic lengths (dynamic=True, or dynamo's automatic dynamic after a length change),
        # the lengths are specialised, with a guard, so another length recompiles.
        seq_q, seq_kv = operator.index(seq_q), operator.index(seq_kv)
        if cfg.mask is not None:
            plans = masked_plan(
                g.rank,
                g.world_size,
                layout=cfg.layout,
                mask=cfg.mask,
                seq_q=seq_q,
                seq_kv=seq_kv,
                batch=cfg.mask_dims[0],
                heads=cfg.mask_dims[1],
                head_span=cfg.mask_heads,
                memo=cfg.plan_memo,
                ranges=cfg.op.capabilities.row_bounds,
            )
        else:
            plans = ring_plan(
                g.rank,
                g.world_size,
                layout=cfg.layout,
                is_causal=cfg.is_causal,
                seq_q=seq_q,
                seq_kv=seq_kv,
            )
        if cfg.score_mod is None:
            return plans
        # A score_mod reads each block's global positions (the layout's, never local rows).
        w = g.world_size
        return with_positions(
            plans,
            layout_runs(cfg.layout, seq_q * w, w, g.rank),
            lambda r: layout_runs(cfg.layout, seq_kv * w, w, r),
        )

    def block_scores(self, cfg: RingConfig, q: torch.Tensor, plan: Block):
        """The call's score_mod bound to one block (ring_impl.score_mods.BlockScores: the global
        positions of its rows and columns, the global indices of its query heads), or None."""
        if cfg.score_mod is None:
            return None
        from ..score_mods import block_scores

        h0 = cfg.mask_heads[0] if cfg.mask_heads is not None else 0
        return block_scores(
            cfg.score_mod,
            batch=q.shape[0],
            heads=(h0, h0 + q.shape[1]),
            q_pos=plan.q_pos,
            kv_pos=plan.kv_pos,
            device=q.device,
        )

    def accumulation_dtype(self, dtype: torch.dtype) -> torch.dtype:
        """Dtype of the output/LSE accumulators and of
        dQ/dK/dV in flight (float32, float64 for float64)."""
        return accumulation_dtype(dtype)

    def pack_kv(self, key: torch.Tensor, value: torch.Tensor) -> torch.Tensor:
        """Key and value in one contiguous buffer, one transfer per hop: (2, batch, heads_kv,
        seq_kv, head_dim) when their head dims agree; (batch, heads_kv, seq_kv, head_dim +
        head_dim_v) side by side on the last dim when value's differs (multi-head latent
        attention), so no byte of padding travels. :func:`split_kv` takes either apart; stacked,
        each half is contiguous, so a kernel gets it without a copy."""
        if key.shape[-1] == value.shape[-1]:
            return torch.stack([key, value])
        return torch.cat([key, value], dim=-1)

    def block_forward(
        self, cfg: RingConfig, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, plan: Block
    ):
        """One block's partial (out, lse) with lse normalised to (batch, heads, rows)."""
        visible, bounds = plan.masking_on(q.device)
        scores = self.block_scores(cfg, q, plan)
        call: dict[str, Any] = {
            "is_causal": plan.is_causal,
            "scale": cfg.scale,
            "visible": visible,
            "row_bounds": bounds,
            "score_mod": scores,
        }
        out, lse = call_forward(cfg.op, q, k, v, **call)
        lse = block_lse(cfg.op, lse, q, **call)
        hidden = plan.hidden_rows_on(q.device)
        if hidden is not None:  # rows the block hides completely: nothing
            out, lse = blank_hidden_rows(hidden.expand(lse.shape), out, lse)
        return out, lse

    def block_backward(
        self, cfg: RingConfig, grad_out, q, k, v, out, lse, plan: Block, grad_lse=None
    ):
        """One block's (dq, dk, dv) for the planned rows, dk/dv with heads_kv heads.

        grad_lse (batch, heads, rows): the gradient reaching the final LSE, or None."""
        visible, bounds = plan.masking_on(q.device)
        hidden = plan.hidden_rows_on(q.device)
        if hidden is not None:  # rows the block hides completely contribute nothing
            b, h, rows, _ = q.shape
            grad_out, lse, grad_lse = blank_hidden_rows_grad(
                hidden.expand(b, h, rows), grad_out, lse, grad_lse
            )
        return call_backward(
            cfg.op,
            grad_out,
            q,
            k,
            v,
            out,
            lse,
            is_causal=plan.is_causal,
            scale=cfg.scale,
            grad_lse=grad_lse,
            visible=visible,
            row_bounds=bounds,
            score_mod=self.block_scores(cfg, q, plan),
        )

    def block_max_logit(
        self, cfg: RingConfig, q: torch.Tensor, k: torch.Tensor, plan: Block
    ) -> torch.Tensor:
        """(heads,) the largest scaled logit the block's queries see, in the accumulation dtype
        (ring_impl.numerics.max_logit: -inf for a head that sees nothing, NaN where a NaN
        reaches)."""
        visible, bounds = plan.masking_on(q.device)
        return block_max_logit(
            q,
            k,
            scale=cfg.scale,
            kind=plan.kind,
            visible=visible,
            bounds=bounds,
            dtype=self.accumulation_dtype(q.dtype),
        )

    def reduce_max_logit(self, cfg: RingConfig, local: torch.Tensor) -> torch.Tensor:
        """The group's per-head maximum of every rank's ``local`` (heads,): one all-reduce."""
        g = cfg.group
        if g.world_size == 1:
            return local
        return reduce_max_logit(local, g.pg, stage_on_host=g.stage_on_host)

    def nonfinite_forward(self, out, lse, q, k, v, plan: Block):
        """The block's (out, lse) with NaN wherever a non-finite input reaches them, whatever the
        kernel did with it (ring_impl.numerics.nonfinite)."""
        visible, bounds = plan.masking_on(q.device)
        return poison_forward(out, lse, q, k, v, plan.kind, visible, bounds=bounds)

    def nonfinite_backward(
        self, dq, dk, dv, q, k, v, out, lse, grad_out, plan: Block, grad_lse=None
    ):
        """The block's (dq, dk, dv) with NaN wherever a non-finite input reaches them."""
        visible, bounds = plan.masking_on(q.device)
        dead = plan.hidden_rows_on(q.device)
        if dead is not None:  # as block_backward: rows the block hides carry no LSE
            lse = torch.where(
                dead.expand(lse.shape), torch.zeros((), dtype=lse.dtype, device=lse.device), lse
            )
        return poison_backward(
            dq,
            dk,
            dv,
            q,
            k,
            v,
            out,
            lse,
            grad_out,
            plan.kind,
            visible,
            grad_lse=grad_lse,
            bounds=bounds,
        )

    def nonfinite_gradients(self, dq, dk, dv, flags: GradientFlags, plan: Block):
        """The block's (dq, dk, dv) with NaN wherever its rows' non-finite gradients reach them,
        the call's query, key and value being finite (``flags``: the call's, of every local
        row)."""
        visible, bounds = plan.masking_on(dq.device)
        return poison_gradients(
            dq,
            dk,
            dv,
            block_rows(flags.row_bad, plan.q_rows, view=True),
            block_rows(flags.feature_bad, plan.q_rows, view=True),
            plan.kind,
            visible,
            bounds,
        )

    def block_grads(
        self,
        cfg: RingConfig,
        block: Block,
        grad_out,
        query,
        kv: tuple[torch.Tensor, torch.Tensor],
        out,
        lse,
        grad_lse,
        finite: bool,
        flags: GradientFlags | None = None,
    ):
        """``(q_rows, dq, dk, dv)`` of one block of the backward: ``kv`` the step's (key, value),
        the other tensors the call's whole local ones; ``finite``: every input the block reads is
        finite (else the kernel runs on their finite parts and NaN goes where they reach);
        ``flags``: the call's gradients made safe, when only they may carry NaN
        (:meth:`gradient_decision`)."""
        view = cfg.op.capabilities.row_views
        # grad_lse only when there is one: variants may override block_backward without it.
        extra = {} if grad_lse is None else {"grad_lse": block_rows(grad_lse, block.q_rows, view)}
        args = (
            block_rows(grad_out, block.q_rows, view),
            block_rows(query, block.q_rows, view),
            block_rows(kv[0], block.kv_rows, view),
            block_rows(kv[1], block.kv_rows, view),
            block_rows(out, block.q_rows, view),
            block_rows(lse, block.q_rows, view),
        )
        if finite:
            return (block.q_rows, *self.block_backward(cfg, *args, block, **extra))
        if flags is not None:  # query, key and value are finite: only the gradients need care
            safe = (
                {}
                if flags.grad_lse is None
                else {"grad_lse": block_rows(flags.grad_lse, block.q_rows, view)}
            )
            dq, dk, dv = self.block_backward(
                cfg, block_rows(flags.grad_out, block.q_rows, view), *args[1:], block, **safe
            )
            return (block.q_rows, *self.nonfinite_gradients(dq, dk, dv, flags, block))
        # the kernel on finite numbers, NaN put exactly where the inputs take it
        do_, q_, k_, v_, o_, l_ = args
        dq, dk, dv = self.block_backward(
            cfg, *finite_parts(*args), block, **{n: finite_parts(t)[0] for n, t in extra.items()}
        )
        return (
            block.q_rows,
            *self.nonfinite_backward(dq, dk, dv, q_, k_, v_, o_, l_, do_, block, **extra),
        )

    def all_finite(
        self, *tensors: torch.Tensor, once: bool = False, ids: IdsCheck | None = None
    ) -> bool:
        """Whether the NaN propagation can be skipped for blocks of these inputs: every element
        finite (the propagation only ever adds NaN where a non-finite input reaches; with none it
        changes nothing), read where reading costs nothing (:meth:`reads_are_free`: on CPU) or,
        with ``once``, where the caller decides for a whole call with one read (on a GPU, a
        one-rank forward: one device sync instead of the propagation's passes over every block;
        its backward then knows its query, key and value, :meth:`gradient_decision`). Otherwise,
        and under compile, False: the blocks go through the propagation, with no data-dependent
        branch.

        ``ids``: the call's unread compare of its document ids (:class:`ring_impl.masks.IdsCheck`),
        read with the sum: StaleIds when they differ from the snapshot the call plans with."""
        if torch.compiler.is_compiling():
            return False
        if not (once or self.reads_are_free(tensors)):
            return False
        total = self.finite_sum(*tensors)
        differs = None if ids is None else ids.take()
        if differs is not None:  # (NaN where the ids differ: one read says both)
            total = total.masked_fill(differs, math.nan)
        # The sum itself is read and judged on the host: a device-side isfinite would be four
        # more kernel launches per read (aten's isfinite is abs, ne, eq and mul).
        finite = math.isfinite(total.item())
        if not finite and differs is not None and bool(differs):
            raise StaleIds()
        return finite

    def finite_sum(self, *tensors: torch.Tensor) -> torch.Tensor:
        """A 0-dim tensor on their device, not read, finite when every element of ``tensors`` is
        (and not when one is not: NaN and inf propagate through a sum, inf - inf too)."""
        # 40x faster than isfinite(t).all(). 16-bit tensors are summed into float32 (one kernel
        # still), so only a sum beyond float32's range overflows, and such finite tensors only
        # lose the shortcut. The sums are added up on the device: one read.
        total = _wide_sum(tensors[0])
        for t in tensors[1:]:
            total = total + _wide_sum(t)
        return total

    def finite_flag(self, *tensors: torch.Tensor) -> torch.Tensor:
        """Whether every element of ``tensors`` is finite, as a 0-dim bool on their device, not
        read (a multi-rank backward reads it after its first kernels: :meth:`speculates`)."""
        return torch.isfinite(self.finite_sum(*tensors))

    def reads_are_free(self, tensors) -> bool:
        """Whether reading a flag of these tensors on the host costs no device sync (on CPU)."""
        return all(t.device.type == "cpu" for t in tensors)

    def speculates(self, cfg: RingConfig, tensors) -> bool:
        """Whether a multi-rank backward whose query, key and value are known finite launches its
        first step's kernels as if ``tensors`` (its gradients) were finite and reads their flag
        (:meth:`finite_flag`) only after them, running those kernels again with the NaN
        propagation when it finds one that is not: where a read is a device sync (a GPU), so
        that the device computes while the host waits, and the next hop is already in flight.
        A one-rank call reads before its kernel instead (:meth:`forward`): with no transfer to
        wait for, a read after the launch would put everything the host does after the launch
        behind the kernel. Never under compile (a graph reads nothing) nor where reads are
        free."""
        return cfg.group.world_size > 1 and not (
            torch.compiler.is_compiling() or self.reads_are_free(tensors)
        )

    def rows_finite(
        self, query, out, grad_out, lse, grad_lse=None, *others: torch.Tensor, once: bool = False
    ) -> bool:
        """:meth:`all_finite` of a backward's row inputs (and ``others``); LSE -inf (rows that see
        nothing) counts as finite, since the propagation treats it as nothing seen too."""
        return self.all_finite(
            query, out, *_gradient_inputs(grad_out, lse, grad_lse), *others, once=once
        )

    def inputs_known_finite(self, cfg: RingConfig) -> bool | None:
        """Whether the call's query, key and value are all finite, known without a read of its
        own: every rank's (more than one rank: the cross-rank check's verdict) or this rank's
        (one rank: what its forward read, kept for the backward); None: unknown (compiled,
        head chunks of one rank)."""
        verdicts = cfg.verdicts
        if verdicts is None:
            return None
        if cfg.group.world_size > 1:
            return verdicts.get("group_finite")
        return verdicts.get("inputs_finite") if cfg.head_chunks == 1 else None

    def gradient_decision(
        self, cfg: RingConfig, query, out, lse, grad_out, grad_lse=None, kv=()
    ) -> tuple[bool, GradientFlags | None]:
        """How a backward treats non-finite numbers, decided once per call: ``(finite, flags)``.

        With query, key and value known finite (:meth:`inputs_known_finite`), only the gradients
        can carry NaN: one read (on a GPU, the backward's one device sync) says whether they are
        all finite; when they are not, ``flags`` (:class:`GradientFlags`) let every block run its
        kernel on their finite parts and put NaN where they reach. Unknown on one rank: one
        read of everything (``kv``: the key and value rows the caller holds); known not finite
        on one rank: False. More ranks otherwise: ``finite`` is the read of this rank's rows and
        ``kv`` where free, else False (a ring step then decides by the rows it receives)."""
        known = self.inputs_known_finite(cfg)
        if known:
            if torch.compiler.is_compiling():  # no read in a graph: every block propagates
                return False, None
            # One read of the gradients (a device sync on a GPU) against the flags' propagation:
            # its per-feature range counts are scans over (batch, heads, rows, head_dim), 2.5x
            # the kernel's own backward at 64k tokens on an H200 (docs/benchmarks.md).
            if self.all_finite(*_gradient_inputs(grad_out, lse, grad_lse), once=True):
                return True, None
            return False, gradient_flags(grad_out, grad_lse)
        if cfg.group.world_size == 1:  # its forward read a non-finite input, or kept nothing
            if known is None:
                return self.rows_finite(query, out, grad_out, lse, grad_lse, *kv, once=True), None
            return False, None
        return self.rows_finite(query, out, grad_out, lse, grad_lse, *kv), None

    def speculated_gradients(
        self, cfg: RingConfig, grad_out, lse, grad_lse=None
    ) -> torch.Tensor | None:
        """The unread flag (:meth:`finite_flag`) of a backward's gradients when it speculates:
        where its query, key and value are known finite and a read is a device sync
        (:meth:`speculates`), the backward launches its first kernels as if the gradients were
        finite and reads this flag after them, before anything they computed leaves the rank;
        when it finds one that is not, those kernels run again with :class:`GradientFlags`.
        None: :meth:`gradient_decision` decides before the kernels."""
        if self.inputs_known_finite(cfg) is True and self.speculates(cfg, (grad_out,)):
            return self.finite_flag(*_gradient_inputs(grad_out, lse, grad_lse))
        return None

    def transport(self, cfg: RingConfig) -> Transport:
        """The rotation method's transport (ring_impl.transports)."""
        return get_transport(cfg.rotate_method)

    def kv_rotation(self, cfg: RingConfig, kv: torch.Tensor, link: Link | None = None):
        """Source of each step's packed key/value block; ``link``: the backward's chain of
        transfers, which the dK/dV hops share."""
        return self.transport(cfg).kv_blocks(kv, cfg.group, link)

    # The backward's dK/dV accumulators, one per block, travel around the ring for every
    # transport: a block's accumulator starts (zero) on the rank after its owner at step 1,
    # collects one contribution per rank and reaches the owner with the hop after step W - 1,
    # where the owner's own (step 0) contribution is added. Three seams, in the order they run:

    def grads_arrived(
        self, cfg: RingConfig, link: Link, step: int, like: torch.Tensor
    ) -> torch.Tensor:
        """The accumulator of step ``step``'s block: zeros at step 1, else the one the last hop
        brought (``like``: zeros of its shape and dtype, made when needed)."""
        return (
            torch.zeros(like.shape, dtype=like.dtype, device=like.device)
            if step == 1
            else link.take("grad")
        )

    def pass_grads(self, cfg: RingConfig, link: Link, step: int, acc: torch.Tensor) -> None:
        """Send the accumulator on to rank + 1: with the next key/value hop when the transport's
        hops share the link, else (and after the last step, home) at once."""
        link.stage("grad", acc)
        if step == cfg.group.world_size - 1 or not self.transport(cfg).kv_hops_share_link:
            link.flush()

    def grads_home(self, cfg: RingConfig, link: Link, like: torch.Tensor) -> torch.Tensor:
        """This rank's own block's accumulator, home after its last hop."""
        return (
            link.take("grad")
            if cfg.group.world_size > 1
            else torch.zeros(like.shape, dtype=like.dtype, device=like.device)
        )

    def merge(
        self,
        out_acc: torch.Tensor,
        lse_acc: torch.Tensor,
        block_out: torch.Tensor,
        block_lse: torch.Tensor,
    ) -> None:
        merge_into(out_acc, lse_acc, block_out, block_lse)

    def forward(
        self,
        cfg: RingConfig,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
    ):
        """Local (out in the input dtype, lse in the accumulation dtype) of this rank's queries;
        with ``cfg.max_logit`` also this rank's max logit (heads,) in the accumulation dtype, the
        maximum over every ring step's blocks (not yet reduced over the group).

        query (batch, heads, seq_q, head_dim); key (batch, heads_kv, seq_kv, head_dim); value
        (batch, heads_kv, seq_kv, head_dim_v); out (batch, heads, seq_q, head_dim_v).
        """
        sq, d = query.shape[2], key.shape[-1]
        out_shape = (*query.shape[:3], value.shape[-1])
        acc = self.accumulation_dtype(query.dtype)
        out_acc: torch.Tensor | None = None
        lse_acc: torch.Tensor | None = None
        # One rank: its own key and value are the only block, nothing travels (no packed copy)
        alone = cfg.group.world_size == 1
        rotation = None if alone else self.kv_rotation(cfg, self.pack_kv(key, value))
        recorder = debug.active_recorder()
        view = cfg.op.capabilities.row_views
        plans = self.plan(cfg, sq, key.shape[2])
        # One rank decides once for its call, with its plan made: the read (a device sync on a
        # GPU) comes right before the kernel's launch, so what the host does after the launch
        # (the merge, autograd, the backward's preparation) overlaps the kernel. Read after the
        # launch, it waits for the kernel and puts all of that after it (measured on an H200:
        # docs/benchmarks.md, "Where each read goes").
        # More ranks: per step, where reads are free.
        group_finite = False
        if alone:
            verdicts = cfg.verdicts or {}
            ids = verdicts.get("ids")
            # (a ring of one inside a larger group, replicated key/value: the group's check
            # has said so already, ring_impl.api._keep_finite)
            known = ids is None and verdicts.get("inputs_finite") is True
            query_finite = known or self.all_finite(query, key, value, once=True, ids=ids)
        else:
            # every rank's query, key and value finite (the cross-rank check's verdict): no
            # block needs the propagation, whatever rotates in; else decided per step below
            group_finite = cfg.verdicts is not None and cfg.verdicts.get("group_finite") is True
            query_finite = group_finite or self.all_finite(query)
        # the running maximum over every step's blocks (a head nothing is seen of stays -inf)
        max_logit = None
        if cfg.max_logit:
            max_logit = torch.full((query.shape[1],), float("-inf"), dtype=acc, device=query.device)
        for plan in plans:
            kv = (key, value) if rotation is None else split_kv(rotation.block(plan.step), d)
            finite = (
                len(plan.blocks) > 0
                and query_finite
                and (alone or group_finite or self.all_finite(kv[0], kv[1]))
            )
            for block in plan.blocks:
                q0, q1 = block.q_rows
                q, k, v = (
                    block_rows(query, block.q_rows, view),
                    block_rows(kv[0], block.kv_rows, view),
                    block_rows(kv[1], block.kv_rows, view),
                )
                if finite:
                    block_out, block_lse = self.block_forward(cfg, q, k, v, block)
                else:  # the kernel on finite numbers, NaN put exactly where the inputs take it
                    block_out, block_lse = self.block_forward(cfg, *finite_parts(q, k, v), block)
                    block_out, block_lse = self.nonfinite_forward(
                        block_out, block_lse, q, k, v, block
                    )
                if max_logit is not None:  # from the block's own q and k: NaN goes where it reaches
                    max_logit = torch.maximum(max_logit, self.block_max_logit(cfg, q, k, block))
                del q, k, v
                if recorder is not None:
                    recorder.add(cfg.group.rank, block, block_out, block_lse)
                if out_acc is None and (q0, q1) == (0, sq):
                    # A first block over every local row (without a mask: step 0, every query
                    # sees itself or everything) becomes the accumulators, without a copy when
                    # it already has their dtype and layout; the call's only block (one rank)
                    # is the output itself, in its own dtype: nothing merges into it.
                    only = len(plans) == 1 and len(plan.blocks) == 1
                    out_acc = block_out if only else _as_accumulator(block_out, acc)
                    lse_acc = _as_accumulator(block_lse, acc)
                else:
                    if out_acc is None or lse_acc is None:  # masks: start from "nothing seen"
                        out_acc = torch.zeros(out_shape, dtype=acc, device=query.device)
                        lse_acc = torch.full(
                            query.shape[:3], float("-inf"), dtype=acc, device=query.device
                        )
                    self.merge(out_acc[:, :, q0:q1], lse_acc[:, :, q0:q1], block_out, block_lse)
                del block_out, block_lse  # not held through the next block's kernel
            del kv
        # (head chunks: each its own; compiled: nothing is read, nothing kept)
        if alone and cfg.verdicts is not None and cfg.head_chunks == 1:
            if not torch.compiler.is_compiling():
                cfg.verdicts["inputs_finite"] = query_finite
        if out_acc is None or lse_acc is None:  # a mask that hides everything from this rank's rows
            out_acc = torch.zeros(out_shape, dtype=acc, device=query.device)
            lse_acc = torch.full(query.shape[:3], float("-inf"), dtype=acc, device=query.device)
        if max_logit is not None:
            return out_acc.to(query.dtype), lse_acc, max_logit
        return out_acc.to(query.dtype), lse_acc

    def backward(self, cfg: RingConfig, grad_out, query, key, value, out, lse, grad_lse=None):
        """(dq, dk, dv) in the input dtype; shapes as query, key, value (grad_out and out:
        (batch, heads, seq_q, head_dim_v)).

        grad_lse: the gradient reaching the returned LSE (batch, heads, seq_q), or None when
        the LSE is not used. It enters every block's dS as ``P * grad_lse`` (d lse_i / d s_ij
        = p_ij), i.e. the row term ``rowsum(dO * O)`` becomes ``rowsum(dO * O) - grad_lse``.
        """
        plans = self.plan(cfg, query.shape[2], key.shape[2])
        whole = _whole_block(plans, cfg.group.world_size, query.shape[2], key.shape[2])
        # a multi-rank backward's flag, read once its first kernels are launched (speculates)
        pending = self.speculated_gradients(cfg, grad_out, lse, grad_lse)
        if pending is not None:
            finite, flags = True, None
        else:
            finite, flags = self.gradient_decision(
                cfg, query, out, lse, grad_out, grad_lse, kv=(key, value)
            )
        if whole is not None:  # one rank, one block: the kernel's gradients are the gradients
            _, dq, dk, dv = self.block_grads(
                cfg, whole, grad_out, query, (key, value), out, lse, grad_lse, finite, flags
            )
            return dq.to(query.dtype), dk.to(key.dtype), dv.to(value.dtype)
        acc = self.accumulation_dtype(query.dtype)
        dq_acc = torch.zeros(query.shape, dtype=acc, device=query.device)
        kv_local = self.pack_kv(key, value)
        if torch.compiler.is_compiling():
            # Tie the backward's key/value hops to grad_out. Without it AOT autograd's partitioner
            # sees collectives that do not depend on the tangents and moves them into the forward
            # graph, a different number on different ranks (their plans differ); a rank then
            # blocks in its forward on a send that its peer only receives in its backward. The
            # tie is an opaque op: arithmetic like `kv + 0 * grad_out.sum()` is simplified away
            # by the joint-graph passes before the partitioner runs.
            kv_local = after(kv_local, grad_out)
        # One chain of transfers carries both key/value and dK/dV hops (ring_impl.transports.Link);
        # compiled, every later transfer depends on the first, so all stay in the backward graph.
        transport = self.transport(cfg)
        link = Link(cfg.group, transport.grad_hop)
        rotation = self.kv_rotation(cfg, kv_local, link)
        like = torch.empty((), dtype=acc, device=query.device).expand(
            kv_local.shape
        )  # the accumulators' kind
        del kv_local  # the rotation holds it as long as it needs it
        # Step 0 (this rank's own block) is computed on key and value themselves, around the other
        # steps (backward_order): part first, while step 1's block travels, the rest last, while
        # the accumulator travels home; one block first or last as the transport says.
        # What moves, per step s of the loop (ring transports; allgather has no key/value hops):
        #   block(s)         takes block s, passes it on (s < W-1) with the accumulator staged last
        #   step s computed  its dQ accumulates here; its dK/dV into the accumulator of block s,
        #                    which arrived with this hop (or starts here at s = 1)
        #   pass_grads       stages that accumulator for the next hop (flushes it at s = W-1: home)
        #   grads_home       after the loop: this rank's own accumulator, plus its step-0 part
        rotation.block(0)
        alone = cfg.group.world_size == 1
        # Every rank's query, key and value finite (the forward's cross-rank verdict): whatever
        # rotates in is finite, so this rank's own gradients decide every block (a NaN in another
        # rank's gradients reaches this rank's dK/dV through the accumulators that rank
        # poisons). Else, as the forward: one rank decides once, more per step where reads are
        # free.
        group_finite = not alone and self.inputs_known_finite(cfg) is True
        order = backward_order(plans, transport.own_block_first(cfg.group.world_size))
        own = []  # this rank's contribution to its own block: added once that accumulator is home
        for plan in order:
            kv = split_kv(rotation.block(plan.step), key.shape[-1]) if plan.step else (key, value)
            for _attempt in range(2):  # again only after the speculated read finds a non-finite
                contribution = []  # (kv_rows, dk, dv) per block
                step_finite = (
                    len(plan.blocks) > 0
                    and finite
                    and (alone or group_finite or self.all_finite(kv[0], kv[1]))
                )
                for block in plan.blocks:
                    (q0, q1), dq, dk, dv = self.block_grads(
                        cfg, block, grad_out, query, kv, out, lse, grad_lse, step_finite, flags
                    )
                    dq_acc[:, :, q0:q1] += dq
                    contribution.append((block.kv_rows, dk, dv))
                    del dq, dk, dv
                if pending is None or not contribution:
                    break
                # The read, after this rank's first kernels and before their results are
                # accumulated or sent on: only this step's blocks used the gradients yet.
                finite_grads, pending = bool(pending), None
                if finite_grads:
                    break
                finite, flags = False, gradient_flags(grad_out, grad_lse)
                dq_acc.zero_()
            if plan.step == 0:
                own += contribution
            else:
                grads = self.grads_arrived(cfg, link, plan.step, like)
                _accumulate(split_kv(grads, key.shape[-1]), contribution)
                self.pass_grads(cfg, link, plan.step, grads)
                del grads
            del kv, contribution  # not held through the next step's kernel
        dk, dv = split_kv(self.grads_home(cfg, link, like), key.shape[-1])
        _accumulate((dk, dv), own)
        return dq_acc.to(query.dtype), dk.to(key.dtype), dv.to(value.dtype)


def _whole_block(plans: list[StepPlan], world_size: int, seq_q: int, seq_kv: int) -> Block | None:
    """The call's only block when one rank computes it as one kernel call over every query and
    key row (its gradients then need no accumulator), else None."""
    if world_size != 1 or len(plans) != 1 or len(plans[0].blocks) != 1:
        return None
    block = plans[0].blocks[0]
    return block if block.q_rows == (0, seq_q) and block.kv_rows == (0, seq_kv) else None


def backward_order(plans: list[StepPlan], own_first: bool) -> list[StepPlan]:
    """The order the backward computes ``plans`` (steps 0..W-1) in.

    The own block (step 0) needs no transfer, so it is what covers the two transfers nothing else
    can: the first key/value hop, which step 1 waits for, and the last dK/dV hop, which brings this
    rank's own accumulator home. An own step of several blocks is cut in two by kernel area
    (``Block.area``), the first part computed before step 1 and the rest after step W-1 (its dK/dV
    kept until the accumulator is home). Measured on packed documents at W=2 (benchmarks/masks.py),
    the first hop left exposed was 10-60 ms of a 0.31 s call. An own step of one block goes first
    or last as the transport says (``own_first``). Every rank still posts the same transfers in the
    same order: only where the compute sits between them changes."""
    own, others = plans[0], plans[1:]
    if not others:
        return list(plans)
    if len(own.blocks) < 2:
        return list(plans) if own_first else [*others, own]
    done = list(itertools.accumulate(b.area for b in own.blocks))  # area of the first i + 1 blocks
    # the cut closest to half the area, both parts non-empty (the later on a tie)
    cut = min(reversed(range(1, len(done))), key=lambda i: abs(done[i - 1] - done[-1] / 2))
    first = StepPlan(step=own.step, kv_rank=own.kv_rank, blocks=own.blocks[:cut])
    last = StepPlan(step=own.step, kv_rank=own.kv_rank, blocks=own.blocks[cut:])
    return [first, *others, last]


def _accumulate(acc: tuple[torch.Tensor, torch.Tensor], contribution) -> None:
    """Add one step's [(kv_rows, dk, dv), ...] per block to the (dK, dV) views of a packed
    accumulator (:func:`split_kv`)."""
    acc_k, acc_v = acc
    for (k0, k1), dk, dv in contribution or ():
        acc_k[:, :, k0:k1] += dk
        acc_v[:, :, k0:k1] += dv


class Path(Protocol):
    """One way of computing attention over the group for a validated call (the ring here; the
    halo exchange, ring_impl.exchanges.halo; the sparse gather, ring_impl.exchanges.kv_gather), as
    two plain functions: the autograd Function below wraps them for eager and traced calls, and
    ring_impl.compiled.masked_call as custom ops for masked calls under torch.compile."""

    def forward(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor):
        """(out in the input dtype, lse in the accumulation dtype, saved, meta): ``saved`` the
        tensors (or None) the backward needs, ``meta`` anything else it needs. A path serving a
        call with ``return_max_logit`` (the ring's, ``RingConfig.max_logit``) returns the group's
        max logit (heads,) fifth."""
        ...

    def backward(self, saved: tuple, meta, grad_out: torch.Tensor, grad_lse: torch.Tensor | None):
        """(dq, dk, dv) in the dtypes of query, key, value; ``grad_out`` zeros when only the LSE
        reaches the loss, ``grad_lse`` None when the LSE is unused."""
        ...


@dataclass(frozen=True)
class RingPath:
    """The ring (:class:`RingAttention` over ``cfg.head_chunks`` head groups) as a :class:`Path`."""

    cfg: RingConfig
    impl: RingAttention

    def forward(self, query, key, value):
        if self.cfg.max_logit:
            out, lse, local = heads.run_forward(self.impl, self.cfg, query, key, value)
            max_logit = self.impl.reduce_max_logit(self.cfg, local)
            return out, lse, (query, key, value, out, lse), None, max_logit
        if self.cfg.head_chunks == 1:  # one ring over every head: straight to it (a frame fewer)
            out, lse = self.impl.forward(self.cfg, query, key, value)
        else:
            out, lse = heads.run_forward(self.impl, self.cfg, query, key, value)
        return out, lse, (query, key, value, out, lse), None

    def backward(self, saved, meta, grad_out, grad_lse):
        query, key, value, out, lse = saved
        if self.cfg.head_chunks == 1:  # as the forward: straight to the ring
            extra = {} if grad_lse is None else {"grad_lse": grad_lse}  # (variants may lack it)
            return self.impl.backward(self.cfg, grad_out, query, key, value, out, lse, **extra)
        return heads.run_backward(
            self.impl, self.cfg, grad_out, query, key, value, out, lse, grad_lse
        )


def _release(version: str) -> tuple[int, int]:
    major, minor = version.split("+")[0].split(".")[:2]
    return int(major), int(minor)


#: Dynamo before torch 2.12 hands a zero gradient to an ``autograd.Function`` output that is an
#: intermediate the forward wrote in place or returned through a no-op ``.to()`` (the ring's
#: merged accumulators are both): compiled, dQ/dK/dV came out wrong by O(1) on torch 2.11, eager
#: right. Compiled calls there return copies (tests/ring_impl/test_compile_versions.py).
_COPY_COMPILED_OUTPUTS = _release(torch.__version__) < (2, 12)


class PathFunction(torch.autograd.Function):
    """A :class:`Path`'s out (and lse when asked for), both differentiable. The backward is
    first-order only (once_differentiable): with ``create_graph=True`` the gradients come back
    without a graph, and differentiating them again raises the same error on every rank, before
    any collective. The LSE is an output only when the caller asks for it: otherwise there is
    no LSE gradient to fold into the backward (compiled graphs materialise zeros for unused
    outputs)."""

    @staticmethod
    def forward(ctx, query, key, value, path: Path, with_lse: bool):
        out, lse, saved, meta, *max_logit = path.forward(query, key, value)
        if _COPY_COMPILED_OUTPUTS and torch.compiler.is_compiling():
            out, lse = out.clone(), lse.clone()
        ctx.save_for_backward(*saved)
        ctx.path, ctx.meta = path, meta
        ctx.out_like = (out.shape, out.dtype, out.device)
        ctx.set_materialize_grads(False)  # an unused output's gradient stays None (eager)
        ctx.with_lse = with_lse
        if not with_lse:
            ctx.mark_non_differentiable(lse)
        if max_logit:  # a third output, never differentiable (a statistic for the optimiser)
            ctx.mark_non_differentiable(max_logit[0])
            return out, lse, max_logit[0]
        return out, lse

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_out, grad_lse, _grad_max_logit=None):
        if grad_out is None:  # only the LSE reaches the loss
            shape, dtype, device = ctx.out_like
            grad_out = torch.zeros(shape, dtype=dtype, device=device)
        if not ctx.with_lse:
            # The caller dropped the LSE, so its gradient is zero; but a compiled graph hands
            # zeros, not None, whatever mark_non_differentiable says, and a zero grad_lse would
            # send kernels without an LSE gradient through the padded head dim of
            # ring_impl.ops.calls._with_lse_grad (head_dim 64 computed as 72).
            grad_lse = None
        dq, dk, dv = ctx.path.backward(ctx.saved_tensors, ctx.meta, grad_out, grad_lse)
        return dq, dk, dv, None, None
