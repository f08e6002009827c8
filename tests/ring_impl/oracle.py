"""Comparisons the op- and route-level tests share: a masked op against the math op on one
block, and a ring run on ranks against the float64 oracle by the numerics policy."""

from __future__ import annotations

import torch

QUANTITIES = ("out", "lse", "dq", "dk", "dv")


def assert_ring_matches_oracle(
    label: str,
    results: list[dict],
    inputs: tuple[torch.Tensor, ...],
    visible: torch.Tensor,
    *,
    layout: str,
    world_size: int,
    dtype: torch.dtype,
) -> None:
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
        assert_close(
            f"{n} [{label}]",
            got,
            want,
            want.to(result_dtype),
            world_size=world_size,
            dtype=dtype,
            result_dtype=result_dtype,
            scales=scales[n],
        )


def assert_results_match_oracle(
    label: str,
    got: dict[str, torch.Tensor | None],
    ref,
    scales: dict,
    *,
    world_size: int,
    dtype: torch.dtype,
    base: dict[str, torch.Tensor] | None = None,
    sink_shares: int | None = None,
) -> None:
    """``got``: a run's global out, lse, dq, dk, dv in the oracle's layout (any dtype), and its
    ``dsinks`` summed over ranks where the case has sinks (absent or None: no sinks); ``ref``:
    the float64 oracle's (``reference.attention_grads``); ``scales``: the policy's magnitudes
    (``reference.budget.error_scales``); ``base``: the policy's baseline B by quantity (None: the
    oracle rounded once to each result dtype, as an exact kernel gives it). Rows that see nothing
    (the oracle's LSE -inf) must have an LSE of exactly -inf, and only they; every other value is
    finite and within the policy's bound. ``world_size``: the key/value blocks each row's result
    merges; ``sink_shares``: the ranks whose shares dsinks sums (None: ``world_size``). The LSE
    is judged in float32 where ``dtype`` is lower, dsinks in float32 over one rounding a row."""
    __tracebackhide__ = True
    from reference.budget import assert_close

    lse_dtype = torch.float64 if dtype == torch.float64 else torch.float32
    for n in QUANTITIES:
        result_dtype = lse_dtype if n == "lse" else dtype
        want = getattr(ref, n)
        b = want.to(result_dtype) if base is None else base[n]
        x, b = got[n].to(torch.float64), b.to(torch.float64)
        if n == "lse":
            nothing = torch.isneginf(want)
            assert torch.equal(torch.isneginf(x), nothing), (
                f"lse: rows that see nothing must be -inf, and only they [{label}]"
            )
            x, want, b = (t.masked_fill(nothing, 0.0) for t in (x, want, b))
        assert torch.isfinite(x).all(), f"{n}: NaN/inf where every input is finite [{label}]"
        assert_close(
            f"{n} [{label}]",
            x,
            want,
            b,
            world_size=world_size,
            dtype=dtype,
            result_dtype=result_dtype,
            scales=scales[n],
        )
    if got.get("dsinks") is not None:
        assert_close(
            f"dsinks [{label}]",
            got["dsinks"],
            ref.dsinks,
            ref.dsinks.float() if base is None else base["dsinks"],
            world_size=world_size if sink_shares is None else sink_shares,
            dtype=dtype,
            result_dtype=torch.float32,
            roundings=ref.out.shape[2],  # the sum over every query row
            scales=scales["dsinks"],
        )


def assert_float64_results_match_oracle(
    label: str, got: dict[str, torch.Tensor], ref, scales: dict, *, world_size: int
) -> None:
    """``got``: some of a float64 run's global results by name (out, lse, dq, dk, dv), each
    against the oracle's by the numerics policy, the oracle its own baseline (an exact kernel)."""
    __tracebackhide__ = True
    from reference.budget import assert_close

    for n, x in got.items():
        want = getattr(ref, n)
        assert_close(f"{n} [{label}]", x, want, want, world_size=world_size, scales=scales[n])


def unshard_results(results: list[dict], layout: str) -> dict[str, torch.Tensor | None]:
    """Each rank's dict of local shards (out, lse, dq, dk, dv under ``layout``, dsinks its share
    or None) as the global results ``assert_results_match_oracle`` takes."""
    import ring_impl

    got = {n: ring_impl.unshard([r[n] for r in results], layout=layout) for n in QUANTITIES}
    shares = [r.get("dsinks") for r in results]
    got["dsinks"] = None if shares[0] is None else sum(shares)
    return got


def assert_masked_op_matches_math(
    op,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    grad_out: torch.Tensor,
    visible: torch.Tensor,
    *,
    scale: float,
) -> torch.Tensor:
    """``op``'s forward (out, LSE) and backward on a masked block against the math op's, by the
    numerics policy (reference.budget): the math op in float64 is the reference R, the math op in
    the inputs' dtype the baseline B (two float32 kernels differ by their roundings, whose size
    the policy's magnitudes bound; a fixed tolerance does not). Rows that see nothing are left
    out of out and LSE; they get LSE 0 and a zero output gradient, as the ring gives them.
    Returns the op's LSE as it gave it (its native layout: trimmed here to the first ``seq_q``
    entries, so a padded layout compares too)."""
    from reference.budget import assert_close, error_scales
    from ring_impl.ops import MathOp

    math = MathOp()
    b, h, sq, _ = q.shape
    dtype = q.dtype
    lse_dtype = torch.float64 if dtype == torch.float64 else torch.float32
    live = visible.any(-1).expand(b, h, sq)
    wide = [t.to(torch.float64) for t in (q, k, v, grad_out)]
    scales = error_scales(*wide, visible=visible, scale=scale)

    def judged(name, x, r, base, rows=None):
        if rows is not None:  # rows that see nothing: no value to judge
            x, r, base = (t.to(torch.float64).masked_fill(~rows, 0.0) for t in (x, r, base))
        assert_close(
            f"{name} [{getattr(op, 'name', op)} against the math op]",
            x,
            r,
            base,
            world_size=1,
            dtype=dtype,
            result_dtype=lse_dtype if name == "lse" else dtype,
            scales=scales[name],
        )

    out, lse = op.forward(q, k, v, is_causal=False, scale=scale, attn_mask=visible)
    want_out, want_lse = math.forward(q, k, v, is_causal=False, scale=scale, attn_mask=visible)
    ref_out, ref_lse = math.forward(*wide[:3], is_causal=False, scale=scale, attn_mask=visible)
    judged("out", out, ref_out, want_out, live.unsqueeze(-1))
    judged("lse", lse[..., :sq], ref_lse, want_lse, live)
    grad_out = grad_out * live.unsqueeze(-1)
    ring_lse, ring_out = (
        torch.where(live, want_lse, 0.0),
        torch.where(live.unsqueeze(-1), want_out, 0.0),
    )  # as merged
    got = op.backward(
        grad_out, q, k, v, ring_out, ring_lse, is_causal=False, scale=scale, attn_mask=visible
    )
    want = math.backward(
        grad_out, q, k, v, ring_out, ring_lse, is_causal=False, scale=scale, attn_mask=visible
    )
    ref = math.backward(
        wide[3] * live.unsqueeze(-1),
        *wide[:3],
        torch.where(live.unsqueeze(-1), ref_out, 0.0),
        torch.where(live, ref_lse, 0.0),
        is_causal=False,
        scale=scale,
        attn_mask=visible,
    )
    for what, g, w, r in zip(("dq", "dk", "dv"), got, want, ref):
        assert g.shape == w.shape and g.dtype == w.dtype, (what, g.shape, w.shape, g.dtype, w.dtype)
        judged(what, g, r, w)
    return lse
