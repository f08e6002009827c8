"""Input checks that fail on every rank, before any ring collective, never with a hang.

A check that fails on one rank only (a shape that differs between ranks, a dtype one rank got
wrong) would leave the other ranks blocked in the first ring collective. So every rank first
runs its local checks *without raising*, then all ranks exchange one small vector (a MAX
all-reduce of ``[per-rank error flags | shape signature | -shape signature]``), and every rank
raises if any rank found a problem or the signatures differ. The exchange is one tiny
all-reduce per call, declared in the collective schedule (phase ``forward``, kind
``all_reduce``); it is skipped under ``torch.compile``, where shapes are static per graph and
a data-dependent branch would break the graph.
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist

from .comm import ROTATE_METHODS
from .heads import check_head_chunks
from .layout import LAYOUTS
from .ops import AttentionOp

__all__ = ["SIGNATURE_FIELDS", "InputError", "agree_across_ranks", "exchange_nbytes", "local_problem"]

#: Fields compared across ranks; each must be equal on every rank.
SIGNATURE_FIELDS = (
    "batch", "heads", "heads_kv", "seq_q", "seq_kv", "head_dim", "dtype", "is_causal", "layout", "rotate_method",
    "head_chunks",
)

_DTYPE_CODES = {torch.float64: 1, torch.float32: 2, torch.bfloat16: 3, torch.float16: 4}


class InputError(ValueError):
    """Bad input to ring attention; raised on every rank of the group."""


def exchange_nbytes(world_size: int) -> int:
    """Bytes of the cross-rank check's all-reduce input (int64 per slot)."""
    return 8 * (world_size + 2 * len(SIGNATURE_FIELDS))


def local_problem(
    query, key, value, *, is_causal: bool, scale, layout: str, rotate_method: str, op: AttentionOp | None,
    op_error: str | None, head_chunks: int = 1,
) -> str | None:
    """Everything one rank can check alone; returns the problem or None. Never raises."""
    names = ("query", "key", "value")
    for name, t in zip(names, (query, key, value)):
        if not isinstance(t, torch.Tensor):
            return f"{name} must be a torch.Tensor, got {type(t).__name__}"
        if t.dim() != 4:
            return f"{name} must be 4-D (batch, heads, seq_local, head_dim), got shape {tuple(t.shape)}"
        if not t.is_floating_point():
            return f"{name} must be floating point, got {t.dtype}"
    if query.dtype != key.dtype or query.dtype != value.dtype:
        return f"query/key/value dtypes differ: {query.dtype}, {key.dtype}, {value.dtype}; cast them to one dtype"
    if query.device != key.device or query.device != value.device:
        return f"query/key/value devices differ: {query.device}, {key.device}, {value.device}"
    if key.shape != value.shape:
        return f"key and value shapes differ: {tuple(key.shape)} vs {tuple(value.shape)}"
    b, h, sq, d = query.shape
    bk, hkv, skv, dk = key.shape
    if b != bk:
        return f"batch differs: query has {b}, key/value have {bk}"
    if d != dk:
        return f"head_dim differs: query has {d}, key/value have {dk}"
    if hkv == 0 or h % hkv:
        return f"query heads ({h}) must be a multiple of key/value heads ({hkv}) for grouped-query attention"
    if min(b, h, sq, skv, d) == 0:
        return f"empty input: query {tuple(query.shape)}, key/value {tuple(key.shape)}"
    if is_causal and sq != skv:
        return (
            f"causal ring attention needs equal local query and key/value lengths, got {sq} and {skv}; "
            "use is_causal=False for cross attention"
        )
    if layout not in LAYOUTS:
        return f"unknown layout {layout!r}; expected one of {LAYOUTS}"
    if layout == "head_tail" and (sq % 2 or skv % 2):
        return (
            f"layout 'head_tail' holds two equal chunks per rank, so local lengths must be even; got "
            f"query {sq}, key/value {skv}; shard a sequence that is a multiple of 2 * world_size"
        )
    if rotate_method not in ROTATE_METHODS:
        return f"unknown rotate_method {rotate_method!r}; expected one of {ROTATE_METHODS}"
    chunks_problem = check_head_chunks(head_chunks, hkv)
    if chunks_problem is not None:
        return chunks_problem
    if scale is not None and not (isinstance(scale, (int, float)) and math.isfinite(scale)):
        return f"scale must be a finite number or None, got {scale!r}"
    if op_error is not None:
        return op_error
    assert op is not None
    why = op.capabilities.unsupported(query.device, query.dtype, d)
    if why is not None:
        return f"attention op {getattr(op, 'name', op)!r} does not support this input: {why}; choose another op="
    return None


def _signature(query, key, *, is_causal: bool, layout: str, rotate_method: str, head_chunks: int) -> list[int]:
    b, h, sq, d = query.shape
    hkv, skv = key.shape[1], key.shape[2]
    return [
        b, h, hkv, sq, skv, d, _DTYPE_CODES.get(query.dtype, 0), int(is_causal),
        LAYOUTS.index(layout), ROTATE_METHODS.index(rotate_method), head_chunks,
    ]


def agree_across_ranks(
    problem: str | None, query, key, *, is_causal: bool, layout: str, rotate_method: str, head_chunks: int = 1,
    group: dist.ProcessGroup, device: torch.device,
) -> None:
    """Raise InputError on every rank if any rank has a problem or the ranks disagree."""
    world, rank = dist.get_world_size(group), dist.get_rank(group)
    n = len(SIGNATURE_FIELDS)
    sig = [0] * n if problem is not None else _signature(
        query, key, is_causal=is_causal, layout=layout, rotate_method=rotate_method, head_chunks=head_chunks
    )
    flags = [0] * world
    flags[rank] = 1 if problem is not None else 0
    vec = torch.tensor(flags + sig + [-x for x in sig], dtype=torch.int64)
    staged = device.type != "cpu" and str(dist.get_backend(group)).lower() == "gloo"
    vec = vec if staged else vec.to(device)
    dist.all_reduce(vec, op=dist.ReduceOp.MAX, group=group)
    agreed: list[int] = vec.cpu().tolist()
    bad_ranks = [r for r in range(world) if agreed[r]]
    if problem is not None:
        raise InputError(f"ring_attention (rank {rank}): {problem}")
    if bad_ranks:
        raise InputError(
            f"ring_attention (rank {rank}): rank(s) {bad_ranks} rejected their input (see the error on "
            "those ranks); every rank raises so none is left waiting in a collective"
        )
    hi, lo = agreed[world : world + n], [-x for x in agreed[world + n :]]
    differing = [f"{name} ranges {lo_v}..{hi_v}" for name, lo_v, hi_v in zip(SIGNATURE_FIELDS, lo, hi) if lo_v != hi_v]
    if differing:
        raise InputError(
            f"ring_attention (rank {rank}): ranks disagree on {', '.join(differing)}; every rank must "
            "pass shards of equal shape and the same options (pad the sequence to a multiple of the "
            "layout's chunk count)"
        )
