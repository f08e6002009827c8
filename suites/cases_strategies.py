"""Rank-side bad input of the strategies: Ulysses and the hybrid on a ``(ulysses, ring)`` mesh
(:func:`suites.cases.strategy_group`), every rank raising the same error."""

from __future__ import annotations

from typing import Any

import torch

from conformance.implementation import load_implementation
from suites.cases import strategy_group
from suites.cases_errors import two_documents

__all__ = ["BAD_INPUTS", "MASKED_BAD_INPUTS", "strategy_bad_input_case"]

# ---------------------------------------------------------------------- bad input

#: kind -> (what every rank's error must mention (regex, case-insensitive),
#: strategies it applies to)
BAD_INPUTS: dict[str, tuple[str, tuple[str, ...]]] = {
    "heads_not_divisible_by_degree": (
        r"not divisible by the Ulysses degree",
        ("ulysses", "hybrid"),
    ),
    "heads_differ_on_one_rank": (r"heads", ("ulysses", "hybrid")),
    "length_differs_on_one_rank": (r"seq_q|length", ("ulysses", "hybrid")),
    "causal_differs_on_one_rank": (r"is_causal", ("ulysses", "hybrid")),
    "return_lse_differs_on_one_rank": (r"return_lse", ("ulysses", "hybrid")),
    # the last rank calls the ring on the same flat group: both checks must exchange one table
    # size (an implementation may call the choice its strategy or its exchange)
    "strategy_differs_on_one_rank": (r"strategy|exchange", ("ulysses",)),
    "head_tail_odd_rows": (r"head_tail", ("ulysses", "hybrid")),
    "head_chunks_for_ulysses": (r"head_chunks", ("ulysses",)),
    "hybrid_on_a_flat_group": (r"2-D DeviceMesh", ("hybrid",)),
    "unknown_strategy": (r"unknown strategy", ("ulysses", "hybrid")),
    # packed lengths shared in one process group but not in the context-parallel mesh
    "documents_differ_on_one_rank": (r"mask|doc|cu_seqlens|seqlen", ("ulysses", "hybrid")),
}
#: Kinds that need the masks of a kind (:data:`reference.masks.MASK_KINDS`) besides the strategy
MASKED_BAD_INPUTS = {"documents_differ_on_one_rank": "document"}


def strategy_bad_input_case(
    ctx, impl_spec: str | None, strategy: str, mesh_shape: tuple[int, int], kind: str
) -> str:
    """Call the implementation with the bad input ``kind``; "no error" if nothing raised."""
    group = strategy_group(ctx, strategy, mesh_shape)
    impl = load_implementation(impl_spec)
    u = mesh_shape[0]
    last = ctx.rank == ctx.world_size - 1
    heads, heads_kv, seq = 4 * u, 2, 4 * u
    kw: dict[str, Any] = dict(
        group=group,
        strategy=strategy,
        is_causal=False,
        layout="contiguous",
        rotate_method="alltoall",
    )
    if kind == "heads_not_divisible_by_degree":
        heads, heads_kv = 4 * u + 1, 1
    elif kind == "heads_differ_on_one_rank" and last:
        heads = 8 * u
    elif kind == "length_differs_on_one_rank" and last:
        seq += 2 * u
    elif kind == "causal_differs_on_one_rank":
        kw["is_causal"] = last
    elif kind == "return_lse_differs_on_one_rank":
        kw["return_lse"] = last
    elif kind == "strategy_differs_on_one_rank" and last:
        kw["strategy"] = "ring"
    elif kind == "head_tail_odd_rows":
        kw["layout"], kw["is_causal"] = "head_tail", True
        seq = 1 if strategy == "hybrid" and u % 2 else 2 * u + 1
    elif kind == "head_chunks_for_ulysses":
        kw["head_chunks"] = 2
    elif kind == "hybrid_on_a_flat_group":
        kw["group"] = ctx.group
    elif kind == "unknown_strategy":
        kw["strategy"] = "ulysess"
    elif kind == "documents_differ_on_one_rank":
        kw["mask"] = two_documents(seq * ctx.world_size, last)
    q = torch.randn(2, heads, seq, 8, device=ctx.device)
    k = torch.randn(2, heads_kv, seq, 8, device=ctx.device)
    impl.obj.ring_attention(q, k, torch.randn_like(k), **kw)
    return "no error"
