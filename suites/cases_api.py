"""Rank-side cases of the context-parallel API and model integration (ring_impl's API).

They use ``context_parallel``, ``context_parallel_unshard`` and the ``ContextParallel`` parallel
style exported by the implementation's package (``capabilities.context_parallel``). Each
returns plain data; the pytest process judges it.
"""

from __future__ import annotations

import copy
import importlib

import torch
import torch.nn as nn
import torch.nn.functional as F

from reference.layout import shard, unshard
from suites.models import LlamaLike, encoder_stack

__all__ = [
    "api_of",
    "context_parallel_case",
    "context_parallel_exception_case",
    "encoder_case",
    "llama_case",
    "tutorial_case",
]


def api_of(impl_spec: str | None):
    """The package offering context_parallel & co for an implementation (ring_impl by default)."""
    from harness.implementation import load_implementation

    impl = load_implementation(impl_spec)
    module = getattr(impl.obj, "api_module", "ring_impl")
    return importlib.import_module(module)


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
    q, k, v = (torch.randn(2, 4, 8 * w, 16, generator=gen, dtype=torch.float64).to(dtype).to(ctx.device) for _ in range(3))
    expected = F.scaled_dot_product_attention(q, k, v, is_causal=is_causal)
    sdpa_before = F.scaled_dot_product_attention
    bufs = [t.clone() for t in (q, k, v)]
    kept = torch.arange(8 * w, dtype=torch.float64).reshape(1, 8 * w)  # left sharded on exit
    with api.context_parallel(_mesh(ctx), buffers=[*bufs, kept], buffer_seq_dims=[2, 2, 2, 1],
                              no_restore_buffers={kept}, layout=layout):
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
        "expected_kept": shard(torch.arange(8 * w, dtype=torch.float64).reshape(1, 8 * w), layout, w, ctx.rank, dim=1).flatten().tolist(),
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
    return {"raised": raised, "restored": torch.equal(buf, original), "sdpa_restored": F.scaled_dot_product_attention is sdpa_before}


def tutorial_case(ctx, impl_spec) -> dict:
    """PyTorch's "Introduction to Context Parallel" example, ported by changing the import."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    api = api_of(impl_spec)
    torch.manual_seed(0)
    batch, nheads, qkv_len, dim = 8, 8, 64, 32
    backend = SDPBackend.FLASH_ATTENTION
    dtype = torch.bfloat16
    qkv = [torch.rand((batch, nheads, qkv_len, dim), dtype=dtype, requires_grad=True, device=ctx.device) for _ in range(3)]
    with sdpa_kernel(backend):
        out = F.scaled_dot_product_attention(*qkv, is_causal=True)
    cp_qkv = [t.detach().clone() for t in qkv]
    with sdpa_kernel(backend):
        with api.context_parallel(_mesh(ctx), buffers=tuple(cp_qkv), buffer_seq_dims=(2, 2, 2)):
            cp_out = F.scaled_dot_product_attention(*cp_qkv, is_causal=True)
        (cp_out,) = api.context_parallel_unshard(_mesh(ctx), [cp_out], [2])
    atol = 1e-03 * ctx.world_size
    return {"max_diff": (cp_out.float() - out.float()).abs().max().item(), "atol": atol,
            "allclose": bool(torch.allclose(cp_out, out, atol=atol))}


def _param_grads(model: nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.grad.detach().clone().cpu() for n, p in model.named_parameters() if p.grad is not None}


def encoder_case(ctx, impl_spec, layout: str) -> dict:
    """``nn.TransformerEncoder`` with ``ContextParallel`` on every layer vs the unsharded model.

    A CP training step: each rank computes the loss of its tokens; parameter gradients are then
    summed over the context-parallel ranks (all-reduce) and must equal the unsharded gradients.
    """
    from torch.distributed.tensor.parallel import parallelize_module

    api = api_of(impl_spec)
    w = ctx.world_size
    torch.manual_seed(7)
    model = encoder_stack().to(ctx.device)
    reference = copy.deepcopy(model)
    seq = 8 * w
    x = torch.randn(2, seq, 32, dtype=torch.float64, device=ctx.device)
    grad_out = torch.randn(2, seq, 32, dtype=torch.float64, device=ctx.device)
    mask = nn.Transformer.generate_square_subsequent_mask(seq, dtype=torch.float64, device=ctx.device)
    ref_out = reference(x, mask=mask, is_causal=True)
    (ref_out * grad_out).sum().backward()

    for layer in model.layers:
        parallelize_module(layer, _mesh(ctx), api.ContextParallel(layout=layout))
    x_local, g_local = shard(x, layout, w, ctx.rank, dim=1), shard(grad_out, layout, w, ctx.rank, dim=1)
    local_mask = nn.Transformer.generate_square_subsequent_mask(seq // w, dtype=torch.float64, device=ctx.device)
    out = model(x_local, mask=local_mask, is_causal=True)
    (out * g_local).sum().backward()
    for p in model.parameters():
        torch.distributed.all_reduce(p.grad, group=ctx.group)
    return {"out": _gather(ctx, out, layout, 1).cpu(), "ref_out": ref_out.detach().cpu(),
            "grads": _param_grads(model), "ref_grads": _param_grads(reference)}


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
    with api.context_parallel(_mesh(ctx), buffers=[tok, g, model.rope_cos, model.rope_sin],
                              buffer_seq_dims=[1, 1, 0, 0], layout=layout):
        logits = model(tok)
        (logits * g).sum().backward()
        full = _gather(ctx, logits, layout, 1)
    for p in model.parameters():
        torch.distributed.all_reduce(p.grad, group=ctx.group)
    return {"out": full.cpu(), "ref_out": ref_logits.detach().cpu(), "grads": _param_grads(model),
            "ref_grads": _param_grads(reference),
            "rope_restored": model.rope_cos.shape[0] == seq}
