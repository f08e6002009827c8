"""ring_impl.exchanges: the key/value head replication, the all-to-all's data movement, the
declared schedule worked out by hand, the local checks, group resolution, head_chunks in the
hybrid's ring and a loss through the LSE only."""

from __future__ import annotations

import math

import pytest
import torch

from reference.attention import attention
from ring_impl import collective_schedule
from ring_impl.checks.mesh import strategy_problem
from ring_impl.exchanges.ulysses import kv_replication
from ring_impl.schedule.head_parallel import strategy_schedule
from ring_impl.schedule.ring import KVShards
from suites.cases import RingCase
from suites.inputs import InputSpec


@pytest.mark.parametrize(
    "heads,heads_kv,degree,factor",
    [
        (8, 8, 4, 1),
        (8, 4, 4, 1),
        (8, 2, 4, 2),
        (8, 1, 4, 4),
        (12, 2, 3, 3),
        (12, 3, 2, 2),
        (12, 6, 4, 2),
        (16, 2, 8, 4),
    ],
)
def test_replicated_kv_heads_split_evenly_and_keep_the_gqa_map(
    heads, heads_kv, degree, factor
) -> None:
    assert kv_replication(heads_kv, degree) == factor
    expanded = heads_kv * factor
    assert expanded % degree == 0 and expanded == math.lcm(heads_kv, degree)
    replica_of = [
        i // factor for i in range(expanded)
    ]  # repeat_interleave: replicas next to each other
    per_rank_q, per_rank_kv = heads // degree, expanded // degree
    for rank in range(degree):
        for h in range(rank * per_rank_q, (rank + 1) * per_rank_q):
            local = (h - rank * per_rank_q) // (
                per_rank_q // per_rank_kv
            )  # the kernel's GQA map on the rank
            assert replica_of[rank * per_rank_kv + local] == h // (heads // heads_kv), (rank, h)


def _alltoall(ctx, heads: int):
    import torch.distributed as dist

    from ring_impl.exchanges.head_alltoall import heads_to_sequence, sequence_to_heads
    from ring_impl.exchanges.mesh_groups import HeadGroup

    g = HeadGroup(dist.group.WORLD.group_name, ctx.rank, ctx.world_size, False)
    s = 3
    # element value encodes (source rank, head, local position, feature)
    x = (
        torch.arange(2 * heads * s * 2, dtype=torch.float64).reshape(2, heads, s, 2)
        + 1000 * ctx.rank
    )
    lse = x[..., 0].to(torch.float32).unsqueeze(-1) + 0.5
    out_x, out_lse = sequence_to_heads([x.to(torch.bfloat16), lse], g)
    back = heads_to_sequence([out_x, out_lse], g)
    return x, out_x.double(), out_lse.double(), back[0].double(), back[1].double()


@pytest.mark.parametrize("w", [2, 3])
def test_alltoall_moves_head_slices_and_back(rank_pool, w: int) -> None:
    heads = 2 * w
    res = rank_pool(w).run(_alltoall, heads)
    inputs = [r[0] for r in res]
    for j, (_, out_x, out_lse, back_x, back_lse) in enumerate(res):
        per = heads // w
        want = torch.cat(
            [inputs[i][:, j * per : (j + 1) * per] for i in range(w)], dim=2
        )  # sources in rank order
        assert torch.equal(out_x, want.to(torch.bfloat16).double()), (
            f"rank {j}: wrong head slice or sequence order"
        )
        assert torch.equal(out_lse, (want[..., :1].float() + 0.5).double()), (
            f"rank {j}: LSE packed with another dtype"
        )
        assert torch.equal(back_x, inputs[j].to(torch.bfloat16).double()) and torch.equal(
            back_lse[..., 0], inputs[j][..., 0].float().double() + 0.5
        )


def test_ulysses_schedule_worked_out_by_hand() -> None:
    # U=4, batch 2, 8 query heads, 2 key/value heads (each replicated twice: 4), local length 4,
    # head_dim 8, bfloat16 (2 bytes), LSE float32 (4 bytes).
    sizes = dict(batch=2, heads_kv=2, seq_kv=4, head_dim=8, dtype=torch.bfloat16)
    shards = KVShards.of(**sizes)
    got = strategy_schedule("ulysses", (4, 1), "alltoall", shards, heads=8, seq_q=4)
    q, kv, out, lse = 2 * 8 * 4 * 8 * 2, 2 * (2 * 4 * 4 * 8 * 2), 2 * 8 * 4 * 8 * 2, 2 * 8 * 4 * 4
    # int64 rows of 4 ranks: problem flag, 17 ring fields (the backward flag last), 5 strategy
    # fields, the ring's finiteness flag
    check_table = 8 * 4 * 24
    assert got == {
        "forward": {
            "all_reduce": {"calls": 1, "bytes": check_table},
            "all_to_all": {"calls": 2, "bytes": q + kv + out + lse},
        },
        "backward": {"all_to_all": {"calls": 2, "bytes": out + lse + q + kv}},
    }
    no_lse = strategy_schedule(
        "ulysses", (4, 1), "alltoall", shards, heads=8, seq_q=4, return_lse=False, compiled=True
    )
    # compiled: the same, the cross-rank check included (ring_impl.compiled.checks)
    assert no_lse == {
        "forward": {
            "all_reduce": {"calls": 1, "bytes": check_table},
            "all_to_all": {"calls": 2, "bytes": q + kv + out},
        },
        "backward": {"all_to_all": {"calls": 2, "bytes": out + q + kv}},
    }
    via_entry = collective_schedule(4, "alltoall", strategy="ulysses", heads=8, seq_q=4, **sizes)
    assert via_entry == got


def test_hybrid_schedule_is_the_rows_alltoalls_plus_the_ring_of_a_row_shard() -> None:
    shards = KVShards.of(batch=1, heads_kv=1, seq_kv=4, head_dim=8, dtype=torch.float32)
    hybrid = strategy_schedule("hybrid", (2, 3), "p2p", shards, heads=4, seq_q=4)
    ulysses = strategy_schedule("ulysses", (2, 1), "allgather", shards, heads=4, seq_q=4)
    # the ring across 3 rows carries the row shard (2 x 4 positions)
    # of 1 key/value head (MQA: 2 replicas, 1 per rank)
    ring = collective_schedule(
        3, "p2p", batch=1, heads_kv=1, seq_kv=8, head_dim=8, dtype=torch.float32
    )
    for phase in ("forward", "backward"):
        assert hybrid[phase]["all_to_all"] == ulysses[phase]["all_to_all"]
        for kind in ("send", "recv"):
            assert hybrid[phase][kind] == ring[phase][kind]
    # one check over the mesh: an all-reduce per mesh dim, each over the 6-rank table
    assert hybrid["forward"]["all_reduce"] == {"calls": 2, "bytes": 2 * 8 * 6 * 24}


def _problem(strategy: str, mesh: tuple[int, int], q, k, v, **overrides) -> str | None:
    """``strategy_problem`` on ``mesh`` of a full contiguous call with the alltoall rotation and
    the math op, one head chunk, no LSE, ``overrides`` applied."""
    from ring_impl.checks.inputs import LocalCall
    from ring_impl.ops import get_op

    options = dict(
        is_causal=False,
        scale=None,
        layout="contiguous",
        rotate_method="alltoall",
        op=get_op("math"),
        effective_scale=q.shape[-1] ** -0.5,
        op_error=None,
        head_chunks=1,
        return_lse=False,
    )
    local = LocalCall(query=q, key=k, value=v, **(options | overrides))
    return strategy_problem(strategy, local, mesh_shape=mesh)


_SHAPE = (1, 4, 8, 4)  # (batch, heads, seq_local, head_dim) the local problems share


@pytest.mark.parametrize(
    "strategy,mesh,shape_q,shape_kv,extra,words",
    [
        (
            "ulysses",
            (4, 1),
            (1, 6, 8, 4),
            (1, 6, 8, 4),
            {},
            "not divisible by the Ulysses degree 4",
        ),
        (
            "ulysses",
            (2, 1),
            (1, 4, 5, 4),
            (1, 4, 5, 4),
            {"layout": "head_tail"},
            "layout 'head_tail'",
        ),
        (
            "ulysses",
            (2, 1),
            _SHAPE,
            _SHAPE,
            {"head_chunks": 2},
            "head_chunks=2 applies to the ring",
        ),
        (
            "ulysses",
            (2, 1),
            _SHAPE,
            _SHAPE,
            {"head_chunks": 1.0},
            "head_chunks=1.0 applies to the ring",
        ),
        ("hybrid", (3, 2), (1, 6, 1, 4), (1, 6, 1, 4), {"layout": "head_tail"}, "row (U x local)"),
        (
            "hybrid",
            (4, 2),
            (1, 8, 8, 4),
            (1, 2, 8, 4),
            {"head_chunks": 2},
            "1 key/value heads per rank",
        ),
        ("hybrid", (2, 2), _SHAPE, _SHAPE, {"return_lse": "yes"}, "return_lse must be a bool"),
    ],
)
def test_local_problems_say_what_to_do(strategy, mesh, shape_q, shape_kv, extra, words) -> None:
    kw = {"is_causal": extra.get("layout") == "head_tail", **extra}
    q, k = torch.randn(*shape_q), torch.randn(*shape_kv)
    problem = _problem(strategy, mesh, q, k, k.clone(), **kw)
    assert problem is not None and words in problem, problem
    full = torch.randn(1, 24, 8, 4)
    fixed = {**kw, "layout": "contiguous", "head_chunks": 1, "return_lse": False}
    assert _problem(strategy, mesh, full, full.clone(), full.clone(), **fixed) is None


def _groups(ctx, kind: str) -> str:
    from ring_impl.exchanges.mesh_groups import resolve_strategy_groups

    if kind == "unnamed_mesh":
        group = ctx.device_mesh((2, 2), ("a", "b"))
    elif kind == "mapping_keys":
        group = {"ulysses": ctx.group}
    elif (
        kind == "mapping_not_a_mesh"
    ):  # both groups every rank: an IndexError in the check table before
        group = {"ulysses": ctx.group, "ring": ctx.group}
    elif kind == "flat_for_hybrid":
        group = ctx.group
    else:
        group = ctx.device_mesh((2, 2), ("ring", "ulysses"))
        g = resolve_strategy_groups("hybrid", group)
        return f"{g.shape} {g.coords} {g.mesh_rank}"
    resolve_strategy_groups("hybrid", group)
    return "no error"


@pytest.mark.parametrize(
    "kind,words",
    [
        ("unnamed_mesh", "dims named 'ulysses' and 'ring'"),
        ("mapping_keys", "exactly the keys"),
        ("flat_for_hybrid", "2-D DeviceMesh"),
        ("mapping_not_a_mesh", "cross only at this rank"),
    ],
)
def test_hybrid_groups_are_checked(rank_pool, kind: str, words: str) -> None:
    outcomes = rank_pool(4).run_outcomes(_groups, kind)
    assert all(not o.ok and words in o.exc_message for o in outcomes), [
        (o.ok, o.exc_message) for o in outcomes
    ]


def test_mesh_coordinates_are_row_major(rank_pool) -> None:
    got = rank_pool(4).run(_groups, "ok")
    assert got == [f"(2, 2) ({r % 2}, {r // 2}) {r}" for r in range(4)]


@pytest.mark.parametrize("rotate,chunks", [("alltoall", 2), ("p2p", 3)])
def test_hybrid_ring_runs_head_chunks(ring, rotate: str, chunks: int) -> None:
    """head_chunks reaches the hybrid's ring: the result is right and the ring's calls multiply."""
    spec = InputSpec(
        batch=1, heads=12, heads_kv=6, seq_q=16, seq_kv=16, head_dim=8, dtype="float32", seed=11
    )
    case = ring.prepare(
        RingCase(
            spec,
            4,
            strategy="hybrid",
            mesh_shape=(2, 2),
            is_causal=True,
            layout="head_tail",
            rotate_method=rotate,
            account=True,
            extras=(("head_chunks", chunks),),
        ),
    )
    results = ring.run(case)
    ring.check(case, results=results)
    expected = strategy_schedule(
        "hybrid",
        (2, 2),
        rotate,
        KVShards.of(batch=1, heads_kv=6, seq_kv=4, head_dim=8, dtype=torch.float32),
        heads=12,
        seq_q=4,
        head_chunks=chunks,
    )
    for rank, r in enumerate(results):
        assert {p: k for p, k in r["collectives"].items() if k} == expected, f"rank {rank}"


def _lse_only(ctx):
    import ring_impl
    from reference.strategies import shard

    mesh = ctx.device_mesh((2, 2), ("ring", "ulysses"))
    g = torch.Generator().manual_seed(5)
    q, k, v = (torch.randn(1, 4, 16, 8, generator=g, dtype=torch.float64) for _ in range(3))
    local = [shard(t, "hybrid", "head_tail", (2, 2), ctx.rank).requires_grad_() for t in (q, k, v)]
    _, lse = ring_impl.ring_attention(
        *local, group=mesh, strategy="hybrid", is_causal=True, layout="head_tail", return_lse=True
    )
    lse.sum().backward()
    return [t.grad for t in local]


def test_loss_through_the_lse_only(ring) -> None:
    """Only the LSE reaches the loss: its gradient travels back through the all-to-all."""
    from reference.strategies import unshard

    res = ring.rank_pool(4).run(_lse_only)
    g = torch.Generator().manual_seed(5)
    q, k, v = (
        torch.randn(1, 4, 16, 8, generator=g, dtype=torch.float64).requires_grad_()
        for _ in range(3)
    )
    attention(q, k, v, is_causal=True).lse.sum().backward()
    assert v.grad is None  # the LSE does not depend on the values
    for i, want in enumerate((q.grad, k.grad, torch.zeros_like(v))):
        got = unshard([r[i] for r in res], "hybrid", "head_tail", (2, 2))
        torch.testing.assert_close(got, want, rtol=0, atol=1e-12)


def test_a_registered_layout_is_named_as_registered_when_a_strategy_refuses_it() -> None:
    """Ulysses and the hybrid take the built-in layouts only; a registered one is refused as such,
    not as unknown (ring_attention accepts it with exchange='ring')."""
    import ring_impl

    ring_impl.register_layout(
        ring_impl.layout.chunked_layout(
            "test_registered_for_ulysses", lambda w: w, lambda w, r: (r,)
        ),
        replace=True,
    )
    q = torch.zeros(1, 4, 8, 8)
    for strategy, mesh in (("ulysses", (2, 1)), ("hybrid", (2, 2))):
        layout = "test_registered_for_ulysses"
        problem = _problem(strategy, mesh, q, q, q, layout=layout)
        assert (
            problem is not None and "is registered" in problem and "exchange='ring'" in problem
        ), problem
