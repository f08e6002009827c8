"""An independent numpy implementation of attention, forward and analytic backward, written
without torch so that the float64 reference is checked against code that shares nothing with it.

Shapes as in reference.attention: q (B, H, Sq, D), k (B, Hkv, Sk, D), v (B, Hkv, Sk, Dv).
"""

from __future__ import annotations

import numpy as np
from numpy.typing import ArrayLike


def _expand(x: np.ndarray, heads: int) -> np.ndarray:
    # GQA: query head h uses kv head h // (heads // heads_kv).
    return np.repeat(x, heads // x.shape[1], axis=1)


def _probs(
    q: np.ndarray, k: np.ndarray, causal: bool, scale: float
) -> tuple[np.ndarray, np.ndarray]:
    """Softmax probabilities (B, H, Sq, Sk) and lse (B, H, Sq), computed row by row with the
    textbook max-shifted logsumexp."""
    s = np.einsum("bhqd,bhkd->bhqk", q, _expand(k, q.shape[1])) * scale
    if causal:
        i = np.arange(q.shape[2])[:, None]
        j = np.arange(k.shape[2])[None, :]
        s = np.where(j <= i, s, -np.inf)
    m = s.max(axis=-1, keepdims=True)
    e = np.exp(s - m)
    z = e.sum(axis=-1, keepdims=True)
    return e / z, (m + np.log(z))[..., 0]


def forward(
    q: ArrayLike, k: ArrayLike, v: ArrayLike, causal: bool = False, scale: float | None = None
) -> tuple[np.ndarray, np.ndarray]:
    """Returns (out (B, H, Sq, Dv), lse (B, H, Sq)) in float64."""
    q, k, v = (np.asarray(t, dtype=np.float64) for t in (q, k, v))
    scale = 1.0 / np.sqrt(q.shape[-1]) if scale is None else scale
    p, lse = _probs(q, k, causal, scale)
    return np.einsum("bhqk,bhkd->bhqd", p, _expand(v, q.shape[1])), lse


def backward(
    q: ArrayLike,
    k: ArrayLike,
    v: ArrayLike,
    dout: ArrayLike,
    causal: bool = False,
    scale: float | None = None,
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Analytic gradients of sum(out * dout): (dq, dk, dv) with dk/dv summed over GQA groups.

    dP = dO V^T; dS = P * (dP - rowsum(dO * O)); dQ = scale dS K; dK = scale dS^T Q; dV = P^T dO.
    """
    q, k, v, dout = (np.asarray(t, dtype=np.float64) for t in (q, k, v, dout))
    scale = 1.0 / np.sqrt(q.shape[-1]) if scale is None else scale
    heads, heads_kv = q.shape[1], k.shape[1]
    ke, ve = _expand(k, heads), _expand(v, heads)
    p, _ = _probs(q, k, causal, scale)
    out = np.einsum("bhqk,bhkd->bhqd", p, ve)
    dp = np.einsum("bhqd,bhkd->bhqk", dout, ve)
    ds = p * (dp - (dout * out).sum(-1, keepdims=True))
    dq = scale * np.einsum("bhqk,bhkd->bhqd", ds, ke)
    dk_e = scale * np.einsum("bhqk,bhqd->bhkd", ds, q)
    dv_e = np.einsum("bhqk,bhqd->bhkd", p, dout)

    def fold(x: np.ndarray) -> np.ndarray:  # sum each GQA group back onto its kv head
        b, _, s, d = x.shape
        return x.reshape(b, heads_kv, heads // heads_kv, s, d).sum(axis=2)

    return dq, fold(dk_e), fold(dv_e)


def masked_forward_backward(
    q: ArrayLike,
    k: ArrayLike,
    v: ArrayLike,
    dout: ArrayLike,
    visible: np.ndarray,
    sinks: ArrayLike | None = None,
    scale: float | None = None,
) -> tuple[np.ndarray, ...]:
    """(out, lse, dq, dk, dv, dsinks) with an arbitrary visibility (broadcast to (B, H, Sq, Sk))
    and optional per-head sink logits (an extra softmax term with no value), by the analytic
    formulas: the sink takes p_sink = exp(sink - lse) of each row, so out = sum_j p_j v_j over
    keys only, dS = P * (dP - rowsum(dO * O)) as without a sink, and d sink_h = -sum p_sink * D.
    Rows that see nothing (and have no sink) get out 0, lse -inf, no gradient."""
    q, k, v, dout = (np.asarray(t, dtype=np.float64) for t in (q, k, v, dout))
    scale = 1.0 / np.sqrt(q.shape[-1]) if scale is None else scale
    heads, heads_kv = q.shape[1], k.shape[1]
    ke, ve = _expand(k, heads), _expand(v, heads)
    s = np.einsum("bhqd,bhkd->bhqk", q, ke) * scale
    vis = np.broadcast_to(np.asarray(visible, dtype=bool), s.shape)
    s = np.where(vis, s, -np.inf)
    cols = [s]
    if sinks is not None:
        sink = np.broadcast_to(
            np.asarray(sinks, dtype=np.float64).reshape(1, -1, 1, 1), (*s.shape[:3], 1)
        )
        cols.append(sink)
    ext = np.concatenate(cols, axis=-1)
    m = ext.max(axis=-1, keepdims=True)
    m = np.where(np.isfinite(m), m, 0.0)
    e = np.exp(ext - m)
    z = e.sum(axis=-1, keepdims=True)
    lse = np.where(z > 0, m + np.log(np.where(z > 0, z, 1.0)), -np.inf)[..., 0]
    pe = np.where(z > 0, e / np.where(z > 0, z, 1.0), 0.0)
    p = pe[..., : s.shape[-1]]
    out = np.einsum("bhqk,bhkd->bhqd", p, ve)
    delta = (dout * out).sum(-1, keepdims=True)
    ds = p * (np.einsum("bhqd,bhkd->bhqk", dout, ve) - delta)
    dq = scale * np.einsum("bhqk,bhkd->bhqd", ds, ke)
    b, _, sk, d = ke.shape
    dk = (
        (scale * np.einsum("bhqk,bhqd->bhkd", ds, q))
        .reshape(b, heads_kv, heads // heads_kv, sk, d)
        .sum(2)
    )
    dv = (
        np.einsum("bhqk,bhqd->bhkd", p, dout).reshape(b, heads_kv, heads // heads_kv, sk, -1).sum(2)
    )
    dsinks = None
    if sinks is not None:
        dsinks = -(pe[..., -1:] * delta).sum(axis=(0, 2, 3))
    return out, lse, dq, dk, dv, dsinks
