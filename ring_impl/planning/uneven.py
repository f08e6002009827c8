"""Uneven shards: ``ring_attention(query, key, value, shard_lengths=...)``.

Rank ``r`` holds ``shard_lengths[r]`` tokens of a global sequence of ``S = sum(shard_lengths)``
(any ``S``, any split for ``layout="contiguous"``, the layout's own split of ``S`` for another:
:func:`ring_impl.layout.shard_lengths`; ``ring_impl.shard(t, W, rank, layout=..., lengths=...)``
cuts them). ``shard_lengths`` is equal on every rank; a rank may hold no token.

Such a call is an even call on a longer sequence: every rank pads its shard at the end to ``L =
max(shard_lengths)`` rows, and the ``W * L - S`` padding rows take the global positions ``S ..
W*L - 1``, each rank's after its real ones (:func:`padded_layout`, a layout like any other: a
rank's positions still increase along its local order). Every real token keeps its own global
position, so causality, windows, documents, ALiBi and the balancers see the true sequence; the
padding is hidden by the mask: a documents mask whose padding (id -1) sees nothing and is seen by
nothing (:func:`real_tokens`), intersected with the call's mask (its tensors extended to the
padded length, :func:`extended_mask`). The plan trims rows and columns nothing sees, so a padding
row costs no kernel work; it travels with its shard (``L - n_r`` rows of rank ``r``). The
output, LSE and gradients of the padding rows are cut off before they reach the caller.

Runs on the exchanges ``"auto"`` (the ring), ``"ring"``, ``"gather"`` and ``"ulysses"``, with
every op, rotation, GQA, head_chunks, mask, sinks, score_mod, max logit and packed (THD) inputs.
Not ``"halo"`` (its exchange sizes come from equal shards) nor ``"hybrid"`` (a row's shard is cut
into equal Ulysses pieces): InputError on every rank.
"""

from __future__ import annotations

import functools
import numbers
from collections.abc import Sequence
from typing import Any

import torch
import torch.nn.functional as F

from .. import masks
from ..layout import Layout, Runs, check_layout, register_derived, split_runs

__all__ = [
    "extended_mask",
    "extended_score_mod",
    "padded_layout",
    "real_tokens",
    "uneven_problem",
    "uneven_result",
    "uneven_views",
]

#: Exchanges an uneven call runs on (the rest refuse it on every rank).
EXCHANGES = ("auto", "ring", "gather", "ulysses")

#: Built-in masks whose parameters hold no sequence length: the same mask on the padded sequence.
_LENGTHLESS = (masks.Full, masks.Causal, masks.SlidingWindow, masks.ChunkedCausal, masks.PrefixLM)


def lengths_problem(shard_lengths, world: int) -> str | None:
    """What is wrong with ``shard_lengths`` for ``world`` ranks, or None; never raises."""
    if isinstance(shard_lengths, torch.Tensor):
        if shard_lengths.dim() != 1 or shard_lengths.is_floating_point():
            return f"shard_lengths must be a 1-D list of ints, got a tensor {shard_lengths!r}"
        shard_lengths = shard_lengths.tolist()
    if not isinstance(shard_lengths, Sequence) or not all(
        isinstance(n, numbers.Integral) and not isinstance(n, bool) for n in shard_lengths
    ):
        return f"shard_lengths must be a list of ints, one per rank, got {shard_lengths!r}"
    if len(shard_lengths) != world or any(n < 0 for n in shard_lengths) or sum(shard_lengths) < 1:
        return (
            f"shard_lengths must hold {world} ints >= 0 (one per rank of the sequence's "
            f"{world} ranks, rank 0 first) with a positive sum, got {list(shard_lengths)}"
        )
    return None


def uneven_problem(
    query, key, value, lengths: tuple[int, ...], rank: int, *, layout, exchange, mask, score_mod
) -> str | None:
    """What is wrong with an uneven call on this rank (``lengths`` already checked by
    :func:`lengths_problem`), or None; never raises. The mask and score_mod are checked on the
    real sequence ``sum(lengths)`` here; the padded call checks the rest."""
    try:
        return _problem(query, key, value, lengths, rank, layout, exchange, mask, score_mod)
    except Exception as exc:  # a check that trips over an argument is still a problem
        return f"invalid uneven-shard arguments ({type(exc).__name__}: {exc})"


def _problem(query, key, value, lengths, rank, layout, exchange, mask, score_mod) -> str | None:
    if exchange not in EXCHANGES:
        if exchange in ("halo", "hybrid"):
            return (
                f"shard_lengths= runs on the exchanges {EXCHANGES}, not {exchange!r} (it needs "
                "equal local lengths); pass exchange='ring' or 'gather'"
            )
        return None  # an unknown exchange: the call's own check says so
    for name, t in (("query", query), ("key", key), ("value", value)):
        if not isinstance(t, torch.Tensor) or t.dim() != 4:
            return None  # the shape problem is reported by the input checks
        if t.shape[2] != lengths[rank]:
            return (
                f"{name} holds {t.shape[2]} tokens on rank {rank} but shard_lengths[{rank}] is "
                f"{lengths[rank]}; every rank passes its own shard of the sequence, split as "
                "shard_lengths says (query, key and value alike)"
            )
    if not isinstance(layout, str):
        return None
    try:
        check_layout(layout)
        split_runs(layout, lengths, rank)
    except ValueError as exc:
        return str(exc)
    seq = sum(lengths)
    b, h = query.shape[0], query.shape[1]
    problem = masks.mask_problem(mask, seq_q=seq, seq_kv=seq, batch=b, heads=h)
    if problem is None and score_mod is not None:
        from ..score_mods import ScoreMod, as_score_mod

        sm = as_score_mod(score_mod)
        if isinstance(sm, ScoreMod):
            problem = sm.check(batch=b, heads=h, seq_q=seq, seq_kv=seq, device=query.device)
    return problem


def padded_layout(layout: str, lengths: tuple[int, ...]) -> str:
    """The name of the padded call's layout: rank ``r``'s real runs under ``layout`` for the split
    ``lengths``, then its padding rows at positions from ``sum(lengths)`` on (rank 0's padding
    first). The layout is built from its name wherever the name is met (every rank, a compiled
    graph's op: :func:`ring_impl.layout.register_derived`)."""
    return f"{_PREFIX}{layout};{','.join(map(str, lengths))})"


_PREFIX = "padded("


def _from_name(name: str) -> Layout:
    """The layout :func:`padded_layout` names (ValueError for a name it cannot have made)."""
    base, _, counts = name[len(_PREFIX) : -1].rpartition(";")
    try:
        lengths = tuple(int(n) for n in counts.split(","))
    except ValueError:
        raise ValueError(f"not a padded layout name: {name!r}") from None
    if not name.endswith(")") or not base or min(lengths) < 0 or sum(lengths) < 1:
        raise ValueError(f"not a padded layout name: {name!r}")
    check_layout(base)
    world, seq, rows = len(lengths), sum(lengths), max(lengths)
    padding = [rows - n for n in lengths]

    def runs(seq_len: int, world_size: int, rank: int) -> Runs:
        if (seq_len, world_size) != (rows * world, world):
            raise ValueError(
                f"layout {name!r} holds {rows * world} positions over {world} ranks, not "
                f"{seq_len} over {world_size}"
            )
        start = seq + sum(padding[:rank])
        pad = ((start, start + padding[rank]),) if padding[rank] else ()
        return split_runs(base, lengths, rank) + pad

    return Layout(name, runs, lambda w: w, derived=True)


register_derived(_PREFIX, _from_name)


def real_tokens(seq: int, total: int, causal: bool) -> masks.Documents:
    """Documents over ``total`` positions: ``[0, seq)`` one document (causal when ``causal``),
    the rest padding (id -1: sees nothing, seen by nothing). Kept for the 64 most recent shapes
    (a snapshot: its ids, checks and plans made once); made anew inside a compiled graph."""
    if torch.compiler.is_compiling():
        return _real_tokens(seq, total, causal)
    return _memo_real_tokens(seq, total, causal)


def _real_tokens(seq: int, total: int, causal: bool) -> masks.Documents:
    ids = torch.zeros(total, dtype=torch.int64)
    ids[seq:] = -1
    return masks.Documents(ids, causal)


@functools.lru_cache(maxsize=64)
def _memo_real_tokens(seq: int, total: int, causal: bool) -> masks.Documents:
    return _real_tokens(seq, total, causal).frozen()


def extended_mask(mask: masks.Mask, seq: int, total: int) -> masks.Mask:
    """``mask`` on global positions ``[0, seq)`` as a mask on ``[0, total)`` that agrees with it
    there (what it says beyond is hidden by :func:`real_tokens`): document ids extended with
    padding (-1), key ranges with empty ones for the padding queries, a function's positions
    clamped into ``[0, seq)``, length-free masks as they are."""
    if type(mask) in _LENGTHLESS:
        return mask
    if type(mask) is masks.And or type(mask) is masks.Or:
        return type(mask)(extended_mask(mask.a, seq, total), extended_mask(mask.b, seq, total))
    if type(mask) is masks.Documents:

        def ids(t):
            return None if t is None else F.pad(torch.as_tensor(t), (0, total - seq), value=-1)

        return masks.Documents(ids(mask.doc_ids), mask.causal, ids(mask.kv_doc_ids)).frozen()
    if (
        type(mask) is masks.KeyRanges and mask.check(seq, seq) is None
    ):  # padding queries see nothing
        return masks.KeyRanges(
            F.pad(mask.start, (0, total - seq)), F.pad(mask.end, (0, total - seq))
        )
    fn = mask.fn if type(mask) is masks.MaskMod else mask.visible
    return masks.MaskMod(_clamped(fn, seq, 0))


def _clamped(fn, seq: int, positions_at: int):
    """``fn`` with its query and key positions (arguments ``positions_at + 2`` and ``+ 3``)
    clamped into ``[0, seq)``, named as ``fn`` (a MaskMod's or ScoreModFn's description)."""

    def clamped(*args):
        args = list(args)
        for i in (positions_at + 2, positions_at + 3):
            args[i] = torch.as_tensor(args[i]).clamp(max=seq - 1)
        return fn(*args)

    clamped.__qualname__ = getattr(fn, "__qualname__", type(fn).__name__)
    return clamped


def extended_score_mod(score_mod, seq: int, total: int):
    """``score_mod`` on the padded sequence: a bias padded with zeros, a function's positions
    clamped into ``[0, seq)``, the rest (soft-cap, ALiBi on global positions) as it is."""
    from ..score_mods import PostScaleBias, ScoreModFn, as_score_mod

    sm = as_score_mod(score_mod)
    if type(sm) is PostScaleBias:
        return PostScaleBias(F.pad(sm.bias, (0, total - seq, 0, total - seq)))
    if type(sm) is ScoreModFn:
        return ScoreModFn(_clamped(sm.fn, seq, 1))
    return sm


def uneven_views(query, key, value, rows: int) -> tuple[torch.Tensor, ...]:
    """Query, key and value padded with zero rows at the end of the sequence dim (2) to ``rows``
    (differentiable: the padding's gradient is dropped)."""
    return tuple(
        t if t.shape[2] == rows else F.pad(t, (0, 0, 0, rows - t.shape[2]))
        for t in (query, key, value)
    )


def uneven_call(call, lengths: tuple[int, ...]) -> Any:
    """The padded call's options: its layout (:func:`padded_layout`), causality and mask folded
    into the real tokens' documents & the extended mask, the score_mod extended."""
    seq, total = sum(lengths), max(lengths) * len(lengths)
    mask: masks.Mask = real_tokens(seq, total, bool(call.is_causal))
    if call.mask is not None:
        mask = mask & extended_mask(masks.snapshot(call.mask), seq, total)
    score_mod = None if call.score_mod is None else extended_score_mod(call.score_mod, seq, total)
    return call.with_(
        layout=padded_layout(call.layout, lengths), is_causal=False, mask=mask, score_mod=score_mod
    )


def uneven_result(result, rows: int, return_lse: bool, return_max_logit: bool):
    """The padded call's result cut to this rank's ``rows`` real rows: out (batch, heads, rows,
    head_dim_v), LSE (batch, heads, rows); the max logit as it is."""
    parts = list(result) if return_lse or return_max_logit else [result]
    parts[0] = parts[0][:, :, :rows]
    if return_lse:
        parts[1] = parts[1][:, :, :rows]
    return tuple(parts) if len(parts) > 1 else parts[0]
