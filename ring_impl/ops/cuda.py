"""CUDA kernels: FlashAttention-2, memory-efficient attention (LSE padded to a multiple of 32) and
cuDNN attention (LSE with a trailing dim of 1). Exercised on GPU runners (``pytest suites
--device cuda``); CI has no GPU."""

from __future__ import annotations

import torch

from .contract import OpCapabilities

__all__ = ["CudaCudnnOp", "CudaEfficientOp", "CudaFlashOp"]


def _empty_int(device: torch.device) -> torch.Tensor:
    return torch.empty(0, dtype=torch.int64, device=device)


class CudaFlashOp:
    """``aten._scaled_dot_product_flash_attention`` (FlashAttention-2): bf16/fp16, LSE bhs."""

    name = "cuda_flash"
    capabilities = OpCapabilities(
        devices=frozenset({"cuda"}),
        dtypes=frozenset({torch.bfloat16, torch.float16}),
        head_dims=(8, 256),
        head_dim_multiple=8,
    )

    def forward(self, query, key, value, *, is_causal, scale):
        res = torch.ops.aten._scaled_dot_product_flash_attention(
            query, key, value, 0.0, is_causal, False, scale=scale
        )
        return res[0], res[1]

    def backward(self, grad_out, query, key, value, out, lse, *, is_causal, scale):
        seed = torch.zeros((), dtype=torch.int64, device=query.device)
        dq, dk, dv = torch.ops.aten._scaled_dot_product_flash_attention_backward(
            grad_out.to(query.dtype).contiguous(),
            query,
            key,
            value,
            out.to(query.dtype),
            lse.float().contiguous(),
            _empty_int(query.device),
            _empty_int(query.device),
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
    )

    def forward(self, query, key, value, *, is_causal, scale):
        res = torch.ops.aten._scaled_dot_product_efficient_attention(
            query, key, value, None, True, 0.0, is_causal, scale=scale
        )
        return res[0], res[1]

    def backward(self, grad_out, query, key, value, out, lse, *, is_causal, scale):
        b, h, sq = lse.shape
        # The kernel reads its LSE in its own padded layout; the padding is never read.
        padded = lse.new_zeros(b, h, -(-sq // 32) * 32, dtype=torch.float32)
        padded[..., :sq] = lse
        seed = torch.zeros((), dtype=torch.int64, device=query.device)
        dq, dk, dv, _ = torch.ops.aten._scaled_dot_product_efficient_attention_backward(
            grad_out.to(query.dtype).contiguous(),
            query,
            key,
            value,
            torch.empty(0, device=query.device, dtype=query.dtype),
            out.to(query.dtype),
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
    """``aten._scaled_dot_product_cudnn_attention``: LSE (batch, heads, seq_q, 1)."""

    name = "cudnn"
    capabilities = OpCapabilities(
        devices=frozenset({"cuda"}),
        dtypes=frozenset({torch.bfloat16, torch.float16}),
        head_dims=(8, 128),
        head_dim_multiple=8,
        lse_layout="bhs1",
    )

    def forward(self, query, key, value, *, is_causal, scale):
        res = torch.ops.aten._scaled_dot_product_cudnn_attention(
            query, key, value, None, True, 0.0, is_causal, False, scale=scale
        )
        return res[0], res[1]

    def backward(self, grad_out, query, key, value, out, lse, *, is_causal, scale):
        seed = torch.zeros((), dtype=torch.int64, device=query.device)
        dq, dk, dv = torch.ops.aten._scaled_dot_product_cudnn_attention_backward(
            grad_out.to(query.dtype).contiguous(),
            query,
            key,
            value,
            out.to(query.dtype),
            lse.float().unsqueeze(-1).contiguous(),
            seed,
            seed,
            torch.empty(0, device=query.device, dtype=query.dtype),
            _empty_int(query.device),
            _empty_int(query.device),
            query.shape[2],
            key.shape[2],
            0.0,
            is_causal,
            scale=scale,
        )
        return dq, dk, dv
