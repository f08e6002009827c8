"""Calling an op: GQA adaptation for ops without native GQA, and the LSE's gradient for ops
that do not take it."""

from __future__ import annotations

import torch

from .contract import AttentionOp, accumulation_dtype
from .math import MathOp
from .varlen import bounds_visible

__all__ = ["block_op", "call_backward", "call_forward"]

_MATH = MathOp()


def _expand_heads(t: torch.Tensor, heads: int) -> torch.Tensor:
    group = heads // t.shape[1]
    return t if group == 1 else t.repeat_interleave(group, dim=1)


def _reduce_heads(t: torch.Tensor, heads_kv: int) -> torch.Tensor:
    b, h, s, d = t.shape
    if h == heads_kv:
        return t
    # query head h belongs to kv head h // group: sum each run of `group` consecutive heads.
    return t.reshape(b, heads_kv, h // heads_kv, s, d).sum(2)


def block_op(
    op: AttentionOp,
    *,
    is_causal: bool,
    scale: float | None,
    visible: torch.Tensor | None = None,
    row_bounds: tuple[torch.Tensor, torch.Tensor] | None = None,
    score_mod=None,
) -> AttentionOp:
    """The op that runs a block: ``op``, or the math op where ``op`` cannot run it: a masked
    block ``op`` cannot mask (row bounds count as a mask for an op that does not take them), or
    a causal block with ``scale <= 0`` on an op whose causal kernel returns NaN there
    (``causal_needs_positive_scale``). ``is_causal=True`` calls refuse or reroute that case
    before any collective; a mask's causal tiles (ring_impl.planning.tiling) reach it here, since
    the tiler, not the caller, chose the causal kernel. A block with a ``score_mod`` on an op
    without ``OpCapabilities.score_mod`` (the calls' checks refuse an op so named; this covers
    ops a variant hands over) runs on the math op too."""
    if score_mod is not None and not getattr(op.capabilities, "score_mod", False):
        return _MATH
    masked = visible is not None or (row_bounds is not None and not op.capabilities.row_bounds)
    if masked and not op.capabilities.masks:
        return _MATH
    if (
        is_causal
        and scale is not None
        and scale <= 0
        and op.capabilities.causal_needs_positive_scale
    ):
        return _MATH
    return op


def _scoring(score_mod) -> dict:
    """``{"score_mod": ...}`` for a block with one, else ``{}`` (ops without the capability
    never see the keyword)."""
    return {} if score_mod is None else {"score_mod": score_mod}


def _masking(
    op: AttentionOp,
    key: torch.Tensor,
    visible: torch.Tensor | None,
    row_bounds: tuple[torch.Tensor, torch.Tensor] | None,
) -> dict:
    """The block's mask as ``op`` takes it: ``{"row_bounds": ...}`` for an op that declares them,
    else ``{"attn_mask": ...}`` (the bounds as a dense visibility), ``{}`` for an unmasked block."""
    if row_bounds is not None:
        if op.capabilities.row_bounds:
            return {"row_bounds": row_bounds}
        return {"attn_mask": bounds_visible(*row_bounds, key.shape[2])}
    return {} if visible is None else {"attn_mask": visible}


def _resolve(
    op, query, key, value, is_causal, scale, visible, row_bounds, score_mod, grad_lse=None
) -> tuple[AttentionOp, torch.Tensor, torch.Tensor, dict]:
    """For :func:`call_forward` and :func:`call_backward`, whose arguments these are: the op that
    runs a block (:func:`block_op`), key and value with their heads expanded to
    the query's when that op lacks native GQA, and the op's keywords beyond the contract's
    (mask, score_mod). ``grad_lse``: a backward's; an op that takes none gets it folded into a
    padded head dim (:func:`_with_lse_grad`), which a mask or score_mod would need padded too,
    so such a block runs on the math op, as does one whose op cannot take the padded head dim."""
    op = block_op(
        op,
        is_causal=is_causal,
        scale=scale,
        visible=visible,
        row_bounds=row_bounds,
        score_mod=score_mod,
    )
    extra = _masking(op, key, visible, row_bounds)
    if (
        grad_lse is not None
        and not op.capabilities.lse_grad
        and ("attn_mask" in extra or score_mod is not None or not _takes_padding(op, query, value))
    ):
        op = _MATH
        extra = _masking(op, key, visible, row_bounds)
    extra.update(_scoring(score_mod))
    if not op.capabilities.gqa:
        key, value = _expand_heads(key, query.shape[1]), _expand_heads(value, query.shape[1])
    return op, key, value, extra


def call_forward(
    op: AttentionOp,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    *,
    is_causal: bool,
    scale: float,
    visible: torch.Tensor | None = None,
    row_bounds: tuple[torch.Tensor, torch.Tensor] | None = None,
    score_mod=None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``op.forward`` with key/value heads expanded only if the op lacks native GQA.

    visible: (batch or 1, heads or 1, rows, cols) bool for a masked block (True: the query sees
    the key), run by the op when it declares ``masks``, else by the math op. row_bounds: the
    block's visibility as one key range per row (``OpCapabilities.row_bounds``), given to ops
    that declare it and as ``visible`` to the others. Rows that see nothing come back however
    the kernel leaves them: the caller sets them (out 0, LSE -inf). score_mod: the block's
    ring_impl.score_mods.BlockScores, for ops declaring ``score_mod`` (else the math op runs it).
    """
    op, key, value, extra = _resolve(
        op, query, key, value, is_causal, scale, visible, row_bounds, score_mod
    )
    return op.forward(query, key, value, is_causal=is_causal, scale=scale, **extra)


def _padded_head_dims(query: torch.Tensor, value: torch.Tensor) -> tuple[int, int]:
    """(query/key, value) head dims of :func:`_with_lse_grad`'s padded call."""
    d, d_v = query.shape[-1], value.shape[-1]
    padded = -(-(d_v + 2) // 8) * 8
    return (padded if d == d_v else d), padded


def _takes_padding(op: AttentionOp, query: torch.Tensor, value: torch.Tensor) -> bool:
    """Whether ``op`` runs the padded head dims :func:`_with_lse_grad` hands it."""
    padded_qk, padded = _padded_head_dims(query, value)
    caps = op.capabilities
    return caps.unsupported(query.device, query.dtype, padded_qk, head_dim_v=padded) is None


def _with_lse_grad(
    op, grad_out, query, key, value, out, lse, grad_lse, *, is_causal, scale, row_bounds=None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``op.backward`` with the LSE's gradient folded into ``out``, for kernels that take none.

    The LSE's gradient ``g`` enters the backward as ``dS = P * (dP - (D - g))`` with
    ``D = rowsum(dO * O)``, and flash-style kernels read ``out`` only to form ``D``. Padding
    the head dim with extra columns where value and the key/query are 0, the output gradient
    is 1 and the output is ``-g`` (in two parts, high and low, so a 16-bit dtype carries ``g``
    to about its square precision) gives ``D' = D - g`` and leaves ``dP``, and the real
    columns of dQ, dK, dV, unchanged. Padded to a multiple of 8 columns (what fused kernels
    want; :func:`_resolve` sends a block whose op cannot take them to the math op).
    ``row_bounds``: a ``ranges`` block's, handed to the op (row ranges do not change with the
    head dim). The columns go on value's side (value, out, grad_out); query and key get zero
    columns too only when their head dim equals value's (kernels that need them equal), else
    they stay as they are (an op declaring ``value_head_dim``).
    """
    d, d_v = query.shape[-1], value.shape[-1]
    padded_qk, padded = _padded_head_dims(query, value)
    acc = accumulation_dtype(query.dtype)
    g = -grad_lse.to(acc)
    g_hi = g.to(query.dtype)
    g_lo = (g - g_hi.to(acc)).to(query.dtype)

    def pad(t: torch.Tensor, to: int, fill: list[torch.Tensor] | None = None) -> torch.Tensor:
        cols = [c.unsqueeze(-1) for c in fill or []]
        if to == t.shape[-1]:
            return t
        zeros = t.new_zeros(*t.shape[:-1], to - t.shape[-1] - len(cols))
        return torch.cat([t, *[c.to(t.dtype) for c in cols], zeros], dim=-1)

    ones = torch.ones_like(grad_lse, dtype=grad_out.dtype)
    ranges = {} if row_bounds is None else {"row_bounds": row_bounds}
    dq, dk, dv = op.backward(
        pad(grad_out, padded, [ones, ones]),
        pad(query, padded_qk),
        pad(key, padded_qk),
        pad(value, padded),
        pad(out, padded, [g_hi, g_lo]),
        lse,
        is_causal=is_causal,
        scale=scale,
        **ranges,
    )
    return dq[..., :d], dk[..., :d], dv[..., :d_v]


def call_backward(
    op: AttentionOp,
    grad_out: torch.Tensor,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    *,
    is_causal: bool,
    scale: float,
    grad_lse: torch.Tensor | None = None,
    visible: torch.Tensor | None = None,
    row_bounds: tuple[torch.Tensor, torch.Tensor] | None = None,
    score_mod=None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``op.backward`` with GQA expansion, returning dk/dv with ``heads_kv`` heads.

    grad_lse (batch, heads, seq_q) or None: the gradient reaching the LSE; given to ops that
    declare ``lse_grad``, folded into ``out`` for the others (:func:`_with_lse_grad`).
    visible, row_bounds: as for :func:`call_forward` (rows that see nothing must come with a
    finite LSE and a zero output gradient: the caller's job). score_mod: as for
    :func:`call_forward`.
    """
    heads_kv = key.shape[1]
    op, key, value, extra = _resolve(
        op, query, key, value, is_causal, scale, visible, row_bounds, score_mod, grad_lse
    )
    args = (grad_out, query, key, value, out, lse)
    if grad_lse is None or op.capabilities.lse_grad:
        if grad_lse is not None:
            extra["grad_lse"] = grad_lse  # the op declares lse_grad: it takes the keyword
        dq, dk, dv = op.backward(*args, is_causal=is_causal, scale=scale, **extra)
    else:  # extra: nothing, or row bounds (the padded head dim leaves them as they are)
        dq, dk, dv = _with_lse_grad(op, *args, grad_lse, is_causal=is_causal, scale=scale, **extra)
    return dq, _reduce_heads(dk, heads_kv), _reduce_heads(dv, heads_kv)
