"""The head-parallel strategies behind ``ring_attention(..., strategy=...)``."""

from __future__ import annotations

from collections.abc import Mapping

import torch

from ..ops import AttentionOp, default_scale, resolve_op
from ..ring import RingAttention, RingConfig
from ..validate import InputError
from .groups import resolve_strategy_groups
from .hybrid import Hybrid
from .layout import STRATEGIES
from .ulysses import HeadParallelConfig, Ulysses, head_parallel_fn
from .validate import agree_on_mesh, strategy_problem

__all__ = ["DEFAULT_ALGORITHMS", "strategy_attention"]

#: The algorithm object of each head-parallel strategy (a variant replaces one, see ``bind``).
DEFAULT_ALGORITHMS: Mapping[str, Ulysses] = {"ulysses": Ulysses(), "hybrid": Hybrid()}


def strategy_attention(
    impl: RingAttention,
    algorithms: Mapping[str, Ulysses] | None,
    strategy: str,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    *,
    group=None,
    is_causal: bool = False,
    scale: float | None = None,
    rotate_method: str,
    op: str | AttentionOp | None = None,
    layout: str = "contiguous",
    return_lse: bool = False,
    head_chunks: int = 1,
    extra_problem: str | None = None,
):
    """``ring_attention`` for ``strategy`` "ulysses" or "hybrid" (see ``ring_impl.ring_attention``)."""
    if strategy not in ("ulysses", "hybrid"):
        raise InputError(f"unknown strategy {strategy!r}; expected one of {STRATEGIES}")
    algo = (algorithms or DEFAULT_ALGORITHMS).get(strategy) or DEFAULT_ALGORITHMS[strategy]
    groups = resolve_strategy_groups(strategy, group)
    op_obj, op_error = None, None
    effective_scale: float | None = None
    if isinstance(query, torch.Tensor) and query.dim() == 4:
        if scale is None:
            effective_scale = default_scale(query.shape[-1])
        elif isinstance(scale, (int, float)) and not isinstance(scale, bool):
            effective_scale = float(scale)
        try:
            op_obj = resolve_op(op, query.device, query.dtype, query.shape[-1], scale=effective_scale,
                                is_causal=is_causal is True or is_causal == 1)
        except (TypeError, ValueError) as exc:
            op_error = str(exc)
    mesh_shape = groups.shape
    problem = extra_problem or strategy_problem(
        strategy, query, key, value, mesh_shape=mesh_shape, is_causal=is_causal, scale=scale, layout=layout,
        rotate_method=rotate_method, op=op_obj, op_error=op_error, head_chunks=head_chunks, return_lse=return_lse,
    )
    if mesh_shape[0] * mesh_shape[1] > 1 and not torch.compiler.is_compiling():
        agree_on_mesh(problem, strategy, groups, query, key, is_causal=is_causal, scale=effective_scale, layout=layout,
                      rotate_method=rotate_method, op=op_obj, head_chunks=head_chunks, return_lse=return_lse,
                      device=query.device if isinstance(query, torch.Tensor) else torch.device("cpu"))
    elif problem is not None:
        raise InputError(f"{strategy} attention: {problem}")
    assert op_obj is not None and effective_scale is not None
    ring_cfg = None
    if strategy == "hybrid":
        ring_cfg = RingConfig(group=groups.ring_group(query.device), is_causal=bool(is_causal), scale=effective_scale,
                              layout=layout, rotate_method=rotate_method, op=op_obj, head_chunks=head_chunks)
    cfg = HeadParallelConfig(heads=groups.head_group(query.device), is_causal=bool(is_causal), scale=effective_scale,
                             layout=layout, op=op_obj, return_lse=bool(return_lse), ring=ring_cfg, ring_impl=impl)
    out, lse = head_parallel_fn(query, key, value, cfg, algo)
    return (out, lse) if return_lse else out
