"""What the rank functions of the ring tests share: their seeded inputs, the call and the loss
they backpropagate, and the local results they hand back to the parent
(``tests.ring_impl.oracle`` judges them)."""

from __future__ import annotations

import contextlib

import torch


def seeded_inputs(
    seed: int,
    dtype: torch.dtype,
    batch: int,
    heads: int,
    heads_kv: int,
    seq: int,
    head_dim: int,
    *,
    dout_last: bool = False,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Global (query, key, value, grad_out): query (batch, heads, seq, head_dim), key and value
    (batch, heads_kv, seq, head_dim), drawn in float64 and rounded to ``dtype``; drawn in the
    order query, grad_out, key, value (``dout_last``: query, key, value, grad_out)."""
    gen = torch.Generator().manual_seed(seed)

    def draw(h: int) -> torch.Tensor:
        return torch.randn(batch, h, seq, head_dim, generator=gen, dtype=torch.float64).to(dtype)

    if dout_last:
        q, k, v = draw(heads), draw(heads_kv), draw(heads_kv)
        return q, k, v, draw(heads)
    q, dout = draw(heads), draw(heads)
    k, v = draw(heads_kv), draw(heads_kv)
    return q, k, v, dout


def backward(
    out: torch.Tensor, lse: torch.Tensor, dout: torch.Tensor, glse: torch.Tensor | None = None
) -> None:
    """Backpropagate ``(out * dout).sum()``, plus ``lse * glse`` over the finite LSE entries when
    ``glse`` is given: the gradients reaching out and the LSE are dout and glse, exactly (rows
    that see nothing, LSE -inf, take no LSE gradient)."""
    loss = (out * dout).sum()
    if glse is not None:
        loss = loss + torch.where(torch.isfinite(lse), lse, 0.0).mul(glse.to(lse.dtype)).sum()
    loss.backward()


def forward_backward(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    dout: torch.Tensor,
    glse: torch.Tensor | None = None,
    *,
    log=None,
    **options,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``ring_attention(q, k, v, return_lse=True, **options)`` and its ``backward`` (out's
    gradient ``dout``, the LSE's ``glse``), each in its own phase of ``log`` (a
    ``harness.accounting.CollectiveLog``) where one is given. Returns (out, lse)."""
    import ring_impl

    def phase(name: str):
        return contextlib.nullcontext() if log is None else log.phase(name)

    with phase("forward"):
        out, lse = ring_impl.ring_attention(q, k, v, return_lse=True, **options)
    with phase("backward"):
        backward(out, lse, dout, glse)
    return out, lse


def local_results(
    out: torch.Tensor,
    lse: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    sinks: torch.Tensor | None = None,
    **extra,
) -> dict:
    """A rank's out, lse, dq, dk, dv and dsinks (its share; None without sinks) after the
    backward, with the rank function's ``extra`` entries."""
    grads = {"dq": q.grad, "dk": k.grad, "dv": v.grad}
    dsinks = None if sinks is None else sinks.grad
    return {"out": out.detach(), "lse": lse.detach(), **grads, "dsinks": dsinks, **extra}


def leaves(*tensors: torch.Tensor | None) -> tuple[torch.Tensor | None, ...]:
    """The tensors made leaves that take gradients, in place (a None, an absent sink, stays)."""
    return tuple(None if t is None else t.requires_grad_(True) for t in tensors)
