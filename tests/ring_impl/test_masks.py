"""``ring_attention(mask=..., sinks=...)``: masks on global positions and attention sinks,
judged against the float64 oracle (reference.masks / reference.attention, written independently
of ring_impl.masks) by the numerics policy, over layouts, rotations, world sizes, dtypes and GQA;
rows that see nothing come back as nothing (out 0, LSE -inf, zero gradients, no NaN); blocks
nobody sees are never computed; bad masks and sinks raise on every rank."""

from __future__ import annotations

import itertools

import pytest
import torch

from reference import attention_grads
from reference.budget import error_scales
from reference.masks import visibility
from tests.ring_impl.oracle import QUANTITIES, assert_results_match_oracle, unshard_results
from tests.ring_impl.outcomes import assert_input_error_on_every_rank
from tests.ring_impl.rank_results import forward_backward, leaves, local_results

BATCH, HEADS, HEADS_KV, HEAD_DIM = 1, 4, 2, 8


def every_fourth_head_sees_back(b, h, q_idx, kv_idx):
    """A mask_mod that depends on the head: heads 0 and 2 causal, heads 1 and 3 see 3 back only."""
    return (kv_idx <= q_idx) & ((h % 2 == 0) | (kv_idx >= q_idx - 3))


def _doc_ids(seq: int) -> list[int]:
    """Uneven documents crossing shard boundaries, a one-token document, padding at the end."""
    lengths = [5, 1, seq // 3, 2]
    ids, d = [], 0
    for n in lengths:
        ids += [d] * n
        d += 1
    ids += [d] * max(0, seq - 4 - len(ids))
    return (ids + [-1] * seq)[:seq]


def _masks(seq: int) -> dict[str, dict]:
    window = seq // 6  # narrower than a shard at W <= 3 (head_tail: half a shard per chunk)
    docs = {"kind": "document", "doc_ids": _doc_ids(seq), "causal": True}
    return {
        "causal": {"kind": "causal"},
        "documents": docs,
        "documents_full": {**docs, "causal": False},
        "window_narrow": {"kind": "sliding_window", "left": window, "right": 0},
        "window_wide": {"kind": "sliding_window", "left": seq // 2, "right": 2},
        "chunked_causal": {"kind": "chunked_causal", "chunk": seq // 4},
        "prefix_lm": {"kind": "prefix_lm", "prefix": seq // 3},
        "documents_window": {
            "kind": "and",
            "masks": [docs, {"kind": "sliding_window", "left": 3, "right": 0}],
        },
        "mask_mod_per_head": {"kind": "mask_mod", "fn": every_fourth_head_sees_back},
    }


def _inputs(seq: int, dtype: torch.dtype, sinks: bool, heads_kv: int = HEADS_KV):
    gen = torch.Generator().manual_seed(seq * 7 + int(sinks))
    q = torch.randn(BATCH, HEADS, seq, HEAD_DIM, generator=gen, dtype=torch.float64).to(dtype)
    k, v = (
        torch.randn(BATCH, heads_kv, seq, HEAD_DIM, generator=gen, dtype=torch.float64).to(dtype)
        for _ in range(2)
    )
    dout = torch.randn(BATCH, HEADS, seq, HEAD_DIM, generator=gen, dtype=torch.float64).to(dtype)
    s = torch.randn(HEADS, generator=gen, dtype=torch.float64).float() if sinks else None
    return q, k, v, dout, s


def _run(ctx, spec, seq, dtype, layout, rotate, op, sinks, strategy="ring"):
    import ring_impl
    from ring_impl.masks import from_spec

    q, k, v, dout, s = _inputs(seq, dtype, sinks)
    q, k, v, dout = (
        ring_impl.shard(t, ctx.world_size, ctx.rank, layout=layout) for t in (q, k, v, dout)
    )
    q, k, v, s = leaves(q, k, v, s)
    from harness.accounting import CollectiveLog

    options = dict(mask=from_spec(spec), sinks=s, layout=layout, rotate_method=rotate, op=op)
    with CollectiveLog() as log:
        out, lse = forward_backward(q, k, v, dout, group=ctx.group, strategy=strategy, **options)
    return local_results(out, lse, q, k, v, s, log=log.summary())


def _cases(strategy: str = "ring"):
    out = []
    combos = itertools.product(
        (
            "causal",
            "documents",
            "documents_full",
            "window_narrow",
            "window_wide",
            "chunked_causal",
            "prefix_lm",
            "documents_window",
            "mask_mod_per_head",
        ),
        ((2, "head_tail"), (3, "contiguous")),
    )
    for i, (name, (world, layout)) in enumerate(combos):
        dtype, op = ((torch.float64, "math"), (torch.float32, "cpu_flash"))[i % 2]
        rotate = ("allgather", "alltoall", "p2p")[i % 3]
        world = (
            4 if strategy == "ulysses" and world == 3 else world
        )  # Ulysses: heads (4) divisible by W
        out.append(
            pytest.param(
                name,
                world,
                layout,
                rotate,
                dtype,
                op,
                i % 3 == 0,
                strategy,
                id=(
                    f"{strategy}-{name}-W{world}-{layout}-{rotate}-{op}"
                    f"{'-sinks' if i % 3 == 0 else ''}"
                ),
            )
        )
    return out


@pytest.mark.parametrize(
    "name,world,layout,rotate,dtype,op,sinks,strategy", _cases("ring") + _cases("ulysses")
)
def test_masked_ring_matches_the_oracle(
    ring, name, world, layout, rotate, dtype, op, sinks, strategy
) -> None:

    seq = 24 * world
    spec = _masks(seq)[name]
    results = ring.rank_pool(world).run(
        _run, spec, seq, dtype, layout, rotate, op, sinks, strategy, timeout=120.0
    )
    q, k, v, dout, s = _inputs(seq, dtype, sinks)
    vis = visibility(spec, seq, seq, batch=BATCH, heads=HEADS)
    ref = attention_grads(q, k, v, dout, visible=vis, sinks=s)
    # The policy's magnitudes of this case (without the sink term, which only lowers every
    # probability: its magnitudes are at most these).
    scales = error_scales(q, k, v, dout, visible=vis, sinks=s, input_dtype=dtype)
    assert_results_match_oracle(
        f"{strategy}, {name}, W={world}, {layout}, {rotate}, {op}, sinks={sinks}",
        unshard_results(results, layout),
        ref,
        scales,
        world_size=world if strategy == "ring" else 1,
        dtype=dtype,
        sink_shares=world,  # the roundings of the sum over ranks
    )


def _work(ctx, spec, seq, layout):
    """This rank's kernel calls per step (counted by wrapping the op) for a masked forward."""
    import ring_impl
    from ring_impl.masks import from_spec
    from ring_impl.ops import get_op

    base = get_op("math")
    calls: list[int] = []

    class Counting:
        name = "counting_math"
        capabilities = base.capabilities

        def forward(self, *a, **kw):
            calls.append(a[1].shape[2])
            return base.forward(*a, **kw)

        def backward(self, *a, **kw):
            return base.backward(*a, **kw)

    q, k, v, _, _ = _inputs(seq, torch.float64, False)
    q, k, v = (ring_impl.shard(t, ctx.world_size, ctx.rank, layout=layout) for t in (q, k, v))
    # halo=False: the ring's plan is under test (the halo path makes one call;
    # tests/ring_impl/test_halo.py)
    ring_impl.ring_attention(
        q,
        k,
        v,
        group=ctx.group,
        mask=from_spec(spec),
        layout=layout,
        op=Counting(),
        rotate_method="alltoall",
        halo=False,
    )
    return len(calls)


def test_blocks_nobody_sees_are_never_computed(ring) -> None:
    """A narrow causal window over W=4 contiguous shards: each rank's queries reach its own block
    and the previous rank's only, so 2 kernel calls per rank (rank 0: 1), not 4."""
    seq = 32
    calls = ring.rank_pool(4).run(
        _work, {"kind": "sliding_window", "left": 3, "right": 0}, seq, "contiguous", timeout=60.0
    )
    assert calls == [1, 2, 2, 2], f"kernel calls per rank {calls}"


def _bad(ctx, kind: str):
    import ring_impl
    from ring_impl.masks import Documents, MaskMod, SlidingWindow

    seq_local = 8
    q = torch.randn(1, 2, seq_local, 8)
    k = v = torch.randn(1, 2, seq_local, 8)
    seq = seq_local * ctx.world_size
    mask, sinks = None, None
    if kind == "doc_ids_length":
        mask = Documents(torch.zeros(seq - 1, dtype=torch.int64))
    elif kind == "doc_ids_decrease":
        mask = Documents(torch.tensor([1] * (seq // 2) + [0] * (seq - seq // 2)))
    elif kind == "window_negative":
        mask = SlidingWindow(-1)
    elif kind == "mask_mod_fails":
        table = torch.zeros(seq // 2, dtype=torch.bool)
        mask = MaskMod(
            lambda b, h, q_idx, kv_idx: table[q_idx] | (kv_idx <= q_idx)
        )  # IndexError past seq/2
    elif kind == "mask_differs":
        mask = SlidingWindow(2 + ctx.rank)
    elif kind == "sinks_shape":
        sinks = torch.zeros(3)
    elif kind == "sinks_dtype":
        sinks = torch.zeros(2, dtype=torch.int64)
    ring_impl.ring_attention(
        q, k, v, group=ctx.group, mask=mask, sinks=sinks, rotate_method="alltoall"
    )
    return "no error"


@pytest.mark.parametrize(
    "kind,pattern",
    [
        ("doc_ids_length", "has 15 entries but the global sequence has 16 tokens"),
        ("doc_ids_decrease", "decrease along the sequence"),
        ("window_negative", "SlidingWindow.left must be an int >= 0"),
        ("mask_mod_fails", "cannot be evaluated on the global positions (IndexError"),
        ("mask_differs", "ranks disagree on mask"),
        ("sinks_shape", "sinks must have shape (2,)"),
        ("sinks_dtype", "sinks must be floating point"),
    ],
)
def test_bad_masks_and_sinks_raise_on_every_rank(ring, kind: str, pattern: str) -> None:
    outcomes = ring.rank_pool(2).run_outcomes(_bad, kind, timeout=30.0)
    assert_input_error_on_every_rank(outcomes, pattern)


def _run_hybrid(
    ctx, spec, seq, dtype, layout, rotate, op, sinks, mesh_shape, heads_kv=HEADS_KV, head_chunks=1
):
    from reference.strategies import shard as strategy_shard
    from ring_impl.masks import from_spec

    u, r = mesh_shape
    mesh = ctx.device_mesh((r, u), ("ring", "ulysses"))
    q, k, v, dout, s = _inputs(seq, dtype, sinks, heads_kv)
    q, k, v, dout = (
        strategy_shard(t, "hybrid", layout, mesh_shape, ctx.rank).contiguous()
        for t in (q, k, v, dout)
    )
    q, k, v, s = leaves(q, k, v, s)
    options = dict(mask=from_spec(spec), sinks=s, layout=layout, rotate_method=rotate, op=op)
    out, lse = forward_backward(
        q, k, v, dout, group=mesh, strategy="hybrid", head_chunks=head_chunks, **options
    )
    return local_results(out, lse, q, k, v, s)


def _hybrid_cases():
    out = []
    names = (
        "causal",
        "documents",
        "documents_full",
        "window_narrow",
        "chunked_causal",
        "prefix_lm",
        "documents_window",
    )
    for i, (name, layout) in enumerate(itertools.product(names, ("head_tail", "contiguous"))):
        dtype, op = ((torch.float64, "math"), (torch.float32, "cpu_flash"))[i % 2]
        rotate = ("allgather", "alltoall", "p2p")[i % 3]
        out.append(
            pytest.param(
                name,
                layout,
                rotate,
                dtype,
                op,
                i % 3 == 0,
                id=f"hybrid2x2-{name}-{layout}-{rotate}-{op}{'-sinks' if i % 3 == 0 else ''}",
            )
        )
    return out


@pytest.mark.parametrize("name,layout,rotate,dtype,op,sinks", _hybrid_cases())
def test_masked_hybrid_matches_the_oracle(ring, name, layout, rotate, dtype, op, sinks) -> None:
    """The hybrid 2x2: Ulysses in rows, the masked ring
    (its plan on global positions) across rows."""
    seq = 48
    _check_hybrid(ring, name, _masks(seq)[name], seq, layout, rotate, dtype, op, sinks)


def every_head_its_own_band(b, h, q_idx, kv_idx):
    """A mask_mod with a different band per head (0: causal, 1: five back, 2: two back, 3: two
    either side): a head planned under another head's index shows."""
    back = torch.where(h == 0, q_idx.new_tensor(1 << 30), torch.where(h == 1, 5, 2))
    return ((kv_idx <= q_idx) | (h == 3)) & (q_idx - kv_idx <= back) & (kv_idx - q_idx <= 2)


@pytest.mark.parametrize(
    "heads_kv,head_chunks,layout,rotate",
    [
        (
            HEADS_KV,
            1,
            "head_tail",
            "alltoall",
        ),  # GQA: a rank's two query heads share its key/value head
        (
            HEADS,
            2,
            "contiguous",
            "p2p",
        ),  # two rings per rank, one head each: the chunk's heads within the rank's
    ],
)
def test_hybrid_plans_a_head_dependent_mask_for_its_heads(
    ring, heads_kv, head_chunks, layout, rotate
) -> None:
    """The hybrid's ring runs the query heads of its rank's head slice: a mask that depends on
    the head is planned for those (global) heads, in head chunks too."""
    seq = 32
    spec = {"kind": "mask_mod", "fn": every_head_its_own_band}
    _check_hybrid(
        ring,
        "every_head_its_own_band",
        spec,
        seq,
        layout,
        rotate,
        torch.float64,
        "math",
        True,
        heads_kv=heads_kv,
        head_chunks=head_chunks,
    )


def _check_hybrid(
    ring, name, spec, seq, layout, rotate, dtype, op, sinks, heads_kv=HEADS_KV, head_chunks=1
) -> None:
    from reference.strategies import unshard as strategy_unshard

    mesh_shape = (2, 2)
    results = ring.rank_pool(4).run(
        _run_hybrid,
        spec,
        seq,
        dtype,
        layout,
        rotate,
        op,
        sinks,
        mesh_shape,
        heads_kv,
        head_chunks,
        timeout=120.0,
    )
    q, k, v, dout, s = _inputs(seq, dtype, sinks, heads_kv)
    vis = visibility(spec, seq, seq, batch=BATCH, heads=HEADS)
    ref = attention_grads(q, k, v, dout, visible=vis, sinks=s)
    scales = error_scales(q, k, v, dout, visible=vis, sinks=s, input_dtype=dtype)
    got = {
        n: strategy_unshard(
            [r[n] if n != "lse" else r[n].unsqueeze(-1) for r in results],
            "hybrid",
            layout,
            mesh_shape,
        )
        for n in QUANTITIES
    }
    got["lse"] = got["lse"].squeeze(-1)
    got["dsinks"] = sum(r["dsinks"] for r in results) if sinks else None
    assert_results_match_oracle(
        f"hybrid 2x2, {name}, {layout}, {rotate}, {op}, sinks={sinks}",
        got,
        ref,
        scales,
        world_size=mesh_shape[1],
        dtype=dtype,
        sink_shares=4,
    )


@pytest.mark.parametrize("dtype", [torch.int32, torch.int64])
def test_documents_ids_updated_in_place_are_read_again(dtype) -> None:
    """A Documents mask reused after its ids changed in place evaluates the new ids (its
    description, which keys the plans and the cross-rank check, always hashed the new ones; an
    int32 copy kept from the first call served the old ones)."""
    from ring_impl.masks import Documents, visibility

    ids = torch.tensor([0] * 8 + [1] * 8, dtype=dtype)
    mask = Documents(ids, causal=False)
    pos = torch.arange(16)
    before, described = visibility(mask, pos, pos, batch=1, heads=1), mask.describe()
    ids[:] = torch.tensor([0] * 4 + [1] * 12, dtype=dtype)
    after = visibility(mask, pos, pos, batch=1, heads=1)
    want = (ids.view(-1, 1) == ids.view(1, -1)).view(1, 1, 16, 16)
    assert mask.describe() != described and not torch.equal(before, after)
    assert torch.equal(after.expand_as(want), want)
