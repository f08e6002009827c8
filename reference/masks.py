"""Attention masks as visibility on global token positions, for the float64 oracle.

A mask is described by a plain-data *spec* (a dict), the same description an implementation under
test receives (as a :class:`conformance.specs.MaskSpec`, this data with a ``visible`` view; an
implementation builds its own mask objects from it, which the oracle never uses):

``{"kind": "full"}``                        every query sees every key
``{"kind": "causal"}``                      key j <= query i (top-left aligned)
``{"kind": "document", "doc_ids": [...], "causal": bool}``
                                            per-token document ids (length = the sequence); a
                                            query sees the keys of its own document (and only
                                            earlier ones if causal); id -1 is padding: it sees
                                            nothing and nothing sees it. ``"cu_seqlens": [...]``
                                            (cumulative lengths from 0) may replace doc_ids, the
                                            tail after the last boundary being padding.
``{"kind": "sliding_window", "left": L, "right": R}``
                                            i - L <= j <= i + R (None: unbounded on that side);
                                            a causal window is right = 0
``{"kind": "chunked_causal", "chunk": C}``  j <= i within the same chunk of C tokens
``{"kind": "prefix_lm", "prefix": P}``      j <= i, or j < P (the prefix is seen by everyone)
``{"kind": "and" | "or", "masks": [...]}``  intersection / union of other masks
``{"kind": "mask_mod", "fn": f}``           ``f(b, h, q_idx, kv_idx) -> bool`` in flex attention's
                                            convention (broadcasting index tensors)

Everything is evaluated on *global* positions, whatever the layout, written without reference
to how an implementation splits the sequence.
"""

from __future__ import annotations

import itertools
from collections.abc import Mapping, Sequence
from typing import Any

import torch
from torch import Tensor

__all__ = ["MASK_KINDS", "document_ids", "visibility", "visible_at"]

MASK_KINDS = (
    "full",
    "causal",
    "document",
    "sliding_window",
    "chunked_causal",
    "prefix_lm",
    "and",
    "or",
    "mask_mod",
)


def document_ids(spec: Mapping[str, Any], seq_len: int) -> Tensor:
    """(seq_len,) int64 document id per token (-1 padding) of a ``document`` spec."""
    if "doc_ids" in spec:
        ids = torch.as_tensor(spec["doc_ids"], dtype=torch.int64)
        if ids.shape != (seq_len,):
            raise ValueError(
                f"document mask: doc_ids has shape {tuple(ids.shape)}, expected ({seq_len},)"
            )
        return ids
    bounds = [int(x) for x in spec["cu_seqlens"]]
    if (
        not bounds
        or bounds[0] != 0
        or any(b < a for a, b in itertools.pairwise(bounds))
        or bounds[-1] > seq_len
    ):
        raise ValueError(
            f"document mask: cu_seqlens {bounds} must start at 0, not decrease and end <= {seq_len}"
        )
    ids = torch.full((seq_len,), -1, dtype=torch.int64)
    for doc, (a, b) in enumerate(itertools.pairwise(bounds)):
        ids[a:b] = doc
    return ids


def visible_at(spec: Mapping[str, Any], b: Tensor, h: Tensor, q: Tensor, k: Tensor) -> Tensor:
    """Bool visibility of ``spec`` at index tensors in flex attention's ``mask_mod`` convention:
    ``b``, ``h``, ``q`` (query positions) and ``k`` (key positions) broadcast to (batch, heads,
    seq_q, seq_k); positions are global. The result is on the positions' device."""
    kind = spec.get("kind")
    if kind == "full":
        return torch.ones(
            torch.broadcast_shapes(q.shape, k.shape), dtype=torch.bool, device=q.device
        )
    if kind == "causal":
        return k <= q
    if kind == "document":
        if "doc_ids" in spec:
            n = len(spec["doc_ids"])
        else:  # positions past the last boundary are padding, however long the sequence
            n = max(int(max(q.max(), k.max())) + 1, int(spec["cu_seqlens"][-1]))
        ids = document_ids(spec, n).to(q.device)
        dq, dk = ids[q], ids[k]
        same = (dq == dk) & (dq >= 0)
        return same & (k <= q) if spec.get("causal", True) else same
    if kind == "sliding_window":
        left, right = spec.get("left"), spec.get("right")
        seen = torch.ones(
            torch.broadcast_shapes(q.shape, k.shape), dtype=torch.bool, device=q.device
        )
        if left is not None:
            seen = seen & (k >= q - int(left))
        if right is not None:
            seen = seen & (k <= q + int(right))
        return seen
    if kind == "chunked_causal":
        c = int(spec["chunk"])
        return (k <= q) & (k // c == q // c)
    if kind == "prefix_lm":
        return (k <= q) | (k < int(spec["prefix"]))
    if kind in ("and", "or"):
        parts = [visible_at(m, b, h, q, k) for m in spec["masks"]]
        out = parts[0]
        for p in parts[1:]:
            out = (out & p) if kind == "and" else (out | p)
        return out
    if kind == "mask_mod":
        return torch.as_tensor(spec["fn"](b, h, q, k), dtype=torch.bool)
    raise ValueError(f"unknown mask kind {kind!r}; expected one of {MASK_KINDS}")


def visibility(
    spec: Mapping[str, Any] | None,
    seq_q: int,
    seq_k: int,
    *,
    batch: int = 1,
    heads: int = 1,
    q_positions: Sequence[int] | Tensor | None = None,
    k_positions: Sequence[int] | Tensor | None = None,
) -> Tensor:
    """Bool visibility (batch, heads, seq_q, seq_k) of a mask spec (None: full).

    q_positions / k_positions: the global positions of the rows and columns (default 0..seq-1);
    pass a rank's positions to get its local block of the global mask.
    """
    q = (
        torch.arange(seq_q)
        if q_positions is None
        else torch.as_tensor(q_positions, dtype=torch.int64)
    )
    k = (
        torch.arange(seq_k)
        if k_positions is None
        else torch.as_tensor(k_positions, dtype=torch.int64)
    )
    b = torch.arange(batch).view(-1, 1, 1, 1)
    h = torch.arange(heads).view(1, -1, 1, 1)
    seen = visible_at(spec or {"kind": "full"}, b, h, q.view(1, 1, -1, 1), k.view(1, 1, 1, -1))
    return seen.expand(batch, heads, q.numel(), k.numel())
