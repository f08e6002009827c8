"""Uneven shards, ``ring_attention(..., shard_lengths=...)`` (ring_impl.planning.uneven): rank ``r``
holds ``shard_lengths[r]`` tokens of a sequence no layout divides. Judged against the float64 oracle
on the global sequence (the oracle's own masks, score mods and shards cut here with plain
slicing, apart from ring_impl's layouts), with the numerics policy's bounds; bad lengths raise
on every rank."""

from __future__ import annotations

import pytest
import torch

from reference import attention_grads
from reference.budget import error_scales
from reference.masks import visibility
from tests.ring_impl.oracle import (
    QUANTITIES,
    assert_float64_results_match_oracle,
    assert_results_match_oracle,
)
from tests.ring_impl.rank_results import local_results

HEADS, HEADS_KV, HEAD_DIM, BATCH = 4, 2, 8, 2


def _inputs(seq: int, dtype: torch.dtype):
    gen = torch.Generator().manual_seed(seq)
    q = torch.randn(BATCH, HEADS, seq, HEAD_DIM, generator=gen, dtype=torch.float64)
    k, v = (
        torch.randn(BATCH, HEADS_KV, seq, HEAD_DIM, generator=gen, dtype=torch.float64)
        for _ in range(2)
    )
    dout = torch.randn(BATCH, HEADS, seq, HEAD_DIM, generator=gen, dtype=torch.float64)
    return tuple(t.to(dtype) for t in (q, k, v, dout))


def _positions(layout: str, lengths: list[int], rank: int) -> list[int]:
    """The global positions rank ``rank`` holds, written apart from ring_impl.layout:
    ``contiguous`` any split, ``head_tail`` 2W chunks cut as torch.tensor_split cuts."""
    if layout == "contiguous":
        start = sum(lengths[:rank])
        return list(range(start, start + lengths[rank]))
    assert layout == "head_tail"
    world, seq = len(lengths), sum(lengths)
    chunks = [c.tolist() for c in torch.arange(seq).tensor_split(2 * world)]
    return chunks[rank] + chunks[2 * world - 1 - rank]


def _mask(kind: str, seq: int):
    """(ring_impl mask or None, is_causal, the oracle's mask spec) for ``kind``."""
    from ring_impl.masks import Documents, MaskMod, SlidingWindow, tabulate

    if kind == "causal":
        return None, True, {"kind": "causal"}
    if kind == "full":
        return None, False, {"kind": "full"}
    if kind == "window":
        return SlidingWindow(3, 1), False, {"kind": "sliding_window", "left": 3, "right": 1}
    if kind in ("documents", "key_ranges"):
        third = seq // 3  # three documents crossing the shard borders, two padding tokens
        ids = [0] * third + [1] * third + [2] * (seq - 2 * third - 2) + [-1] * 2
        spec = {"kind": "document", "doc_ids": ids, "causal": True}
        documents = Documents(torch.tensor(ids, dtype=torch.int32))
        if kind == "key_ranges":  # the same documents as one range of keys per query
            return tabulate(documents, seq), False, spec
        return documents, False, spec
    assert kind == "mask_mod"  # depends on the batch row, the head and a table of the sequence

    table = torch.arange(seq) % 4  # indexes positions: fails beyond the sequence unless clamped

    def fn(b, h, q, kv):
        return (kv <= q) & ((table[kv] + b + h) % 3 != 0)

    return MaskMod(fn), False, {"kind": "mask_mod", "fn": fn}


def _run(ctx, lengths, layout, kind, exchange, dtype, extras):
    import ring_impl

    seq = sum(lengths)
    q, k, v, dout = _inputs(seq, dtype)
    rows = _positions(layout, lengths, ctx.rank)
    q, k, v, dout = (t[:, :, rows] for t in (q, k, v, dout))
    q, k, v = (t.clone().requires_grad_(True) for t in (q, k, v))
    mask, causal, _ = _mask(kind, seq)
    options = dict(is_causal=causal, mask=mask, layout=layout, shard_lengths=lengths)
    result = ring_impl.ring_attention(
        q, k, v, group=ctx.group, exchange=exchange, return_lse=True, **options, **extras
    )
    out, lse = result[0], result[1]
    out.backward(dout)
    return local_results(out, lse, q, k, v, max_logit=result[2] if len(result) > 2 else None)


CASES = [
    # world, shard_lengths, layout, mask, exchange, dtype, extra options
    (2, [5, 3], "contiguous", "causal", "ring", torch.float32, {}),
    (3, [1, 7, 2], "contiguous", "window", "ring", torch.float64, {"rotate_method": "p2p"}),
    (4, [3, 3, 2, 2], "head_tail", "causal", "auto", torch.float32, {}),
    (4, [7, 0, 1, 4], "contiguous", "documents", "gather", torch.float64, {}),
    (3, [6, 2, 5], "contiguous", "key_ranges", "ring", torch.float64, {}),
    (2, [2, 5], "contiguous", "causal", "ulysses", torch.float32, {}),
    (3, [4, 2, 5], "contiguous", "mask_mod", "ring", torch.float64, {"head_chunks": 2}),
    (3, [6, 1, 3], "contiguous", "full", "ring", torch.float64, {"return_max_logit": True}),
    (1, [5], "contiguous", "causal", "auto", torch.float64, {"op": "math"}),
]


@pytest.mark.parametrize("world,lengths,layout,kind,exchange,dtype,extras", CASES)
def test_uneven_shards_match_the_oracle(
    ring, world, lengths, layout, kind, exchange, dtype, extras
) -> None:
    seq = sum(lengths)
    results = ring.rank_pool(world).run(
        _run, lengths, layout, kind, exchange, dtype, extras, timeout=120.0
    )
    q, k, v, dout = (t.to(torch.float64) for t in _inputs(seq, dtype))
    _, _, spec = _mask(kind, seq)
    vis = visibility(spec, seq, seq, batch=BATCH, heads=HEADS)
    ref = attention_grads(q, k, v, dout, visible=vis)
    scales = error_scales(q, k, v, dout, visible=vis, input_dtype=dtype)
    for r, res in enumerate(results):
        n = lengths[r]
        assert res["out"].shape == (BATCH, HEADS, n, HEAD_DIM), res["out"].shape
        assert res["lse"].shape == (BATCH, HEADS, n) and res["dk"].shape[2] == n
    order = [p for r in range(world) for p in _positions(layout, lengths, r)]
    inverse = torch.argsort(torch.tensor(order))
    got = {n: torch.cat([res[n] for res in results], dim=2)[:, :, inverse] for n in QUANTITIES}
    assert_results_match_oracle(
        f"W={world}, {lengths}, {layout}, {kind}, {exchange}",
        got,
        ref,
        scales,
        world_size=world if exchange != "ulysses" else 1,
        dtype=dtype,
    )
    if extras.get("return_max_logit"):
        scale = HEAD_DIM**-0.5
        kk = k.repeat_interleave(HEADS // HEADS_KV, dim=1)
        logits = (scale * q @ kk.transpose(-1, -2)).masked_fill(~vis, float("-inf"))
        want = logits.amax(dim=(0, 2, 3))
        for res in results:
            torch.testing.assert_close(res["max_logit"].to(torch.float64), want)


def _run_packed(ctx, lengths, cu):
    import ring_impl

    seq = sum(lengths)
    q, k, v, dout = (t[0].transpose(0, 1) for t in _inputs(seq, torch.float64))  # (seq, h, d)
    rows = _positions("contiguous", lengths, ctx.rank)
    q, k, v, dout = (t[rows].clone() for t in (q, k, v, dout))
    q.requires_grad_(True)
    out = ring_impl.ring_attention(
        q, k, v, group=ctx.group, cu_seqlens=cu, shard_lengths=lengths, is_causal=True
    )
    out.backward(dout)
    return {"out": out.detach(), "dq": q.grad}


def test_packed_inputs_on_uneven_shards_match_the_oracle(ring) -> None:
    """THD inputs whose packed tokens split unevenly: cu_seqlens over the sum of the lengths."""
    lengths, cu = [6, 2, 5], [0, 4, 9, 11]
    seq = sum(lengths)
    results = ring.rank_pool(3).run(_run_packed, lengths, cu, timeout=120.0)
    q, k, v, dout = (t[:1] for t in _inputs(seq, torch.float64))
    ids = [0] * 4 + [1] * 5 + [2] * 2 + [-1] * 2
    vis = visibility({"kind": "document", "doc_ids": ids, "causal": True}, seq, seq, heads=HEADS)
    ref = attention_grads(q, k, v, dout, visible=vis)
    scales = error_scales(q, k, v, dout, visible=vis)
    got = {
        n: torch.cat([res[n] for res in results], dim=0).transpose(0, 1).unsqueeze(0)
        for n in ("out", "dq")
    }
    assert_float64_results_match_oracle(f"packed, uneven {lengths}", got, ref, scales, world_size=3)


def _bad(ctx, kind: str) -> str:
    import ring_impl

    lengths: object = [3, 5]
    n = [3, 5][ctx.rank]
    q = torch.randn(1, 2, n, 4)
    k = v = torch.randn(1, 2, n, 4)
    options: dict = {}
    if kind == "wrong_local":
        lengths = [5, 3]
    elif kind == "differ":  # each rank believes another split
        lengths = [3, 5] if ctx.rank == 0 else [4, 4]
        if ctx.rank == 1:
            q = torch.randn(1, 2, 4, 4)
            k = v = torch.randn(1, 2, 4, 4)
    elif kind == "count":
        lengths = [3, 5, 0]
    elif kind == "negative":
        lengths = [-1, 9]
    elif kind == "halo":
        options = {"exchange": "halo"}
    elif kind == "layout_split":
        options = {"layout": "head_tail"}  # head_tail splits 8 over 2 as 4, 4
    elif kind == "no_lengths":  # unequal shards without shard_lengths: the error says what to pass
        lengths = None
    ring_impl.ring_attention(q, k, v, group=ctx.group, shard_lengths=lengths, **options)
    return "no error"


@pytest.mark.parametrize(
    "kind,pattern",
    [
        ("wrong_local", "query holds 3 tokens on rank 0 but shard_lengths[0] is 5"),
        ("differ", "ranks disagree on"),
        ("count", "shard_lengths must hold 2 ints >= 0"),
        ("negative", "shard_lengths must hold 2 ints >= 0"),
        ("halo", "not 'halo'"),
        ("layout_split", "layout 'head_tail' splits 8 tokens over 2 ranks as [4, 4], not [3, 5]"),
        ("no_lengths", "for uneven shards pass shard_lengths=[3, 5]"),
    ],
)
def test_bad_uneven_input_raises_on_every_rank(ring, kind: str, pattern: str) -> None:
    outcomes = ring.rank_pool(2).run_outcomes(_bad, kind, timeout=30.0)
    summary = [(o.rank, o.ok, o.exc_type, o.exc_message) for o in outcomes]
    assert all(not o.ok and o.exc_type.endswith("InputError") for o in outcomes), summary
    assert any(pattern in o.exc_message for o in outcomes), summary


def test_shard_and_unshard_follow_any_contiguous_split_and_the_layouts_own() -> None:
    import ring_impl
    from ring_impl.layout import shard_lengths

    t = torch.arange(11).view(1, 1, 11, 1)
    split = [4, 0, 6, 1]
    shards = [ring_impl.shard(t, 4, r, lengths=split) for r in range(4)]
    assert [s.shape[2] for s in shards] == split
    assert torch.equal(ring_impl.unshard(shards), t)
    lengths = shard_lengths(11, 4, "head_tail")
    shards = [ring_impl.shard(t, 4, r, layout="head_tail") for r in range(4)]
    assert [s.shape[2] for s in shards] == list(lengths)
    for r in range(4):
        assert shards[r].flatten().tolist() == _positions("head_tail", list(lengths), r)
    assert torch.equal(ring_impl.unshard(shards, layout="head_tail"), t)
    with pytest.raises(ValueError, match="splits 11 tokens over 4 ranks as"):
        ring_impl.unshard(
            [t[:, :, :5], t[:, :, 5:6], t[:, :, 6:9], t[:, :, 9:]], layout="head_tail"
        )
    with pytest.raises(ValueError, match="lengths must be 4 ints >= 0 summing to"):
        ring_impl.shard(t, 4, 0, lengths=[4, 4, 4, 4])


def _run_compiled(ctx, lengths):
    import ring_impl

    seq = sum(lengths)
    q, k, v, dout = (
        t[:, :, _positions("contiguous", lengths, ctx.rank)] for t in _inputs(seq, torch.float64)
    )

    def attend(q, k, v):
        return ring_impl.ring_attention(
            q, k, v, group=ctx.group, is_causal=True, shard_lengths=lengths
        )

    results = []
    for fn in (attend, torch.compile(attend)):
        qq = q.clone().requires_grad_(True)
        out = fn(qq, k, v)
        out.backward(dout)
        results.append((out.detach(), qq.grad))
    return results


def test_compiled_uneven_call_matches_the_eager_one(ring) -> None:
    """Under torch.compile the padded layout is built from its name where the compiled op runs
    (no registration to replay): the compiled call gives the eager call's output and gradient."""
    for (eager_out, eager_dq), (out, dq) in ring.rank_pool(2).run(
        _run_compiled, [6, 2], timeout=300.0
    ):
        torch.testing.assert_close(out, eager_out, rtol=0, atol=1e-12)
        torch.testing.assert_close(dq, eager_dq, rtol=0, atol=1e-12)


def test_a_balanced_layout_of_an_uneven_length_runs_uneven_shards(ring) -> None:
    """The work-aware balancer's layout of a length the ranks do not divide: its shard_lengths
    run as they are (the layout's own split) and match the oracle."""
    results = ring.rank_pool(3).run(_run_balanced, 50, timeout=120.0)
    q, k, v, dout = _inputs(50, torch.float64)
    vis = visibility({"kind": "causal"}, 50, 50)
    ref = attention_grads(q, k, v, dout, visible=vis)
    scales = error_scales(q, k, v, dout, visible=vis)
    order = torch.cat([res["positions"] for res in results])
    inverse = torch.argsort(order)
    got = {n: torch.cat([res[n] for res in results], dim=2)[:, :, inverse] for n in ("out", "dk")}
    label = "work_aware, 50 tokens over 3"
    assert_float64_results_match_oracle(label, got, ref, scales, world_size=3)


def _run_balanced(ctx, seq):
    import ring_impl
    from ring_impl.layout import permutation, shard_lengths
    from ring_impl.masks import Causal
    from ring_impl.planning.balance import register_balanced_layout

    name, _ = register_balanced_layout("work_aware", Causal(), seq, ctx.world_size)
    lengths = shard_lengths(seq, ctx.world_size, name)
    assert len(set(lengths)) > 1, lengths  # an uneven split
    q, k, v, dout = (
        ring_impl.shard(t, ctx.world_size, ctx.rank, layout=name)
        for t in _inputs(seq, torch.float64)
    )
    k.requires_grad_(True)
    out = ring_impl.ring_attention(
        q, k, v, group=ctx.group, is_causal=True, layout=name, shard_lengths=lengths
    )
    out.backward(dout)
    start = sum(lengths[: ctx.rank])
    positions = permutation(name, seq, ctx.world_size)[start : start + lengths[ctx.rank]]
    return {"out": out.detach(), "dk": k.grad, "positions": positions}


def test_padded_layouts_are_built_from_their_name_and_kept_boundedly() -> None:
    """A padded layout is a function of its name: any process builds it when it meets the name,
    and only the most recent DERIVED_KEPT are kept (a loader whose split changes every step
    must not grow the registry without end); names it cannot have made are no layout."""
    import ring_impl.layout as layout
    from ring_impl.planning.uneven import padded_layout

    name = padded_layout("head_tail", (3, 3, 2, 2))
    assert layout.layout_runs(name, 12, 4, 2) == ((4, 5), (7, 8), (10, 11))  # real runs, padding
    assert layout.is_derived(name) and name not in layout.layouts()
    for n in range(layout.DERIVED_KEPT + 5):
        layout.get_layout(padded_layout("contiguous", (n + 1, 1)))
    assert len(layout._BUILT) == layout.DERIVED_KEPT
    assert layout.layout_runs(name, 12, 4, 0) == ((0, 2), (9, 10))  # rebuilt, equal
    for bad in ("padded(contiguous;1,x)", "padded(unknown;1,1)", "padded(contiguous;0,0)"):
        assert not layout.is_layout(bad), bad


def _run_even(ctx):
    import ring_impl
    import ring_impl.api as api

    padded = []
    real = api.uneven_call
    api.uneven_call = lambda call, lengths: padded.append(lengths) or real(call, lengths)
    try:
        outs = []
        for lengths in (None, [4, 4], [5, 3]):  # no split given, the even split, an uneven one
            n = 4 if lengths is None else lengths[ctx.rank]
            q, k, v = (t[:, :, :n] for t in _inputs(8, torch.float32)[:3])
            outs.append(
                ring_impl.ring_attention(
                    q, k, v, group=ctx.group, is_causal=True, shard_lengths=lengths
                )
            )
    finally:
        api.uneven_call = real
    return torch.equal(outs[0], outs[1]), padded


def test_equal_shard_lengths_run_the_plain_call(ring) -> None:
    """shard_lengths that are the layout's own even split run the call as it is (bit for bit),
    without the padded call and its mask: that is made for the uneven split only."""
    for same, padded in ring.rank_pool(2).run(_run_even):
        assert same and padded == [(5, 3)], padded
