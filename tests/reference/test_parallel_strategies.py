"""The oracle's pieces for Ulysses and the hybrid (reference/strategies.py): layouts restated from
their definition, the hybrid's simulation and the replay equal to plain attention, each replayed
bug different from the truth where it can show, and the diagnosis naming the bug it is shown."""

from __future__ import annotations

import itertools

import pytest
import torch

from reference import strategies as rs
from reference.attention import attention
from reference.diagnose import diagnose_strategy
from reference.diagnose.strategies import _local_only
from ring_impl.planning import mesh_layout as impl_layout

MESHES = [
    ("ulysses", (4, 1)),
    ("ulysses", (3, 1)),
    ("hybrid", (2, 2)),
    ("hybrid", (2, 3)),
    ("hybrid", (3, 2)),
    ("hybrid", (4, 1)),
    ("hybrid", (1, 4)),
    ("ring", (1, 4)),
]


def held(strategy: str, layout: str, mesh: tuple[int, int], rank: int, seq: int) -> list[int]:
    """Positions restated from the definition, so the tests trust neither implementation."""
    u_size, r_size = mesh
    u, r = rank % u_size, rank // u_size
    ranks = u_size if strategy == "ulysses" else r_size
    who = u if strategy == "ulysses" else r
    chunks = [who] if layout == "contiguous" else [who, 2 * ranks - 1 - who]
    c = seq // (ranks * (1 if layout == "contiguous" else 2))
    row = [p for k in chunks for p in range(k * c, (k + 1) * c)]
    if strategy == "ulysses":
        return row
    n = len(row) // u_size
    return row[u * n : (u + 1) * n]


@pytest.mark.parametrize("strategy,mesh", MESHES)
@pytest.mark.parametrize("layout", ["contiguous", "head_tail"])
def test_positions_follow_the_definition_and_agree_with_ring_impl(strategy, mesh, layout) -> None:
    seq = 24 * mesh[0] * mesh[1]
    seen = []
    for m in range(mesh[0] * mesh[1]):
        want = held(strategy, layout, mesh, m, seq)
        assert rs.positions(strategy, layout, mesh, m, seq).tolist() == want
        ranges = impl_layout.position_ranges(strategy, layout, mesh, rs_coords(m, mesh), seq)
        assert [p for a, b in ranges for p in range(a, b)] == want
        seen += want
    assert sorted(seen) == list(range(seq))
    t = torch.randn(2, 3, seq, 4)
    shards = [rs.shard(t, strategy, layout, mesh, m) for m in range(mesh[0] * mesh[1])]
    assert torch.equal(rs.unshard(shards, strategy, layout, mesh), t)
    impl_shards = [
        impl_layout.shard(
            t, strategy=strategy, layout=layout, mesh_shape=mesh, coords=rs_coords(m, mesh)
        )
        for m in range(mesh[0] * mesh[1])
    ]
    assert all(torch.equal(a, b) for a, b in zip(shards, impl_shards))
    assert torch.equal(
        impl_layout.unshard(impl_shards, strategy=strategy, layout=layout, mesh_shape=mesh), t
    )
    index = (1, 2, seq - 3, 1)
    rank, local = rs.locate(index, strategy, layout, mesh, seq)
    assert shards[rank][local] == t[index]


def rs_coords(m: int, mesh: tuple[int, int]) -> tuple[int, int]:
    return m % mesh[0], m // mesh[0]


def test_sequence_divisor_is_what_sharding_needs() -> None:
    assert (
        impl_layout.sequence_divisor("hybrid", "head_tail", (3, 2)) == 12
    )  # 2R chunks, rows of 2 chunks cut in 3
    assert impl_layout.sequence_divisor("hybrid", "contiguous", (3, 2)) == 6
    assert impl_layout.sequence_divisor("ulysses", "head_tail", (4, 1)) == 8
    with pytest.raises(ValueError, match="multiple of 12"):
        impl_layout.position_ranges("hybrid", "head_tail", (3, 2), (0, 0), 18)


def problem(heads: int, heads_kv: int, seq: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(1, heads, seq, 4, generator=g, dtype=torch.float64)
    k = torch.randn(1, heads_kv, seq, 4, generator=g, dtype=torch.float64)
    v = torch.randn(1, heads_kv, seq, 4, generator=g, dtype=torch.float64)
    return q, k, v


@pytest.mark.parametrize("strategy,mesh", [m for m in MESHES if m[0] != "ring"])
@pytest.mark.parametrize(
    "layout,causal", list(itertools.product(["contiguous", "head_tail"], [False, True]))
)
@pytest.mark.parametrize("heads_kv", [12, 2, 1])
def test_replay_and_simulation_equal_attention(strategy, mesh, layout, causal, heads_kv) -> None:
    seq = 4 * mesh[0] * mesh[1] * mesh[0]
    q, k, v = problem(12, heads_kv, seq)
    ref = attention(q, k, v, is_causal=causal).out
    replayed = rs.replay_head_parallel(
        q, k, v, strategy=strategy, layout=layout, mesh_shape=mesh, is_causal=causal
    )
    torch.testing.assert_close(replayed, ref, rtol=0, atol=1e-12)
    if strategy == "hybrid":
        sim = rs.simulate_hybrid(q, k, v, mesh_shape=mesh, layout=layout, is_causal=causal)
        torch.testing.assert_close(sim.out, ref, rtol=0, atol=1e-12)
        # step 0 of every row is its own block; head slice
        # u's ring covers query heads of slice u only
        assert all(sim.step(u, r, 0).kv_rank == r for u in range(mesh[0]) for r in range(mesh[1]))
        if causal and layout == "head_tail":
            work = sim.work_per_row()
            assert max(work) == min(work), f"head_tail rows must do equal causal work, got {work}"


def test_each_replayed_bug_changes_the_result_where_it_can_show() -> None:
    mesh, seq = (3, 2), 72
    q, k, v = problem(6, 2, seq)  # GQA below the degree: each key/value head replicated 3 times
    ref = attention(q, k, v, is_causal=True).out
    common = dict(strategy="hybrid", layout="head_tail", mesh_shape=mesh, is_causal=True)
    for change in ({"kv_order": "tile"}, {"split": "sequence"}, {"assumed_layout": "contiguous"}):
        other = rs.replay_head_parallel(q, k, v, **common, **change)
        assert (other - ref).abs().max() > 1e-2, change
    # tiling the replicas is harmless with one key/value head (MQA) or none replicated
    for heads_kv in (1, 3):
        q, k, v = problem(6, heads_kv, seq)
        same = rs.replay_head_parallel(q, k, v, **common, kv_order="tile")
        torch.testing.assert_close(same, attention(q, k, v, is_causal=True).out, rtol=0, atol=1e-12)


@pytest.mark.parametrize(
    "bug,words",
    [
        ({"kv_order": "tile"}, "replicated in the wrong order"),
        ({"split": "sequence"}, "heads and sequence swapped"),
        ({"assumed_layout": "contiguous"}, "head_tail reorder is missing"),
        ("local", "local attention, context parallelism silently off"),
    ],
)
def test_diagnosis_names_the_replayed_bug(bug, words) -> None:
    mesh, seq = (3, 2), 72
    q, k, v = problem(6, 2, seq, seed=3)
    common = dict(strategy="hybrid", layout="head_tail", mesh_shape=mesh, is_causal=True)
    if bug == "local":
        observed = _local_only(q, k, v, scale=None, **common)
    else:
        observed = rs.replay_head_parallel(q, k, v, **common, **bug)
    observed = observed.to(torch.float32).to(torch.float64)  # what a float32 run would return
    text = diagnose_strategy(q, k, v, observed, **common)
    assert words in text, text
    assert "mesh rank" in text, text


def test_diagnosis_of_a_correct_result_names_nothing() -> None:
    q, k, v = problem(4, 4, 16)
    ref = attention(q, k, v).out
    text = diagnose_strategy(
        q, k, v, ref, strategy="ulysses", layout="contiguous", mesh_shape=(4, 1), is_causal=False
    )
    assert "no element is off" in text and "explained" not in text
