"""Rank-side bad-input cases: each must raise on every rank, before any collective can hang.

Several problems exist on one rank only (a dtype, a length, an option of the wrong type), which is
the hard part: the other ranks have valid input and would otherwise wait forever in the first ring
collective. Options that must agree are those whose disagreement gives a wrong result or a hang
(causality, scale, layout, rotation); a per-rank choice that changes neither (whether to return
the LSE) is not an error.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

from conformance.implementation import load_implementation
from conformance.specs import MaskSpec, ScoreModSpec

__all__ = ["BAD_INPUTS", "bad_input_case"]

#: kind -> (what the error message must mention (regex, case-insensitive), needs)
#: ``needs``: None, "context_parallel" (the SDPA route), "cuda", "ops", "sinks", "score_mod",
#: "packed", "replicated_kv", or a mask kind of :data:`reference.masks.MASK_KINDS` ("mask_mod",
#: "document", "sliding_window").
BAD_INPUTS: dict[str, tuple[str, str | None]] = {
    "dtype_on_one_rank": (r"dtype", None),
    "device_mismatch": (r"device", "cuda"),
    "batch_mismatch": (r"batch", None),
    "head_dim_mismatch": (r"head_dim|head dim", None),
    "gqa_heads_not_divisible": (r"heads", None),
    "lengths_differ_between_ranks": (r"seq|length", None),
    "causal_cross_lengths": (r"causal", None),
    "layout_cannot_shard": (r"head_tail|even|layout", None),
    "unknown_op": (r"\bop\b|attention op", "ops"),
    "unknown_rotation": (r"rotate", None),
    "unknown_layout": (r"layout", None),
    "options_differ_between_ranks": (r"causal", None),
    "is_causal_none_on_one_rank": (r"is_causal", None),
    "is_causal_not_a_bool": (r"is_causal", None),
    "scale_differs_between_ranks": (r"scale", None),
    "layout_differs_between_ranks": (r"layout", None),
    "rotation_differs_between_ranks": (r"rotate", None),
    "dtensor_inputs": (r"DTensor", None),
    "nan_scale": (r"scale", None),
    "sdpa_attn_mask": (r"attn_mask|mask", "context_parallel"),
    "sdpa_dropout": (r"dropout", "context_parallel"),
    # a mask_mod that differs on one rank only where a probe of its first positions, batch 0 and
    # head 0 does not look: each rank would attend under its own mask
    "mask_mod_differs_beyond_64": (r"mask", "mask_mod"),
    "mask_mod_differs_at_head_1": (r"mask", "mask_mod"),
    "mask_mod_differs_at_batch_1": (r"mask", "mask_mod"),
    # packed lengths shared in one process group but not in the context-parallel one: the last
    # rank's documents split one position later
    "documents_differ_between_ranks": (r"mask|doc|cu_seqlens|seqlen", "document"),
    "window_differs_between_ranks": (r"mask|window", "sliding_window"),
    # a hook that drops the mask on one rank (that rank attends without it)
    "mask_on_some_ranks_only": (r"mask|window", "sliding_window"),
    # sink logits applied on one rank only, or another rank's values
    "sinks_on_some_ranks_only": (r"sink", "sinks"),
    "sinks_differ_between_ranks": (r"sink", "sinks"),
    "softcap_differs_between_ranks": (r"score.?mod|soft.?cap", "score_mod"),
    # packed (THD) lengths shared in one process group but not in the context-parallel one
    "cu_seqlens_differ_between_ranks": (r"cu_seqlens|seqlen|doc|mask", "packed"),
    # a cross-attention layer whose text tokens one rank takes for a sequence shard: that rank
    # would join a ring the others never start
    "replicated_kv_differs_between_ranks": (r"replicated", "replicated_kv"),
}

#: Where the last rank's mask_mod hides one more key, per kind (global positions; seq_q >= 96)
_MASK_MOD_DIFFERENCE = {
    "mask_mod_differs_beyond_64": lambda b, h, q, kv: (q == 90) & (kv == 70),
    "mask_mod_differs_at_head_1": lambda b, h, q, kv: (h == 1) & (q == kv) & (q > 0),
    "mask_mod_differs_at_batch_1": lambda b, h, q, kv: (b == 1) & (q == kv) & (q > 0),
}


def _differing_mask_mod(kind: str, last: bool):
    """A causal mask_mod; on the last rank it also hides the entries of
    ``_MASK_MOD_DIFFERENCE[kind]``."""
    hidden = _MASK_MOD_DIFFERENCE[kind]

    def causal_mask_mod(b, h, q_idx, kv_idx):
        seen = kv_idx <= q_idx
        return seen & ~hidden(b, h, q_idx, kv_idx) if last else seen

    return MaskSpec({"kind": "mask_mod", "fn": causal_mask_mod})


def document_cut(total: int, last: bool) -> int:
    """Where the two documents of ``total`` tokens meet in the bad-input cases whose ranks
    disagree on the documents: one token later on the last rank."""
    return total // 2 + (1 if last else 0)


def two_documents(total: int, last: bool) -> MaskSpec:
    """Two causal documents of ``total`` tokens cut at :func:`document_cut`."""
    cut = document_cut(total, last)
    return MaskSpec(
        {"kind": "document", "doc_ids": [0] * cut + [1] * (total - cut), "causal": True}
    )


def _qkv(ctx, batch=2, heads=4, heads_kv=4, seq=8, seq_kv=None, head_dim=16, dtype=torch.float32):
    seq_kv = seq if seq_kv is None else seq_kv
    q = torch.randn(batch, heads, seq, head_dim, dtype=dtype, device=ctx.device)
    k = torch.randn(batch, heads_kv, seq_kv, head_dim, dtype=dtype, device=ctx.device)
    v = torch.randn(batch, heads_kv, seq_kv, head_dim, dtype=dtype, device=ctx.device)
    return q, k, v


def bad_input_case(ctx, impl_spec: str | None, kind: str) -> str:
    """Call the implementation with the bad input ``kind``; return "no error" if nothing raised."""
    impl = load_implementation(impl_spec)
    last = ctx.rank == ctx.world_size - 1
    kw: dict[str, Any] = dict(
        group=ctx.group, is_causal=False, rotate_method="allgather", layout="contiguous"
    )
    q, k, v = _qkv(ctx)
    if kind == "dtype_on_one_rank":
        if last:
            k = k.double()
    elif kind == "device_mismatch":
        k = k.cpu()
    elif kind == "batch_mismatch":
        k, v = k[:1], v[:1]
    elif kind == "head_dim_mismatch":
        k, v = k[..., :8], v[..., :8]
    elif kind == "gqa_heads_not_divisible":
        q, k, v = _qkv(ctx, heads=4, heads_kv=3)
    elif kind == "lengths_differ_between_ranks":
        q, k, v = _qkv(ctx, seq=10 if last else 8)
    elif kind == "causal_cross_lengths":
        q, k, v = _qkv(ctx, seq=8, seq_kv=16)
        kw["is_causal"] = True
    elif kind == "layout_cannot_shard":
        q, k, v = _qkv(ctx, seq=3)
        kw.update(layout="head_tail", is_causal=True)
    elif kind == "unknown_op":
        kw["op"] = "no_such_op"
    elif kind == "unknown_rotation":
        kw["rotate_method"] = "ring_of_fire"
    elif kind == "unknown_layout":
        kw["layout"] = "zigzag_spiral"
    elif kind == "options_differ_between_ranks":
        kw["is_causal"] = ctx.rank == 0
    elif kind == "is_causal_none_on_one_rank":
        if last:
            kw["is_causal"] = None
    elif kind == "is_causal_not_a_bool":
        kw["is_causal"] = "yes"
    elif kind == "scale_differs_between_ranks":
        kw["scale"] = 0.25 if last else 0.125
    elif kind == "layout_differs_between_ranks":
        kw["layout"] = "head_tail" if last else "contiguous"
    elif kind == "rotation_differs_between_ranks":
        kw["rotate_method"] = "alltoall" if last else "allgather"
    elif kind == "dtensor_inputs":
        from torch.distributed.tensor import DTensor, Shard

        from suites.cases_api import _mesh

        mesh = _mesh(ctx)
        q, k, v = (DTensor.from_local(t, mesh, [Shard(2)]) for t in (q, k, v))
    elif kind in _MASK_MOD_DIFFERENCE:
        q, k, v = _qkv(ctx, seq=48)  # a global sequence of at least 96
        kw["mask"] = _differing_mask_mod(kind, last)
    elif kind == "documents_differ_between_ranks":
        kw["mask"] = two_documents(q.shape[2] * ctx.world_size, last)
    elif kind == "window_differs_between_ranks":
        kw["mask"] = MaskSpec({"kind": "sliding_window", "left": 4 if last else 3, "right": 0})
    elif kind == "mask_on_some_ranks_only":
        if not last:
            kw["mask"] = MaskSpec({"kind": "sliding_window", "left": 3, "right": 0})
    elif kind == "sinks_on_some_ranks_only":
        if not last:
            kw["sinks"] = torch.zeros(q.shape[1], device=ctx.device)
    elif kind == "sinks_differ_between_ranks":
        kw["sinks"] = torch.full((q.shape[1],), 0.5 if last else 0.0, device=ctx.device)
    elif kind == "softcap_differs_between_ranks":
        kw["score_mod"] = ScoreModSpec({"kind": "softcap", "cap": 20.0 if last else 30.0})
    elif kind == "cu_seqlens_differ_between_ranks":
        q, k, v = (t[0].transpose(0, 1).contiguous() for t in (q, k, v))  # (tokens, heads, d)
        total = q.shape[0] * ctx.world_size
        cut = document_cut(total, last)
        kw["cu_seqlens"] = torch.tensor([0, cut, total], dtype=torch.int32, device=ctx.device)
    elif kind == "replicated_kv_differs_between_ranks":
        kw["replicated_kv"] = not last  # key/value of the query's length: a valid shard too
        del kw["rotate_method"]
    elif kind == "nan_scale":
        kw["scale"] = float("nan")
    elif kind in ("sdpa_attn_mask", "sdpa_dropout"):
        from suites.cases_api import _mesh, api_of

        api = api_of(impl_spec)
        mask = torch.ones(8, 8, dtype=torch.bool, device=ctx.device).tril()
        extra = {"attn_mask": mask} if kind == "sdpa_attn_mask" else {"dropout_p": 0.1}
        with api.context_parallel(_mesh(ctx)):
            F.scaled_dot_product_attention(q, k, v, **extra)
        return "no error"
    else:
        raise KeyError(f"unknown bad-input kind {kind!r}")
    impl.obj.ring_attention(q, k, v, **kw)
    return "no error"
