"""The op registry: names accepted by ``op=``, and the choice ``op="auto"`` makes."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from . import cpu, cuda
from .contract import AttentionOp, default_scale, missing_members
from .flex import FlexOp
from .math import MathOp

__all__ = [
    "available_ops",
    "get_op",
    "register_op",
    "registry_generation",
    "resolve_op",
    "resolve_scale_and_op",
]


@dataclass
class _Registry:
    ops: dict[str, AttentionOp] = field(default_factory=dict)
    #: registrations so far: a name registered again may mean another op, so what was derived
    #: from a name (ring_impl.checks.remembered) is keyed by this too
    generation: int = 0


_REGISTRY = _Registry()


def register_op(op: AttentionOp, *, name: str | None = None, replace: bool = False) -> AttentionOp:
    """Make ``op`` selectable by name (``ring_attention(..., op=name)``)."""
    missing = missing_members(op)
    if missing:
        raise TypeError(f"register_op: {op!r} lacks {missing}; see ring_impl.ops.AttentionOp")
    key = name or op.name
    if key in _REGISTRY.ops and not replace:
        raise ValueError(
            f"register_op: an op named {key!r} is already registered; pass replace=True"
        )
    _REGISTRY.ops[key] = op
    _REGISTRY.generation += 1
    return op


def registry_generation() -> int:
    """How many registrations the op registry has taken (it changes whenever a name may mean
    another op)."""
    return _REGISTRY.generation


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


def resolve_op(
    op: str | AttentionOp | None,
    device: torch.device,
    dtype: torch.dtype,
    head_dim: int,
    *,
    scale: float | None = None,
    is_causal: bool = False,
    masked: bool = False,
    score_mod: bool = False,
    head_dim_v: int | None = None,
) -> AttentionOp:
    """Turn the ``op=`` argument into an op object; "auto"/None picks by device, dtype, the
    call's scale and causality (routing around a kernel's known faults), whether it has a mask
    or a score_mod, and value's head dim (``head_dim_v``, None: ``head_dim``;
    OpCapabilities.value_head_dim).

    "auto" picks the fastest registered op that supports the call; ``math`` where no fused
    kernel does (float64 on CUDA, a value head dim other than query's on CPU, or a fused kernel's
    known fault such as cpu_flash's causal scale <= 0).
    A masked call on CUDA takes the varlen kernel first: it runs a ring step of documents, a
    window or any other mask of key ranges in one call (``OpCapabilities.row_bounds``), where
    the dense kernels take one call per document and the math op for the rest. A call with a
    score_mod takes the math op (the one built-in op with ``OpCapabilities.score_mod``: the
    fused kernels compute no explicit scores to modify)."""
    if op is not None and op != "auto":
        if isinstance(op, str):
            return get_op(op)
        missing = missing_members(op)
        if missing:
            raise TypeError(
                f"op must be 'auto', a registered name ({available_ops()}) or an object with "
                f"forward/backward/capabilities (ring_impl.ops.AttentionOp); {op!r} lacks {missing}"
            )
        return op
    if score_mod:
        return get_op("math")
    if device.type == "cpu":
        candidates: tuple[str, ...] = ("cpu_flash",)
    else:
        candidates = (
            ("cuda_flash_varlen", "cuda_flash", "cuda_efficient")
            if masked
            else ("cuda_flash", "cuda_efficient")
        )
    for name in candidates:
        auto = get_op(name)
        if (
            auto.capabilities.unsupported(
                device, dtype, head_dim, scale=scale, is_causal=is_causal, head_dim_v=head_dim_v
            )
            is None
        ):
            return auto
    return get_op("math")


for _op in (
    MathOp(),
    cpu.CpuFlashOp(),
    cpu.CpuEfficientLayoutOp(),
    cpu.CpuEfficientMaskedLayoutOp(),
    cpu.CpuCudnnLayoutOp(),
    cpu.CpuFlashVarlenLayoutOp(),
    cuda.CudaFlashOp(),
    cuda.CudaEfficientOp(),
    cuda.CudaEfficientMaskedOp(),
    cuda.CudaFlashVarlenOp(),
    cuda.CudaCudnnOp(),
    FlexOp(),
):
    register_op(_op)


def resolve_scale_and_op(
    query, scale, op, is_causal, masked: bool = False, score_mod: bool = False, value=None
) -> tuple[float | None, AttentionOp | None, str | None]:
    """(the scale in effect, the op object, why the op cannot be resolved) for a call's
    arguments (``masked``: the call has a mask; ``score_mod``: a score_mod; ``value``: the
    call's, whose head dim "auto" picks a kernel for); never raises (a bad argument is reported
    by the input checks on every rank)."""
    if not (isinstance(query, torch.Tensor) and query.dim() == 4):
        return None, None, None
    effective_scale: float | None = None
    if scale is None:
        effective_scale = default_scale(query.shape[-1])
    elif isinstance(scale, (int, float)) and not isinstance(scale, bool):
        effective_scale = float(scale)
    try:
        head_dim_v = (
            value.shape[-1] if isinstance(value, torch.Tensor) and value.dim() == 4 else None
        )
        op_obj = resolve_op(
            op,
            query.device,
            query.dtype,
            query.shape[-1],
            scale=effective_scale,
            is_causal=is_causal is True or is_causal == 1,
            masked=masked,
            score_mod=score_mod,
            head_dim_v=head_dim_v,
        )
    except (TypeError, ValueError) as exc:
        return effective_scale, None, str(exc)
    return effective_scale, op_obj, None
