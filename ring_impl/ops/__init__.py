"""Local attention kernels behind one contract: the attention op.

- :mod:`.contract`: the op contract (:class:`AttentionOp`) and what an op declares
  (:class:`OpCapabilities`: devices, dtypes, head dims, GQA, LSE layout, known faults).
- :mod:`.math`: a pure-torch op in every dtype (float64 included) and device.
- :mod:`.cpu`: CPU flash attention and CPU emulations of the CUDA kernels' LSE layouts.
- :mod:`.cuda`: FlashAttention-2, memory-efficient and cuDNN attention.
- :mod:`.varlen`: FlashAttention-2's varlen kernel for every block, a masked block's runs of rows
  packed as sequences (:mod:`.varlen_emulation` emulates the kernel on CPU).
- :mod:`.flex`: flex attention's forward (masks as its ``mask_mod``) with the math op's backward.
- :mod:`.registry`: names accepted by ``op=`` and the choice of ``op="auto"``.
- :mod:`.calls`: calling an op (GQA adaptation, the LSE's gradient).

A new kernel is one class in a module by device, registered in :mod:`.registry` (or at run time
with :func:`register_op`).
"""

from __future__ import annotations

from .calls import block_op, call_backward, call_forward
from .contract import (
    ALL_DTYPES,
    LSE_LAYOUTS,
    AttentionOp,
    OpCapabilities,
    accumulation_dtype,
    default_scale,
    missing_members,
)
from .cpu import (
    CpuCudnnLayoutOp,
    CpuEfficientLayoutOp,
    CpuEfficientMaskedLayoutOp,
    CpuFlashOp,
    CpuFlashVarlenLayoutOp,
)
from .cuda import (
    CudaCudnnOp,
    CudaEfficientMaskedOp,
    CudaEfficientOp,
    CudaFlashOp,
    CudaFlashVarlenOp,
)
from .flex import FlexOp
from .math import MathOp
from .registry import available_ops, get_op, register_op, resolve_op, resolve_scale_and_op

__all__ = [
    "ALL_DTYPES",
    "LSE_LAYOUTS",
    "AttentionOp",
    "CpuCudnnLayoutOp",
    "CpuEfficientLayoutOp",
    "CpuEfficientMaskedLayoutOp",
    "CpuFlashOp",
    "CpuFlashVarlenLayoutOp",
    "CudaCudnnOp",
    "CudaEfficientMaskedOp",
    "CudaEfficientOp",
    "CudaFlashOp",
    "CudaFlashVarlenOp",
    "FlexOp",
    "MathOp",
    "OpCapabilities",
    "accumulation_dtype",
    "available_ops",
    "block_op",
    "call_backward",
    "call_forward",
    "default_scale",
    "get_op",
    "missing_members",
    "register_op",
    "resolve_op",
    "resolve_scale_and_op",
]
