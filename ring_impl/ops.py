"""Local attention kernels behind one contract: the attention op.

The ring calls a local kernel once per ring step on a block of queries against a block of
keys/values. Every kernel PyTorch ships has its own calling convention and, worse, its own
layout for the log-sum-exp (LSE) the merge depends on. An :class:`AttentionOp` hides both:

- ``forward(query, key, value, *, is_causal, scale) -> (out, lse)``: ``out`` in the input dtype,
  ``lse`` in the op's *native* layout (declared by ``capabilities.lse_layout``; the ring
  normalises it with :func:`ring_impl.lse.normalize_lse`).
- ``backward(grad_out, query, key, value, out, lse, *, is_causal, scale) -> (dq, dk, dv)``:
  ``out`` and ``lse`` are the *final* merged output and the normalised LSE ``(batch, heads,
  seq_q)``; the op converts the LSE to whatever its kernel wants. An op that declares
  ``capabilities.lse_grad`` also takes ``grad_lse`` (the gradient reaching the LSE, or None);
  for the others :func:`call_backward` folds it into ``out`` (see there).

Shapes: query ``(batch, heads, seq_q, head_dim)``, key/value ``(batch, heads_kv, seq_k,
head_dim)``. Ops that declare ``gqa=False`` always receive ``heads_kv == heads``; the ring's
:func:`call_forward` / :func:`call_backward` expand and reduce key/value heads for them, so only
``heads_kv`` heads ever travel around the ring.

``is_causal`` is top-left aligned as in ``torch.nn.functional.scaled_dot_product_attention``
(query i sees key j iff j <= i); the ring only asks for it on blocks with ``seq_q == seq_k``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Protocol, runtime_checkable

import torch

__all__ = [
    "LSE_LAYOUTS",
    "AttentionOp",
    "CpuCudnnLayoutOp",
    "CpuEfficientLayoutOp",
    "CpuFlashOp",
    "CudaCudnnOp",
    "CudaEfficientOp",
    "CudaFlashOp",
    "MathOp",
    "OpCapabilities",
    "accumulation_dtype",
    "available_ops",
    "call_backward",
    "call_forward",
    "default_scale",
    "get_op",
    "register_op",
    "resolve_op",
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

    def unsupported(self, device: torch.device, dtype: torch.dtype, head_dim: int, *,
                    scale: float | None = None, is_causal: bool = False) -> str | None:
        """Return why (device, dtype, head_dim[, scale, is_causal]) is unsupported, or None."""
        if device.type not in self.devices:
            return f"device {device.type!r} not in {sorted(self.devices)}"
        if dtype not in self.dtypes:
            names = sorted(str(d).removeprefix("torch.") for d in self.dtypes)
            return f"dtype {str(dtype).removeprefix('torch.')} not in {names}"
        lo, hi = self.head_dims
        if not lo <= head_dim <= hi or head_dim % self.head_dim_multiple:
            return (
                f"head_dim {head_dim} outside [{lo}, {hi}]"
                + (f" or not a multiple of {self.head_dim_multiple}" if self.head_dim_multiple > 1 else "")
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
        self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, *, is_causal: bool, scale: float
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


# --------------------------------------------------------------------------------------------
# Pure-torch math op: every dtype and device, native GQA.
# --------------------------------------------------------------------------------------------


def _causal_mask(seq_q: int, seq_k: int, device: torch.device) -> torch.Tensor:
    """(seq_q, seq_k) bool, True where query i may see key j (top-left aligned: j <= i)."""
    return torch.ones(seq_q, seq_k, dtype=torch.bool, device=device).tril()


class MathOp:
    """Attention in plain torch ops, computed in the accumulation dtype (float64 for float64).

    The reference kernel of the ring for dtypes and devices no fused kernel covers, and the one
    that makes a float64 ring possible. Memory is O(seq_q * seq_k) per block.
    """

    name = "math"
    capabilities = OpCapabilities(devices=frozenset({"cpu", "cuda"}), gqa=True, lse_grad=True)

    @staticmethod
    def _scores(query: torch.Tensor, key: torch.Tensor, is_causal: bool, scale: float) -> torch.Tensor:
        # query (b, h, sq, d) viewed as (b, hkv, g, sq, d): query head h uses kv head h // g.
        b, h, sq, d = query.shape
        hkv, sk = key.shape[1], key.shape[2]
        acc = accumulation_dtype(query.dtype)
        q = query.to(acc).reshape(b, hkv, h // hkv, sq, d)
        s = torch.einsum("bngqd,bnkd->bngqk", q, key.to(acc)) * scale
        if is_causal:
            s = s.masked_fill(~_causal_mask(sq, sk, query.device), float("-inf"))
        return s  # (b, hkv, g, sq, sk)

    def forward(self, query, key, value, *, is_causal, scale):
        b, h, sq, d = query.shape
        s = self._scores(query, key, is_causal, scale)
        lse = torch.logsumexp(s, dim=-1)  # (b, hkv, g, sq)
        p = torch.exp(s - lse.unsqueeze(-1))
        out = torch.einsum("bngqk,bnkd->bngqd", p, value.to(s.dtype))
        return out.reshape(b, h, sq, d).to(query.dtype), lse.reshape(b, h, sq)

    def backward(self, grad_out, query, key, value, out, lse, *, is_causal, scale, grad_lse=None):
        b, h, sq, d = query.shape
        hkv = key.shape[1]
        g = h // hkv
        s = self._scores(query, key, is_causal, scale)
        acc = s.dtype
        p = torch.exp(s - lse.to(acc).reshape(b, hkv, g, sq, 1))
        do = grad_out.to(acc).reshape(b, hkv, g, sq, d)
        o = out.to(acc).reshape(b, hkv, g, sq, d)
        dv = torch.einsum("bngqk,bngqd->bnkd", p, do)
        dp = torch.einsum("bngqd,bnkd->bngqk", do, value.to(acc))
        delta = (do * o).sum(-1, keepdim=True)  # rowsum(dO * O) of the *final* output
        if grad_lse is not None:  # d lse_i / d s_ij = p_ij
            delta = delta - grad_lse.to(acc).reshape(b, hkv, g, sq, 1)
        ds = p * (dp - delta)
        dq = torch.einsum("bngqk,bnkd->bngqd", ds, key.to(acc)) * scale
        dk = torch.einsum("bngqk,bngqd->bnkd", ds, query.to(acc).reshape(b, hkv, g, sq, d)) * scale
        return dq.reshape(b, h, sq, d).to(query.dtype), dk.to(key.dtype), dv.to(value.dtype)


# --------------------------------------------------------------------------------------------
# CPU flash attention and CPU emulations of the CUDA kernels' LSE layouts.
# --------------------------------------------------------------------------------------------


class CpuFlashOp:
    """``aten._scaled_dot_product_flash_attention_for_cpu`` and its backward.

    LSE comes back (batch, heads, seq_q) in float32 (float64 for float64 inputs).
    """

    name = "cpu_flash"
    capabilities = OpCapabilities(devices=frozenset({"cpu"}), causal_needs_positive_scale=True)

    def forward(self, query, key, value, *, is_causal, scale):
        out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
            query, key, value, 0.0, is_causal, scale=scale
        )
        return out, lse

    def backward(self, grad_out, query, key, value, out, lse, *, is_causal, scale):
        acc = accumulation_dtype(query.dtype)
        dq, dk, dv = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
            grad_out.to(query.dtype),
            query,
            key,
            value,
            out.to(query.dtype),
            lse.to(acc).contiguous(),
            0.0,
            is_causal,
            scale=scale,
        )
        return dq, dk, dv


def _garbage_like(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """Plausible-looking but wrong LSE values, like uninitialised kernel memory.

    Finite and large, so an implementation that forgets to trim is caught by the numbers rather
    than by a NaN check it might happen to have.
    """
    gen = torch.Generator(device="cpu").manual_seed(0x5EED)
    return (torch.randn(shape, generator=gen, dtype=torch.float64) * 1e4).to(dtype=dtype, device=device)


class CpuEfficientLayoutOp(CpuFlashOp):
    """CPU flash with the LSE layout of CUDA memory-efficient attention.

    LSE is (batch, heads, ceil(seq_q / 32) * 32) and the padding holds garbage, exactly the
    layout the ring must trim; lets CI exercise the trimming path without a GPU.
    """

    name = "cpu_efficient_layout"
    capabilities = OpCapabilities(devices=frozenset({"cpu"}), lse_layout="bhs_padded32", causal_needs_positive_scale=True)

    def forward(self, query, key, value, *, is_causal, scale):
        out, lse = super().forward(query, key, value, is_causal=is_causal, scale=scale)
        b, h, sq = lse.shape
        padded = _garbage_like((b, h, -(-sq // 32) * 32), lse.dtype, lse.device)
        padded[..., :sq] = lse
        return out, padded


class CpuCudnnLayoutOp(CpuFlashOp):
    """CPU flash with the LSE layout of cuDNN attention: (batch, heads, seq_q, 1)."""

    name = "cpu_cudnn_layout"
    capabilities = OpCapabilities(devices=frozenset({"cpu"}), lse_layout="bhs1", causal_needs_positive_scale=True)

    def forward(self, query, key, value, *, is_causal, scale):
        out, lse = super().forward(query, key, value, is_causal=is_causal, scale=scale)
        return out, lse.unsqueeze(-1)


# --------------------------------------------------------------------------------------------
# CUDA kernels. Exercised on GPU runners (`pytest suites --device cuda`); CI has no GPU.
# --------------------------------------------------------------------------------------------


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


# --------------------------------------------------------------------------------------------
# Registry
# --------------------------------------------------------------------------------------------


@dataclass
class _Registry:
    ops: dict[str, AttentionOp] = field(default_factory=dict)


_REGISTRY = _Registry()


def register_op(op: AttentionOp, *, name: str | None = None, replace: bool = False) -> AttentionOp:
    """Make ``op`` selectable by name (``ring_attention(..., op=name)``)."""
    missing = [a for a in ("forward", "backward", "capabilities") if not hasattr(op, a)]
    if missing:
        raise TypeError(f"register_op: {op!r} lacks {missing}; see ring_impl.ops.AttentionOp")
    key = name or op.name
    if key in _REGISTRY.ops and not replace:
        raise ValueError(f"register_op: an op named {key!r} is already registered; pass replace=True")
    _REGISTRY.ops[key] = op
    return op


def available_ops() -> list[str]:
    """Names accepted by ``op=`` (plus ``"auto"``)."""
    return sorted(_REGISTRY.ops)


def get_op(name: str) -> AttentionOp:
    """The registered op called ``name``; raises ValueError naming the registered ones."""
    try:
        return _REGISTRY.ops[name]
    except KeyError:
        raise ValueError(
            f"unknown attention op {name!r}; registered ops: {available_ops()} (or 'auto'); "
            "register your own with ring_impl.register_op"
        ) from None


def _auto_op(device: torch.device, dtype: torch.dtype, head_dim: int, *, scale: float | None = None,
             is_causal: bool = False) -> AttentionOp:
    """The fastest registered op that supports the call; ``math`` where no fused kernel does
    (float64 on CUDA, or a fused kernel's known fault such as cpu_flash's causal scale <= 0)."""
    candidates = ("cpu_flash",) if device.type == "cpu" else ("cuda_flash", "cuda_efficient")
    for name in candidates:
        op = get_op(name)
        if op.capabilities.unsupported(device, dtype, head_dim, scale=scale, is_causal=is_causal) is None:
            return op
    return get_op("math")


def resolve_op(op: str | AttentionOp | None, device: torch.device, dtype: torch.dtype, head_dim: int, *,
               scale: float | None = None, is_causal: bool = False) -> AttentionOp:
    """Turn the ``op=`` argument into an op object; "auto"/None picks by device, dtype and the
    call's scale and causality (routing around a kernel's known faults)."""
    if op is None or op == "auto":
        return _auto_op(device, dtype, head_dim, scale=scale, is_causal=is_causal)
    if isinstance(op, str):
        return get_op(op)
    missing = [a for a in ("forward", "backward", "capabilities") if not hasattr(op, a)]
    if missing:
        raise TypeError(
            f"op must be 'auto', a registered name ({available_ops()}) or an object with "
            f"forward/backward/capabilities (ring_impl.ops.AttentionOp); {op!r} lacks {missing}"
        )
    return op


_MATH = MathOp()
for _op in (_MATH, CpuFlashOp(), CpuEfficientLayoutOp(), CpuCudnnLayoutOp(), CudaFlashOp(), CudaEfficientOp(), CudaCudnnOp()):
    register_op(_op)


# --------------------------------------------------------------------------------------------
# GQA adaptation for ops without native GQA
# --------------------------------------------------------------------------------------------


def _expand_heads(t: torch.Tensor, heads: int) -> torch.Tensor:
    group = heads // t.shape[1]
    return t if group == 1 else t.repeat_interleave(group, dim=1)


def _reduce_heads(t: torch.Tensor, heads_kv: int) -> torch.Tensor:
    b, h, s, d = t.shape
    if h == heads_kv:
        return t
    # query head h belongs to kv head h // group: sum each run of `group` consecutive heads.
    return t.reshape(b, heads_kv, h // heads_kv, s, d).sum(2)


def call_forward(
    op: AttentionOp, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, *, is_causal: bool, scale: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """``op.forward`` with key/value heads expanded only if the op lacks native GQA."""
    if not op.capabilities.gqa:
        key, value = _expand_heads(key, query.shape[1]), _expand_heads(value, query.shape[1])
    return op.forward(query, key, value, is_causal=is_causal, scale=scale)


def _with_lse_grad(
    op: AttentionOp, grad_out: torch.Tensor, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
    out: torch.Tensor, lse: torch.Tensor, grad_lse: torch.Tensor, *, is_causal: bool, scale: float,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``op.backward`` with the LSE's gradient folded into ``out``, for kernels that take none.

    The LSE's gradient ``g`` enters the backward as ``dS = P * (dP - (D - g))`` with
    ``D = rowsum(dO * O)``, and flash-style kernels read ``out`` only to form ``D``. Padding
    the head dim with extra columns where value and the key/query are 0, the output gradient
    is 1 and the output is ``-g`` (in two parts, high and low, so a 16-bit dtype carries ``g``
    to about its square precision) gives ``D' = D - g`` and leaves ``dP``, and the real
    columns of dQ, dK, dV, unchanged. Padded to a multiple of 8 columns (what fused kernels
    want); an op that cannot take the padded head dim runs the block with the math op.
    """
    d = query.shape[-1]
    padded = -(-(d + 2) // 8) * 8
    if op.capabilities.unsupported(query.device, query.dtype, padded) is not None:
        return _MATH.backward(grad_out, query, key, value, out, lse, is_causal=is_causal, scale=scale, grad_lse=grad_lse)
    extra = padded - d
    acc = accumulation_dtype(query.dtype)
    g = -grad_lse.to(acc)
    g_hi = g.to(query.dtype)
    g_lo = (g - g_hi.to(acc)).to(query.dtype)

    def pad(t: torch.Tensor, fill: list[torch.Tensor] | None = None) -> torch.Tensor:
        cols = [c.unsqueeze(-1) for c in fill or []]
        zeros = t.new_zeros(*t.shape[:-1], extra - len(cols))
        return torch.cat([t, *[c.to(t.dtype) for c in cols], zeros], dim=-1)

    ones = torch.ones_like(grad_lse, dtype=grad_out.dtype)
    dq, dk, dv = op.backward(
        pad(grad_out, [ones, ones]), pad(query), pad(key), pad(value), pad(out, [g_hi, g_lo]), lse,
        is_causal=is_causal, scale=scale,
    )
    return dq[..., :d], dk[..., :d], dv[..., :d]


def call_backward(
    op: AttentionOp,
    grad_out: torch.Tensor,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    *,
    is_causal: bool,
    scale: float,
    grad_lse: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``op.backward`` with GQA expansion, returning dk/dv with ``heads_kv`` heads.

    grad_lse (batch, heads, seq_q) or None: the gradient reaching the LSE; given to ops that
    declare ``lse_grad``, folded into ``out`` for the others (:func:`_with_lse_grad`).
    """
    heads_kv = key.shape[1]
    if not op.capabilities.gqa:
        key, value = _expand_heads(key, query.shape[1]), _expand_heads(value, query.shape[1])
    if grad_lse is None:
        dq, dk, dv = op.backward(grad_out, query, key, value, out, lse, is_causal=is_causal, scale=scale)
    elif op.capabilities.lse_grad:
        dq, dk, dv = op.backward(grad_out, query, key, value, out, lse, is_causal=is_causal, scale=scale,
                                 grad_lse=grad_lse)  # type: ignore[call-arg]
    else:
        dq, dk, dv = _with_lse_grad(op, grad_out, query, key, value, out, lse, grad_lse, is_causal=is_causal, scale=scale)
    return dq, _reduce_heads(dk, heads_kv), _reduce_heads(dv, heads_kv)


def default_scale(head_dim: int) -> float:
    return 1.0 / math.sqrt(head_dim)

