"""CPU kernels: ``aten``'s CPU flash attention, and CPU emulations of the CUDA kernels' LSE layouts
(so the ring's trimming and reshaping paths are tested without a GPU)."""

from __future__ import annotations

import math
from dataclasses import replace

import torch

from .contract import OpCapabilities, accumulation_dtype
from .cuda import BIAS_ALIGNMENT, additive_bias
from .varlen import VarlenOp
from .varlen_emulation import emulated_varlen_backward, emulated_varlen_forward

__all__ = [
    "CpuCudnnLayoutOp",
    "CpuEfficientLayoutOp",
    "CpuEfficientMaskedLayoutOp",
    "CpuFlashOp",
    "CpuFlashVarlenLayoutOp",
]


class CpuFlashOp:
    """``aten._scaled_dot_product_flash_attention_for_cpu`` and its backward.

    LSE comes back (batch, heads, seq_q) in float32 (float64 for float64 inputs).
    """

    name = "cpu_flash"
    # row_views: the kernel honours every stride but the head dim's (_dense_head_dim); its outputs,
    # LSE and gradients on row views were checked bit-identical to those on contiguous copies
    # (tests/ring_impl/test_row_views.py). No value_head_dim: the kernel (torch 2.13) raises "Q/K/V
    # should have the same head size"
    capabilities = OpCapabilities(
        devices=frozenset({"cpu"}), causal_needs_positive_scale=True, masks=True, row_views=True
    )

    def forward(self, query, key, value, *, is_causal, scale, attn_mask=None):
        mask = self.kernel_mask(attn_mask, query, key)
        query, key, value = (_dense_head_dim(t) for t in (query, key, value))
        out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
            query, key, value, 0.0, is_causal, attn_mask=mask, scale=scale
        )
        return out, lse

    def kernel_mask(
        self, visible: torch.Tensor | None, query: torch.Tensor, key: torch.Tensor
    ) -> torch.Tensor | None:
        """A masked block's bool visibility as the kernel's additive mask (None: no mask)."""
        return _additive(visible, query.dtype)

    def backward(self, grad_out, query, key, value, out, lse, *, is_causal, scale, attn_mask=None):
        mask = self.kernel_mask(attn_mask, query, key)
        acc = accumulation_dtype(query.dtype)
        dq, dk, dv = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
            _dense_head_dim(grad_out.to(query.dtype)),
            _dense_head_dim(query),
            _dense_head_dim(key),
            _dense_head_dim(value),
            _dense_head_dim(out.to(query.dtype)),
            lse.to(acc).contiguous(),
            0.0,
            is_causal,
            attn_mask=mask,
            scale=scale,
        )
        return dq, dk, dv


def _dense_head_dim(t: torch.Tensor) -> torch.Tensor:
    """``t`` with unit stride on the head dim (copied only when it has another). aten's CPU flash
    kernel (torch 2.13) reads the head dim as if its stride were 1: a view such as ``x[..., ::2]``
    gives wrong outputs, LSE and gradients, silently (other strides it honours)."""
    return t if t.stride(-1) == 1 or t.shape[-1] == 1 else t.contiguous()


def _additive(visible: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor | None:
    """The CPU flash kernel takes masks only as additive masks in the query's dtype: 0 where a
    query sees a key, -inf elsewhere."""
    if visible is None:
        return None
    zero = torch.zeros((), dtype=dtype, device=visible.device)
    return torch.where(
        visible, zero, torch.full((), float("-inf"), dtype=dtype, device=visible.device)
    )


def _garbage_like(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """Plausible-looking but wrong LSE values, like uninitialised kernel memory.

    Finite and large, so an implementation that forgets to trim is caught by the numbers rather
    than by a NaN check it might happen to have. A fixed low-discrepancy sequence in [-1e4, 1e4)
    rather than a seeded generator: dynamo cannot trace a Generator made inside the compiled
    ring ("An opaque object was created in the middle of the program").
    """
    n = torch.arange(1, math.prod(shape) + 1, dtype=torch.float64, device=device).reshape(shape)
    return ((n * 0.6180339887498949 + 0.5) % 1.0 * 2e4 - 1e4).to(dtype)


class CpuEfficientLayoutOp(CpuFlashOp):
    """CPU flash with the LSE layout of CUDA memory-efficient attention.

    LSE is (batch, heads, ceil(seq_q / 32) * 32) and the padding holds garbage, exactly the
    layout the ring must trim; lets CI exercise the trimming path without a GPU.
    """

    name = "cpu_efficient_layout"
    capabilities = OpCapabilities(
        devices=frozenset({"cpu"}), lse_layout="bhs_padded32", causal_needs_positive_scale=True
    )

    def forward(self, query, key, value, *, is_causal, scale, attn_mask=None):
        out, lse = super().forward(
            query, key, value, is_causal=is_causal, scale=scale, attn_mask=attn_mask
        )
        b, h, sq = lse.shape
        padded = _garbage_like((b, h, -(-sq // 32) * 32), lse.dtype, lse.device)
        padded[..., :sq] = lse
        return out, padded


class CpuEfficientMaskedLayoutOp(CpuEfficientLayoutOp):
    """CPU flash standing in for ``cuda_efficient_masked`` (ring_impl.ops.cuda): masked blocks get
    the same additive bias (:func:`ring_impl.ops.cuda.additive_bias`), checked for the alignment
    the memory-efficient kernel requires (it refuses a misaligned bias), and the LSE comes back
    padded to a multiple of 32 with garbage in the padding. What it cannot emulate is the CUDA
    kernel's own reading of the bias."""

    name = "cpu_efficient_masked_layout"
    capabilities = replace(CpuEfficientLayoutOp.capabilities, masks=True)

    def kernel_mask(self, visible, query, key):
        if visible is None:
            return None
        return _checked_bias(additive_bias(visible, query.dtype, (*query.shape[:3], key.shape[2])))


def _checked_bias(bias: torch.Tensor) -> torch.Tensor:
    """``bias`` after the memory-efficient kernel's own check (every stride but the last a
    multiple of BIAS_ALIGNMENT, the last 1), raising as the kernel does when it fails."""
    if bias.stride(-1) != 1 or any(st % BIAS_ALIGNMENT for st in bias.stride()[:-1]):
        raise RuntimeError(
            f"attention bias is not aligned: strides {bias.stride()} (want multiples of "
            f"{BIAS_ALIGNMENT}, the last 1)"
        )
    return bias


class CpuCudnnLayoutOp(CpuFlashOp):
    """CPU flash with the LSE layout of cuDNN attention: (batch, heads, seq_q, 1)."""

    name = "cpu_cudnn_layout"
    capabilities = OpCapabilities(
        devices=frozenset({"cpu"}), lse_layout="bhs1", causal_needs_positive_scale=True
    )

    def forward(self, query, key, value, *, is_causal, scale):
        out, lse = super().forward(query, key, value, is_causal=is_causal, scale=scale)
        return out, lse.unsqueeze(-1)


class CpuFlashVarlenLayoutOp(VarlenOp):
    """``cuda_flash_varlen`` (ring_impl.ops.cuda) on CPU: the same packing (:class:`VarlenOp`),
    with FlashAttention-2's varlen kernel emulated (:mod:`ring_impl.ops.varlen_emulation`: its
    argument checks and bottom-right windows, evaluated with the math op). What it cannot
    emulate is the CUDA kernel's own arithmetic. Every dtype, so float64 rings check the
    packing at 1e-12."""

    name = "cpu_flash_varlen_layout"
    # No value_head_dim, as the kernel it emulates (FlashAttention-2 needs one head dim)
    capabilities = OpCapabilities(
        devices=frozenset({"cpu"}), gqa=True, masks=True, row_bounds=True, row_views=True
    )  # as cuda_flash_varlen: its packing takes views

    def kernel_forward(self, q, k, v, cu_q, cu_k, max_q, max_k, *, scale, window):
        return emulated_varlen_forward(
            q, k, v, cu_q, cu_k, max_q, max_k, scale=scale, window=window
        )

    def kernel_backward(
        self, grad_out, q, k, v, out, lse, cu_q, cu_k, max_q, max_k, *, scale, window
    ):
        return emulated_varlen_backward(
            grad_out, q, k, v, out, lse, cu_q, cu_k, max_q, max_k, scale=scale, window=window
        )
