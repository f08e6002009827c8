"""Masks under ``torch.compile``. Built-in masks and ``MaskMod`` (as a table of bits on the global
grid, ``ring_impl.planning.mask_table``) run in the graph as custom ops
(``ring_impl.compiled.masked_call``), ``fullgraph=True`` included, with every strategy and path
(ring, halo exchange, sparse gather, Ulysses, the hybrid); a MaskMod whose table would be too large
runs eagerly inside the compiled region (a graph break, ``ring_impl.api.MASKS_RUN_EAGERLY``), with
the code around it compiled.

Judged against the same call run eagerly, bitwise: the code around the attention is exact
(multiplications by powers of two), so any difference is the ring's. A second mask after the
first compile must get its own plan (a graph that baked the first plan in would serve it stale):
documents with other ids reuse the graph (the ids are a tensor input, also when a MaskMod closes
over them), a window of another width recompiles (dynamo guards on it). The saved state of the ops
is freed with the graph, bad input still raises InputError on every rank (a MaskMod differing
between ranks beyond the eager probe's positions included), and ``fullgraph=True`` with a
MaskMod over the table limit fails on every rank naming why. The eager masked ring itself is judged
against the float64 oracle in test_masks.py.
"""

from __future__ import annotations

import pytest
import torch

from tests.ring_impl.outcomes import assert_every_rank_raised

SEQ, HEADS, HEADS_KV, HEAD_DIM = 32, 4, 2, 8


def _mask(kind: str, variant: int):
    from ring_impl.masks import Documents, MaskMod, SlidingWindow, tabulate

    if kind in (
        "documents",
        "key_ranges",
        "mask_mod",
    ):  # variant 1: other boundaries, crossing the shards differently
        lengths = ([5, 1, 19, 7], [16, 3, 13])[variant]
        ids = torch.cat([torch.full((n,), d) for d, n in enumerate(lengths)])
        if kind == "documents":
            return Documents(ids)
        if kind == "key_ranges":  # the documents as one range of keys per query
            return tabulate(Documents(ids), SEQ)

        def documents_per_head_window(
            b, h, q_idx, kv_idx
        ):  # a new closure per call, over other ids
            return (
                (ids[q_idx] == ids[kv_idx])
                & (kv_idx <= q_idx)
                & ((h == 0) | (kv_idx >= q_idx - 3 * h))
            )

        return MaskMod(documents_per_head_window)
    return SlidingWindow((3, 9)[variant], 0)


def _compiled_vs_eager(ctx, kind, strategy, layout, backend, with_sinks, sparse_kv):
    import torch._dynamo.testing

    import ring_impl

    gen = torch.Generator().manual_seed(5)
    q = torch.randn(1, HEADS, SEQ, HEAD_DIM, generator=gen)
    k, v = (torch.randn(1, HEADS_KV, SEQ, HEAD_DIM, generator=gen) for _ in range(2))
    dout = torch.randn(1, HEADS, SEQ, HEAD_DIM, generator=gen)
    sinks = torch.randn(HEADS, generator=gen) if with_sinks else None
    group = ctx.group
    if strategy == "hybrid":  # a 2 x 2 mesh
        from reference.strategies import shard
        from suites.cases_strategies import strategy_group

        group = strategy_group(ctx, strategy, (2, 2))
        q, k, v, dout = (
            shard(t, strategy, layout, (2, 2), ctx.rank).contiguous() for t in (q, k, v, dout)
        )
    else:
        q, k, v, dout = (
            ring_impl.shard(t, ctx.world_size, ctx.rank, layout=layout) for t in (q, k, v, dout)
        )
    extra = {"sparse_kv": True} if sparse_kv else {}

    def attention(q, k, v, mask, sinks):
        # Exact arithmetic around the ring (powers of two): compiled and eager agree bitwise.
        out = ring_impl.ring_attention(
            q * 2.0,
            k,
            v,
            group=group,
            mask=mask,
            sinks=sinks,
            layout=layout,
            rotate_method="alltoall",
            strategy=strategy,
            scale=0.25,
            **extra,
        )
        return out * 0.5

    # Ranks live across cases, and every case compiles this same code: a reset keeps dynamo's
    # recompile limit (8 per code object) for this case's masks.
    torch._dynamo.reset()
    counter = torch._dynamo.testing.CompileCounterWithBackend(backend)
    compiled = torch.compile(attention, backend=counter, fullgraph=True)
    results = {}
    for variant in (0, 1):
        for name, fn in (("compiled", compiled), ("eager", attention)):
            leaves = [t.clone().requires_grad_(True) for t in (q, k, v)]
            s = None if sinks is None else sinks.clone().requires_grad_(True)
            out = fn(*leaves, _mask(kind, variant), s)
            out.backward(dout)
            results[name, variant] = (
                [out.detach()] + [t.grad for t in leaves] + ([] if s is None else [s.grad])
            )
    from ring_impl.compiled.masked_call import saved_states

    return {"results": results, "frames": counter.frame_count, "saved": saved_states()}


@pytest.mark.parametrize(
    "kind,strategy,layout,backend,with_sinks,sparse_kv",
    [
        ("documents", "ring", "head_tail", "aot_eager", True, False),
        ("window", "ring", "contiguous", "aot_eager", False, False),  # the halo exchange
        ("documents", "ring", "head_tail", "aot_eager", False, True),  # the sparse gather
        ("documents", "ulysses", "contiguous", "aot_eager", False, False),
        ("window", "hybrid", "head_tail", "aot_eager", True, False),  # 4 ranks, a 2 x 2 mesh
        ("documents", "ring", "head_tail", "inductor", False, False),
        ("key_ranges", "ring", "head_tail", "aot_eager", False, False),
        ("window", "ring", "contiguous", "inductor", False, False),
        # A MaskMod (documents per head window, closing over the ids) as a table of bits
        ("mask_mod", "ring", "head_tail", "aot_eager", True, False),
        ("mask_mod", "ring", "contiguous", "aot_eager", False, True),  # the sparse gather
        (
            "mask_mod",
            "ulysses",
            "contiguous",
            "aot_eager",
            False,
            False,
        ),  # heads split: global head indices
        ("mask_mod", "hybrid", "head_tail", "aot_eager", False, False),
        # (inductor without sinks: it fuses the sink
        # term's exp/log with other rounding than eager's)
        ("mask_mod", "ring", "head_tail", "inductor", False, False),
    ],
)
def test_masked_attention_under_compile_equals_eager(
    ring, kind, strategy, layout, backend, with_sinks, sparse_kv
) -> None:
    world = 4 if strategy == "hybrid" else 2
    runs = ring.rank_pool(world).run(
        _compiled_vs_eager, kind, strategy, layout, backend, with_sinks, sparse_kv, timeout=240.0
    )
    names = ["out", "dq", "dk", "dv", "dsinks"]
    for rank, run in enumerate(runs):
        res = run["results"]
        # In the graph (fullgraph=True compiled): the documents' ids (and key ranges) are an input
        # of the graph (also closed over by a MaskMod), a window's width a constant it was
        # specialised on.
        want = 2 if kind == "window" else 1
        assert run["frames"] == want, (
            f"rank {rank}: {run['frames']} compiled frames for two {kind} masks, expected {want}"
        )
        assert run["saved"] == 0, f"rank {rank}: {run['saved']} saved states outlive their backward"
        for variant in (0, 1):
            for name, got, want in zip(names, res["compiled", variant], res["eager", variant]):
                assert torch.equal(got, want), (
                    f"rank {rank}, mask variant {variant}: {name} compiled ({backend}) differs "
                    f"from eager by {float((got - want).abs().max()):.2e} [{kind}, {strategy}, "
                    f"{layout}]"
                )
        # The second mask got its own plan: its output is not the first mask's.
        assert not torch.equal(res["compiled", 0][0], res["compiled", 1][0]), (
            f"rank {rank}: two different masks gave the same compiled output (a stale plan?)"
        )


def _saved_state_lifetime(ctx):
    import ring_impl
    from ring_impl.compiled.masked_call import saved_states
    from ring_impl.masks import Documents

    mask = _mask("documents", 0)
    assert isinstance(mask, Documents)
    q = torch.randn(1, HEADS, SEQ // 2, HEAD_DIM, requires_grad=True)
    fn = torch.compile(
        lambda q: ring_impl.ring_attention(q, q, q, group=ctx.group, mask=mask, is_causal=True),
        backend="aot_eager",
        fullgraph=True,
    )
    counts = {}
    out = fn(q)
    counts["after forward"] = saved_states()
    out.sum().backward(retain_graph=True)
    first = q.grad.clone()
    q.grad = None
    out.sum().backward()  # a second backward of a retained graph
    counts["second backward equal"] = int(torch.equal(q.grad, first))
    counts["after backward"] = saved_states()
    del out
    counts["after release"] = saved_states()
    out = fn(q)
    del out  # a forward whose backward never runs
    counts["forward only, released"] = saved_states()
    with torch.no_grad():
        fn(q)
    counts["no_grad"] = saved_states()
    return counts


def test_compiled_masked_call_frees_its_saved_state(ring) -> None:
    """What the backward op needs lives as long as the graph that will call it, as autograd's
    saved tensors: through a retained graph's second backward, and not past its release."""
    for rank, counts in enumerate(ring.rank_pool(2).run(_saved_state_lifetime, timeout=240.0)):
        assert counts == {
            "after forward": 1,
            "second backward equal": 1,
            "after backward": 0,
            "after release": 0,
            "forward only, released": 0,
            "no_grad": 0,
        }, (rank, counts)


def _bad_input_compiled(ctx, case):
    import ring_impl
    from ring_impl.masks import Documents, SlidingWindow

    local = SEQ // 2
    if case == "ids_of_wrong_length":
        mask = Documents(torch.zeros(SEQ + 3, dtype=torch.int64))
    elif case == "mask_differs_between_ranks":
        mask = SlidingWindow(3 + ctx.rank)
    else:  # "mask_mod_differs_beyond_the_probe": equal on the first 64 positions, not at 90
        from ring_impl.masks import MaskMod

        local, odd = 48, 90 if ctx.rank == 1 else -1
        mask = MaskMod(lambda b, h, q_idx, kv_idx: (kv_idx <= q_idx) & (q_idx != odd))
    q = torch.randn(1, HEADS, local, HEAD_DIM)
    fn = torch.compile(
        lambda q, mask: ring_impl.ring_attention(q, q, q, group=ctx.group, mask=mask),
        backend="aot_eager",
        fullgraph=True,
    )
    fn(q, mask)
    return "no error"


@pytest.mark.parametrize(
    "case",
    ["ids_of_wrong_length", "mask_differs_between_ranks", "mask_mod_differs_beyond_the_probe"],
)
def test_compiled_masked_call_refuses_bad_input_on_every_rank(ring, case) -> None:
    """The op runs the eager call's checks, the cross-rank agreement included: a MaskMod's table
    is compared whole (eagerly its values over the call's range: ring_impl.masks.probe_text)."""
    outcomes = ring.rank_pool(2).run_outcomes(_bad_input_compiled, case, timeout=120.0)
    summary = assert_every_rank_raised(outcomes, "InputError", clip=300)
    word = "entries" if case == "ids_of_wrong_length" else "mask"
    assert all(word in o.exc_message for o in outcomes), summary


def _fullgraph(ctx):
    import ring_impl
    import ring_impl.planning.mask_table as mask_table
    from ring_impl.masks import MaskMod

    q = torch.randn(1, 2, 8, 8)
    mask = MaskMod(lambda b, h, q_idx, kv_idx: kv_idx <= q_idx)
    fn = torch.compile(
        lambda q: ring_impl.ring_attention(q, q, q, group=ctx.group, mask=mask),
        backend="eager",
        fullgraph=True,
    )
    limit = mask_table.MAX_TABLE_BITS
    mask_table.MAX_TABLE_BITS = 16 * 16 - 1  # one bit short of this call's table
    try:
        fn(q)
    finally:
        mask_table.MAX_TABLE_BITS = limit
    return "no error"


def test_fullgraph_names_why_a_mask_mod_breaks_the_graph(ring) -> None:
    """A MaskMod whose table would exceed MAX_TABLE_BITS runs eagerly: fullgraph=True refuses it
    on every rank, naming why."""
    outcomes = ring.rank_pool(2).run_outcomes(_fullgraph, timeout=60.0)
    summary = assert_every_rank_raised(outcomes, clip=300)
    assert all(
        "runs eagerly inside torch.compile" in o.exc_message and "MaskMod" in o.exc_message
        for o in outcomes
    ), summary


def _asserting_mask_mod(ctx, fullgraph: bool):
    """A mask_mod whose own assertion fails on rank 1's data only (its positions reach 31 there)."""
    import ring_impl
    from ring_impl.masks import MaskMod

    limit = 64 if ctx.rank == 0 else 16

    def checked_causal(b, h, q_idx, kv_idx):
        assert (q_idx < limit).all(), "positions beyond the table"
        return kv_idx <= q_idx

    q = torch.randn(1, 2, 16, 8)
    fn = torch.compile(
        lambda q: ring_impl.ring_attention(q, q, q, group=ctx.group, mask=MaskMod(checked_causal)),
        backend="aot_eager",
        fullgraph=fullgraph,
    )
    fn(q)
    return "no error"


@pytest.mark.parametrize("fullgraph", [False, True])
def test_a_mask_mod_that_asserts_is_refused_on_every_rank(ring, fullgraph) -> None:
    """In the graph a failing assertion would raise on its own rank while the others wait in the
    op's check: a MaskMod whose code asserts or raises runs eagerly, its failure an InputError on
    every rank (or, where the graph cannot break, a refusal naming why on every rank)."""
    outcomes = ring.rank_pool(2).run_outcomes(_asserting_mask_mod, fullgraph, timeout=120.0)
    summary = assert_every_rank_raised(outcomes, clip=300)
    assert all(
        o.exc_type.endswith("InputError") or "asserts or raises" in o.exc_message for o in outcomes
    ), summary
    assert any(
        "positions beyond the table" in o.exc_message or "asserts or raises" in o.exc_message
        for o in outcomes
    ), summary


def test_raises_itself_reads_the_code() -> None:
    from ring_impl.compiled.masked_call import raises_itself

    def plain(b, h, q, kv):
        return kv <= q

    def asserting(b, h, q, kv):
        assert (q >= 0).all()
        return kv <= q

    def nested(b, h, q, kv):
        def inner(x):
            if (x < 0).any():
                raise ValueError("negative")
            return x

        return inner(kv) <= q

    class Callable:
        def __call__(self, b, h, q, kv):
            assert q.dim() == 4
            return kv <= q

    assert not raises_itself(plain) and not raises_itself(lambda b, h, q, kv: kv <= q)
    assert raises_itself(asserting) and raises_itself(nested) and raises_itself(Callable())


#: documents over 48 global positions, crossing the shard boundaries at W = 2
_DOC_IDS = torch.tensor([0] * 7 + [1] + [2] * 20 + [3] * 20)


def _document_causal(b, h, q_idx, kv_idx):
    return (_DOC_IDS[q_idx] == _DOC_IDS[kv_idx]) & (kv_idx <= q_idx)


def _flex_compiled(ctx):
    import torch._dynamo.testing
    import torch.nn.attention.flex_attention as flex_module

    import ring_impl
    from ring_impl.torch_api.sdpa_route import sdpa_routed_to_ring

    seq = _DOC_IDS.numel()
    block_mask = flex_module.create_block_mask(_document_causal, None, None, seq, seq, device="cpu")
    gen = torch.Generator().manual_seed(3)
    q, k, v, dout = (
        ring_impl.shard(
            torch.randn(1, HEADS, seq, HEAD_DIM, generator=gen),
            ctx.world_size,
            ctx.rank,
            layout="head_tail",
        )
        for _ in range(4)
    )

    def attention(q, k, v):  # flex_attention looked up at call time: the route's
        return flex_module.flex_attention(q * 2.0, k, v, block_mask=block_mask, scale=0.25) * 0.5

    counter = torch._dynamo.testing.CompileCounterWithBackend("aot_eager")
    results = []
    with sdpa_routed_to_ring(ctx.group, layout="head_tail"):
        for fn in (torch.compile(attention, backend=counter, fullgraph=True), attention):
            leaves = [t.clone().requires_grad_(True) for t in (q, k, v)]
            out = fn(*leaves)
            out.backward(dout)
            results.append([out.detach()] + [t.grad for t in leaves])
    return {"compiled": results[0], "eager": results[1], "frames": counter.frame_count}


def test_routed_flex_call_under_compile_equals_eager(ring) -> None:
    """``flex_attention(..., block_mask=)`` under context parallel, inside a function compiled with
    ``fullgraph=True``: routed to the masked ring, its mask_mod evaluated in the graph."""
    for rank, run in enumerate(ring.rank_pool(2).run(_flex_compiled, timeout=240.0)):
        assert run["frames"] == 1, (
            f"rank {rank}: {run['frames']} compiled frames, expected one graph"
        )
        for name, got, want in zip(("out", "dq", "dk", "dv"), run["compiled"], run["eager"]):
            assert torch.equal(got, want), (
                f"rank {rank}: routed flex {name} compiled differs from eager"
            )
