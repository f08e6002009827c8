"""Attention in float64: the oracle every verdict rests on.

Shape names used throughout:
    query: (batch, heads, seq_q, head_dim)
    key:   (batch, heads_kv, seq_k, head_dim)
    value: (batch, heads_kv, seq_k, head_dim_v)   (head_dim_v is usually head_dim)
    out:   (batch, heads, seq_q, head_dim_v)
    lse:   (batch, heads, seq_q)

GQA: query head h reads key/value head h // (heads // heads_kv), the mapping of torch SDPA
`enable_gqa=True` and of `repeat_interleave` on the head dim.
Causal: top-left aligned like torch SDPA `is_causal=True`: query i sees key j iff j <= i.
LSE: the natural-log logsumexp over keys of the scaled, masked scores.

This module is kept deliberately plain (one matmul, one softmax, one matmul) so that it can be
trusted by reading; everything else in reference/ is built on `masked_attention`.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import torch
from torch import Tensor

__all__ = [
    "AttentionOutput",
    "ReferenceResult",
    "attention",
    "attention_grads",
    "causal_visibility",
    "default_scale",
    "expand_kv_heads",
    "masked_attention",
    "max_logit",
    "nonfinite_reach",
]


class AttentionOutput(NamedTuple):
    """out: (batch, heads, seq_q, head_dim_v) float64; lse: (batch, heads, seq_q) float64."""

    out: Tensor
    lse: Tensor


class ReferenceResult(NamedTuple):
    """Forward and gradients of the float64 reference, all float64.

    out: (batch, heads, seq_q, head_dim_v); lse: (batch, heads, seq_q);
    dq: (batch, heads, seq_q, head_dim); dk: (batch, heads_kv, seq_k, head_dim);
    dv: (batch, heads_kv, seq_k, head_dim_v); dsinks: (heads,) when sinks were given.
    """

    out: Tensor
    lse: Tensor
    dq: Tensor
    dk: Tensor
    dv: Tensor
    dsinks: Tensor | None = None


def default_scale(head_dim: int) -> float:
    """The softmax scale torch SDPA uses when none is given: 1 / sqrt(head_dim)."""
    return 1.0 / math.sqrt(head_dim)


def check_shapes(query: Tensor, key: Tensor, value: Tensor) -> None:
    """Raise ValueError unless query/key/value have the shapes described in the module docstring."""
    if query.dim() != 4 or key.dim() != 4 or value.dim() != 4:
        raise ValueError(
            "attention expects 4-d tensors (batch, heads, seq, head_dim); got query "
            f"{tuple(query.shape)}, key {tuple(key.shape)}, value {tuple(value.shape)}"
        )
    if key.shape[:3] != value.shape[:3]:
        raise ValueError(
            f"key {tuple(key.shape)} and value {tuple(value.shape)} must agree on "
            "(batch, heads_kv, seq_k)"
        )
    if query.shape[0] != key.shape[0] or query.shape[3] != key.shape[3]:
        raise ValueError(
            f"query {tuple(query.shape)} and key {tuple(key.shape)} must agree on batch and "
            "head_dim"
        )
    heads, heads_kv = query.shape[1], key.shape[1]
    if heads_kv == 0 or heads % heads_kv != 0:
        raise ValueError(
            f"query heads ({heads}) must be a multiple of key/value heads ({heads_kv}) for GQA"
        )


def expand_kv_heads(kv: Tensor, heads: int) -> Tensor:
    """(batch, heads_kv, seq_k, d) -> (batch, heads, seq_k, d), query head h reading kv head
    h // (heads // heads_kv). repeat_interleave, so autograd sums the groups back into dk/dv."""
    return kv.repeat_interleave(heads // kv.shape[1], dim=1)


def causal_visibility(q_positions: Tensor, k_positions: Tensor) -> Tensor:
    """(seq_q,), (seq_k,) global positions -> (seq_q, seq_k) bool: query i sees key j iff
    position(j) <= position(i). With positions arange(seq_q), arange(seq_k) this is torch SDPA's
    top-left `is_causal=True` mask."""
    return k_positions[None, :] <= q_positions[:, None]


def nonfinite_reach(
    query: Tensor,
    key: Tensor,
    value: Tensor,
    grad_out: Tensor | None = None,
    visible: Tensor | None = None,
) -> dict[str, Tensor]:
    """Which results a non-finite input reaches: bool masks of the shapes of out, lse (and dq,
    dk, dv with grad_out), True where the result depends on a NaN/inf input.

    The rule is dependency through the visibility, not what some arithmetic happens to do (a
    matmul multiplies a masked-out weight 0 by a NaN value and gets NaN; the result does not
    depend on that value): row i's scores depend on query i and the keys it sees; out[i, d] on
    those and on feature d of the values it sees; the LSE on the scores. dQ[i] depends on row i's
    scores, its output and output gradient (D = rowsum(dO * O)) and every value it sees (dP);
    dK[j] on every row that sees key j, through dQ's dependencies; dV[j, d] on the scores of
    every row that sees j and on feature d of their output gradients. A row that sees no key
    depends on nothing: its output is 0, its LSE -inf and its dQ 0, whatever its query and
    output gradient hold.
    """
    q, k, v = query, expand_kv_heads(key, query.shape[1]), expand_kv_heads(value, query.shape[1])
    vis = (
        torch.ones(q.shape[-2], k.shape[-2], dtype=torch.float64)
        if visible is None
        else visible.to(torch.float64)
    )
    vis = vis.to(q.device)

    def seen(flags: Tensor) -> Tensor:  # flags over keys (b, h, sk[, d]) -> does row i see one
        f = flags.to(torch.float64)
        return (vis @ f if f.dim() == 4 else (vis @ f.unsqueeze(-1)).squeeze(-1)) > 0

    def seen_by(flags: Tensor) -> Tensor:  # flags over rows (b, h, sq[, d]) -> is key j seen by one
        f = flags.to(torch.float64)
        vt = vis.transpose(-2, -1)
        return (vt @ f if f.dim() == 4 else (vt @ f.unsqueeze(-1)).squeeze(-1)) > 0

    def to_kv_heads(flags: Tensor) -> Tensor:  # any over each GQA group
        b, h = flags.shape[:2]
        hkv = key.shape[1]
        return flags.reshape(b, hkv, h // hkv, *flags.shape[2:]).any(2)

    bad_v = ~torch.isfinite(v)
    # A row that sees no key has out 0 and LSE -inf whatever its query and output gradient hold.
    sees = vis.sum(-1) > 0  # (seq_q,) or broadcastable to (b, h, seq_q)
    row = ((~torch.isfinite(q)).any(-1) & sees) | seen((~torch.isfinite(k)).any(-1))
    reach = {"out": row.unsqueeze(-1) | seen(bad_v), "lse": row}
    if grad_out is None:
        return reach
    bad_do = ~torch.isfinite(grad_out)
    row_grad = row | (bad_do.any(-1) & sees) | seen(bad_v.any(-1))
    reach["dq"] = row_grad.unsqueeze(-1).expand(query.shape)
    reach["dk"] = to_kv_heads(seen_by(row_grad)).unsqueeze(-1).expand(key.shape)
    reach["dv"] = to_kv_heads(seen_by(row.unsqueeze(-1) | bad_do))
    return reach


def _finite(t: Tensor) -> Tensor:
    """t with its non-finite entries replaced by 0 (see nonfinite_reach for where they go)."""
    return torch.where(torch.isfinite(t), t, torch.zeros((), dtype=t.dtype, device=t.device))


def masked_attention(
    query: Tensor,
    key: Tensor,
    value: Tensor,
    visible: Tensor | None = None,
    *,
    scale: float | None = None,
    sinks: Tensor | None = None,
    score_mod: dict | None = None,
) -> AttentionOutput:
    """Attention in float64 with an arbitrary visibility mask and optional attention sinks.

    query (batch, heads, seq_q, head_dim), key (batch, heads_kv, seq_k, head_dim),
    value (batch, heads_kv, seq_k, head_dim_v); visible: bool (seq_q, seq_k) or broadcastable
    to (batch, heads, seq_q, seq_k), None = all visible; sinks: (heads,) logits of one extra
    softmax term per head that every row sees and that has no value (its probability mass is
    taken from the keys and goes nowhere), None = no sink; score_mod: a plain-data score change
    (reference.score_mods) applied to the scaled scores before the mask, None = none.
    Returns out (batch, heads, seq_q, head_dim_v) and lse (batch, heads, seq_q), float64; the LSE
    includes the sink term. A row that sees no key gets out 0 and lse -inf (the neutral element
    of the LSE merge), or lse = its sink logit with a sink.
    Non-finite inputs give NaN exactly where they reach (:func:`nonfinite_reach`).
    Differentiable in query, key, value and sinks.
    """
    check_shapes(query, key, value)
    reach = nonfinite_reach(query, key, value, visible=visible)
    q = _finite(query.to(torch.float64))
    k = expand_kv_heads(_finite(key.to(torch.float64)), q.shape[1])
    v = expand_kv_heads(_finite(value.to(torch.float64)), q.shape[1])
    scale = default_scale(q.shape[-1]) if scale is None else float(scale)

    scores = torch.matmul(q, k.transpose(-2, -1)) * scale  # (batch, heads, seq_q, seq_k)
    if score_mod is not None:  # the scaled scores, before the mask; the whole sequence's positions
        from reference.score_mods import apply_score_mod

        scores = apply_score_mod(score_mod, scores)
    if visible is not None:
        try:
            ok = (
                visible.dtype == torch.bool
                and torch.broadcast_shapes(visible.shape, scores.shape) == scores.shape
            )
        except RuntimeError:
            ok = False
        if not ok:
            raise ValueError(
                "visible must be a bool mask of shape (seq_q, seq_k) or broadcastable to (batch, "
                f"heads, seq_q, seq_k) = {tuple(scores.shape)}; got {visible.dtype} of shape "
                f"{tuple(visible.shape)}"
            )
        scores = scores.masked_fill(~visible.to(scores.device), -math.inf)
    sink = None
    if sinks is not None:
        if sinks.shape != (q.shape[1],):
            raise ValueError(
                f"sinks must have shape (heads,) = ({q.shape[1]},), got {tuple(sinks.shape)}"
            )
        sink = sinks.to(torch.float64).view(1, -1, 1, 1).expand(*scores.shape[:-1], 1)

    # Subtracting the row max keeps exp() in range for any logit size (scores of 1e4 and more).
    # The shift cancels mathematically, so it is detached: autograd sees plain softmax.
    row_max = scores.amax(dim=-1, keepdim=True).detach()
    if sink is not None:
        row_max = torch.maximum(row_max, sink.detach())
    row_max = torch.where(torch.isfinite(row_max), row_max, torch.zeros_like(row_max))
    weights = torch.exp(scores - row_max)  # masked entries: exp(-inf) = 0
    denom = weights.sum(dim=-1, keepdim=True)
    if sink is not None:
        denom = denom + torch.exp(sink - row_max)  # the sink's share of the row: no value
    seen = denom > 0
    # Rows that see nothing: out = 0 / 1 = 0 rather than 0 / 0; lse = log(0) = -inf.
    out = torch.matmul(weights, v) / torch.where(seen, denom, torch.ones_like(denom))
    lse = (row_max + torch.log(denom)).squeeze(-1)
    nan = torch.full((), math.nan, dtype=torch.float64, device=out.device)
    return AttentionOutput(torch.where(reach["out"], nan, out), torch.where(reach["lse"], nan, lse))


def attention(
    query: Tensor,
    key: Tensor,
    value: Tensor,
    *,
    is_causal: bool = False,
    scale: float | None = None,
    visible: Tensor | None = None,
    sinks: Tensor | None = None,
    score_mod: dict | None = None,
) -> AttentionOutput:
    """Float64 attention with LSE, whatever the input dtype (inputs are upcast exactly).

    query (batch, heads, seq_q, head_dim), key (batch, heads_kv, seq_k, head_dim),
    value (batch, heads_kv, seq_k, head_dim_v) -> out (batch, heads, seq_q, head_dim_v),
    lse (batch, heads, seq_q), both float64. visible / sinks / score_mod: as for masked_attention
    (e.g. a
    mask spec's visibility from reference.masks). is_causal is top-left aligned (query i sees keys
    0..i), scale defaults to 1 / sqrt(head_dim). Callers pass the dtype-rounded inputs the
    kernel under test saw, so the only difference left is the kernel's arithmetic.
    """
    if is_causal:
        if visible is not None:
            raise ValueError("pass either is_causal=True or visible (a causal mask spec), not both")
        device = query.device
        visible = causal_visibility(
            torch.arange(query.shape[-2], device=device), torch.arange(key.shape[-2], device=device)
        )
    return masked_attention(
        query, key, value, visible, scale=scale, sinks=sinks, score_mod=score_mod
    )


def attention_grads(
    query: Tensor,
    key: Tensor,
    value: Tensor,
    grad_out: Tensor,
    *,
    is_causal: bool = False,
    scale: float | None = None,
    grad_lse: Tensor | None = None,
    visible: Tensor | None = None,
    sinks: Tensor | None = None,
    score_mod: dict | None = None,
) -> ReferenceResult:
    """Forward and float64 autograd gradients of `attention` for the loss
    (out * grad_out).sum() + (lse * grad_lse).sum().

    query (batch, heads, seq_q, head_dim), key (batch, heads_kv, seq_k, head_dim),
    value (batch, heads_kv, seq_k, head_dim_v), grad_out (batch, heads, seq_q, head_dim_v),
    grad_lse (batch, heads, seq_q) or None (the LSE is not part of the loss); visible / sinks /
    score_mod as for masked_attention.
    Returns out, lse, dq (shape of query), dk (shape of key: heads_kv heads, GQA groups summed),
    dv (shape of value), dsinks ((heads,), with sinks), all float64.
    """
    # Finite copies as the leaves (non-finite entries as 0): a gradient entry then never passes
    # through the replacement, so dV at a non-finite value is P^T dO as everywhere else.
    q, k, v = (
        _finite(t.detach().to(torch.float64)).requires_grad_(True) for t in (query, key, value)
    )
    sk = None if sinks is None else sinks.detach().to(torch.float64).requires_grad_(True)
    if is_causal:
        if visible is not None:
            raise ValueError("pass either is_causal=True or visible (a causal mask spec), not both")
        visible = causal_visibility(torch.arange(query.shape[-2]), torch.arange(key.shape[-2]))
    reach = nonfinite_reach(query, key, value, grad_out, visible)
    grad_out = _finite(grad_out.detach().to(torch.float64))
    with torch.enable_grad():
        # The gradients of finite copies, NaN where a non-finite input reaches (nonfinite_reach).
        out, lse = masked_attention(q, k, v, visible, scale=scale, sinks=sk, score_mod=score_mod)
        if grad_out.shape != out.shape:
            raise ValueError(
                f"grad_out has shape {tuple(grad_out.shape)}, expected the output's "
                f"{tuple(out.shape)}"
            )
        lse_term: Tensor | float = 0.0
        if grad_lse is not None:
            if grad_lse.shape != lse.shape:
                raise ValueError(
                    f"grad_lse has shape {tuple(grad_lse.shape)}, expected the LSE's "
                    f"{tuple(lse.shape)}"
                )
            # Rows that see nothing have LSE -inf and no gradient: keep 0 * -inf out of the loss.
            used = torch.isfinite(lse) & ~reach["lse"]
            lse_term = (
                torch.where(used, lse, torch.zeros_like(lse))
                .mul(_finite(grad_lse.to(torch.float64)))
                .sum()
            )
        # The loss of the finite copies: every gradient entry no non-finite input reaches
        # (nonfinite_reach) is then the exact one. dV never depends on a value, so the rows whose
        # output a non-finite value reaches still count in it (dV = P^T dO).
        loss = (out * grad_out).sum() + lse_term
        dq, dk, dv = torch.autograd.grad(
            loss, (q, k, v), retain_graph=sk is not None, allow_unused=True
        )
        dsinks = None
        if sk is not None:  # its gradient leaves out the outputs a non-finite input reaches
            kept = torch.where(reach["out"], torch.zeros_like(out), out)
            (dsinks,) = torch.autograd.grad(
                (kept * grad_out).sum() + lse_term, (sk,), allow_unused=True
            )
            dsinks = torch.zeros_like(sk) if dsinks is None else dsinks
    nan = torch.full((), math.nan, dtype=torch.float64)
    out, lse = (
        torch.where(reach["out"], nan, out.detach()),
        torch.where(reach["lse"], nan, lse.detach()),
    )
    dq, dk, dv = (torch.where(reach[n], nan, g) for n, g in (("dq", dq), ("dk", dk), ("dv", dv)))
    return ReferenceResult(out, lse, dq, dk, dv, dsinks)


def max_logit(
    query: Tensor,
    key: Tensor,
    *,
    is_causal: bool = False,
    scale: float | None = None,
    visible: Tensor | None = None,
    dtype: torch.dtype = torch.float64,
) -> Tensor:
    """The per-head maximum attention logit: (heads,), the largest ``scale * q_i . k_j`` of the
    full score matrix over the batch, every query row and every key that row sees (the maximum of
    the masked scores before the softmax; what QK-clip optimisers read). A head whose rows see
    nothing gets -inf; a NaN that reaches a visible score (a NaN in that query row or key)
    makes its head's maximum NaN, one in a key nobody sees does not. Sinks are no keys' logits
    and play no part.

    query (batch, heads, seq_q, head_dim), key (batch, heads_kv, seq_k, head_dim); visible /
    is_causal as for :func:`attention`. ``dtype``: the dtype the scores are formed in (float64,
    the oracle; the suites' single-device baseline passes the kernels' compute dtype).
    """
    if query.dim() != 4 or key.dim() != 4 or query.shape[::3] != key.shape[::3]:
        raise ValueError(
            "max_logit expects query (batch, heads, seq_q, d) and key (batch, heads_kv, seq_k, d); "
            f"got {tuple(query.shape)} and {tuple(key.shape)}"
        )
    if key.shape[1] == 0 or query.shape[1] % key.shape[1]:
        raise ValueError(
            f"query heads ({query.shape[1]}) must be a multiple of key heads ({key.shape[1]}) "
            "for GQA"
        )
    q = query.detach().to(dtype)
    k = expand_kv_heads(key.detach().to(dtype), q.shape[1])
    scale = default_scale(q.shape[-1]) if scale is None else float(scale)
    scores = torch.matmul(q, k.transpose(-2, -1)) * scale  # (batch, heads, seq_q, seq_k)
    if is_causal:
        if visible is not None:
            raise ValueError("pass either is_causal=True or visible (a causal mask spec), not both")
        visible = causal_visibility(torch.arange(q.shape[-2]), torch.arange(k.shape[-2]))
    if visible is not None:
        scores = scores.masked_fill(~visible.to(scores.device).expand_as(scores), -math.inf)
    if scores.shape[2] == 0 or scores.shape[3] == 0:
        return torch.full((q.shape[1],), -math.inf, dtype=dtype)
    return scores.amax(dim=(0, 2, 3))
