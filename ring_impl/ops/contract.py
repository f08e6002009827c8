"""The attention-op contract: what a local kernel is to the ring, and what it declares.

The ring calls a local kernel once per ring step on a block of queries against a block of
keys/values. Every kernel PyTorch ships has its own calling convention and, worse, its own
layout for the log-sum-exp (LSE) the merge depends on. An :class:`AttentionOp` hides both:

- ``forward(query, key, value, *, is_causal, scale) -> (out, lse)``: ``out`` in the input dtype,
  ``lse`` in the op's *native* layout (declared by ``capabilities.lse_layout``; the ring
  normalises it with :func:`ring_impl.numerics.lse.normalize_lse`).
- ``backward(grad_out, query, key, value, out, lse, *, is_causal, scale) -> (dq, dk, dv)``:
  ``out`` and ``lse`` are the *final* merged output and the normalised LSE ``(batch, heads,
  seq_q)``; the op converts the LSE to whatever its kernel wants. An op that declares
  ``capabilities.lse_grad`` also takes ``grad_lse`` (the gradient reaching the LSE, or None);
  for the others :func:`ring_impl.ops.call_backward` folds it into ``out`` (see there).

Shapes: query ``(batch, heads, seq_q, head_dim)``, key ``(batch, heads_kv, seq_k, head_dim)``,
value ``(batch, heads_kv, seq_k, head_dim_v)``, out and grad_out ``(batch, heads, seq_q,
head_dim_v)``. ``head_dim_v`` differs from ``head_dim`` (DeepSeek's multi-head latent attention)
only for ops that declare ``capabilities.value_head_dim``. Ops that declare ``gqa=False``
always receive ``heads_kv == heads``; the ring's
:func:`ring_impl.ops.call_forward` / :func:`ring_impl.ops.call_backward` expand and reduce key/value
heads for them, so only ``heads_kv`` heads ever travel around the ring.

Memory order: the ring hands an op contiguous tensors, unless the op declares
``capabilities.row_views``: then query/key/value/grad_out/out/LSE may be views of a range of rows
(the sequence dim) of a larger tensor, with any batch, head and sequence strides and a unit
head-dim stride, which saves a copy of every input of every kernel call.

``is_causal`` is top-left aligned as in ``torch.nn.functional.scaled_dot_product_attention``
(query i sees key j iff j <= i); the ring only asks for it on blocks with ``seq_q == seq_k``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

import torch

__all__ = [
    "ALL_DTYPES",
    "LSE_LAYOUTS",
    "AttentionOp",
    "OpCapabilities",
    "accumulation_dtype",
    "default_scale",
    "missing_members",
]

#: Native LSE layouts an op may declare.
#: ``bhs``: ``(batch, heads, seq_q)``; ``bhs_padded32``: ``(batch, heads, ceil(seq_q/32)*32)`` with
#: undefined values in the padding (CUDA memory-efficient attention); ``bhs1``:
#: ``(batch, heads, seq_q, 1)`` (cuDNN attention).
LSE_LAYOUTS = ("bhs", "bhs_padded32", "bhs1")

ALL_DTYPES = frozenset({torch.float64, torch.float32, torch.bfloat16, torch.float16})


def accumulation_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype partial results are merged and gradients accumulated in.

    float64 stays float64 (a float64 ring must agree with a float64 oracle to ~1e-12); every
    other floating dtype accumulates in float32 so error does not grow with the world size.
    """
    return torch.float64 if dtype == torch.float64 else torch.float32


@dataclass(frozen=True)
class OpCapabilities:
    """What a local kernel supports; the ring validates inputs against it before any collective."""

    devices: frozenset[str] = frozenset({"cpu"})
    dtypes: frozenset[torch.dtype] = ALL_DTYPES
    head_dims: tuple[int, int] = (1, 1 << 16)  # inclusive range
    head_dim_multiple: int = 1
    gqa: bool = False
    lse_layout: str = "bhs"
    lse_grad: bool = False  # backward takes grad_lse=
    #: a known kernel fault: causal attention with a scale <= 0 comes back wrong (NaN)
    causal_needs_positive_scale: bool = False
    #: forward and backward take ``attn_mask=``: a bool tensor broadcastable to
    #: (batch, heads, rows, cols), True where a query sees a key (a block of a masked step).
    #: Ops without it run masked blocks with the math op.
    masks: bool = False
    #: forward and backward take ``row_bounds=(lo, hi)``: (rows,) int64 tensors on the inputs'
    #: device, query row ``r`` seeing key columns ``lo[r] .. hi[r] - 1`` for every batch element
    #: and head (``lo >= hi``: none; the caller sets such rows). A kernel that packs rows by their
    #: key ranges (varlen) runs a whole ring step of documents or a window in one call this way,
    #: so the ring plans one block per step for it instead of a call per document
    #: (ring_impl.planning.row_bounds). Ops without it get the block as ``attn_mask``.
    row_bounds: bool = False
    #: forward and backward read strided views: rows [a, b) of the sequence dim of a larger
    #: tensor (any batch/head/sequence strides, unit head-dim stride) instead of a contiguous copy.
    #: An op whose kernel reads memory in a fixed order whatever the strides must not declare it.
    row_views: bool = False
    #: forward and backward take ``score_mod=``: a :class:`ring_impl.score_mods.BlockScores`
    #: (the call's score_mod bound to the block's global positions and heads), applied to the
    #: scaled scores before the mask and the softmax (``score_mod.apply(s)``, s (batch, heads,
    #: rows, cols)), and in the backward the gradient reaching the modified scores taken back
    #: through it (``score_mod.grad(s, ds)``). The fused kernels compute no explicit scores and
    #: cannot; ``op="auto"`` picks an op with it for a call with a score_mod, and a call naming
    #: an op without it is refused (InputError on every rank).
    score_mod: bool = False
    #: value (and so out, grad_out, dV) may have a head dim ``head_dim_v`` other than query's and
    #: key's (multi-head latent attention); ``head_dims`` and ``head_dim_multiple`` bound both.
    #: Ops without it only ever get ``head_dim_v == head_dim``.
    value_head_dim: bool = False

    def unsupported(
        self,
        device: torch.device,
        dtype: torch.dtype,
        head_dim: int,
        *,
        scale: float | None = None,
        is_causal: bool = False,
        head_dim_v: int | None = None,
    ) -> str | None:
        """Return why (device, dtype, head_dim[, scale, is_causal, head_dim_v]) is unsupported,
        or None. ``head_dim_v``: value's head dim (None: ``head_dim``)."""
        if head_dim_v is not None and head_dim_v != head_dim:
            if not self.value_head_dim:
                return (
                    f"value head_dim {head_dim_v} differs from query/key head_dim {head_dim} "
                    "(the kernel needs them equal; capabilities.value_head_dim)"
                )
            why = self.unsupported(device, dtype, head_dim_v, scale=scale, is_causal=is_causal)
            if why is not None:
                return f"value {why}"
        if device.type not in self.devices:
            return f"device {device.type!r} not in {sorted(self.devices)}"
        if dtype not in self.dtypes:
            names = sorted(str(d).removeprefix("torch.") for d in self.dtypes)
            return f"dtype {str(dtype).removeprefix('torch.')} not in {names}"
        lo, hi = self.head_dims
        if not lo <= head_dim <= hi or head_dim % self.head_dim_multiple:
            return f"head_dim {head_dim} outside [{lo}, {hi}]" + (
                f" or not a multiple of {self.head_dim_multiple}"
                if self.head_dim_multiple > 1
                else ""
            )
        if self.causal_needs_positive_scale and is_causal and scale is not None and scale <= 0:
            return f"causal attention with scale {scale} <= 0 (the kernel returns NaN there)"
        return None


@runtime_checkable
class AttentionOp(Protocol):
    """The attention-op contract (see the module docstring)."""

    name: str
    capabilities: OpCapabilities

    def forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        *,
        is_causal: bool,
        scale: float,
    ) -> tuple[torch.Tensor, torch.Tensor]: ...

    def backward(
        self,
        grad_out: torch.Tensor,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        out: torch.Tensor,
        lse: torch.Tensor,
        *,
        is_causal: bool,
        scale: float,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]: ...


def missing_members(obj: object) -> list[str]:
    """The members of the op contract ``obj`` lacks (empty for an op); the one check used by
    every place that accepts an op object (``op=``, :func:`register_op`, ``--op``)."""
    return [name for name in ("forward", "backward", "capabilities") if not hasattr(obj, name)]


def default_scale(head_dim: int) -> float:
    return 1.0 / math.sqrt(head_dim)
