"""``strategy=`` through the context-parallel API: ``context_parallel`` and ``ContextParallel``
route SDPA to Ulysses (sequence-to-heads all-to-all) as they do to the ring, with the same
buffer sharding, and to the hybrid on a 2-D mesh (buffers in the hybrid's layout over the
flattened mesh); the hybrid on anything but a (ring, ulysses) mesh is refused on every rank."""

from __future__ import annotations

import pytest
import torch

from reference import attention
from reference.budget import assert_close
from tests.ring_impl.outcomes import assert_every_rank_raised
from tests.ring_impl.routes import CausalSDPA, sdpa_both_routes

HEADS, HEAD_DIM, LOCAL = 4, 8, 8


def _inputs(world: int):
    gen = torch.Generator().manual_seed(21)
    return [
        torch.randn(1, HEADS, LOCAL * world, HEAD_DIM, dtype=torch.float64, generator=gen)
        for _ in range(3)
    ]


def _routed(ctx, strategy: str) -> dict:
    return sdpa_both_routes(ctx, *_inputs(ctx.world_size), strategy=strategy)


def _calls(summary: dict, kind: str) -> int:
    return sum(kinds.get(kind, {}).get("calls", 0) for kinds in summary.values())


@pytest.mark.parametrize("world", [2, 4])
def test_context_parallel_routes_sdpa_to_ulysses(ring, world: int) -> None:
    import ring_impl

    q, k, v = _inputs(world)
    ref = attention(q, k, v, is_causal=True).out
    base = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
    ranks = {s: ring.rank_pool(world).run(_routed, s, timeout=60.0) for s in ("ulysses", "ring")}
    for route in ("cp", "style"):
        got = ring_impl.unshard([r[route][0] for r in ranks["ulysses"]], layout="head_tail")
        assert_close(
            f"out [context parallel {route}, ulysses, W={world}]", got, ref, base, world_size=1
        )
        for strategy in ("ulysses", "ring"):
            # Forward only: each route issued its strategy's declared forward all-to-alls
            # (Ulysses: query/key/value to heads, output back; the ring: W-1 key/value hops).
            declared = ring_impl.collective_schedule(
                world,
                "alltoall",
                strategy=strategy,
                batch=1,
                heads=HEADS,
                heads_kv=HEADS,
                seq_q=LOCAL,
                seq_kv=LOCAL,
                head_dim=HEAD_DIM,
                dtype=torch.float64,
                return_lse=False,
                **({"mesh_shape": (world, 1)} if strategy == "ulysses" else {}),
            )["forward"]["all_to_all"]["calls"]
            for rank in range(world):
                issued = ranks[strategy][rank][route][1]
                assert _calls(issued, "all_to_all") == declared, (
                    f"rank {rank} {route} {strategy}: issued {issued}, declared {declared}"
                )
            assert declared == (2 if strategy == "ulysses" else world - 1)


def _hybrid_routed(ctx) -> dict:
    import torch.nn.functional as F
    from torch.distributed.tensor.parallel import parallelize_module

    import ring_impl

    mesh = ctx.device_mesh((2, 2), ("ring", "ulysses"))
    q, k, v = _inputs(ctx.world_size)
    out: dict = {}
    qs, ks, vs = q.clone(), k.clone(), v.clone()
    with ring_impl.context_parallel(
        mesh,
        buffers=[qs, ks, vs],
        buffer_seq_dims=[2, 2, 2],
        rotate_method="p2p",
        strategy="hybrid",
    ):
        o = F.scaled_dot_product_attention(qs, ks, vs, is_causal=True)
        out["cp"] = ring_impl.context_parallel_unshard(mesh, [o], [2], strategy="hybrid")[0]
    module = parallelize_module(
        CausalSDPA(), mesh, ring_impl.ContextParallel(rotate_method="p2p", strategy="hybrid")
    )
    from ring_impl.torch_api.hybrid_cp import hybrid_sharding

    _, layout = hybrid_sharding(mesh, "head_tail")
    o = module(
        *(ring_impl.shard(t, ctx.world_size, ctx.rank, layout=layout, dim=2) for t in (q, k, v))
    )
    out["style"] = ring_impl.context_parallel_unshard(mesh, [o], [2], strategy="hybrid")[0]
    return out


def test_context_parallel_routes_sdpa_to_the_hybrid(ring) -> None:
    """A 2x2 (ring x ulysses) mesh: buffers sharded in the hybrid's layout over the flattened
    mesh, SDPA routed to the hybrid, unshard back; equal to single-process SDPA by the policy."""
    q, k, v = _inputs(4)
    ref = attention(q, k, v, is_causal=True).out
    base = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
    for rank, r in enumerate(ring.rank_pool(4).run(_hybrid_routed, timeout=90.0)):
        for route in ("cp", "style"):
            assert_close(
                f"out [context parallel {route}, hybrid 2x2, rank {rank}]",
                r[route],
                ref,
                base,
                world_size=2,
            )


def _hybrid_refused(ctx, where: str):
    import ring_impl

    x = torch.zeros(1, HEADS, LOCAL * ctx.world_size, HEAD_DIM)
    if where == "style":
        from torch.distributed.device_mesh import DeviceMesh
        from torch.distributed.tensor.parallel import parallelize_module

        parallelize_module(
            CausalSDPA(),
            DeviceMesh.from_group(ctx.group, "cpu"),
            ring_impl.ContextParallel(strategy="hybrid"),
        )
    else:
        with ring_impl.context_parallel(
            ctx.group, buffers=[x], buffer_seq_dims=[2], strategy="hybrid"
        ):
            pass
    return "accepted"


@pytest.mark.parametrize("where", ["context_parallel", "style"])
def test_hybrid_on_a_1d_mesh_is_refused_on_every_rank_with_what_to_do(ring, where: str) -> None:
    outcomes = ring.rank_pool(2).run_outcomes(_hybrid_refused, where, timeout=30.0)
    summary = assert_every_rank_raised(outcomes, "ContextParallelError")
    assert all(
        "needs a 2-D DeviceMesh with dims named 'ring' and 'ulysses'" in o.exc_message
        for o in outcomes
    ), summary


def _hybrid_option_differs(ctx, option: str):
    import ring_impl

    mesh = ctx.device_mesh((2, 2), ("ring", "ulysses"))
    x = torch.zeros(1, HEADS, LOCAL * ctx.world_size, HEAD_DIM)
    bad = ctx.rank != 0  # rank 0's arguments are good, the others' are not
    kwargs = (
        {"rotate_method": "ring" if bad else "p2p"}
        if option == "rotate_method"
        else {"strategy": "sideways" if bad else "hybrid"}
    )
    with ring_impl.context_parallel(
        mesh, buffers=[x], buffer_seq_dims=[2], **{"strategy": "hybrid", **kwargs}
    ):
        pass
    return "accepted"


@pytest.mark.parametrize("option", ["rotate_method", "strategy"])
def test_hybrid_option_bad_on_some_ranks_is_refused_on_every_rank(ring, option: str) -> None:
    """Rank 0 passes good arguments and the others a bad one: rank 0 must not wait alone in the
    argument check (it agreed over the flattened mesh while the others gave up before any
    collective: a hang, found by the fuzz campaign)."""
    outcomes = ring.rank_pool(4).run_outcomes(_hybrid_option_differs, option, timeout=60.0)
    summary = assert_every_rank_raised(outcomes, "ContextParallelError", clip=200)
    assert "rejected their arguments" in outcomes[0].exc_message, summary
