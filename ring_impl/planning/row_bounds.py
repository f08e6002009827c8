"""A mask as one interval of keys per query row, computed from its parameters in O(rows + cols)
instead of evaluated over every (query, key) pair.

Most masks in use show each query one contiguous range of key positions: causal, sliding windows,
chunked causal, prefix-LM (``kv < prefix or kv <= q`` is ``kv <= max(prefix - 1, q)``), packed
documents whose tokens are contiguous, and intersections of these. For them a block's visibility
is two integers per query row, ``[lo, hi)`` on the block's local key columns, and a plan built
from them costs O(rows + cols) time and memory where the dense visibility costs rows x cols (4 GiB
of booleans for one 64k-token step, 30 s to evaluate on a CPU).

:func:`key_bounds` gives the bounds in key *positions* for the built-in masks (exact types only:
a subclass may change ``visible``), None for any other (a ``MaskMod``, a union, documents with
padding inside a document, a mask that depends on the batch or the head). :func:`column_bounds`
maps them to local columns of a shard whose key positions increase along the local order (every
built-in layout), which is what the ring's plan hands a kernel that takes row bounds
(``OpCapabilities.row_bounds``).

Shapes: ``q_pos`` (rows,) and ``kv_pos`` (cols,) int64 global positions; bounds (rows,) int64.
"""

from __future__ import annotations

import torch

from .. import masks

__all__ = ["column_bounds", "key_bounds"]

#: A bound no position reaches (positions are < 2^62 for any tensor torch can hold).
_FAR = 1 << 62


def key_bounds(
    mask: masks.Mask, q_pos: torch.Tensor, kv_pos: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor] | None:
    """``(lo, hi)``: query ``q_pos[r]`` sees exactly the keys at positions ``p`` with
    ``lo[r] <= p < hi[r]`` among ``kv_pos`` (``lo >= hi``: none); None when ``mask`` is not one
    interval per row that this module can state from its parameters."""
    rule = _RULES.get(type(mask))
    return None if rule is None else rule(mask, q_pos.to(torch.int64), kv_pos.to(torch.int64))


def column_bounds(
    mask: masks.Mask, q_pos: torch.Tensor, kv_pos: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor] | None:
    """:func:`key_bounds` as local key columns: query row ``r`` sees columns ``lo[r] .. hi[r] - 1``
    of ``kv_pos`` (``lo == hi``: none). None also when ``kv_pos`` does not increase strictly
    (a range of positions would then not be a range of columns)."""
    if type(mask) not in _RULES:  # (before the order check, which reads: a sync on a GPU)
        return None
    kv = kv_pos.to(torch.int64)
    if kv.numel() > 1 and not bool((kv[1:] > kv[:-1]).all()):
        return None
    bounds = key_bounds(mask, q_pos, kv)
    if bounds is None:
        return None
    lo = torch.searchsorted(kv, bounds[0].contiguous())
    hi = torch.searchsorted(kv, bounds[1].contiguous())
    return lo, torch.maximum(lo, hi)


def _full(mask, q, kv):
    return torch.full_like(q, -_FAR), torch.full_like(q, _FAR)


def _causal(mask, q, kv):
    return torch.full_like(q, -_FAR), q + 1


def _window(mask: masks.SlidingWindow, q, kv):
    lo = torch.full_like(q, -_FAR) if mask.left is None else q - mask.left
    hi = torch.full_like(q, _FAR) if mask.right is None else q + mask.right + 1
    return lo, hi


def _chunked(mask: masks.ChunkedCausal, q, kv):
    return torch.div(q, mask.chunk, rounding_mode="floor") * mask.chunk, q + 1


def _prefix(mask: masks.PrefixLM, q, kv):
    return torch.full_like(q, -_FAR), torch.clamp(q + 1, min=mask.prefix)


def _documents(mask: masks.Documents, q, kv):
    """A query sees the keys of its document (up to itself when causal): one range when every
    document's keys are contiguous (no padding inside a document), which is checked here."""
    q_ids = mask._ids(False, q.device)[q]
    kv_ids = mask._ids(True, kv.device)[kv]
    real = kv_ids >= 0
    ids, pos = kv_ids[real], kv[real]  # non-decreasing ids (Documents.check), positions increasing
    col = torch.arange(kv.numel(), device=kv.device)[real]
    if ids.numel() > 1 and not bool((ids[1:] >= ids[:-1]).all()):
        return None
    first = torch.searchsorted(ids, q_ids.contiguous(), side="left")
    last = torch.searchsorted(
        ids, q_ids.contiguous(), side="right"
    )  # one past the document's last key
    present = (last > first) & (q_ids >= 0)
    if ids.numel() > 0:
        # A document's keys are one range of columns when its first and last are as many
        # columns apart as it has keys; otherwise padding sits between them.
        at_first, at_last = first.clamp(max=ids.numel() - 1), (last - 1).clamp(min=0)
        start, end = pos[at_first], pos[at_last]
        gaps = present & (col[at_last] - col[at_first] != last - 1 - first)
        if bool(gaps.any()):
            return None
    else:
        start = end = torch.zeros_like(q)
    lo = torch.where(present, start, torch.zeros_like(q))
    hi = torch.where(present, end + 1, torch.zeros_like(q))
    if mask.causal:
        hi = torch.minimum(hi, q + 1)
    return lo, hi


def _key_ranges(mask: masks.KeyRanges, q, kv):
    return mask.bounds(q)


def _and(mask: masks.And, q, kv):
    a = key_bounds(mask.a, q, kv)
    b = None if a is None else key_bounds(mask.b, q, kv)
    if a is None or b is None:
        return None
    return torch.maximum(a[0], b[0]), torch.minimum(a[1], b[1])


_RULES = {
    masks.Full: _full,
    masks.Causal: _causal,
    masks.SlidingWindow: _window,
    masks.ChunkedCausal: _chunked,
    masks.PrefixLM: _prefix,
    masks.Documents: _documents,
    masks.KeyRanges: _key_ranges,
    masks.And: _and,
}
