"""Attention sinks: a learnable per-head logit that joins every row's softmax with no value.

With sink logit ``s_h`` a row's softmax denominator gains ``exp(s_h)``: its LSE becomes
``lse' = logaddexp(lse, s_h)`` and its output ``out' = out * exp(lse - lse')`` (the sink takes
its share of the probability mass and contributes nothing). Written on the ring's differentiable
``(out, lse)``, autograd gives dQ, dK, dV through the ring and ``dsinks`` here. A row that sees
nothing (LSE -inf) gets out 0 and LSE ``s_h``. Each rank's ``dsinks`` covers its own query rows:
reduce it over the context-parallel group as any parameter's gradient.
"""

from __future__ import annotations

import torch

__all__ = ["sinks_problem", "with_sinks"]


def sinks_problem(sinks, heads: int) -> str | None:
    """What is wrong with ``sinks`` for ``heads`` query heads, or None."""
    if sinks is None:
        return None
    if not isinstance(sinks, torch.Tensor):
        return (
            f"sinks must be a tensor of shape ({heads},), one logit per query head, got "
            f"{type(sinks).__name__}"
        )
    if not sinks.is_floating_point():
        return f"sinks must be floating point, got {sinks.dtype}"
    if sinks.device.type == "meta":
        return (
            "sinks are on the meta device, which holds no values: give them on the inputs' device "
            "(or the CPU)"
        )
    if tuple(sinks.shape) != (heads,):
        return (
            f"sinks must have shape ({heads},), one logit per query head, got {tuple(sinks.shape)}"
        )
    return None


def with_sinks(
    out: torch.Tensor, lse: torch.Tensor, sinks: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """out (batch, heads, rows, head_dim) in the input dtype, lse (batch, heads, rows) in the
    accumulation dtype, sinks (heads,) -> the same with the sink term, differentiable in all
    three."""
    s = sinks.to(device=lse.device, dtype=lse.dtype).view(1, -1, 1)
    lse_new = torch.logaddexp(lse, s.expand_as(lse))
    weight = torch.exp(lse - lse_new)  # 0 where lse = -inf
    return (out.to(lse.dtype) * weight.unsqueeze(-1)).to(out.dtype), lse_new
