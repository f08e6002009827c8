"""Masks under ``torch.compile``: the masked ring runs eagerly inside the compiled region (a graph
break, ``ring_impl.api.MASKS_RUN_EAGERLY``), with the code around it compiled.

Judged against the same call run eagerly, bitwise: the code around the attention is exact
(multiplications by powers of two), so any difference is the ring's. A second mask after the
first compile must get its own plan (a graph that baked the first plan in would serve it stale),
and ``fullgraph=True`` must fail on every rank naming why. The eager masked ring itself is judged
against the float64 oracle in test_masks.py.
"""

from __future__ import annotations

import pytest
import torch

from conformance.implementation import DEFAULT_IMPL_SPEC

SEQ, HEADS, HEADS_KV, HEAD_DIM = 32, 4, 2, 8


def _skip_other_impls(ring):
    if ring.impl.spec != DEFAULT_IMPL_SPEC:
        pytest.skip(f"mask= is ring_impl's API here; the implementation under test is {ring.impl.spec}")


def _mask(kind: str, variant: int):
    from ring_impl.masks import Documents, SlidingWindow

    if kind == "documents":  # variant 1: other boundaries, crossing the shards differently
        lengths = ([5, 1, 19, 7], [16, 3, 13])[variant]
        return Documents(torch.cat([torch.full((n,), d) for d, n in enumerate(lengths)]))
    return SlidingWindow((3, 9)[variant], 0)


def _compiled_vs_eager(ctx, kind, strategy, layout, backend, with_sinks):
    import torch._dynamo.testing

    import ring_impl

    gen = torch.Generator().manual_seed(5)
    q = torch.randn(1, HEADS, SEQ, HEAD_DIM, generator=gen)
    k, v = (torch.randn(1, HEADS_KV, SEQ, HEAD_DIM, generator=gen) for _ in range(2))
    dout = torch.randn(1, HEADS, SEQ, HEAD_DIM, generator=gen)
    sinks = torch.randn(HEADS, generator=gen) if with_sinks else None
    q, k, v, dout = (ring_impl.shard(t, ctx.world_size, ctx.rank, layout=layout) for t in (q, k, v, dout))

    def attention(q, k, v, mask, sinks):
        # Exact arithmetic around the ring (powers of two): compiled and eager agree bitwise.
        out = ring_impl.ring_attention(q * 2.0, k, v, group=ctx.group, mask=mask, sinks=sinks, layout=layout,
                                       rotate_method="alltoall", strategy=strategy, scale=0.25)
        return out * 0.5

    counter = torch._dynamo.testing.CompileCounterWithBackend(backend)
    compiled = torch.compile(attention, backend=counter)
    results = {}
    for variant in (0, 1):
        for name, fn in (("compiled", compiled), ("eager", attention)):
            leaves = [t.clone().requires_grad_(True) for t in (q, k, v)]
            s = None if sinks is None else sinks.clone().requires_grad_(True)
            out = fn(*leaves, _mask(kind, variant), s)
            out.backward(dout)
            results[name, variant] = [out.detach()] + [t.grad for t in leaves] + ([] if s is None else [s.grad])
    return {"results": results, "frames": counter.frame_count}


@pytest.mark.parametrize("kind,strategy,layout,backend,with_sinks", [
    ("documents", "ring", "head_tail", "aot_eager", True),
    ("window", "ring", "contiguous", "aot_eager", False),  # the halo exchange
    ("documents", "ulysses", "contiguous", "aot_eager", False),
    ("documents", "ring", "head_tail", "inductor", True),
])
def test_masked_attention_under_compile_equals_eager(ring, kind, strategy, layout, backend, with_sinks) -> None:
    _skip_other_impls(ring)
    runs = ring.rank_pool(2).run(_compiled_vs_eager, kind, strategy, layout, backend, with_sinks, timeout=240.0)
    names = ["out", "dq", "dk", "dv", "dsinks"]
    for rank, run in enumerate(runs):
        # The code around the attention was compiled (graphs before and after the break).
        assert run["frames"] >= 1, f"rank {rank}: torch.compile compiled no frame: nothing was under test"
        res = run["results"]
        for variant in (0, 1):
            for name, got, want in zip(names, res["compiled", variant], res["eager", variant]):
                assert torch.equal(got, want), (
                    f"rank {rank}, mask variant {variant}: {name} compiled ({backend}) differs from eager by "
                    f"{float((got - want).abs().max()):.2e} [{kind}, {strategy}, {layout}]")
        # The second mask got its own plan: its output is not the first mask's.
        assert not torch.equal(res["compiled", 0][0], res["compiled", 1][0]), (
            f"rank {rank}: two different masks gave the same compiled output (a stale plan?)")


def _fullgraph(ctx):
    import ring_impl
    from ring_impl.masks import SlidingWindow

    q = torch.randn(1, 2, 8, 8)
    fn = torch.compile(lambda q: ring_impl.ring_attention(q, q, q, group=ctx.group, mask=SlidingWindow(2)),
                       backend="eager", fullgraph=True)
    fn(q)
    return "no error"


def test_fullgraph_names_why_a_masked_call_breaks_the_graph(ring) -> None:
    _skip_other_impls(ring)
    outcomes = ring.rank_pool(2).run_outcomes(_fullgraph, timeout=60.0)
    summary = [(o.rank, o.ok, o.exc_type, o.exc_message[:300]) for o in outcomes]
    assert all(not o.ok for o in outcomes), summary
    assert all("runs eagerly inside torch.compile" in o.exc_message for o in outcomes), summary


#: documents over 48 global positions, crossing the shard boundaries at W = 2
_DOC_IDS = torch.tensor([0] * 7 + [1] + [2] * 20 + [3] * 20)


def _document_causal(b, h, q_idx, kv_idx):
    return (_DOC_IDS[q_idx] == _DOC_IDS[kv_idx]) & (kv_idx <= q_idx)


def _flex_compiled(ctx):
    import torch._dynamo.testing
    import torch.nn.attention.flex_attention as flex_module

    import ring_impl
    from ring_impl.sdpa_route import sdpa_routed_to_ring

    seq = _DOC_IDS.numel()
    block_mask = flex_module.create_block_mask(_document_causal, None, None, seq, seq, device="cpu")
    gen = torch.Generator().manual_seed(3)
    q, k, v, dout = (ring_impl.shard(torch.randn(1, HEADS, seq, HEAD_DIM, generator=gen), ctx.world_size, ctx.rank,
                                     layout="head_tail") for _ in range(4))

    def attention(q, k, v):  # flex_attention looked up at call time: the route's
        return flex_module.flex_attention(q * 2.0, k, v, block_mask=block_mask, scale=0.25) * 0.5

    counter = torch._dynamo.testing.CompileCounterWithBackend("aot_eager")
    results = []
    with sdpa_routed_to_ring(ctx.group, layout="head_tail"):
        for fn in (torch.compile(attention, backend=counter), attention):
            leaves = [t.clone().requires_grad_(True) for t in (q, k, v)]
            out = fn(*leaves)
            out.backward(dout)
            results.append([out.detach()] + [t.grad for t in leaves])
    return {"compiled": results[0], "eager": results[1], "frames": counter.frame_count}


def test_routed_flex_call_under_compile_equals_eager(ring) -> None:
    """``flex_attention(..., block_mask=)`` under context parallel, inside a compiled function:
    routed to the masked ring, which runs eagerly in the compiled region."""
    _skip_other_impls(ring)
    for rank, run in enumerate(ring.rank_pool(2).run(_flex_compiled, timeout=240.0)):
        assert run["frames"] >= 1, f"rank {rank}: torch.compile compiled no frame: nothing was under test"
        for name, got, want in zip(("out", "dq", "dk", "dv"), run["compiled"], run["eager"]):
            assert torch.equal(got, want), f"rank {rank}: routed flex {name} compiled differs from eager"
