"""What the rank functions of the ring tests share: the loss they backpropagate and the local
results they hand back to the parent (``tests.ring_impl.oracle`` judges them)."""

from __future__ import annotations

import torch


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
