"""Comparisons the op- and route-level tests share: a masked op against the math op on one
block, and a ring run on ranks against the float64 oracle by the numerics policy."""

from __future__ import annotations

import torch

QUANTITIES = ("out", "lse", "dq", "dk", "dv")


def assert_ring_matches_oracle(label: str, results: list[dict], inputs: tuple[torch.Tensor, ...], visible: torch.Tensor,
                               *, layout: str, world_size: int, dtype: torch.dtype) -> None:
    """``results``: each rank's dict of local shards (out, lse, dq, dk, dv) under ``layout``;
    ``inputs``: the global (query, key, value, grad_out) in ``dtype``; ``visible``: the mask's
    visibility on global positions. The LSE is judged in float32 where ``dtype`` is lower."""
    import ring_impl
    from reference import attention_grads
    from reference.budget import assert_close, error_scales

    q, k, v, dout = inputs
    ref = attention_grads(q, k, v, dout, visible=visible)
    scales = error_scales(q, k, v, dout, visible=visible)
    for n in QUANTITIES:
        got = ring_impl.unshard([r[n] for r in results], layout=layout).to(torch.float64)
        result_dtype = torch.float32 if n == "lse" and dtype != torch.float64 else dtype
        want = getattr(ref, n)
        assert_close(f"{n} [{label}]", got, want, want.to(result_dtype), world_size=world_size, dtype=dtype,
                     result_dtype=result_dtype, scales=scales[n])


def assert_masked_op_matches_math(op, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, grad_out: torch.Tensor,
                                  visible: torch.Tensor, *, scale: float, tol: float) -> torch.Tensor:
    """``op``'s forward (out, LSE) and backward on a masked block equal the math op's on the rows
    that see something; those that see nothing get LSE 0 and a zero output gradient, as the ring
    gives them. Returns the op's LSE as it gave it (its native layout: trimmed here to the
    first ``seq_q`` entries, so a padded layout compares too)."""
    from ring_impl.ops import MathOp

    math = MathOp()
    b, h, sq, _ = q.shape
    out, lse = op.forward(q, k, v, is_causal=False, scale=scale, attn_mask=visible)
    want_out, want_lse = math.forward(q, k, v, is_causal=False, scale=scale, attn_mask=visible)
    live = visible.any(-1).expand(b, h, sq)
    assert torch.allclose(out[live], want_out[live], atol=tol, rtol=0), f"out {(out - want_out)[live].abs().max():.2e}"
    assert torch.allclose(lse[..., :sq][live], want_lse[live].to(lse.dtype), atol=tol, rtol=0)
    ring_lse, ring_out = torch.where(live, want_lse, 0.0), torch.where(live.unsqueeze(-1), want_out, 0.0)  # as merged
    grad_out = grad_out * live.unsqueeze(-1)
    got = op.backward(grad_out, q, k, v, ring_out, ring_lse, is_causal=False, scale=scale, attn_mask=visible)
    want = math.backward(grad_out, q, k, v, ring_out, ring_lse, is_causal=False, scale=scale, attn_mask=visible)
    for what, g, w in zip(("dq", "dk", "dv"), got, want):
        assert g.shape == w.shape and g.dtype == w.dtype, (what, g.shape, w.shape, g.dtype, w.dtype)
        assert torch.allclose(g, w, atol=tol, rtol=0), f"{what}: {(g - w).abs().max():.2e}"
    return lse
