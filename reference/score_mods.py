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

__all__ = ["SCORE_MOD_KINDS", "apply_score_mod"]

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
    kind = spec.get("kind")
    if kind == "softcap":
        cap = float(spec["cap"])
        return cap * torch.tanh(scores / cap)
    if kind == "alibi":
        slopes = torch.as_tensor(spec["slopes"], dtype=torch.float64, device=dev).view(1, -1, 1, 1)
        if slopes.shape[1] != heads:
            raise ValueError(f"alibi: {slopes.shape[1]} slopes for {heads} heads")
        dist = (j - i).to(torch.float64)
        return scores + slopes * (-dist.abs() if spec.get("symmetric", False) else dist)
    if kind == "bias":
        bias = torch.as_tensor(spec["bias"]).to(device=dev, dtype=torch.float64)
        return scores + bias[:, :, i.flatten()][:, :, :, j.flatten()].expand(
            batch, heads, seq_q, seq_k
        )
    if kind == "score_mod":
        out = torch.as_tensor(spec["fn"](scores, b, h, i, j))
        return out.to(torch.float64).expand(scores.shape)
    raise ValueError(f"unknown score_mod kind {kind!r}; expected one of {SCORE_MOD_KINDS}")
