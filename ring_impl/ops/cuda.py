"""CUDA kernels: FlashAttention-2, memory-efficient attention (LSE padded to a multiple of 32) and
cuDNN attention (LSE with a trailing dim of 1). Exercised on GPU runners (``pytest suites
--device cuda``); CI has no GPU."""

from __future__ import annotations

from dataclasses import replace

import torch

from .contract import OpCapabilities
from .varlen import VarlenOp

__all__ = [
    "BIAS_ALIGNMENT",
    "CudaCudnnOp",
    "CudaEfficientMaskedOp",
    "CudaEfficientOp",
    "CudaFlashOp",
    "CudaFlashVarlenOp",
    "additive_bias",
    "in_efficient_order",
]


# The backward kernels take their dense (non-varlen, unbiased) path only when the cumulative
# sequence lengths and the bias are *undefined* tensors; ``torch.ops`` turns ``None`` into an
# undefined tensor. An empty tensor is defined: it selects the varlen path (flash: "cu_seqlens_q
# must have dtype int32") or is read as a bias (efficient: "Bias expected in BMHK format").
_UNDEFINED = None


def _dense(*tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """Contiguous (batch, heads, seq, head_dim) tensors for a backward kernel: the ring hands
    merged outputs and received blocks in whatever memory order they were made in."""
    return tuple(t.contiguous() for t in tensors)


def in_efficient_order(out: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``out`` (batch, heads, seq, head_dim) in ``dtype``, laid out in memory as the
    memory-efficient backward reads it. The kernel reads ``out`` as (batch, seq, heads,
    head_dim)-contiguous whatever its strides say (the row stride is taken as heads * head_dim), as
    its own forward returns it. Measured on an H100, torch 2.11: a (batch, heads, seq,
    head_dim)-contiguous ``out`` gave dQ/dK errors of order 1 (dV right).
    ``tests/ring_impl/test_kernel_memory_order.py`` holds eager and compiled rings to it on CPU,
    with a kernel that reads memory the same way."""
    return out.to(dtype).transpose(1, 2).contiguous().transpose(1, 2)


class CudaFlashOp:
    """``aten._scaled_dot_product_flash_attention`` (FlashAttention-2): bf16/fp16, LSE bhs; one
    head dim for query, key and value (no ``value_head_dim``: SDPA's check_head_dim_size_flash)."""

    name = "cuda_flash"
    capabilities = OpCapabilities(
        devices=frozenset({"cuda"}),
        dtypes=frozenset({torch.bfloat16, torch.float16}),
        head_dims=(8, 256),
        head_dim_multiple=8,
        # Measured on an H100 (torch 2.11, suites/test_edge_values.py): causal with scale <= 0
        # gives inf/NaN, as CPU flash does; "auto" routes such calls to another kernel.
        causal_needs_positive_scale=True,
    )

    def forward(self, query, key, value, *, is_causal, scale):
        res = torch.ops.aten._scaled_dot_product_flash_attention(
            query, key, value, 0.0, is_causal, False, scale=scale
        )
        return res[0], res[1]

    def backward(self, grad_out, query, key, value, out, lse, *, is_causal, scale):
        grad_out, query, key, value, out = _dense(
            grad_out.to(query.dtype), query, key, value, out.to(query.dtype)
        )
        seed = torch.zeros((), dtype=torch.int64, device=query.device)
        dq, dk, dv = torch.ops.aten._scaled_dot_product_flash_attention_backward(
            grad_out,
            query,
            key,
            value,
            out,
            lse.float().contiguous(),
            _UNDEFINED,
            _UNDEFINED,
            query.shape[2],
            key.shape[2],
            0.0,
            is_causal,
            seed,
            seed,
            scale=scale,
        )
        return dq, dk, dv


class CudaEfficientOp:
    """``aten._scaled_dot_product_efficient_attention``: LSE padded to a multiple of 32."""

    name = "cuda_efficient"
    capabilities = OpCapabilities(
        devices=frozenset({"cuda"}),
        dtypes=frozenset({torch.float32, torch.bfloat16, torch.float16}),
        lse_layout="bhs_padded32",
        # The kernel takes value's own head dim (SDPA's check_head_dim_size_mem_efficient asks
        # query and key to agree, value only to be aligned); not yet run with one on a GPU here.
        value_head_dim=True,
    )

    # attn_mask= (a masked block's bool visibility) reaches these only through
    # CudaEfficientMaskedOp, whose capabilities declare masks; this op's masked blocks run with
    # the math op. Without a mask the kernels get an undefined bias (None).

    def forward(self, query, key, value, *, is_causal, scale, attn_mask=None):
        bias = (
            None
            if attn_mask is None
            else additive_bias(attn_mask, query.dtype, (*query.shape[:3], key.shape[2]))
        )
        res = torch.ops.aten._scaled_dot_product_efficient_attention(
            query, key, value, bias, True, 0.0, is_causal, scale=scale
        )
        return res[0], res[1]

    def backward(self, grad_out, query, key, value, out, lse, *, is_causal, scale, attn_mask=None):
        grad_out, query, key, value = _dense(grad_out.to(query.dtype), query, key, value)
        out = in_efficient_order(out, query.dtype)
        b, h, sq = lse.shape
        # The kernel reads its LSE in its own padded layout; the padding is never read.
        padded = lse.new_zeros(b, h, -(-sq // 32) * 32, dtype=torch.float32)
        padded[..., :sq] = lse
        bias = (
            _UNDEFINED
            if attn_mask is None
            else additive_bias(attn_mask, query.dtype, (b, h, sq, key.shape[2]))
        )
        seed = torch.zeros((), dtype=torch.int64, device=query.device)
        dq, dk, dv, _ = torch.ops.aten._scaled_dot_product_efficient_attention_backward(
            grad_out,
            query,
            key,
            value,
            bias,
            out,
            padded,
            seed,
            seed,
            0.0,
            [True, True, True, False],
            is_causal,
            scale=scale,
        )
        return dq, dk, dv


class CudaCudnnOp:
    """``aten._scaled_dot_product_cudnn_attention``: LSE (batch, heads, seq_q, 1). No
    ``value_head_dim``: not run here with a value head dim of its own."""

    name = "cudnn"
    capabilities = OpCapabilities(
        devices=frozenset({"cuda"}),
        dtypes=frozenset({torch.bfloat16, torch.float16}),
        head_dims=(8, 128),
        head_dim_multiple=8,
        lse_layout="bhs1",
        # Measured on an H100 (torch 2.11): causal with scale <= 0 gives inf/NaN, as flash does.
        causal_needs_positive_scale=True,
    )

    def forward(self, query, key, value, *, is_causal, scale):
        res = torch.ops.aten._scaled_dot_product_cudnn_attention(
            query, key, value, None, True, 0.0, is_causal, False, scale=scale
        )
        return res[0], res[1]

    def backward(self, grad_out, query, key, value, out, lse, *, is_causal, scale):
        grad_out, query, key, value, out = _dense(
            grad_out.to(query.dtype), query, key, value, out.to(query.dtype)
        )
        seed = torch.zeros((), dtype=torch.int64, device=query.device)
        dq, dk, dv = torch.ops.aten._scaled_dot_product_cudnn_attention_backward(
            grad_out,
            query,
            key,
            value,
            out,
            lse.float().unsqueeze(-1).contiguous(),
            seed,
            seed,
            _UNDEFINED,
            _UNDEFINED,
            _UNDEFINED,
            query.shape[2],
            key.shape[2],
            0.0,
            is_causal,
            scale=scale,
        )
        return dq, dk, dv


#: The memory-efficient kernel reads an attention bias whose strides, all but the last (which
#: must be 1), are multiples of this many elements (SDPA pads its masks the same way before
#: calling it; 16 covers the 8 or 16 its kernels want per dtype).
BIAS_ALIGNMENT = 16


def additive_bias(
    visible: torch.Tensor, dtype: torch.dtype, shape: tuple[int, int, int, int]
) -> torch.Tensor:
    """A masked block's visibility as the memory-efficient kernel's additive bias.

    visible: bool, broadcastable to ``shape`` = (batch, heads, rows, cols), True where a query
    sees a key. Returns ``shape`` in ``dtype``: 0 where visible, -inf elsewhere, as a view of a
    buffer whose rows are padded to :data:`BIAS_ALIGNMENT` elements (the padding is -inf and never
    read), with batch and head dims broadcast (stride 0) where ``visible`` has size 1 there.
    Rows that see nothing are all -inf: the kernel's result for them is overwritten by the ring
    (out 0, LSE -inf) and its backward gets LSE 0 and a zero output gradient for them.
    """
    b, h, rows, cols = shape
    v = visible if visible.dim() == 4 else visible.reshape(1, 1, *visible.shape[-2:])
    padded_cols = -(-cols // BIAS_ALIGNMENT) * BIAS_ALIGNMENT
    buf = torch.full(
        (v.shape[0], v.shape[1], rows, padded_cols), float("-inf"), dtype=dtype, device=v.device
    )
    buf[..., :cols].masked_fill_(v.expand(v.shape[0], v.shape[1], rows, cols), 0.0)
    return buf[..., :cols].expand(b, h, rows, cols)


class CudaEfficientMaskedOp(CudaEfficientOp):
    """:class:`CudaEfficientOp` that also runs masked blocks, with the block's visibility as the
    kernel's additive bias (:func:`additive_bias`).

    Opt in with ``op="cuda_efficient_masked"``; ``auto`` does not pick it, and masked blocks of
    ``cuda_efficient`` run with the math op. Checked on a GPU runner (``ci/gpu_check.py``, see
    docs/gpu.md) with ``pytest tests/ring_impl/test_cuda_kernels.py --device cuda`` and ``pytest
    suites/test_masks.py --device cuda --op cuda_efficient_masked``. On CPU,
    ``cpu_efficient_masked_layout`` (ring_impl.ops.cpu) emulates it: the same bias, the kernel's
    alignment check and its padded LSE.
    """

    name = "cuda_efficient_masked"
    capabilities = replace(CudaEfficientOp.capabilities, masks=True)


class CudaFlashVarlenOp(VarlenOp):
    """FlashAttention-2's varlen kernel (``aten._flash_attention_forward`` / ``_backward`` with
    cumulative lengths, as ``torch.nn.attention.varlen`` calls them): every block as packed
    sequences, a masked block's runs of rows as one sequence each, so a block of many short
    documents is one call computing only what its queries see (:mod:`ring_impl.ops.varlen`).

    ``op="auto"`` picks it for masked calls on CUDA (:func:`ring_impl.ops.resolve_op`). Checked
    on a GPU runner (``ci/gpu_check.py``, see docs/gpu.md) with ``pytest
    tests/ring_impl/test_cuda_kernels.py --device cuda -k varlen`` and ``pytest
    suites/test_masks.py --device cuda --op cuda_flash_varlen``. On CPU,
    ``cpu_flash_varlen_layout`` (ring_impl.ops.cpu) runs the same packing with the kernel emulated
    (:mod:`ring_impl.ops.varlen_emulation`).
    """

    name = "cuda_flash_varlen"
    capabilities = OpCapabilities(
        devices=frozenset({"cuda"}),
        dtypes=frozenset({torch.bfloat16, torch.float16}),
        head_dims=(8, 256),
        head_dim_multiple=8,
        gqa=True,
        masks=True,
        row_bounds=True,
        # Every tensor reaches the kernel through the packing (ring_impl.ops.varlen._packed,
        # _take): (tokens, heads, head_dim) with a dense head dim, as the kernel reads it (row
        # and head strides of any size: the packed views of (batch, heads, seq)-contiguous
        # rows ran the suites on an H200); the LSE is copied dense.
        row_views=True,
    )

    def kernel_forward(self, q, k, v, cu_q, cu_k, max_q, max_k, *, scale, window):
        out, lse, _, _, _ = torch.ops.aten._flash_attention_forward(
            q,
            k,
            v,
            cu_q,
            cu_k,
            max_q,
            max_k,
            0.0,
            window == (-1, 0),
            False,
            scale=scale,
            window_size_left=window[0],
            window_size_right=window[1],
        )
        return out, lse

    def kernel_backward(
        self, grad_out, q, k, v, out, lse, cu_q, cu_k, max_q, max_k, *, scale, window
    ):
        # No dropout: the kernel reads neither the RNG state nor the unused tensor.
        rng_state = torch.zeros(2, dtype=torch.uint64, device=q.device)
        unused = torch.empty(0, device=q.device)
        dq, dk, dv = torch.ops.aten._flash_attention_backward(
            grad_out,
            q,
            k,
            v,
            out,
            lse.float().contiguous(),
            cu_q,
            cu_k,
            max_q,
            max_k,
            0.0,
            window == (-1, 0),
            rng_state,
            unused,
            scale=scale,
            window_size_left=window[0],
            window_size_right=window[1],
        )
        return dq, dk, dv
