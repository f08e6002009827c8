"""A ring run on ranks against the float64 oracle, by the numerics policy: the comparison the
op- and route-level ring tests share."""

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
