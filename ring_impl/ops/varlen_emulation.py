"""FlashAttention-2's varlen kernel, emulated on any device with the math op: the stand-in
that lets CI run :class:`ring_impl.ops.varlen.VarlenOp`'s packing without a GPU.

It takes the arguments ``aten._flash_attention_forward`` / ``_backward`` take in their varlen
form and refuses what they refuse (a cumulative length that is not int32, a head dim that is not
contiguous, key heads that do not divide query heads), plus what they would silently misread
(cumulative lengths that do not start at 0, decrease or miss the packed totals; a ``max_q`` /
``max_k`` below a sequence's length, which leaves the kernel's grid short of rows). It evaluates
the documented semantics one sequence at a time, as the kernel does (a NaN in one sequence never
reaches another), each sequence's window aligned to its bottom right (see
:mod:`ring_impl.ops.varlen`) as a visibility given to the math op, and gives a row that sees
nothing what FlashAttention-2 gives it: out 0, LSE +inf. Under torch.compile each direction is
one opaque custom op, as the aten kernel is.

Where it differs from the kernel: it takes every dtype (float64 keeps a float64 LSE, so a
float64 ring can be held to 1e-12 through the packing), and it refuses ``scale <= 0`` (the op
must send those calls to the math op: the kernel's masking gives NaN there).
"""

from __future__ import annotations

from collections.abc import Iterator

import torch

from .contract import accumulation_dtype
from .math import MathOp

__all__ = [
    "emulated_varlen_backward",
    "emulated_varlen_forward",
    "sequence_visibility",
    "varlen_visibility",
]

_MATH = MathOp()


def sequence_visibility(
    sq: int, sk: int, window: tuple[int, int], device: torch.device | None = None
) -> torch.Tensor:
    """(sq, sk) bool: query ``t`` of a sequence sees key ``j`` iff ``t + sk - sq - left <= j <=
    t + sk - sq + right`` (a side of -1 unbounded)."""
    left, right = window
    t = torch.arange(sq, device=device).view(-1, 1)
    j = torch.arange(sk, device=device).view(1, -1)
    vis = torch.ones(sq, sk, dtype=torch.bool, device=device)
    if left >= 0:
        vis &= j >= t + sk - sq - left
    if right >= 0:
        vis &= j <= t + sk - sq + right
    return vis


def varlen_visibility(
    cu_q: torch.Tensor, cu_k: torch.Tensor, window: tuple[int, int]
) -> torch.Tensor:
    """(total_q, total_k) bool: packed query row ``a`` sees packed key row ``c`` iff both are in
    one sequence and :func:`sequence_visibility` shows them there."""
    vis = torch.zeros(int(cu_q[-1]), int(cu_k[-1]), dtype=torch.bool, device=cu_q.device)
    for rows_q, rows_k, seen in _sequences(cu_q, cu_k, window, cu_q.device):
        vis[rows_q, rows_k] = seen
    return vis


def _sequences(
    cu_q: torch.Tensor, cu_k: torch.Tensor, window: tuple[int, int], device: torch.device
) -> Iterator[tuple[slice, slice, torch.Tensor]]:
    """Each sequence of the packing that has queries and keys, in order: its packed query rows,
    its packed key rows and its (sq, sk) :func:`sequence_visibility` on ``device``."""
    q_at, k_at = cu_q.tolist(), cu_k.tolist()
    for a, b, c, d in zip(q_at, q_at[1:], k_at, k_at[1:]):
        if b == a or d == c:
            continue
        yield slice(a, b), slice(c, d), sequence_visibility(b - a, d - c, window, device)


def _check(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_q: torch.Tensor,
    cu_k: torch.Tensor,
    max_q: int,
    max_k: int,
    scale: float,
    window: tuple[int, int],
) -> None:
    for name, t in (("query", q), ("key", k), ("value", v)):
        if t.dim() != 3 or t.stride(-1) != 1:
            raise RuntimeError(
                f"{name} must be (total, heads, head_dim) with a contiguous last dimension, "
                f"got shape {tuple(t.shape)} strides {t.stride()}"
            )
    if k.shape != v.shape or q.shape[2] != k.shape[2] or q.shape[1] % k.shape[1]:
        raise RuntimeError(
            f"query {tuple(q.shape)} / key {tuple(k.shape)} / value {tuple(v.shape)}: key and "
            "value must match, share the head dim, and their heads divide the query's"
        )
    for name, cu, total, longest in (
        ("cu_seqlens_q", cu_q, q.shape[0], max_q),
        ("cu_seqlens_k", cu_k, k.shape[0], max_k),
    ):
        if cu.dtype != torch.int32 or cu.dim() != 1:
            raise RuntimeError(
                f"{name} must be a 1-D int32 tensor, got {cu.dtype} of shape {tuple(cu.shape)}"
            )
        lengths = cu.diff()
        if int(cu[0]) != 0 or int(cu[-1]) != total or bool((lengths < 0).any()):
            raise RuntimeError(f"{name} {cu.tolist()} must rise from 0 to the packed total {total}")
        if lengths.numel() and int(lengths.max()) > longest:
            raise RuntimeError(
                f"{name}: a sequence of {int(lengths.max())} rows exceeds max {longest}"
            )
    if cu_q.numel() != cu_k.numel():
        raise RuntimeError(
            f"cu_seqlens_q ({cu_q.numel()}) and cu_seqlens_k ({cu_k.numel()}) differ in length"
        )
    if any(w < -1 for w in window):
        raise RuntimeError(f"window {window}: each side is -1 (unbounded) or >= 0")
    if scale <= 0:
        raise RuntimeError(
            f"scale {scale} <= 0: the kernel's masked entries come out NaN; the op sends these "
            "calls to the math op"
        )


@torch.library.custom_op("ring_impl::emulated_varlen_forward", mutates_args=())
def _forward(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_q: torch.Tensor,
    cu_k: torch.Tensor,
    max_q: int,
    max_k: int,
    scale: float,
    left: int,
    right: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    # One sequence at a time, as the kernel: a NaN in one sequence's keys or values must not
    # reach another's rows (a dense masked product would carry it: 0 * NaN is NaN).
    _check(q, k, v, cu_q, cu_k, max_q, max_k, scale, (left, right))
    out = torch.zeros_like(q)
    lse = torch.full(
        (q.shape[1], q.shape[0]), float("inf"), dtype=accumulation_dtype(q.dtype), device=q.device
    )
    for rows_q, rows_k, vis in _sequences(cu_q, cu_k, (left, right), q.device):
        o, l_ = _MATH.forward(
            *_heads_first(q[rows_q], k[rows_k], v[rows_k]),
            is_causal=False,
            scale=scale,
            attn_mask=vis,
        )
        live = vis.any(1)  # a row that sees nothing keeps the kernel's out 0 and LSE +inf
        out[rows_q][live] = o[0].transpose(0, 1)[live]
        lse[:, rows_q][:, live] = l_[0][:, live].to(lse.dtype)
    return out, lse


@_forward.register_fake
def _(q, k, v, cu_q, cu_k, max_q, max_k, scale, left, right):
    return torch.empty_like(q), q.new_empty(
        (q.shape[1], q.shape[0]), dtype=accumulation_dtype(q.dtype)
    )


@torch.library.custom_op("ring_impl::emulated_varlen_backward", mutates_args=())
def _backward(
    grad_out: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    cu_q: torch.Tensor,
    cu_k: torch.Tensor,
    max_q: int,
    max_k: int,
    scale: float,
    left: int,
    right: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    _check(q, k, v, cu_q, cu_k, max_q, max_k, scale, (left, right))
    if out.shape != q.shape or grad_out.shape != q.shape or lse.shape != (q.shape[1], q.shape[0]):
        raise RuntimeError(
            f"out {tuple(out.shape)} / grad_out {tuple(grad_out.shape)} must be the query's shape "
            f"{tuple(q.shape)}, lse {tuple(lse.shape)} (heads, total_q)"
        )
    dq, dk, dv = torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)
    for rows_q, rows_k, vis in _sequences(cu_q, cu_k, (left, right), q.device):
        do_, q_, k_, v_, o_ = _heads_first(
            grad_out[rows_q], q[rows_q], k[rows_k], v[rows_k], out[rows_q]
        )
        grads = _MATH.backward(
            do_,
            q_,
            k_,
            v_,
            o_,
            lse[:, rows_q].unsqueeze(0),
            is_causal=False,
            scale=scale,
            attn_mask=vis,
        )
        for acc, g in zip((dq[rows_q], dk[rows_k], dv[rows_k]), grads):
            acc.copy_(g[0].transpose(0, 1))
    return dq, dk, dv


@_backward.register_fake
def _(grad_out, q, k, v, out, lse, cu_q, cu_k, max_q, max_k, scale, left, right):
    return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)


def _heads_first(*packed: torch.Tensor) -> list[torch.Tensor]:
    """(rows, heads, d) -> (1, heads, rows, d)."""
    return [t.transpose(0, 1).unsqueeze(0) for t in packed]


def emulated_varlen_forward(q, k, v, cu_q, cu_k, max_q, max_k, *, scale, window):
    """q (total_q, heads, d), k/v (total_k, heads_kv, d) -> out (total_q, heads, d) in q's
    dtype, LSE (heads, total_q) float32 (float64 for float64). One opaque op under
    torch.compile, as the kernel is."""
    return _forward(q, k, v, cu_q, cu_k, max_q, max_k, float(scale), window[0], window[1])


def emulated_varlen_backward(
    grad_out, q, k, v, out, lse, cu_q, cu_k, max_q, max_k, *, scale, window
):
    """Packed as :func:`emulated_varlen_forward`; lse (heads, total_q) as it returns -> dq (total_q,
    heads, d), dk/dv (total_k, heads_kv, d) in the inputs' dtype."""
    return _backward(
        grad_out, q, k, v, out, lse, cu_q, cu_k, max_q, max_k, float(scale), window[0], window[1]
    )
