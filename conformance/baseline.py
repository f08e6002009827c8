"""The session's device, and the single-device baseline every suite judges against.

The numerics policy (reference/budget.py) measures an implementation's error against the error
of *the same kernel in the same dtype on one device*: the baseline B. "One device" is the
session's device (``--device`` / ``RING_DEVICE``): on a GPU run the baseline must run the CUDA
kernel the ranks run, never a CPU stand-in (a CUDA-only op cannot run on the CPU at all). This
module is the one place that knows that device and runs B; the suites call it and nothing else.

- :func:`session_device` is the device the session's ranks and baselines use.
- :func:`to_session_device` puts tensors there (the suites' parent-side tensors go through it).
- :func:`single_device_baseline` runs an op's forward and backward over the whole sequence,
  with an optional mask and sinks, and returns CPU tensors for the judge.

Both read the device through :func:`session_device`, so a test that points it at the ``meta``
device (``tests/conformance/test_session_device.py``) sees any suite that builds its baseline
or case tensors elsewhere.
"""

from __future__ import annotations

import torch

__all__ = ["session_device", "single_device_baseline", "to_session_device"]


def session_device() -> torch.device:
    """The device of the session's ranks (``--device``), with the current CUDA index on a GPU."""
    from harness.settings import current

    name = current().device
    if name == "cuda":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device(name)


def to_session_device(*tensors: torch.Tensor | None) -> tuple[torch.Tensor | None, ...]:
    """The tensors on :func:`session_device` (None stays None)."""
    device = session_device()
    return tuple(None if t is None else t.to(device) for t in tensors)


def single_device_baseline(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    grad_out: torch.Tensor,
    *,
    op_spec: str | None,
    is_causal: bool = False,
    scale: float | None = None,
    grad_lse: torch.Tensor | None = None,
    visible: torch.Tensor | None = None,
    sinks: torch.Tensor | None = None,
    score_mod: dict | None = None,
) -> dict[str, torch.Tensor]:
    """The policy's B: one call of the op over the whole sequence on the session's device.

    query (b, h, sq, d), key (b, hkv, skv, d), value (b, hkv, skv, dv), grad_out (b, h, sq, dv)
    (``dv``: value's head dim, which may differ from ``d``), grad_lse (b, h, sq) or
    None; visible (b or 1, h or 1, sq, skv) bool for a masked case (a masked call goes to the op
    when it declares ``masks``, else to the math op, exactly as the ring's masked blocks do);
    sinks (h,) logits; score_mod: plain data (reference.score_mods), applied on the whole
    sequence's positions by an op declaring ``OpCapabilities.score_mod`` (the math op where
    the named one does not, as the ring's blocks).
    ``op_spec`` names the kernel (``None``/``"auto"``: the registered default
    for the device, dtype and call). A masked case on a kernel that takes no mask runs on the
    math op, and each element that sees something carries the larger of the math op's error and
    the kernel's own on the same inputs unmasked (the ring runs the mask's unmasked pieces on the
    kernel; reference.budget, "The baseline of a masked case whose kernel takes no mask"): then
    out, lse, dq, dk and dv come back in float64. Returns CPU tensors ``out``, ``lse`` (normalised
    to (b, h, sq)), ``dq``, ``dk``, ``dv`` and, with sinks, ``dsinks``. Rows that see nothing come
    back as out 0, LSE -inf (the sink logit with sinks) and contribute no gradient.

    Raises ValueError when the kernel does not run on the session's device for this call: the
    case asks for something the session cannot do, and says so instead of running it elsewhere.
    """
    from conformance.implementation import load_op
    from ring_impl.numerics.lse import normalize_lse
    from ring_impl.ops import call_backward, call_forward, default_scale, resolve_op
    from ring_impl.ops.calls import block_op

    device = session_device()
    q, k, v, do, glse, vis, s = to_session_device(
        query, key, value, grad_out, grad_lse, visible, sinks
    )
    # (query, key, value and grad_out are tensors: only grad_lse, visible and sinks may be None)
    assert q is not None and k is not None and v is not None and do is not None
    batch, heads, seq_q, head_dim = q.shape
    dtype = q.dtype
    scale = scale if scale is not None else default_scale(head_dim)
    head_dim_v = v.shape[-1]
    scores = None
    if score_mod is not None:
        from ring_impl.score_mods import block_scores, from_spec

        scores = block_scores(
            from_spec(score_mod),
            batch=batch,
            heads=(0, heads),
            q_pos=((0, seq_q),),
            kv_pos=((0, k.shape[2]),),
            device=device,
        )
    if op_spec in (None, "auto"):
        op = resolve_op(
            "auto",
            device,
            dtype,
            head_dim,
            scale=scale,
            is_causal=is_causal,
            score_mod=scores is not None,
            head_dim_v=head_dim_v,
        )
    else:
        op = load_op(op_spec)
    why = op.capabilities.unsupported(
        device, dtype, head_dim, scale=scale, is_causal=is_causal, head_dim_v=head_dim_v
    )
    if why is not None:
        raise ValueError(
            f"the single-device baseline cannot run op {getattr(op, 'name', op)!r} on {device}: "
            f"{why}; the case asks for a kernel that does not run on the session's device "
            "(--device)"
        )
    # the op that runs the call (math for a mask or a score_mod the op cannot take)
    runner = block_op(op, is_causal=is_causal, scale=scale, visible=vis, score_mod=scores)
    out, raw_lse = call_forward(
        op, q, k, v, is_causal=is_causal, scale=scale, visible=vis, score_mod=scores
    )
    lse = normalize_lse(
        raw_lse, batch=batch, heads=heads, seq_q=seq_q, layout=runner.capabilities.lse_layout
    )
    dead = None
    if vis is not None:  # rows that see nothing: out 0, LSE -inf, whatever the kernel left there
        dead = ~vis.any(-1).expand(batch, heads, seq_q)
        out = torch.where(dead.unsqueeze(-1), torch.zeros((), dtype=out.dtype, device=device), out)
        lse = torch.where(dead, torch.full((), float("-inf"), dtype=lse.dtype, device=device), lse)
    kernel_out, kernel_lse, dsinks = out, lse, None
    if (
        s is not None
    ):  # the sink term on the kernel's result, and its gradients back into the kernel's backward
        from ring_impl.sinks import with_sinks

        o, l_, s = (
            out.detach().requires_grad_(),
            lse.detach().requires_grad_(),
            s.detach().requires_grad_(),
        )
        o2, l2 = with_sinks(o, l_, s)
        torch.autograd.backward(
            [o2, l2], [do, glse] if glse is not None else [do, torch.zeros_like(l2)]
        )
        out, lse, dsinks = o2.detach(), l2.detach(), s.grad
        assert o.grad is not None  # (o2 depends on o: the backward above reached it)
        do, glse = o.grad.to(dtype), l_.grad
    if (
        dead is not None
    ):  # the backward of rows that see nothing: no gradient, and an LSE the kernel can take
        kernel_lse = torch.where(
            dead, torch.zeros((), dtype=kernel_lse.dtype, device=device), kernel_lse
        )
        do = torch.where(dead.unsqueeze(-1), torch.zeros((), dtype=do.dtype, device=device), do)
        if glse is not None:
            glse = torch.where(dead, torch.zeros((), dtype=glse.dtype, device=device), glse)
    dq, dk, dv = call_backward(
        op,
        do,
        q,
        k,
        v,
        kernel_out,
        kernel_lse,
        is_causal=is_causal,
        scale=scale,
        grad_lse=glse,
        visible=vis,
        score_mod=scores,
    )
    result = {"out": out, "lse": lse, "dq": dq, "dk": dk, "dv": dv}
    if dsinks is not None:
        result["dsinks"] = dsinks
    result = {name: t.detach().cpu() for name, t in result.items()}
    if vis is not None and runner is not op and scores is None:
        # (the caller's grad_out: `do` was zeroed on rows that see nothing,
        # and moved through the sinks)
        result = _with_the_kernels_own_error(
            result,
            op,
            q,
            k,
            v,
            to_session_device(grad_out)[0],
            vis,
            sinks,
            scale=scale,
            grad_lse=grad_lse,
        )
    return result


def _with_the_kernels_own_error(result, op, q, k, v, do, vis, sinks, *, scale, grad_lse):
    """The masked baseline ``result`` (the math op's) with, per element that sees something, the
    larger of its error and the error of ``op`` (a kernel that takes no mask) on the same inputs
    unmasked: the ring runs a mask's unmasked pieces on ``op`` (reference.budget, "The baseline
    of a masked case whose kernel takes no mask")."""
    from reference.attention import attention_grads
    from reference.budget import baseline_error_of_both
    from ring_impl.numerics.lse import normalize_lse
    from ring_impl.ops import call_backward, call_forward

    batch, heads, seq_q, _ = q.shape
    heads_kv, seq_kv = k.shape[1], k.shape[2]
    out, raw = call_forward(op, q, k, v, is_causal=False, scale=scale)
    lse = normalize_lse(
        raw, batch=batch, heads=heads, seq_q=seq_q, layout=op.capabilities.lse_layout
    )
    dq, dk, dv = call_backward(op, do, q, k, v, out, lse, is_causal=False, scale=scale)
    kernel = {"out": out, "lse": lse, "dq": dq, "dk": dk, "dv": dv}
    cpu = [t.detach().cpu() for t in (q, k, v, do)]
    vis = vis.cpu()
    masked_ref = attention_grads(
        *cpu,
        scale=scale,
        visible=vis,
        grad_lse=grad_lse,
        sinks=None if sinks is None else sinks.detach().cpu(),
    )
    kernel_ref = attention_grads(*cpu, scale=scale)
    full = vis.expand(batch, heads, seq_q, seq_kv)
    rows = full.any(-1)  # (b, h, sq): rows that see a key
    keys = (
        full.any(-2).reshape(batch, heads_kv, heads // heads_kv, seq_kv).any(2)
    )  # (b, hkv, skv): keys seen
    seen = {
        "out": rows.unsqueeze(-1),
        "lse": rows,
        "dq": rows.unsqueeze(-1),
        "dk": keys.unsqueeze(-1),
        "dv": keys.unsqueeze(-1),
    }
    both = dict(result)
    for name, where in seen.items():
        both[name] = baseline_error_of_both(
            result[name],
            getattr(masked_ref, name),
            kernel[name].detach().cpu(),
            getattr(kernel_ref, name),
            where,
        )
    return both
