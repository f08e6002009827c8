"""The local kernels the suites name: the registry of attention ops (``--op``, a case's ``op``,
the single-device baseline's kernel), asked through this module so that the suites never reach
into the implementation package that hosts the registry.

An op is a name in the registry (``"math"``, ``"cpu_flash"``, ``"cuda_flash_varlen"``, ...) or an
object with the :class:`ring_impl.ops.AttentionOp` members (:func:`conformance.implementation.
load_op` loads either).
"""

from __future__ import annotations

import torch

from ring_impl import ops

__all__ = ["default_op", "kernel_cannot_run", "kernel_computes_scores"]


def default_op(device: torch.device, dtype: torch.dtype, head_dim: int, head_dim_v: int | None):
    """The op the registry picks for an unmasked call on ``device`` in ``dtype`` with query/key
    head dim ``head_dim`` and value head dim ``head_dim_v`` (None: ``head_dim``)."""
    return ops.resolve_op("auto", device, dtype, head_dim, head_dim_v=head_dim_v)


def kernel_cannot_run(
    name: str,
    device: torch.device,
    dtype: torch.dtype,
    head_dim: int,
    *,
    scale: float | None,
    is_causal: bool,
    head_dim_v: int | None,
) -> str | None:
    """Why the registered kernel ``name`` cannot run such a call on ``device`` (its own declared
    limit), or None when it can, or when ``name`` is not registered (an unknown name is the
    implementation's to refuse)."""
    if name not in ops.available_ops():
        return None
    return ops.get_op(name).capabilities.unsupported(
        device,
        dtype,
        head_dim,
        scale=scale if scale is not None else ops.default_scale(head_dim),
        is_causal=is_causal,
        head_dim_v=head_dim_v,
    )


def kernel_computes_scores(name: str) -> bool:
    """Whether the registered kernel ``name`` computes explicit scores a score_mod can change
    (``OpCapabilities.score_mod``; a fused kernel does not)."""
    return bool(getattr(ops.get_op(name).capabilities, "score_mod", False))
