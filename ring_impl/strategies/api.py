"""The head-parallel strategies behind ``ring_attention(..., strategy=...)``."""

from __future__ import annotations

from collections.abc import Mapping

import torch

from ..masks import fold_causal, mask_code, masking_problem
from ..ops import AttentionOp, resolve_scale_and_op
from ..ring import RingAttention, RingConfig
from ..validate import InputError
from .groups import resolve_strategy_groups
from .hybrid import Hybrid
from .layout import STRATEGIES
from .ulysses import HeadParallelConfig, HeadParallelPath, Ulysses
from .validate import agree_on_mesh, strategy_problem

__all__ = ["DEFAULT_ALGORITHMS", "strategy_path"]

#: The algorithm object of each head-parallel strategy (a variant replaces one, see ``bind``).
DEFAULT_ALGORITHMS: Mapping[str, Ulysses] = {"ulysses": Ulysses(), "hybrid": Hybrid()}


def strategy_path(
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
    mask=None,
    sinks=None,
):
    """The :class:`~ring_impl.strategies.ulysses.HeadParallelPath` serving ``ring_attention`` with
    ``strategy`` "ulysses" or "hybrid" (see ``ring_impl.ring_attention``), after checking the call
    on this rank and across the mesh (InputError on every rank for bad input). Its LSE is
    returned when ``return_lse`` or ``sinks`` (the sink term needs it)."""
    if strategy not in ("ulysses", "hybrid"):
        raise InputError(f"unknown strategy {strategy!r}; expected one of {STRATEGIES}")
    algo = (algorithms or DEFAULT_ALGORITHMS).get(strategy) or DEFAULT_ALGORITHMS[strategy]
    groups = resolve_strategy_groups(strategy, group)
    effective_scale, op_obj, op_error = resolve_scale_and_op(query, scale, op, is_causal)
    mesh_shape = groups.shape
    problem = extra_problem or strategy_problem(
        strategy, query, key, value, mesh_shape=mesh_shape, is_causal=is_causal, scale=scale, layout=layout,
        rotate_method=rotate_method, op=op_obj, op_error=op_error, head_chunks=head_chunks, return_lse=return_lse,
    ) or _masking_problem(query, key, mask, sinks, mesh_shape)
    if mesh_shape[0] * mesh_shape[1] > 1 and not torch.compiler.is_compiling():
        agree_on_mesh(problem, strategy, groups, query, key, is_causal=is_causal, scale=effective_scale, layout=layout,
                      rotate_method=rotate_method, op=op_obj, head_chunks=head_chunks, return_lse=return_lse,
                      device=query.device if isinstance(query, torch.Tensor) else torch.device("cpu"),
                      mask_code=mask_code(mask, sinks) if problem is None else 0)
    elif problem is not None:
        raise InputError(f"{strategy} attention: {problem}")
    assert op_obj is not None and effective_scale is not None
    folded = fold_causal(mask, is_causal)
    ring_cfg = None
    head_group = groups.head_group(query.device)
    if strategy == "hybrid":
        # The mask goes to the ring across rows: a row's shard is the ring layout's over R ranks
        # (positions global), its heads the query heads of this rank's slice of the U head slices
        # (a mask that depends on the head is planned for those heads only).
        per_rank = query.shape[1] // head_group.size
        span = (head_group.rank * per_rank, (head_group.rank + 1) * per_rank)
        ring_cfg = RingConfig(group=groups.ring_group(query.device), is_causal=bool(is_causal), scale=effective_scale,
                              layout=layout, rotate_method=rotate_method, op=op_obj, head_chunks=head_chunks,
                              mask=folded, mask_dims=(query.shape[0], query.shape[1]), mask_heads=span)
    cfg = HeadParallelConfig(heads=head_group, is_causal=bool(is_causal), scale=effective_scale,
                             layout=layout, op=op_obj, return_lse=bool(return_lse) or sinks is not None, ring=ring_cfg,
                             ring_impl=impl, mask=folded if strategy == "ulysses" else None)
    return HeadParallelPath(cfg, algo)


def _masking_problem(query, key, mask, sinks, mesh_shape) -> str | None:
    if mask is None and sinks is None:
        return None
    return masking_problem(query, key, mask, sinks, world_size=mesh_shape[0] * mesh_shape[1])
