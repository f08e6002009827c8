"""Input checks of the head-parallel strategies, on every rank of the mesh before any collective.

As for the ring (:mod:`ring_impl.checks.inputs`): every rank first finds its own problem without
raising, then the ranks exchange one small table (each fills its own row: a problem flag and its
signature) and every rank raises the same :class:`ring_impl.InputError` if any rank found a
problem or the rows differ. On a 2-D mesh the table goes round in two SUM all-reduces, one over
the rank's Ulysses group and one over its ring group: after the first every rank holds its row's
entries, after the second every row's (each entry is added once, by the row's rank in the
column). Nothing is raised between the two, so no rank is left waiting. Skipped under
``torch.compile`` (as the ring's); declared in the schedule (phase ``forward``, ``all_reduce``).
"""

from __future__ import annotations

import dataclasses

import torch
import torch.distributed as dist

from ..exchanges.heads import check_head_chunks
from ..exchanges.mesh_groups import StrategyGroups
from ..exchanges.ulysses import kv_replication
from ..layout import LAYOUTS
from .inputs import (
    STRATEGY_FIELDS,
    LocalCall,
    _is_bool,
    agree,
    exchange_nbytes,
    local_problem,
    never_raises,
    signature,
    strategy_codes,
)

__all__ = [
    "STRATEGY_FIELDS",
    "agree_on_mesh",
    "exchange_calls",
    "exchange_nbytes",
    "strategy_problem",
    "ulysses_head_chunks_problem",
]


def exchange_calls(mesh_shape: tuple[int, int]) -> int:
    """All-reduces of the check: one per mesh dim of size > 1."""
    return int(mesh_shape[0] > 1) + int(mesh_shape[1] > 1)


@never_raises
def strategy_problem(strategy: str, local: LocalCall, *, mesh_shape: tuple[int, int]) -> str | None:
    """Everything one rank can check alone (the ring's checks and the strategy's); never raises."""
    query, key, layout, head_chunks = local.query, local.key, local.layout, local.head_chunks
    if not _is_bool(return_lse := local.return_lse):
        return f"return_lse must be a bool, got {return_lse!r} ({type(return_lse).__name__})"
    # The ring's checks, with the layout and head_chunks checked below for the strategy.
    base = local_problem(dataclasses.replace(local, layout="contiguous", head_chunks=1))
    if base is not None:
        return base
    u, r = mesh_shape
    heads, heads_kv, sq, skv = query.shape[1], key.shape[1], query.shape[2], key.shape[2]
    if heads % u:
        return (
            f"query heads ({heads}) are not divisible by the Ulysses degree {u}: each rank "
            f"attends whole heads, heads / {u} of them; use a Ulysses degree that divides {heads}"
            + (
                " (a smaller 'ulysses' mesh dim, the rest on 'ring')"
                if strategy == "hybrid"
                else " (exchange='hybrid' with a smaller Ulysses degree, or exchange='ring')"
            )
        )
    from ..layout import is_derived

    if strategy == "ulysses" and is_derived(layout):
        # an uneven call's padded layout (ring_impl.planning.uneven): masked, ordered by positions
        pass
    elif not isinstance(layout, str) or layout not in LAYOUTS:
        from ..layout import layouts as registered_layouts

        if isinstance(layout, str) and layout in registered_layouts():
            return (
                f"layout {layout!r} is registered, but {strategy} runs the built-in layouts "
                f"{LAYOUTS} only (its all-to-all reorders by them); use exchange='ring' for a "
                "registered layout"
            )
        return f"unknown layout {layout!r}; expected one of {LAYOUTS}"
    if layout == "head_tail":
        # Ulysses: two equal chunks per rank; hybrid: the
        # row's ring shard (U local pieces) holds two.
        held = 1 if strategy == "ulysses" else u
        if (held * sq) % 2 or (held * skv) % 2:
            return (
                f"layout 'head_tail' needs {'local' if held == 1 else 'row (U x local)'} lengths "
                f"that split into two equal chunks; got query {held * sq}, key/value "
                f"{held * skv}; shard a sequence that is a multiple of "
                f"{2 * u if strategy == 'ulysses' else 2 * r * u}"
            )
    if strategy == "ulysses":
        return ulysses_head_chunks_problem(head_chunks)
    heads_kv_per_rank = heads_kv * kv_replication(heads_kv, u) // u
    problem = check_head_chunks(head_chunks, heads_kv_per_rank)
    if problem is not None:
        return f"{problem} (the hybrid's ring runs on {heads_kv_per_rank} key/value heads per rank)"
    return None


def ulysses_head_chunks_problem(head_chunks) -> str | None:
    """Why Ulysses cannot take ``head_chunks``, or None (only the int 1: Ulysses has no ring)."""
    if type(head_chunks) is not int or head_chunks != 1:  # 1.0 and True are not the int 1
        return (
            f"head_chunks={head_chunks!r} applies to the ring; exchange='ulysses' runs one "
            "kernel call per rank on its slice of heads: leave head_chunks at 1"
        )
    return None


def agree_on_mesh(
    problem: str | None,
    strategy: str,
    groups: StrategyGroups,
    local: LocalCall,
    *,
    device: torch.device,
    mask_code: int = 0,
) -> None:
    """The mesh's :func:`ring_impl.checks.inputs.agree`: raise InputError on every rank of the mesh
    if any rank has a problem or the ranks disagree.

    Rows of the table are mesh ranks (``r * U + u``), its last entry (the ring's finiteness flag)
    stays 0; layouts are compared by name."""
    mesh_shape, mesh_rank = groups.shape, groups.mesh_rank
    codes = None
    if problem is None:
        codes = signature(local, mask_code=mask_code) + strategy_codes(
            strategy, mesh_shape, local.return_lse
        )
    agree(
        problem,
        codes,
        row=mesh_rank,
        size=mesh_shape[0] * mesh_shape[1],
        groups=[
            pg
            for pg in (groups.ulysses, groups.ring)
            if pg is not None and dist.get_world_size(pg) > 1
        ],
        device=device,
        op=local.op,
        world_size=None,
        where=(
            f"{strategy} attention (mesh rank {mesh_rank}, ulysses {groups.coords[0]}, ring "
            f"{groups.coords[1]})"
        ),
        refused=lambda bad: f"mesh rank(s) {bad}",
        numbering=" (ranks numbered as mesh ranks, ring * U + ulysses)",
    )
