"""Score modifications for the float64 oracle, from plain data (written apart from ring_impl).

A score_mod changes the scaled logit ``s = scale * q . k`` of query position ``i`` and key
position ``j`` (global positions: the oracle runs on the whole sequence) of head ``h`` and batch
row ``b`` before the mask and the softmax:

``{"kind": "softcap", "cap": c}``                 ``c * tanh(s / c)``
``{"kind": "alibi", "slopes": [...], "symmetric": bool}``
                                                  ``s + slopes[h] * (j - i)``; symmetric:
                                                  ``s - slopes[h] * |i - j|``
``{"kind": "bias", "bias": tensor}``              ``s + bias[b or 0, h or 0, i, j]`` (a (1 or
                                                  batch, 1 or heads, seq_q, seq_k) tensor)
``{"kind": "score_mod", "fn": f}``                ``f(s, b, h, i, j)``, flex attention's
                                                  convention (broadcasting index tensors)

Everything is differentiable in ``s`` through plain torch ops (autograd is the oracle's backward).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from torch import Tensor

__all__ = ["SCORE_MOD_KINDS", "apply_score_mod", "score_mod_at"]

SCORE_MOD_KINDS = ("softcap", "alibi", "bias", "score_mod")


def apply_score_mod(
    spec: Mapping[str, Any] | None,
    scores: Tensor,
    *,
    q_positions: Tensor | None = None,
    k_positions: Tensor | None = None,
) -> Tensor:
    """scores (batch, heads, seq_q, seq_k) float64 -> the modified scores (None: unchanged).

    q_positions / k_positions: the positions of the rows and columns (default 0..seq-1, the
    whole sequence); other positions evaluate the score_mod as an implementation would that
    reads them (the suite's diagnosis of positions taken from the wrong place)."""
    if spec is None:
        return scores
    batch, heads, seq_q, seq_k = scores.shape
    dev = scores.device
    b = torch.arange(batch, device=dev).view(-1, 1, 1, 1)
    h = torch.arange(heads, device=dev).view(1, -1, 1, 1)
    i = (
        (torch.arange(seq_q) if q_positions is None else torch.as_tensor(q_positions))
        .to(dev)
        .view(1, 1, -1, 1)
    )
    j = (
        (torch.arange(seq_k) if k_positions is None else torch.as_tensor(k_positions))
        .to(dev)
        .view(1, 1, 1, -1)
    )
    if spec.get("kind") == "alibi" and len(spec["slopes"]) != heads:
        raise ValueError(f"alibi: {len(spec['slopes'])} slopes for {heads} heads")
    return score_mod_at(spec, scores, b, h, i, j).to(torch.float64).expand(scores.shape)


def _as_float(values: Any, score: Tensor) -> Tensor:
    """``values`` on ``score``'s device in the wider of its own float dtype (float64 for plain
    numbers) and ``score``'s: a float32 constant stays float32 on float32 scores, and the oracle's
    float64 scores take it exactly."""
    t = values if isinstance(values, Tensor) else torch.as_tensor(values, dtype=torch.float64)
    return t.to(device=score.device, dtype=torch.promote_types(t.dtype, score.dtype))


def score_mod_at(
    spec: Mapping[str, Any], score: Tensor, b: Tensor, h: Tensor, q: Tensor, k: Tensor
) -> Tensor:
    """``spec`` applied in flex attention's ``score_mod`` convention: ``score`` (B, H, rows,
    cols) and index tensors that broadcast to it (``b`` (B, 1, 1, 1), ``h`` (1, H, 1, 1), ``q``
    the query positions (1, 1, rows, 1), ``k`` the key positions (1, 1, 1, cols), all global).
    Returns the modified scores in ``score``'s dtype."""
    kind = spec.get("kind")
    if kind == "softcap":
        cap = float(spec["cap"])
        out = cap * torch.tanh(score / cap)
    elif kind == "alibi":
        slopes = _as_float(spec["slopes"], score).flatten()[h]
        dist = (k - q).to(slopes.dtype)
        out = score + slopes * (-dist.abs() if spec.get("symmetric", False) else dist)
    elif kind == "bias":
        bias = _as_float(spec["bias"], score)
        # a size-1 batch or head dim of the bias is shared by every batch row or head
        at_b = b if bias.shape[0] > 1 else torch.zeros_like(b)
        at_h = h if bias.shape[1] > 1 else torch.zeros_like(h)
        out = score + bias[at_b, at_h, q, k]
    elif kind == "score_mod":
        out = torch.as_tensor(spec["fn"](score, b, h, q, k))
    else:
        raise ValueError(f"unknown score_mod kind {kind!r}; expected one of {SCORE_MOD_KINDS}")
    return out.to(score.dtype)
