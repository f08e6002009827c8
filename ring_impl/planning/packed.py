"""Packed (THD) inputs: ``ring_attention(query, key, value, cu_seqlens=...)``.

FlashAttention's varlen functions, TransformerEngine's THD format and MagiAttention's varlen key
take a batch of documents packed into one token dimension: ``(tokens, heads, head_dim)`` with
``cu_seqlens = [0, l0, l0 + l1, ...]`` the cumulative document lengths. Under context
parallelism each rank holds its shard of the *global* packed sequence (``tokens_local = tokens /
W`` rows, at the global positions its layout gives it: ``ring_impl.shard(t, W, rank, layout=...,
dim=0)``), and ``cu_seqlens`` is the global one, equal on every rank.

Such a call is the 4-D call on ``(1, heads, tokens_local, head_dim)`` views with the documents
as a mask (:class:`ring_impl.masks.Documents`, causal within each document when ``is_causal``),
intersected with ``mask`` when one is given too. So it runs on every exchange, layout, op and
balancer the documents mask does, at the cost of the mask (one kernel call per ring step on an
op taking row bounds, ``ring_impl.planning.row_bounds``). Tokens from ``cu_seqlens[-1]`` to the
global length are padding: they see nothing and nothing sees them (out 0, LSE -inf).

Returns ``(tokens_local, heads, head_dim_v)`` (contiguous) and, with ``return_lse``, the LSE as
``(heads, tokens_local)``, FlashAttention's varlen layout.
"""

from __future__ import annotations

import collections
import functools
import itertools
import numbers
from collections.abc import Sequence

import torch

from .. import masks
from ..masks import Documents, IdsCheck

__all__ = [
    "keep_documents",
    "kept_documents",
    "packed_documents",
    "packed_problem",
    "packed_result",
    "packed_views",
    "sequence_place",
]


def sequence_place(strategy: str, group) -> tuple[int, int] | None:
    """``(ranks, place)``: how many ranks the sequence is sharded over for ``strategy``'s
    ``group`` and this rank's place among them (its shard's index in sequence order); None when
    the group cannot be resolved (the call's own checks then say why)."""
    from ..group import resolve_group

    try:
        if strategy in ("ulysses", "hybrid"):
            from ..exchanges.mesh_groups import resolve_strategy_groups

            groups = resolve_strategy_groups(strategy, group)
            (u_size, r_size), (u, r) = groups.shape, groups.coords
            return u_size * r_size, r * u_size + u
        pg = resolve_group(group)
        return torch.distributed.get_world_size(pg), torch.distributed.get_rank(pg)
    except Exception:  # a bad group: refused by the call's checks, on every rank
        return None


def packed_problem(
    query,
    key,
    value,
    cu_seqlens,
    world: int | None,
    total: int | None = None,
    *,
    values: bool = True,
) -> str | None:
    """What is wrong with a packed call's tensors and ``cu_seqlens``, or None; never raises.
    ``total``: the global token count (None: ``tokens_local x world``, equal shards). Reads
    ``cu_seqlens`` on the host (a copy when it lives on a device) unless ``values`` is False:
    a tensor's values are then known good (:func:`kept_documents`) and only its kind is
    checked."""
    try:
        return _problem(query, key, value, cu_seqlens, world, total, values)
    except Exception as exc:  # a check that trips over an argument is still a problem
        return f"invalid packed arguments ({type(exc).__name__}: {exc})"


def _problem(
    query, key, value, cu_seqlens, world: int | None, total: int | None, read: bool
) -> str | None:
    for name, t in (("query", query), ("key", key), ("value", value)):
        if not isinstance(t, torch.Tensor) or t.dim() != 3:
            shape = tuple(t.shape) if isinstance(t, torch.Tensor) else type(t).__name__
            return (
                f"with cu_seqlens, {name} must be packed (tokens_local, heads, head_dim), got "
                f"{shape}; pass 4-D (batch, heads, seq_local, head_dim) tensors without cu_seqlens"
            )
    if key.shape[0] != query.shape[0] or value.shape[0] != query.shape[0]:
        return (
            "with cu_seqlens, key and value hold the query's tokens (self-attention over packed "
            f"documents), got query {query.shape[0]}, key {key.shape[0]}, value {value.shape[0]} "
            "tokens; for cross attention pass 4-D tensors and Documents(doc_ids, kv_doc_ids=...)"
        )
    if isinstance(cu_seqlens, torch.Tensor):
        if (
            cu_seqlens.dim() != 1
            or cu_seqlens.is_floating_point()
            or cu_seqlens.is_complex()
            or cu_seqlens.dtype == torch.bool
        ):
            return (
                f"cu_seqlens must be a 1-D integer tensor, got {cu_seqlens.dtype} of shape "
                f"{tuple(cu_seqlens.shape)}"
            )
        if torch.compiler.is_compiling() or not read:
            # its values are data in a graph: the documents they make are checked when the call
            # runs; not read: known good
            return None
        values = cu_seqlens.tolist()
    elif isinstance(cu_seqlens, Sequence) and (
        all(type(x) is int for x in cu_seqlens)  # (the common case, without abc checks)
        or all(isinstance(x, numbers.Integral) and not isinstance(x, bool) for x in cu_seqlens)
    ):
        values = [int(x) for x in cu_seqlens]
    else:
        return f"cu_seqlens must be a 1-D integer tensor or a list of ints, got {cu_seqlens!r}"
    shown = f"{total} (the sum of shard_lengths)"
    if total is None and world is not None:
        total = query.shape[0] * world
        shown = f"{total} (tokens_local {query.shape[0]} x {world} ranks)"
    if (
        not values
        or values[0] != 0
        or any(b < a for a, b in itertools.pairwise(values))
        or (total is not None and values[-1] > total)
    ):
        return (
            f"cu_seqlens must start at 0, not decrease and end at most at the global token count "
            f"{shown}, got {values}"
        )
    return None


def packed_views(
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The 4-D call's ``(1, heads, tokens_local, head_dim)`` views of a packed call's query, key
    and value (gradients flow back through them)."""
    q, k, v = (t.transpose(0, 1).unsqueeze(0) for t in (query, key, value))
    return q, k, v


def packed_documents(cu_seqlens, total: int, causal: bool) -> Documents:
    """The documents of ``cu_seqlens`` on the global packed sequence of ``total`` tokens (the 4-D
    call's mask, causal within each document when ``causal``); kept per values
    (:func:`_memo_documents`), so a model's layers share one, read on the host once per call."""
    if torch.compiler.is_compiling():  # cu_seqlens are data in a graph: no values to key a memo by
        return _documents(torch.as_tensor(cu_seqlens), total, causal)
    if isinstance(cu_seqlens, torch.Tensor):
        return _memo_documents(tuple(cu_seqlens.tolist()), total, causal)
    return _memo_documents(tuple(int(x) for x in cu_seqlens), total, causal)


#: (dtype, length, device, total tokens, causal) -> (a copy of the last packed call's
#: cu_seqlens that lived on that device, their documents): served again unread, the copy
#: compared on the device (kept_documents). The 8 most recent kinds.
_ON_DEVICE: collections.OrderedDict[tuple, tuple[torch.Tensor, Documents]] = (
    collections.OrderedDict()
)


def _device_key(cu_seqlens, total: int, causal: bool) -> tuple | None:
    """The :data:`_ON_DEVICE` key of ``cu_seqlens``; None where reading them costs no device
    sync (a list, a CPU tensor) or nothing is read (compiling)."""
    if (
        not isinstance(cu_seqlens, torch.Tensor)
        or masks.reads_are_free(cu_seqlens)
        or torch.compiler.is_compiling()
    ):
        return None
    return (cu_seqlens.dtype, tuple(cu_seqlens.shape), cu_seqlens.device, total, causal)


def kept_documents(cu_seqlens, total: int, causal: bool, ids: IdsCheck) -> Documents | None:
    """The documents of the last packed call whose ``cu_seqlens`` lived on the same device, with
    the same dtype and length, over ``total`` tokens (:func:`keep_documents`), served without
    reading ``cu_seqlens`` (a device sync per call): their compare with the kept copy is left in
    ``ids``, unread (:class:`ring_impl.masks.IdsCheck`; lengths that differ make the call raise
    StaleIds and run again, read). None where nothing is kept or reading is free."""
    key = _device_key(cu_seqlens, total, causal)
    hit = None if key is None else _ON_DEVICE.get(key)
    if hit is None:
        return None
    ids.compare([cu_seqlens], [hit[0]])
    return hit[1]


def keep_documents(cu_seqlens, total: int, causal: bool, documents: Documents) -> None:
    """Keep ``documents``, made from ``cu_seqlens`` read on the host and found good, for the next
    call with lengths on the same device (:func:`kept_documents`); lengths whose read costs
    nothing are not kept."""
    key = _device_key(cu_seqlens, total, causal)
    if key is None:
        return
    _ON_DEVICE[key] = (cu_seqlens.detach().clone(), documents)
    _ON_DEVICE.move_to_end(key)
    while len(_ON_DEVICE) > 8:
        _ON_DEVICE.popitem(last=False)


def _documents(cu: torch.Tensor, total: int, causal: bool) -> Documents:
    """The documents of cumulative lengths ``cu`` over ``total`` global tokens (the call then runs
    with is_causal=False: ``causal`` is the documents')."""
    positions = torch.arange(total, device=cu.device)
    # Document d holds positions [cu[d], cu[d + 1]); positions from cu[-1] on are padding (-1).
    ids = torch.searchsorted(cu[1:].to(torch.int64), positions, right=True)
    ids = torch.where(positions < cu[-1], ids, torch.full_like(ids, -1))
    return Documents(ids, causal)


@functools.lru_cache(maxsize=64)
def _memo_documents(cu: tuple[int, ...], total: int, causal: bool) -> Documents:
    """The snapshot of the documents of ``cu`` (cu_seqlens values) over ``total`` tokens, kept
    for the 64 most recent: a model's layers (and its steps over one batch) share one, its ids,
    checks and plans made once."""
    return _documents(torch.tensor(cu, dtype=torch.int64), total, causal).frozen()


def packed_result(result, return_lse: bool, return_max_logit: bool = False):
    """The 4-D call's result in the packed layout: out ``(tokens_local, heads, head_dim_v)``, LSE
    ``(heads, tokens_local)``; the max logit ``(heads,)`` as it is."""
    parts = list(result) if return_lse or return_max_logit else [result]
    parts[0] = parts[0].squeeze(0).transpose(0, 1).contiguous()
    if return_lse:
        parts[1] = parts[1].squeeze(0)
    return tuple(parts) if len(parts) > 1 else parts[0]
