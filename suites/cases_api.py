"""Rank-side cases of the context-parallel API and model integration (ring_impl's API).

They use ``context_parallel``, ``context_parallel_unshard`` and the ``ContextParallel`` parallel
style exported by the implementation's API package (:func:`api_of`; needs
``capabilities.context_parallel``). Each returns plain data; the pytest process judges it.
Cases whose contract allows either a correct result or an error on every rank let the error
propagate, and the test judges every rank's outcome.
"""

from __future__ import annotations

import copy

import torch
import torch.nn as nn
import torch.nn.functional as F

from reference.layout import shard, unshard
from suites.models import LlamaLike, encoder_stack

__all__ = [
    "api_of",
    "compiled_module_case",
    "compiled_sdpa_case",
    "context_parallel_case",
    "context_parallel_exception_case",
    "encoder_case",
    "llama_case",
    "mha_default_case",
    "nested_buffers_case",
    "parameter_buffer_case",
    "repeated_buffer_case",
    "repeated_buffer_two_dims_case",
    "tutorial_case",
]


def api_of(impl_spec: str | None):
    """The module offering context_parallel & co for an implementation: the protocol's
    ``api_module`` (conformance.implementation.Implementation.api_module: a claimed API without one
    fails, naming it; never another implementation's API)."""
    from conformance.implementation import load_implementation

    return load_implementation(impl_spec).api_module()


def _mesh(ctx):
    from torch.distributed.device_mesh import DeviceMesh

    return DeviceMesh.from_group(ctx.group, ctx.device.type)


def _gather(ctx, t: torch.Tensor, layout: str, dim: int) -> torch.Tensor:
    parts = [torch.empty_like(t) for _ in range(ctx.world_size)]
    torch.distributed.all_gather(parts, t.detach().contiguous(), group=ctx.group)
    return unshard(parts, layout, dim=dim)


def context_parallel_case(ctx, impl_spec, layout: str, is_causal: bool, dtype_name: str) -> dict:
    """Buffers sharded in place, SDPA routed, buffers and SDPA restored, outputs unsharded.

    Returns the global output from ``context_parallel_unshard``, the single-process SDPA output of
    the same inputs, what the buffers held inside and after the context, and whether SDPA was
    the original function again afterwards.
    """
    api = api_of(impl_spec)
    dtype = getattr(torch, dtype_name)
    w = ctx.world_size
    gen = torch.Generator().manual_seed(1234)
    q, k, v = (
        torch.randn(2, 4, 8 * w, 16, generator=gen, dtype=torch.float64).to(dtype).to(ctx.device)
        for _ in range(3)
    )
    expected = F.scaled_dot_product_attention(q, k, v, is_causal=is_causal)
    sdpa_before = F.scaled_dot_product_attention
    bufs = [t.clone() for t in (q, k, v)]
    kept = torch.arange(8 * w, dtype=torch.float64).reshape(1, 8 * w)  # left sharded on exit
    with api.context_parallel(
        _mesh(ctx),
        buffers=[*bufs, kept],
        buffer_seq_dims=[2, 2, 2, 1],
        no_restore_buffers={kept},
        layout=layout,
    ):
        inside_shapes = [tuple(b.shape) for b in bufs]
        inside_q = bufs[0].clone()
        routed = F.scaled_dot_product_attention is not sdpa_before
        out = F.scaled_dot_product_attention(*bufs, is_causal=is_causal)
        (full,) = api.context_parallel_unshard(_mesh(ctx), [out], [2], layout=layout)
    return {
        "full": full.cpu(),
        "expected": expected.cpu(),
        "inputs": [t.cpu() for t in (q, k, v)],
        "inside_shapes": inside_shapes,
        "inside_q_matches_shard": torch.equal(inside_q, shard(q, layout, w, ctx.rank, dim=2)),
        "restored": all(torch.equal(b, t) for b, t in zip(bufs, (q, k, v))),
        "kept_positions": kept.flatten().tolist(),
        "expected_kept": shard(
            torch.arange(8 * w, dtype=torch.float64).reshape(1, 8 * w), layout, w, ctx.rank, dim=1
        )
        .flatten()
        .tolist(),
        "routed_inside": routed,
        "sdpa_restored": F.scaled_dot_product_attention is sdpa_before,
    }


def context_parallel_exception_case(ctx, impl_spec) -> dict:
    """An exception inside the context must still restore buffers and SDPA."""
    api = api_of(impl_spec)
    w = ctx.world_size
    buf = torch.arange(16 * w, dtype=torch.float32).reshape(1, 1, 16 * w, 1).to(ctx.device)
    original = buf.clone()
    sdpa_before = F.scaled_dot_product_attention
    raised = False
    try:
        with api.context_parallel(_mesh(ctx), buffers=[buf], buffer_seq_dims=[2]):
            raise KeyError("boom inside the context")
    except KeyError:
        raised = True
    return {
        "raised": raised,
        "restored": torch.equal(buf, original),
        "sdpa_restored": F.scaled_dot_product_attention is sdpa_before,
    }


def tutorial_case(ctx, impl_spec) -> dict:
    """PyTorch's "Introduction to Context Parallel" example, ported by changing the import."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    api = api_of(impl_spec)
    torch.manual_seed(0)
    batch, nheads, qkv_len, dim = 8, 8, 64, 32
    backend = SDPBackend.FLASH_ATTENTION
    dtype = torch.bfloat16
    qkv = [
        torch.rand(
            (batch, nheads, qkv_len, dim), dtype=dtype, requires_grad=True, device=ctx.device
        )
        for _ in range(3)
    ]
    with sdpa_kernel(backend):
        out = F.scaled_dot_product_attention(*qkv, is_causal=True)
    cp_qkv = [t.detach().clone() for t in qkv]
    with sdpa_kernel(backend):
        with api.context_parallel(_mesh(ctx), buffers=tuple(cp_qkv), buffer_seq_dims=(2, 2, 2)):
            cp_out = F.scaled_dot_product_attention(*cp_qkv, is_causal=True)
        (cp_out,) = api.context_parallel_unshard(_mesh(ctx), [cp_out], [2])
    atol = 1e-03 * ctx.world_size
    return {
        "max_diff": (cp_out.float() - out.float()).abs().max().item(),
        "atol": atol,
        "allclose": bool(torch.allclose(cp_out, out, atol=atol)),
    }


def _param_grads(model: nn.Module) -> dict[str, torch.Tensor]:
    return {
        n: p.grad.detach().clone().cpu() for n, p in model.named_parameters() if p.grad is not None
    }


def _unsharded_causal_step(
    ctx, module: nn.Module, layout: str, mask_arg: str
) -> tuple[nn.Module, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """The unsharded side of an encoder case: a copy of ``module`` runs (2, 8 W, 32) float64
    tokens under a causal mask (its ``mask_arg`` keyword) and backward of ``out · g``.

    Returns the copy, its output, and this rank's shards of the tokens and of ``g`` (``layout``,
    sequence dim 1) with the causal mask of a shard.
    """
    w = ctx.world_size
    seq = 8 * w
    reference = copy.deepcopy(module)
    x = torch.randn(2, seq, 32, dtype=torch.float64, device=ctx.device)
    grad_out = torch.randn(2, seq, 32, dtype=torch.float64, device=ctx.device)

    def causal(n: int) -> torch.Tensor:
        return nn.Transformer.generate_square_subsequent_mask(
            n, dtype=torch.float64, device=ctx.device
        )

    ref_out = reference(x, **{mask_arg: causal(seq)}, is_causal=True)
    (ref_out * grad_out).sum().backward()
    return (
        reference,
        ref_out,
        shard(x, layout, w, ctx.rank, dim=1),
        shard(grad_out, layout, w, ctx.rank, dim=1),
        causal(seq // w),
    )


def encoder_case(ctx, impl_spec, layout: str) -> dict:
    """``nn.TransformerEncoder`` with ``ContextParallel`` on every layer vs the unsharded model.

    A CP training step: each rank computes the loss of its tokens; parameter gradients are then
    summed over the context-parallel ranks (all-reduce) and must equal the unsharded gradients.
    """
    from torch.distributed.tensor.parallel import parallelize_module

    api = api_of(impl_spec)
    torch.manual_seed(7)
    model = encoder_stack().to(ctx.device)
    reference, ref_out, x_local, g_local, local_mask = _unsharded_causal_step(
        ctx, model, layout, "mask"
    )

    for layer in model.layers:
        parallelize_module(layer, _mesh(ctx), api.ContextParallel(layout=layout))
    out = model(x_local, mask=local_mask, is_causal=True)
    (out * g_local).sum().backward()
    for p in model.parameters():
        torch.distributed.all_reduce(p.grad, group=ctx.group)
    return {
        "out": _gather(ctx, out, layout, 1).cpu(),
        "ref_out": ref_out.detach().cpu(),
        "grads": _param_grads(model),
        "ref_grads": _param_grads(reference),
    }


def llama_case(ctx, impl_spec, layout: str) -> dict:
    """A Llama-like decoder (RoPE, GQA, RMSNorm, SwiGLU) under ``context_parallel`` vs unsharded.

    The tokens and the RoPE tables are sharded with ``context_parallel(buffers=...)``; logits and
    the all-reduced parameter gradients must equal the unsharded model's.
    """
    api = api_of(impl_spec)
    w = ctx.world_size
    seq = 8 * w
    torch.manual_seed(11)
    model = LlamaLike(max_seq=seq).to(ctx.device)
    reference = copy.deepcopy(model)
    tokens = torch.randint(0, 64, (2, seq), device=ctx.device)
    grad_out = torch.randn(2, seq, 64, dtype=torch.float64, device=ctx.device)
    ref_logits = reference(tokens)
    (ref_logits * grad_out).sum().backward()

    tok, g = tokens.clone(), grad_out.clone()
    with api.context_parallel(
        _mesh(ctx),
        buffers=[tok, g, model.rope_cos, model.rope_sin],
        buffer_seq_dims=[1, 1, 0, 0],
        layout=layout,
    ):
        logits = model(tok)
        (logits * g).sum().backward()
        full = _gather(ctx, logits, layout, 1)
    for p in model.parameters():
        torch.distributed.all_reduce(p.grad, group=ctx.group)
    return {
        "out": full.cpu(),
        "ref_out": ref_logits.detach().cpu(),
        "grads": _param_grads(model),
        "ref_grads": _param_grads(reference),
        "rope_restored": model.rope_cos.shape[0] == seq,
    }


# ---------------------------------------------------------------------- silent fallbacks


def _encoder_layer(device) -> nn.TransformerEncoderLayer:
    return nn.TransformerEncoderLayer(
        32, 4, 64, dropout=0.0, batch_first=True, dtype=torch.float64
    ).to(device)


def compiled_module_case(ctx, impl_spec, backend: str, layout: str) -> dict:
    """``ContextParallel`` on an ``nn.TransformerEncoderLayer``, then ``torch.compile(backend)``:
    two training steps (the second runs the cached graph) against the unsharded layer.

    Returns both steps' global outputs, the parameter gradients of the last step after the
    all-reduce a CP training step needs, and the unsharded layer's output and gradients.
    """
    from torch.distributed.tensor.parallel import parallelize_module

    api = api_of(impl_spec)
    torch.manual_seed(5)
    layer = _encoder_layer(ctx.device)
    reference, ref_out, x_local, g_local, local_mask = _unsharded_causal_step(
        ctx, layer, layout, "src_mask"
    )

    parallelize_module(layer, _mesh(ctx), api.ContextParallel(layout=layout))
    compiled = torch.compile(layer, backend=backend)
    outs = []
    for _ in range(2):
        layer.zero_grad(set_to_none=True)
        out = compiled(x_local, src_mask=local_mask, is_causal=True)
        (out * g_local).sum().backward()
        outs.append(_gather(ctx, out, layout, 1).cpu())
    for p in layer.parameters():
        torch.distributed.all_reduce(p.grad, group=ctx.group)
    return {
        "outs": outs,
        "ref_out": ref_out.detach().cpu(),
        "grads": _param_grads(layer),
        "ref_grads": _param_grads(reference),
    }


def _causal_sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    return F.scaled_dot_product_attention(q, k, v, is_causal=True)


def compiled_sdpa_case(ctx, impl_spec, backend: str, layout: str) -> dict:
    """A ``torch.compile``d function calling SDPA, run inside ``context_parallel`` (twice: the
    second call runs the cached code); the global outputs and single-process SDPA's."""
    api = api_of(impl_spec)
    w = ctx.world_size
    gen = torch.Generator().manual_seed(21)
    q, k, v = (
        torch.randn(1, 4, 8 * w, 16, generator=gen, dtype=torch.float64).to(ctx.device)
        for _ in range(3)
    )
    expected = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    attend = torch.compile(_causal_sdpa, backend=backend)
    fulls = []
    for _ in range(2):
        bufs = [t.clone() for t in (q, k, v)]
        with api.context_parallel(
            _mesh(ctx), buffers=bufs, buffer_seq_dims=[2, 2, 2], layout=layout
        ):
            out = attend(*bufs)
            (full,) = api.context_parallel_unshard(_mesh(ctx), [out], [2], layout=layout)
        fulls.append(full.cpu())
    return {"fulls": fulls, "expected": expected.cpu(), "inputs": [t.cpu() for t in (q, k, v)]}


def mha_default_case(ctx, impl_spec, route: str) -> dict:
    """``nn.MultiheadAttention`` called with its defaults (``need_weights=True``) under
    ``context_parallel`` or ``ContextParallel``; raises what the implementation raises.

    Returns the global output and the unsharded module's output.
    """
    from torch.distributed.tensor.parallel import parallelize_module

    api = api_of(impl_spec)
    w = ctx.world_size
    torch.manual_seed(3)
    mha = nn.MultiheadAttention(32, 4, batch_first=True, dtype=torch.float64).to(ctx.device)
    x = torch.randn(2, 8 * w, 32, dtype=torch.float64, device=ctx.device)
    ref_out, _ = copy.deepcopy(mha)(x, x, x)
    if route == "context_parallel":
        xs = x.clone()
        with api.context_parallel(
            _mesh(ctx), buffers=[xs], buffer_seq_dims=[1], layout="head_tail"
        ):
            out, _ = mha(xs, xs, xs)
    else:
        parallelize_module(mha, _mesh(ctx), api.ContextParallel(layout="head_tail"))
        x_local = shard(x, "head_tail", w, ctx.rank, dim=1)
        out, _ = mha(x_local, x_local, x_local)
    return {"out": _gather(ctx, out, "head_tail", 1).cpu(), "ref_out": ref_out.detach().cpu()}


# ---------------------------------------------------------------------- buffers


def repeated_buffer_case(ctx, impl_spec, layout: str) -> dict:
    """Self-attention with the same tensor listed three times in ``buffers`` (q = k = v = x)."""
    api = api_of(impl_spec)
    w = ctx.world_size
    gen = torch.Generator().manual_seed(8)
    x = torch.randn(2, 4, 8 * w, 16, generator=gen, dtype=torch.float64).to(ctx.device)
    expected = F.scaled_dot_product_attention(x, x, x, is_causal=True)
    xs = x.clone()
    with api.context_parallel(
        _mesh(ctx), buffers=[xs, xs, xs], buffer_seq_dims=[2, 2, 2], layout=layout
    ):
        inside = tuple(xs.shape)
        matches_shard = inside == tuple(shard(x, layout, w, ctx.rank, dim=2).shape) and torch.equal(
            xs, shard(x, layout, w, ctx.rank, dim=2)
        )
        out = F.scaled_dot_product_attention(xs, xs, xs, is_causal=True)
        (full,) = api.context_parallel_unshard(_mesh(ctx), [out], [2], layout=layout)
    return {
        "inside": inside,
        "global": tuple(x.shape),
        "matches_shard": matches_shard,
        "full": full.cpu(),
        "expected": expected.cpu(),
        "x": x.cpu(),
        "restored": torch.equal(xs, x),
    }


def repeated_buffer_two_dims_case(ctx, impl_spec) -> dict:
    """One tensor listed twice with different sequence dims; raises what the implementation
    raises (after checking that the tensor is unchanged)."""
    api = api_of(impl_spec)
    w = ctx.world_size
    y = torch.arange((8 * w) ** 2, dtype=torch.float64, device=ctx.device).reshape(1, 8 * w, 8 * w)
    original = y.clone()
    try:
        with api.context_parallel(_mesh(ctx), buffers=[y, y], buffer_seq_dims=[1, 2]):
            inside = tuple(y.shape)
    except Exception as exc:
        if not torch.equal(y, original):
            raise AssertionError(
                f"the rejected buffer was left changed (shape {tuple(y.shape)})"
            ) from exc
        raise
    return {"inside": inside, "restored": torch.equal(y, original)}


def nested_buffers_case(ctx, impl_spec, layout: str) -> dict:
    """``context_parallel`` nested in another over the same buffer. The inner context either
    raises (recorded; the outer one then exits normally) or must not shard the buffer again."""
    api = api_of(impl_spec)
    w = ctx.world_size
    x = torch.arange(16 * w, dtype=torch.float64, device=ctx.device).reshape(1, 1, 16 * w, 1)
    xs = x.clone()
    rec: dict = {"shard": shard(x, layout, w, ctx.rank, dim=2).cpu()}
    with api.context_parallel(_mesh(ctx), buffers=[xs], buffer_seq_dims=[2], layout=layout):
        rec["outer"] = xs.cpu().clone()
        try:
            with api.context_parallel(_mesh(ctx), buffers=[xs], buffer_seq_dims=[2], layout=layout):
                rec["inner"] = xs.cpu().clone()
            rec["error"] = None
        except Exception as exc:
            rec["error"] = f"{type(exc).__name__}: {exc}"
        rec["after_inner"] = xs.cpu().clone()
    rec["restored"] = torch.equal(xs, x)
    return rec


class _LeaveByException(Exception):
    pass


def _positional_attention_loss(pos: torch.Tensor, x: torch.Tensor, g: torch.Tensor) -> torch.Tensor:
    """sum(SDPA(x + pos) * g) with 2 heads of 8: pos (1, seq, 16), x and g (2, seq, 16)."""
    b, s, _ = x.shape
    h = (x + pos).view(b, s, 2, 8).transpose(1, 2)
    out = F.scaled_dot_product_attention(h, h, h, is_causal=True)
    return (out.transpose(1, 2).reshape(b, s, 16) * g).sum()


def parameter_buffer_case(ctx, impl_spec, layout: str, leave_by_exception: bool) -> dict:
    """A learned position table (an ``nn.Parameter`` holding a gradient on entry) sharded by
    ``context_parallel``; backward inside the context; then an SGD step after it.

    Returns the parameter's gradient and value after the step (or the step's error), and the
    same for an unsharded run of the same loss.
    """
    api = api_of(impl_spec)
    w = ctx.world_size
    seq = 8 * w
    gen = torch.Generator().manual_seed(13)
    init, entry = (torch.randn(1, seq, 16, generator=gen, dtype=torch.float64) for _ in range(2))
    x, g = (
        torch.randn(2, seq, 16, generator=gen, dtype=torch.float64).to(ctx.device) for _ in range(2)
    )
    init, entry = init.to(ctx.device), entry.to(ctx.device)

    ref = nn.Parameter(init.clone())
    ref.grad = entry.clone()
    _positional_attention_loss(ref, x, g).backward()
    ref_grad = ref.grad.detach().clone()
    torch.optim.SGD([ref], lr=0.5).step()

    pos = nn.Parameter(init.clone())
    pos.grad = entry.clone()
    xs, gs = x.clone(), g.clone()
    try:
        with api.context_parallel(
            _mesh(ctx), buffers=[pos, xs, gs], buffer_seq_dims=[1, 1, 1], layout=layout
        ):
            _positional_attention_loss(pos, xs, gs).backward()
            if leave_by_exception:
                raise _LeaveByException
    except _LeaveByException:
        pass
    rec: dict = {
        "param_shape": tuple(pos.shape),
        "grad_shape": None if pos.grad is None else tuple(pos.grad.shape),
        "grad": None if pos.grad is None else pos.grad.detach().cpu().clone(),
        "ref_grad": ref_grad.cpu(),
        "entry_grad": entry.cpu(),
        "data_restored": torch.equal(pos.detach(), init),
    }
    try:
        torch.optim.SGD([pos], lr=0.5).step()
        rec["step_error"] = None
    except Exception as exc:
        rec["step_error"] = f"{type(exc).__name__}: {exc}"
    rec["param"], rec["ref_param"] = pos.detach().cpu(), ref.detach().cpu()
    return rec
