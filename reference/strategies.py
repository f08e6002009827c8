"""Float64 oracle pieces of the parallel strategies beside the ring, written independently of
ring_impl on purpose (the oracle must not reuse the code under test).

Layout (the same definition as the implementation's, restated here). A rank sits at ``(u, r)``
of a ``(ulysses, ring)`` mesh of shape ``(U, R)``; its mesh rank is ``r * U + u``.

- ``ring`` (``(1, W)``): the ring layout over ``W`` ranks (reference.layout).
- ``ulysses`` (``(U, 1)``): the ring layout over the ``U`` Ulysses ranks.
- ``hybrid`` (``(U, R)``): the ring layout over the ``R`` rows; each row's shard cut into ``U``
  contiguous pieces, piece ``u`` on rank ``(u, r)``.

Simulation of the hybrid (:func:`simulate_hybrid`): rank ``(u, r)``'s all-to-all gathers its
row's whole shard for query heads ``[u*H/U, (u+1)*H/U)``; the ring then runs across the rows on
that head slice. So the hybrid is ``U`` rings of ``R`` rows, one per head slice, and each is
:func:`reference.simulate.simulate_ring` of that slice: which step, which row, which block, with
every partial.

Replay (:func:`replay_head_parallel`): the strategies' data movement in float64, rank by rank
(sequence shards -> head shards of each row, attention of every row's head slice against every
row's keys by their positions, head shards -> sequence shards), with the places where
implementations went wrong as parameters: key/value heads replicated in place or tiled, the
all-to-all splitting heads or the sequence, the positions the attention assumes (the layout's, or
``contiguous`` ones on ``head_tail`` data). With the defaults it is the strategy itself, equal to
:func:`reference.attention.attention` to rounding; with one parameter changed it reproduces one
bug, which :func:`reference.diagnose.diagnose_strategy` uses to name the cause of a failure.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from reference import layout as ring_layout
from reference.attention import causal_visibility, check_shapes, masked_attention
from reference.simulate import RingSimulation, StepRecord, simulate_ring

__all__ = [
    "STRATEGIES",
    "HybridSimulation",
    "kv_blocks",
    "locate",
    "mesh_rank",
    "positions",
    "replay_head_parallel",
    "shard",
    "simulate_hybrid",
    "unshard",
]

STRATEGIES: tuple[str, ...] = ("ring", "ulysses", "hybrid")


def _check(strategy: str, mesh_shape: tuple[int, int]) -> tuple[int, int]:
    if strategy not in STRATEGIES:
        raise ValueError(f"unknown strategy {strategy!r}; expected one of {STRATEGIES}")
    u, r = mesh_shape
    if (strategy == "ring" and u != 1) or (strategy == "ulysses" and r != 1):
        raise ValueError(f"strategy {strategy!r} does not run on a {u}x{r} (ulysses x ring) mesh")
    return u, r


def mesh_rank(coords: tuple[int, int], mesh_shape: tuple[int, int]) -> int:
    """``r * U + u`` of ``coords = (u, r)``."""
    return coords[1] * mesh_shape[0] + coords[0]


def kv_blocks(strategy: str, mesh_shape: tuple[int, int]) -> int:
    """How many key/value blocks a row's result merges: the ring degree (1 for Ulysses, whose
    kernel sees the whole sequence): the ``world_size`` of the numerics policy."""
    return _check(strategy, mesh_shape)[1]


def positions(
    strategy: str, layout: str, mesh_shape: tuple[int, int], rank: int, seq_len: int
) -> Tensor:
    """(seq_len // (U*R),) int64: the global positions mesh rank ``rank`` holds, in local order."""
    u_size, r_size = _check(strategy, mesh_shape)
    u, r = rank % u_size, rank // u_size
    if strategy == "ulysses":
        return ring_layout.positions(layout, u_size, u, seq_len)
    row = ring_layout.positions(layout, r_size, r, seq_len)
    if len(row) % u_size:
        raise ValueError(
            f"a row's shard of {len(row)} positions does not split into {u_size} equal pieces; "
            "pad the sequence"
        )
    n = len(row) // u_size
    return row[u * n : (u + 1) * n]


def shard(
    t: Tensor, strategy: str, layout: str, mesh_shape: tuple[int, int], rank: int, dim: int = 2
) -> Tensor:
    """Mesh rank ``rank``'s shard of global ``t`` along ``dim`` (a new tensor)."""
    return t.index_select(
        dim, positions(strategy, layout, mesh_shape, rank, t.shape[dim]).to(t.device)
    )


def unshard(
    shards: Sequence[Tensor], strategy: str, layout: str, mesh_shape: tuple[int, int], dim: int = 2
) -> Tensor:
    """Inverse of :func:`shard`: ``shards[mesh_rank]``; differentiable."""
    if len(shards) != mesh_shape[0] * mesh_shape[1]:
        raise ValueError(f"{len(shards)} shards for a {mesh_shape[0]}x{mesh_shape[1]} mesh")
    seq_len = sum(s.shape[dim] for s in shards)
    order = torch.cat(
        [positions(strategy, layout, mesh_shape, m, seq_len) for m in range(len(shards))]
    )
    return torch.cat(list(shards), dim=dim).index_select(dim, order.argsort().to(shards[0].device))


def locate(
    index: Sequence[int],
    strategy: str,
    layout: str,
    mesh_shape: tuple[int, int],
    seq_len: int,
    dim: int = 2,
) -> tuple[int, tuple[int, ...]]:
    """(mesh rank, index into its shard) of an index into the global tensor."""
    index = tuple(int(i) for i in index)
    dim %= len(index)
    for m in range(mesh_shape[0] * mesh_shape[1]):
        hit = (positions(strategy, layout, mesh_shape, m, seq_len) == index[dim]).nonzero()
        if len(hit):
            return m, (*index[:dim], int(hit[0, 0]), *index[dim + 1 :])
    raise ValueError(f"position {index[dim]} is outside a sequence of length {seq_len}")


# -------------------------------------------------------------------------- the hybrid's simulation


@dataclass(frozen=True, eq=False)
class HybridSimulation:
    """The hybrid as ``U`` rings of ``R`` rows, ``rings[u]`` on query heads ``heads_of(u)``."""

    query: Tensor
    key: Tensor
    value: Tensor
    mesh_shape: tuple[int, int]
    layout: str
    is_causal: bool
    rings: list[RingSimulation]

    def heads_of(self, u: int) -> slice:
        """The query heads of Ulysses rank ``u`` (of every row)."""
        n = self.query.shape[1] // self.mesh_shape[0]
        return slice(u * n, (u + 1) * n)

    def step(self, u: int, row: int, s: int) -> StepRecord:
        """Row ``row``'s ring step ``s`` on head slice ``u``: which key/value row,
        what kind, the partial."""
        return self.rings[u].step(row, s)

    def row_out(self, row: int) -> Tensor:
        """(batch, heads, row_len, head_dim_v): row ``row``'s shard, every head."""
        return torch.cat([ring.local_out(row) for ring in self.rings], dim=1)

    def local_out(self, rank: int) -> Tensor:
        """Mesh rank ``rank``'s output shard (batch, heads, seq_local, head_dim_v)."""
        u_size = self.mesh_shape[0]
        u, row = rank % u_size, rank // u_size
        full = self.row_out(row)
        n = full.shape[2] // u_size
        return full[:, :, u * n : (u + 1) * n]

    @property
    def out(self) -> Tensor:
        return unshard(
            [self.local_out(m) for m in range(self.mesh_shape[0] * self.mesh_shape[1])],
            "hybrid",
            self.layout,
            self.mesh_shape,
        )

    def work_per_row(self) -> list[int]:
        """Visible score entries each row computes, summed
        over head slices' rings (per batch and head)."""
        return [
            sum(ring.work_per_rank()[row] for ring in self.rings)
            for row in range(self.mesh_shape[1])
        ]


def simulate_hybrid(
    query: Tensor,
    key: Tensor,
    value: Tensor,
    *,
    mesh_shape: tuple[int, int],
    layout: str,
    is_causal: bool = False,
    scale: float | None = None,
) -> HybridSimulation:
    """Simulate the hybrid on global inputs in float64 (see the module docstring).

    query (batch, heads, seq_q, head_dim), key/value (batch, heads_kv, seq_k, head_dim); heads
    divisible by U. Each head slice's ring gets the key/value heads its query heads read (as many
    heads as the slice, so any grouping of the key/value heads is covered)."""
    check_shapes(query, key, value)
    u_size, r_size = _check("hybrid", mesh_shape)
    heads, heads_kv = query.shape[1], key.shape[1]
    if heads % u_size:
        raise ValueError(f"query heads {heads} are not divisible by the Ulysses degree {u_size}")
    group = heads // heads_kv
    rings = []
    for u in range(u_size):
        hs = list(range(u * heads // u_size, (u + 1) * heads // u_size))
        kv_heads = torch.tensor([h // group for h in hs])
        rings.append(
            simulate_ring(
                query[:, hs],
                key.index_select(1, kv_heads),
                value.index_select(1, kv_heads),
                world_size=r_size,
                layout=layout,
                is_causal=is_causal,
                scale=scale,
            )
        )
    return HybridSimulation(query, key, value, (u_size, r_size), layout, is_causal, rings)


# ---------------------------------------------------------------------------- replay


def replay_head_parallel(
    query: Tensor,
    key: Tensor,
    value: Tensor,
    *,
    strategy: str,
    layout: str,
    mesh_shape: tuple[int, int],
    is_causal: bool,
    scale: float | None = None,
    kv_order: str = "interleave",
    split: str = "heads",
    assumed_layout: str | None = None,
) -> Tensor:
    """The global float64 output of Ulysses or the hybrid, replayed rank by rank.

    kv_order: "interleave" (key/value head i's replicas next to each other, correct) or "tile"
    (the heads repeated as a block); split: "heads" (the sequence-to-heads all-to-all sends head
    slice j to rank j, correct) or "sequence" (it sends sequence slice j, read as head slice j);
    assumed_layout: the layout whose positions the attention assumes for the gathered rows (None:
    ``layout``, correct)."""
    u_size, r_size = _check(strategy, mesh_shape)
    q64, k64, v64 = (t.detach().to(torch.float64) for t in (query, key, value))
    seq_q, heads_kv, seq_k = q64.shape[2], k64.shape[1], k64.shape[2]
    assumed = layout if assumed_layout is None else assumed_layout
    e = u_size // math.gcd(heads_kv, u_size)

    def expand(t: Tensor) -> Tensor:
        return t.repeat_interleave(e, dim=1) if kv_order == "interleave" else t.repeat(1, e, 1, 1)

    def to_heads(parts: list[Tensor], j: int) -> Tensor:
        """Rank j's head shard of a row from the row's sequence shards ``parts`` (rank order)."""
        pieces = []
        for t in parts:
            n_heads, s = t.shape[1] // u_size, t.shape[2]
            if split == "heads":
                pieces.append(t[:, j * n_heads : (j + 1) * n_heads])
            else:
                if s % u_size:
                    raise ValueError("a sequence split needs local lengths divisible by the degree")
                piece = t[:, :, j * s // u_size : (j + 1) * s // u_size].contiguous()
                pieces.append(piece.reshape(t.shape[0], n_heads, s, t.shape[3]))
        return torch.cat(pieces, dim=2)

    ranks = range(u_size * r_size)
    local = {
        name: [shard(t, strategy, layout, (u_size, r_size), m) for m in ranks]
        for name, t in (("q", q64), ("k", k64), ("v", v64))
    }
    local["k"] = [expand(t) for t in local["k"]]
    local["v"] = [expand(t) for t in local["v"]]

    def row_positions(r: int, seq: int) -> Tensor:
        return torch.cat(
            [
                positions(strategy, assumed, (u_size, r_size), r * u_size + i, seq)
                for i in range(u_size)
            ]
        )

    outs: dict[tuple[int, int], Tensor] = {}
    for j in range(u_size):
        rows = {
            name: [
                to_heads([local[name][r * u_size + i] for i in range(u_size)], j)
                for r in range(r_size)
            ]
            for name in ("q", "k", "v")
        }
        k_all, v_all = torch.cat(rows["k"], dim=2), torch.cat(rows["v"], dim=2)
        k_pos = torch.cat([row_positions(r, seq_k) for r in range(r_size)])
        for r in range(r_size):
            visible = causal_visibility(row_positions(r, seq_q), k_pos) if is_causal else None
            outs[(j, r)] = masked_attention(rows["q"][r], k_all, v_all, visible, scale=scale).out
    shards = []
    for m in ranks:
        u, r = m % u_size, m // u_size
        s = seq_q // (u_size * r_size)
        shards.append(
            torch.cat([outs[(j, r)][:, :, u * s : (u + 1) * s] for j in range(u_size)], dim=1)
        )
    return unshard(shards, strategy, layout, (u_size, r_size))
