"""Load balance under a mask: each rank's work from the plan, and a work-aware layout.

A rank's *work* is the score area its kernel calls compute (:attr:`ring_impl.plan.Block.work`,
summed over the ring's steps): what decides its time. Correctness tests cannot see imbalance, so
it is measured here from the same plan the ring runs.

:func:`work_balanced_layout` cuts the sequence into equal chunks, weighs each chunk by the score
area its query rows see under the mask (on the whole sequence), and deals the chunks out
greedily, heaviest first, each to the rank with the least work that still has room (every rank
holds the same number of chunks, as every layout must); each rank's chunks stay in sequence
order. For a causal mask it reproduces head-tail's balance; for packed documents of very
different lengths it balances where head_tail cannot (a long document's tail is heavy wherever
it lands).
"""

from __future__ import annotations

import torch

from .layout import Layout
from .plan import masked_plan

__all__ = ["rank_work", "work_balanced_layout"]


def rank_work(layout: str, mask, seq_len: int, world_size: int, *, batch: int = 1, heads: int = 1) -> list[int]:
    """Per rank, the score entries its ring steps compute under ``mask`` (global length
    ``seq_len``, any registered layout)."""
    local = seq_len // world_size
    return [
        sum(block.work for plan in masked_plan(r, world_size, layout=layout, mask=mask, seq_q=local, seq_kv=local,
                                                batch=batch, heads=heads) for block in plan.blocks)
        for r in range(world_size)
    ]


def work_balanced_layout(name: str, mask, seq_len: int, world_size: int, *, chunks_per_rank: int = 8) -> Layout:
    """A layout for sequences of exactly ``seq_len`` over ``world_size`` ranks that balances the
    work of ``mask``; register it with :func:`ring_impl.register_layout` on every rank (equal
    inputs give an equal layout)."""
    from .masks import visibility

    pieces = chunks_per_rank * world_size
    if seq_len % pieces:
        raise ValueError(f"work_balanced_layout: seq_len {seq_len} is not a multiple of {pieces} "
                         f"({chunks_per_rank} chunks per rank x {world_size} ranks)")
    n = seq_len // pieces
    pos = torch.arange(seq_len)
    seen = visibility(mask, pos, pos).any(0).any(0)  # (seq, seq)
    weight = seen.reshape(pieces, n, seq_len).sum(dim=(1, 2)).tolist()
    order = sorted(range(pieces), key=lambda c: (-weight[c], c))
    load, held = [0] * world_size, [[] for _ in range(world_size)]
    for c in order:
        r = min((r for r in range(world_size) if len(held[r]) < chunks_per_rank), key=lambda r: (load[r], r))
        held[r].append(c)
        load[r] += weight[c]
    assignment = [tuple(sorted(h)) for h in held]

    def runs(length: int, world: int, rank: int):
        if (length, world) != (seq_len, world_size):
            raise ValueError(f"layout {name!r} was balanced for {seq_len} tokens over {world_size} ranks, "
                             f"not {length} over {world}; build one for this sequence")
        return tuple((c * n, (c + 1) * n) for c in assignment[rank])

    return Layout(name, runs, lambda world: pieces, chunks=lambda world, rank: assignment[rank])
