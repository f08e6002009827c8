"""A single-process, float64 simulation of ring attention, step by step.

Ring convention (the implementation follows it too): at ring step s (0..W-1), rank r holds the
key/value shard of rank (r - s) mod W. Each (rank, step) yields a partial attention result over
the keys visible in that block; merging a rank's partials in step order gives its local output.

Every step's kind comes from the TRUE global visibility mask of the rank's query positions against
the visited key positions, never from a rule about step numbers, so the simulation cannot share
a mistake with an implementation that derives kinds by rule.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from reference import layout as layouts
from reference.attention import (
    attention,
    causal_visibility,
    check_shapes,
    default_scale,
    masked_attention,
)

__all__ = [
    "STEP_KINDS",
    "RingSimulation",
    "StepRecord",
    "classify",
    "logsigmoid",
    "lower_triangular",
    "merge_partials",
    "merge_two",
    "simulate_ring",
    "visibility",
]

STEP_KINDS: tuple[str, ...] = ("full", "causal", "skip", "partial")


@dataclass(frozen=True, eq=False)
class StepRecord:
    """One (rank, step) of the ring.

    kind: "full" (every query sees every key), "skip" (none sees any), "causal" (the block is the
    rank's own shard and the mask is lower-triangular: a plain causal kernel call), "partial"
    (any other mix, e.g. head_tail steps where only some chunk pairs are visible).
    pairs: ((q_chunk, k_chunk, kind), ...) per pair of global chunk ids, query chunks in local
    order, then key chunks in local order (1 pair for contiguous, 4 for head_tail).
    work: visible (query, key) score entries per (batch, head).
    visible: (seq_q_local, seq_k_local) bool mask. partial_out: (batch, heads, seq_q_local,
    head_dim_v) float64, 0 on rows that see no key; partial_lse: (batch, heads, seq_q_local)
    float64, -inf on rows that see no key.
    """

    rank: int
    step: int
    kv_rank: int
    kind: str
    pairs: tuple[tuple[int, int, str], ...]
    work: int
    visible: Tensor
    partial_out: Tensor
    partial_lse: Tensor


def lower_triangular(n: int) -> Tensor:
    """(n, n) bool, True on and below the diagonal: a causal kernel call's mask.
    (Not Tensor.tril: its CPU kernel always enters a parallel region, which costs milliseconds per
    call on a busy machine, and the simulation makes thousands of such calls.)"""
    return torch.arange(n)[None, :] <= torch.arange(n)[:, None]


def logsigmoid(x: Tensor) -> Tensor:
    """log(sigmoid(x)), exact to rounding and finite for any finite x. Same function as
    F.logsigmoid, whose CPU kernel has the parallel-region cost described above."""
    return torch.clamp(x, max=0) - torch.log1p(torch.exp(-x.abs()))


def classify(visible: Tensor, same_shard: bool) -> str:
    """Kind of a (seq_q_local, seq_k_local) bool visibility block; see StepRecord."""
    if bool(visible.all()):
        return "full"
    if not bool(visible.any()):
        return "skip"
    rows, cols = visible.shape
    if same_shard and rows == cols and torch.equal(visible, lower_triangular(rows)):
        return "causal"
    return "partial"


def merge_two(
    out: Tensor, lse: Tensor, block_out: Tensor, block_lse: Tensor
) -> tuple[Tensor, Tensor]:
    """Merge two partial results over disjoint key sets.

    out/block_out (batch, heads, rows, head_dim_v), lse/block_lse (batch, heads, rows).
    Rows with lse -inf saw no key and are the neutral element: they never produce NaN.
    """
    # The naive form new_lse = lse + log(1 + exp(block_lse - lse)) overflows exp for large LSE
    # gaps; sigmoid/logsigmoid is the same quantity without overflow (ring-flash-attention).
    empty, block_empty = lse == -torch.inf, block_lse == -torch.inf
    # On rows where a side is empty, -inf - -inf would be NaN: use a harmless placeholder and
    # take the other side verbatim below.
    diff = torch.where(empty | block_empty, torch.zeros_like(lse), block_lse - lse)
    new_out = out - torch.sigmoid(diff).unsqueeze(-1) * (out - block_out)
    new_lse = lse - logsigmoid(-diff)
    new_out = torch.where(block_empty.unsqueeze(-1), out, new_out)
    new_out = torch.where(empty.unsqueeze(-1) & ~block_empty.unsqueeze(-1), block_out, new_out)
    new_lse = torch.where(block_empty, lse, torch.where(empty, block_lse, new_lse))
    return new_out, new_lse


def merge_partials(partials: Sequence[tuple[Tensor, Tensor]]) -> tuple[Tensor, Tensor]:
    """Merge [(out, lse), ...] in order; out (batch, heads, rows, head_dim_v), lse (batch, heads,
    rows). Returns the merged (out, lse) in float64."""
    if not partials:
        raise ValueError("merge_partials needs at least one (out, lse) partial")
    out, lse = (t.to(torch.float64) for t in partials[0])
    for block_out, block_lse in partials[1:]:
        out, lse = merge_two(out, lse, block_out.to(torch.float64), block_lse.to(torch.float64))
    return out, lse


@dataclass(frozen=True, eq=False)
class RingSimulation:
    """The simulated ring. query/key/value are the global float64 inputs (shapes as in
    reference.attention); steps is ordered by rank, then step."""

    query: Tensor
    key: Tensor
    value: Tensor
    world_size: int
    layout: str
    is_causal: bool
    scale: float
    steps: list[StepRecord]

    def step(self, rank: int, s: int) -> StepRecord:
        """The record of rank `rank` at ring step `s`."""
        if not (0 <= rank < self.world_size and 0 <= s < self.world_size):
            raise ValueError(f"(rank={rank}, step={s}) is outside a ring of size {self.world_size}")
        return self.steps[rank * self.world_size + s]

    def rank_steps(self, rank: int) -> list[StepRecord]:
        """The records of one rank in step order."""
        return [self.step(rank, s) for s in range(self.world_size)]

    def local_merge(self, rank: int) -> tuple[Tensor, Tensor]:
        """(out (batch, heads, seq_q_local, head_dim_v), lse (batch, heads, seq_q_local))."""
        return merge_partials([(r.partial_out, r.partial_lse) for r in self.rank_steps(rank)])

    def local_out(self, rank: int) -> Tensor:
        """(batch, heads, seq_q_local, head_dim_v): rank's partials merged in step order."""
        return self.local_merge(rank)[0]

    def local_lse(self, rank: int) -> Tensor:
        """(batch, heads, seq_q_local): rank's merged LSE."""
        return self.local_merge(rank)[1]

    @property
    def out(self) -> Tensor:
        """Global (batch, heads, seq_q, head_dim_v) merged output."""
        return layouts.unshard([self.local_out(r) for r in range(self.world_size)], self.layout)

    @property
    def lse(self) -> Tensor:
        """Global (batch, heads, seq_q) merged LSE."""
        return layouts.unshard([self.local_lse(r) for r in range(self.world_size)], self.layout)

    def work_per_rank(self) -> list[int]:
        """Visible score entries per (batch, head) each rank computes over all steps."""
        return [sum(r.work for r in self.rank_steps(rank)) for rank in range(self.world_size)]

    def q_positions(self, rank: int) -> Tensor:
        """(seq_q_local,) global query positions rank holds; k_positions likewise for keys."""
        return layouts.positions(self.layout, self.world_size, rank, self.query.shape[2])

    def k_positions(self, rank: int) -> Tensor:
        return layouts.positions(self.layout, self.world_size, rank, self.key.shape[2])

    def query_shard(self, rank: int) -> Tensor:
        """rank's float64 query shard (batch, heads, seq_q_local, head_dim); key/value likewise."""
        return layouts.shard(self.query, self.layout, self.world_size, rank)

    def key_shard(self, rank: int) -> Tensor:
        return layouts.shard(self.key, self.layout, self.world_size, rank)

    def value_shard(self, rank: int) -> Tensor:
        return layouts.shard(self.value, self.layout, self.world_size, rank)

    def reference(self) -> tuple[Tensor, Tensor]:
        """Unchunked float64 attention of the same inputs: (out, lse), global."""
        return attention(
            self.query, self.key, self.value, is_causal=self.is_causal, scale=self.scale
        )


def visibility(
    layout: str,
    world_size: int,
    rank: int,
    kv_rank: int,
    seq_q: int,
    seq_k: int,
    is_causal: bool,
) -> Tensor:
    """(seq_q // W, seq_k // W) bool: which of kv_rank's keys rank's queries see, from their
    global positions (the truth every step kind is derived from)."""
    q_pos = layouts.positions(layout, world_size, rank, seq_q)
    k_pos = layouts.positions(layout, world_size, kv_rank, seq_k)
    if not is_causal:
        return torch.ones(len(q_pos), len(k_pos), dtype=torch.bool)
    return causal_visibility(q_pos, k_pos)


def _pairs(
    layout: str,
    world_size: int,
    rank: int,
    kv_rank: int,
    visible: Tensor,
) -> tuple[tuple[int, int, str], ...]:
    """((q_chunk, k_chunk, kind), ...) for each pair of global chunk ids in local order, the kind
    read off the pair's sub-block of the (seq_q_local, seq_k_local) visibility mask."""
    q_chunks = layouts.chunk_ids(layout, world_size, rank)
    k_chunks = layouts.chunk_ids(layout, world_size, kv_rank)
    cq, ck = visible.shape[0] // len(q_chunks), visible.shape[1] // len(k_chunks)
    pairs = []
    for i, qc in enumerate(q_chunks):
        for j, kc in enumerate(k_chunks):
            block = visible[i * cq : (i + 1) * cq, j * ck : (j + 1) * ck]
            pairs.append((qc, kc, classify(block, same_shard=qc == kc)))
    return tuple(pairs)


def simulate_ring(
    query: Tensor,
    key: Tensor,
    value: Tensor,
    *,
    world_size: int,
    layout: str,
    is_causal: bool = False,
    scale: float | None = None,
) -> RingSimulation:
    """Simulate ring attention on global inputs, in float64.

    query (batch, heads, seq_q, head_dim), key (batch, heads_kv, seq_k, head_dim),
    value (batch, heads_kv, seq_k, head_dim_v). seq_q and seq_k are both sharded by `layout`
    (cross attention, seq_q != seq_k, only without is_causal). Returns a RingSimulation whose
    merged result equals `attention()` of the same inputs to rounding (~1e-13).
    """
    check_shapes(query, key, value)
    seq_q, seq_k = query.shape[2], key.shape[2]
    if is_causal and seq_q != seq_k:
        raise ValueError(
            f"causal ring attention needs seq_q == seq_k, got {seq_q} and {seq_k}; "
            "top-left causal masks of unequal lengths are not sharded by any layout"
        )
    for name, n in (("seq_q", seq_q), ("seq_k", seq_k)):
        try:
            layouts.chunk_len(layout, world_size, n)
        except ValueError as err:
            raise ValueError(f"{name}: {err}") from None
    q64, k64, v64 = (t.detach().to(torch.float64) for t in (query, key, value))
    scale = default_scale(query.shape[-1]) if scale is None else float(scale)

    records: list[StepRecord] = []
    for rank in range(world_size):
        q_local = layouts.shard(q64, layout, world_size, rank)
        for s in range(world_size):
            kv_rank = (rank - s) % world_size
            visible = visibility(layout, world_size, rank, kv_rank, seq_q, seq_k, is_causal)
            out, lse = masked_attention(
                q_local,
                layouts.shard(k64, layout, world_size, kv_rank),
                layouts.shard(v64, layout, world_size, kv_rank),
                visible.to(q64.device),
                scale=scale,
            )
            records.append(
                StepRecord(
                    rank=rank,
                    step=s,
                    kv_rank=kv_rank,
                    kind=classify(visible, same_shard=kv_rank == rank),
                    pairs=_pairs(layout, world_size, rank, kv_rank, visible),
                    work=int(visible.sum()),
                    visible=visible,
                    partial_out=out,
                    partial_lse=lse,
                )
            )
    return RingSimulation(q64, k64, v64, world_size, layout, is_causal, scale, records)
