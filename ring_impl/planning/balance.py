"""Load balance under a mask: each rank's work from the plan, and two balancers.

A rank's *work* is the score area its kernel calls compute
(:attr:`ring_impl.planning.plan.Block.work`, summed over the ring's steps): what decides its time.
Correctness tests cannot see imbalance, so it is measured here from the same plan the ring runs.

Balancers (each builds a :class:`~ring_impl.layout.Layout` for one mask, sequence length and
world size; register it with :func:`ring_impl.register_layout` on every rank, or let
:func:`register_balanced_layout` name and register it):

``document_head_tail`` (:func:`document_head_tail_layout`)
    head_tail per packed document: every document is cut into ``2W`` chunks and rank ``r``
    takes chunk ``r`` and chunk ``2W-1-r`` of each, so each rank holds a head-and-tail pair of
    every document and does the same causal work in each. A document's length is rarely a
    multiple of ``2W``: its ``L mod 2W`` leftover tokens (all of a document shorter than
    ``2W``) are dealt one per rank, round robin over the whole sequence (the turn carries on
    from one document to the next), to the rank's head chunk first, then its tail chunk. Every
    rank then holds ``S / W`` tokens for ``S`` a multiple of ``W``, else counts at most one
    apart (an uneven layout, for ``ring_attention(shard_lengths=)``). Padding
    (id -1) is a document like any other; a mask without documents is one document (then, for
    ``S`` a multiple of ``2W``, this is ``head_tail``).
``work_aware`` (:func:`work_balanced_layout`)
    cuts the sequence into equal chunks (as ``torch.tensor_split`` does for a length they do not
    divide: an uneven layout), weighs each chunk by the score area its query rows see under the
    mask (on the whole sequence), and deals the chunks out greedily, heaviest first, each to the
    rank with the least work that still has room (every rank holds the same number of chunks),
    then swaps chunks between the heaviest rank and the others while a swap lowers its work
    (where heavy chunks are few per rank, the ranks that fill up last cannot be evened by the
    deal alone); each rank's chunks stay in sequence order. For a causal
    mask it reproduces head-tail's balance; for packed documents of very different lengths it
    balances where head_tail cannot (a long document's tail is heavy wherever it lands).

**One layout for several masks.** A model whose layers use different masks (sliding-window
layers beside full causal ones, documents everywhere) shards its activations once: every layer
sees the same layout. Every balancer here takes ``masks``: one mask, a sequence of masks, or a
sequence of ``(mask, weight)`` pairs (weight: how many layers run that mask, or any relative
cost), and balances their weighted sum of work: ``work_aware`` weighs each chunk by
``sum(weight * area seen under the mask)``; ``document_head_tail`` needs the documents only (the
masks must agree on them). :func:`rank_work` takes the same forms.
"""

from __future__ import annotations

import zlib
from collections.abc import Sequence
from itertools import pairwise
from typing import TYPE_CHECKING

import torch

from ..layout import Layout, Runs, layout_runs, register_layout
from .plan import masked_plan

if TYPE_CHECKING:
    from ..masks import Mask

__all__ = [
    "BALANCERS",
    "balanced_layout",
    "document_head_tail_layout",
    "document_spans",
    "imbalance",
    "rank_work",
    "register_balanced_layout",
    "weighted_masks",
    "work_balanced_layout",
]

#: The balancers :func:`register_balanced_layout` knows (an implementation under test declares
#: the ones it has in ``capabilities.balancers``).
BALANCERS = ("document_head_tail", "work_aware")


def weighted_masks(masks) -> list[tuple[Mask, float]]:
    """``masks`` (one mask, a sequence of masks, or of ``(mask, weight)`` pairs) as ``(mask,
    weight)`` pairs; ValueError for an empty sequence or a weight that is not a positive finite
    number."""
    from ..masks import Mask

    if isinstance(masks, Mask):
        return [(masks, 1.0)]
    if not isinstance(masks, Sequence) or isinstance(masks, (str, bytes)) or not masks:
        raise ValueError(
            f"masks must be a Mask, or a non-empty sequence of masks or (mask, weight) pairs; "
            f"got {masks!r}"
        )
    pairs = []
    for entry in masks:
        mask, weight = entry if isinstance(entry, tuple) else (entry, 1.0)
        if not isinstance(mask, Mask):
            raise ValueError(f"masks: {mask!r} is not a ring_impl.masks.Mask")
        if (
            isinstance(weight, bool)
            or not isinstance(weight, (int, float))
            or not 0 < weight < float("inf")
        ):
            raise ValueError(
                f"masks: the weight of {mask.describe()} must be a positive number, got {weight!r}"
            )
        pairs.append((mask, float(weight)))
    return pairs


def rank_work(
    layout: str, masks, seq_len: int, world_size: int, *, batch: int = 1, heads: int = 1
) -> list[float]:
    """Per rank, the score entries its ring steps compute under ``masks`` (one mask, or their
    weighted sum: :func:`weighted_masks`), global length ``seq_len``, any registered layout
    (a multiple of the layout's divisor: the padded plans of an uneven split are not counted
    here)."""
    local = seq_len // world_size
    return [
        sum(
            weight
            * sum(
                block.work
                for plan in masked_plan(
                    r,
                    world_size,
                    layout=layout,
                    mask=mask,
                    seq_q=local,
                    seq_kv=local,
                    batch=batch,
                    heads=heads,
                )
                for block in plan.blocks
            )
            for mask, weight in weighted_masks(masks)
        )
        for r in range(world_size)
    ]


def imbalance(work: Sequence[int]) -> float:
    """max / mean of per-rank work (1.0: balanced; ``W``: one rank does everything)."""
    total = sum(work)
    return max(work) * len(work) / total if total else 1.0


def work_balanced_layout(
    name: str, masks, seq_len: int, world_size: int, *, chunks_per_rank: int = 8
) -> Layout:
    """A layout for sequences of exactly ``seq_len`` over ``world_size`` ranks that balances the
    work of ``masks`` (one mask, or the weighted sum of several: :func:`weighted_masks`); register
    it with :func:`ring_impl.register_layout` on every rank (equal inputs give an equal layout)."""
    from ..masks import visibility

    pairs = weighted_masks(masks)
    pieces = chunks_per_rank * world_size
    if seq_len < pieces:
        raise ValueError(
            f"work_balanced_layout: seq_len {seq_len} is shorter than its {pieces} chunks "
            f"({chunks_per_rank} chunks per rank x {world_size} ranks); pass fewer "
            "chunks_per_rank"
        )
    # Chunks as torch.tensor_split cuts: equal for a multiple of ``pieces``, else the first
    # ``seq_len mod pieces`` one longer (ranks then hold unequal counts: an uneven layout).
    n, longer = divmod(seq_len, pieces)
    starts = [c * n + min(c, longer) for c in range(pieces + 1)]
    pos = torch.arange(seq_len)
    weight = [0.0] * pieces
    for mask, w in pairs:
        seen = visibility(mask, pos, pos).any(0).any(0)  # (seq, seq)
        rows = seen.sum(dim=1)
        area = [int(rows[a:b].sum()) for a, b in pairwise(starts)]
        weight = [total + w * a for total, a in zip(weight, area, strict=True)]
    order = sorted(range(pieces), key=lambda c: (-weight[c], c))
    load: list[float] = [0] * world_size
    held: list[list[int]] = [[] for _ in range(world_size)]
    for c in order:
        r = min(
            (r for r in range(world_size) if len(held[r]) < chunks_per_rank),
            key=lambda r: (load[r], r),
        )
        held[r].append(c)
        load[r] += weight[c]
    _refine_by_swaps(held, weight)
    assignment = [tuple(sorted(h)) for h in held]

    def runs(length: int, world: int, rank: int):
        _check_built_for(name, seq_len, world_size, length, world)
        return tuple((starts[c], starts[c + 1]) for c in assignment[rank])

    return Layout(
        name,
        runs,
        lambda world: pieces,
        chunks=lambda world, rank: assignment[rank],
        uneven=bool(longer),
    )


def _refine_by_swaps(held: list[list[int]], weight: Sequence[float]) -> None:
    """Lower the heaviest rank's work by swapping chunks, in place, until no swap helps; every
    rank keeps its number of chunks.

    The greedy deal (heaviest chunk first, to the least loaded rank with room) leaves a rank up
    to a heavy chunk above the mean when heavy chunks are few per rank, since the ranks that
    fill up last must take what is left whatever their load (a long document's tail at W=64:
    1.064 max/mean, 1.007 after the swaps). Each round swaps a chunk a of the heaviest rank h
    for a lighter chunk b of another rank r (d = weight[a] - weight[b] moved), choosing the swap
    with the smallest max(load[h] - d, load[r] + d) below load[h]. Pure arithmetic on equal
    inputs: every rank builds the same layout.
    """
    w = len(held)
    if w < 2:
        return
    k = max(len(chunks) for chunks in held)
    # (W, k) chunk weights; NaN where a rank holds fewer chunks (uneven layouts): never swapped.
    table = torch.full((w, k), float("nan"), dtype=torch.float64)
    for r, chunks in enumerate(held):
        table[r, : len(chunks)] = torch.tensor([weight[c] for c in chunks], dtype=torch.float64)
    load = table.nan_to_num(0.0).sum(1)
    tolerance = 1e-9 * max(1.0, float(load.sum()))
    for _ in range(4 * w * k):  # each round lowers the heaviest load or ends; a cap all the same
        h = int(load.argmax())
        d = table[h][:, None, None] - table[None, :, :]  # (k, W, k): moved from h to r
        new_max = torch.maximum(load[h] - d, load[None, :, None] + d)
        new_max[:, h] = float("inf")
        new_max = torch.where(d > 0, new_max, float("inf"))  # NaN compares False
        best = int(new_max.argmin())
        if not float(new_max.flatten()[best]) < float(load[h]) - tolerance:
            return
        a, r, b = best // (w * k), best // k % w, best % k
        moved = float(d[a, r, b])
        held[h][a], held[r][b] = held[r][b], held[h][a]
        table[h, a], table[r, b] = table[r, b].clone(), table[h, a].clone()
        load[h] -= moved
        load[r] += moved


def document_spans(documents, seq_len: int) -> list[tuple[int, int]]:
    """The ``(start, stop)`` spans of equal document id along the sequence (padding runs
    included), from a mask (its :class:`~ring_impl.masks.Documents`, found inside ``&``/``|``;
    none: one span, the whole sequence) or from per-position ids (seq_len,)."""
    ids = _document_ids(documents, seq_len)
    if ids is None:
        return [(0, seq_len)] if seq_len else []
    ids = torch.as_tensor(ids, dtype=torch.int64).flatten()
    if ids.numel() != seq_len:
        raise ValueError(
            f"document ids have {ids.numel()} entries but the sequence has {seq_len} tokens"
        )
    starts = [0, *((ids[1:] != ids[:-1]).nonzero().flatten() + 1).tolist()]
    return [(a, b) for a, b in zip(starts, [*starts[1:], seq_len]) if b > a]


def _document_ids(documents, seq_len: int):
    from ..masks import And, Documents, Mask, Or

    if (
        isinstance(documents, Sequence)
        and documents
        and all(
            isinstance(e, Mask) or (isinstance(e, tuple) and e and isinstance(e[0], Mask))
            for e in documents
        )
    ):
        documents = [
            m for m, _ in weighted_masks(documents)
        ]  # several masks: their documents must agree
    elif not isinstance(documents, Mask):
        return documents
    stack, found = (list(documents) if isinstance(documents, list) else [documents]), []
    while stack:
        m = stack.pop()
        if isinstance(m, Documents):
            found.append(m)
        elif isinstance(m, (And, Or)):
            stack += [m.b, m.a]
    if len(found) > 1 and any(
        not torch.equal(torch.as_tensor(f.doc_ids), torch.as_tensor(found[0].doc_ids))
        for f in found
    ):
        raise ValueError(
            "document_head_tail_layout: the masks hold different document ids; pass the ids to "
            "balance"
        )
    return found[0].doc_ids if found else None


def document_head_tail_runs(spans: Sequence[tuple[int, int]], world_size: int) -> list[Runs]:
    """Per rank, its runs under ``document_head_tail`` for documents at ``spans`` (see the
    module docstring): chunks ``r`` and ``2W-1-r`` of every document, leftovers dealt round
    robin."""
    w = world_size
    held: list[list[tuple[int, int]]] = [[] for _ in range(w)]
    turn = 0  # the rank that gets the next leftover token
    for a, b in spans:
        base, leftover = divmod(b - a, 2 * w)
        sizes = [base] * (2 * w)
        for _ in range(leftover):  # at most two per rank per document (leftover < 2W)
            sizes[turn if sizes[turn] == base else 2 * w - 1 - turn] += 1
            turn = (turn + 1) % w
        start = a
        for chunk, size in enumerate(sizes):
            if size:
                runs = held[chunk if chunk < w else 2 * w - 1 - chunk]
                if (
                    runs and runs[-1][1] == start
                ):  # continues the rank's last run (rank 0 across documents)
                    runs[-1] = (runs[-1][0], start + size)
                else:
                    runs.append((start, start + size))
            start += size
    return [tuple(r) for r in held]


def document_head_tail_layout(name: str, documents, seq_len: int, world_size: int) -> Layout:
    """The ``document_head_tail`` layout (module docstring) of ``documents`` (a mask or
    per-position document ids) for sequences of exactly ``seq_len`` over ``world_size`` ranks;
    a ``seq_len`` that is not a multiple of ``world_size`` leaves ranks unequal counts (at most
    one apart: an uneven layout, for ``ring_attention(shard_lengths=)``). Register it on every
    rank."""
    if world_size < 1 or seq_len < world_size:
        raise ValueError(
            f"document_head_tail_layout: seq_len {seq_len} is shorter than world_size {world_size}"
        )
    per_rank = document_head_tail_runs(document_spans(documents, seq_len), world_size)

    def runs(length: int, world: int, rank: int) -> Runs:
        _check_built_for(name, seq_len, world_size, length, world)
        return per_rank[rank]

    return Layout(name, runs, lambda world: world, uneven=bool(seq_len % world_size))


def _check_built_for(name: str, seq_len: int, world_size: int, length: int, world: int) -> None:
    if (length, world) != (seq_len, world_size):
        raise ValueError(
            f"layout {name!r} was balanced for {seq_len} tokens over {world_size} ranks, "
            f"not {length} over {world}; build one for this sequence"
        )


def balanced_layout(balancer: str, name: str, mask, seq_len: int, world_size: int) -> Layout:
    """The layout balancer ``balancer`` (one of :data:`BALANCERS`) builds for ``mask`` (one mask,
    or several, weighted: :func:`weighted_masks`)."""
    if balancer == "document_head_tail":
        return document_head_tail_layout(name, mask, seq_len, world_size)
    if balancer == "work_aware":
        return work_balanced_layout(name, mask, seq_len, world_size)
    raise ValueError(f"unknown balancer {balancer!r}; expected one of {BALANCERS}")


def register_balanced_layout(
    balancer: str, mask, seq_len: int, world_size: int
) -> tuple[str, list[Runs]]:
    """Build and register ``balancer``'s layout for ``mask`` (one mask, or several masks of one
    model, weighted: :func:`weighted_masks`; on this process: call it on every rank with equal
    arguments); returns its name, for ``layout=``, and every rank's runs.

    The name is derived from the arguments (the masks' digests and weights), so equal calls on
    every rank agree on it and a repeated call replaces the layout with an equal one."""
    described = ";".join(f"{m.describe()}*{w!r}" for m, w in weighted_masks(mask))
    digest = zlib.crc32(f"{balancer}|{described}|{seq_len}|{world_size}".encode()) & 0xFFFFFFFF
    name = f"{balancer}-{seq_len}x{world_size}-{digest:08x}"
    register_layout(balanced_layout(balancer, name, mask, seq_len, world_size), replace=True)
    return name, [layout_runs(name, seq_len, world_size, r) for r in range(world_size)]
