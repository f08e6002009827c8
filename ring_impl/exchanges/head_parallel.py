"""The head-parallel strategies behind ``ring_attention(..., strategy=...)``."""

from __future__ import annotations

from collections.abc import Mapping

import torch

from ..call import Call
from ..checks.inputs import InputError, LocalCall
from ..checks.mesh import agree_on_mesh, strategy_problem
from ..masks import fold_causal, mask_code, masking_problem
from ..planning.mesh_layout import STRATEGIES
from ..planning.plan import plan_ahead
from .heads import plan_chunks
from .hybrid import Hybrid
from .mesh_groups import resolve_strategy_groups
from .ring import RingAttention, RingConfig
from .ulysses import HeadParallelConfig, HeadParallelPath, Ulysses, kv_replication

__all__ = ["DEFAULT_ALGORITHMS", "strategy_path"]

#: The algorithm object of each head-parallel strategy (a variant replaces one, see ``bind``).
DEFAULT_ALGORITHMS: Mapping[str, Ulysses] = {"ulysses": Ulysses(), "hybrid": Hybrid()}


def strategy_path(
    impl: RingAttention,
    algorithms: Mapping[str, Ulysses] | None,
    call: Call,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
):
    """The :class:`~ring_impl.exchanges.ulysses.HeadParallelPath` serving ``call`` (exchange
    "ulysses" or "hybrid", see ``ring_impl.ring_attention``), after checking it on this rank and
    across the mesh (InputError on every rank for bad input). Its LSE is returned when
    ``return_lse`` or ``sinks`` (the sink term needs it). A ``score_mod`` runs on Ulysses' kernel
    with the global positions of the gathered sequence and the global indices of the rank's
    heads, and on the hybrid's ring as on the ring."""
    from ..score_mods import as_score_mod, score_mod_problem

    score_mod = as_score_mod(call.score_mod)
    strategy = call.strategy
    if strategy not in ("ulysses", "hybrid"):
        raise InputError(f"unknown strategy {strategy!r}; expected one of {STRATEGIES}")
    mask, sinks, layout, head_chunks = call.mask, call.sinks, call.layout, call.head_chunks
    is_causal, rotate_method = call.is_causal, call.rotate_method
    algo = (algorithms or DEFAULT_ALGORITHMS).get(strategy) or DEFAULT_ALGORITHMS[strategy]
    groups = resolve_strategy_groups(strategy, call.group)
    local = LocalCall.of(call, query, key, value, score_mod=score_mod)
    effective_scale, op_obj = local.effective_scale, local.op
    mesh_shape = groups.shape
    problem = (
        call.problem
        or (
            None
            if call.return_max_logit is False
            else (
                f"return_max_logit runs on the ring only (exchange={strategy!r} does not compute "
                "it); pass exchange='auto'"
            )
        )
        or strategy_problem(strategy, local, mesh_shape=mesh_shape)
        or _masking_problem(query, key, mask, sinks, mesh_shape)
        or score_mod_problem(
            score_mod,
            query,
            world_size=mesh_shape[0] * mesh_shape[1],
            key=key,
            layout=None,
            op=op_obj,
            strategy=strategy,
        )
    )
    cfg = None
    if problem is None:
        # strategy_problem passed the ring's checks: query 4-D, scale a number or None, op resolved
        assert effective_scale is not None and op_obj is not None
        folded = fold_causal(mask, is_causal)
        head_group = groups.head_group(query.device)
        ring_cfg = None
        if strategy == "hybrid":
            ring_cfg = _hybrid_ring_config(
                groups,
                head_group,
                query,
                folded,
                is_causal,
                effective_scale,
                layout,
                rotate_method,
                op_obj,
                head_chunks,
                score_mod,
            )
        cfg = HeadParallelConfig(
            heads=head_group,
            is_causal=bool(is_causal),
            scale=effective_scale,
            layout=layout,
            op=op_obj,
            return_lse=call.lse_needed,
            ring=ring_cfg,
            ring_impl=impl,
            mask=folded if strategy == "ulysses" else None,
            plan_memo={},
            score_mod=score_mod if strategy == "ulysses" else None,
        )
        # A mask known only by evaluating it is evaluated now, for what this rank will attend (the
        # hybrid: its ring's plans; Ulysses: the mask for its heads), so one that fails there is a
        # problem every rank raises (ring_impl.planning.plan.plan_ahead).
        problem = plan_ahead(lambda: _plan(algo, cfg, query, key, mesh_shape[0]), folded)
    if mesh_shape[0] * mesh_shape[1] > 1 and not torch.compiler.is_compiling():
        agree_on_mesh(
            problem,
            strategy,
            groups,
            local,
            device=query.device if isinstance(query, torch.Tensor) else torch.device("cpu"),
            mask_code=mask_code(
                mask, sinks, _global_dims(query, key, mesh_shape), query.device, score_mod=score_mod
            )
            if problem is None
            else 0,
        )
    elif problem is not None:
        raise InputError(f"{strategy} attention: {problem}")
    assert cfg is not None
    return HeadParallelPath(cfg, algo)


def _global_dims(query, key, mesh_shape) -> tuple[int, int, int, int]:
    """(batch, heads, seq_q, seq_kv) of the call: the local sequence shards times the mesh size."""
    n = mesh_shape[0] * mesh_shape[1]
    return query.shape[0], query.shape[1], query.shape[2] * n, key.shape[2] * n


def _plan(algo, cfg: HeadParallelConfig, query, key, u: int) -> None:
    """What the call's inner attention will evaluate of its mask, made now (kept in the configs'
    plan memos): after the all-to-all a rank holds U x the local lengths for heads / U query
    heads."""
    heads, seq_q, seq_kv = query.shape[1] // u, query.shape[2] * u, key.shape[2] * u
    if cfg.ring is not None:
        heads_kv = key.shape[1] * kv_replication(key.shape[1], u) // u
        plan_chunks(cfg.ring_impl, cfg.ring, heads, heads_kv, seq_q, seq_kv)
    else:
        algo.visible_for(cfg, query.shape[0], heads, seq_q, seq_kv, query.device)


def _hybrid_ring_config(
    groups,
    head_group,
    query,
    mask,
    is_causal,
    scale,
    layout,
    rotate_method,
    op,
    head_chunks,
    score_mod=None,
) -> RingConfig:
    """The hybrid's ring across rows, given ``mask`` with is_causal folded in. A row's shard is the
    ring layout's over R ranks (positions global), its heads the query heads of this rank's slice
    of the U head slices (a mask that depends on the head is planned for those heads only)."""
    per_rank = query.shape[1] // head_group.size
    span = (head_group.rank * per_rank, (head_group.rank + 1) * per_rank)
    return RingConfig(
        group=groups.ring_group(query.device),
        is_causal=bool(is_causal),
        scale=scale,
        layout=layout,
        rotate_method=rotate_method,
        op=op,
        head_chunks=head_chunks,
        mask=mask,
        mask_dims=(query.shape[0], query.shape[1]),
        mask_heads=span,
        plan_memo={},
        verdicts={},
        score_mod=score_mod,
    )


def _masking_problem(query, key, mask, sinks, mesh_shape) -> str | None:
    if mask is None and sinks is None:
        return None
    return masking_problem(query, key, mask, sinks, world_size=mesh_shape[0] * mesh_shape[1])
