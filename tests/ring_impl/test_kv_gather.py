"""``ring_attention(mask=..., sparse_kv=True)``: the sparse gather (ring_impl.exchanges.kv_gather).

Judged against the float64 oracle (reference.masks / reference.attention, written apart from
ring_impl) by the numerics policy, over masks, layouts (the balancers' included), dtypes, GQA,
sinks and the LSE's gradient; its collectives against its declared schedule, and its key/value
bytes against the minimum computed here from the oracle's visibility (each row a rank's queries
see, once); bad options raise on every rank.
"""

from __future__ import annotations

import pytest
import torch

from reference import attention_grads
from reference.budget import error_scales
from reference.masks import visibility
from ring_impl.ops.math import MathOp
from tests.ring_impl.oracle import assert_results_match_oracle, unshard_results
from tests.ring_impl.outcomes import assert_every_rank_raised
from tests.ring_impl.rank_results import forward_backward, leaves, local_results
from tests.ring_impl.test_halo import (
    BATCH,
    HEAD_DIM,
    HEADS,
    _baseline,
    assert_nan_where_the_oracle_has_it,
)
from tests.ring_impl.test_masks import every_fourth_head_sees_back


def _doc_ids(seq: int) -> list[int]:
    """Uneven documents crossing shard boundaries, one-token documents, a long one, padding."""
    lengths = [5, 1, seq // 3, 2, 1, seq // 5]
    ids: list[int] = []
    for d, n in enumerate(lengths):
        ids += [d] * n
    ids += [len(lengths)] * max(0, seq - 4 - len(ids))
    return (ids + [-1] * seq)[:seq]


def _spec(name: str, seq: int) -> dict:
    docs = {"kind": "document", "doc_ids": _doc_ids(seq), "causal": True}
    return {
        "documents": docs,
        "documents_full": {**docs, "causal": False},
        "window": {"kind": "sliding_window", "left": seq // 6, "right": 2},
        "prefix_lm": {"kind": "prefix_lm", "prefix": seq // 3},
        "documents_window": {
            "kind": "and",
            "masks": [docs, {"kind": "sliding_window", "left": 3, "right": 0}],
        },
        "mask_mod_per_head": {
            "kind": "mask_mod",
            "fn": every_fourth_head_sees_back,
        },  # the union over heads travels
    }[name]


def _layout(name: str, spec: dict, seq: int, world: int) -> str:
    """``name``, or for "work_balanced" the work-aware layout of the documents, registered here."""
    if name != "work_balanced":
        return name
    import ring_impl
    from ring_impl.masks import from_spec
    from ring_impl.planning.balance import work_balanced_layout

    registered = f"test_gather_work_{seq}_{world}"
    ring_impl.register_layout(
        work_balanced_layout(registered, from_spec(spec), seq, world, chunks_per_rank=3),
        replace=True,
    )
    return registered


def _inputs(
    seq: int, dtype: torch.dtype, heads_kv: int, sinks: bool, nan_keys: tuple[int, ...] = ()
):
    gen = torch.Generator().manual_seed(seq + heads_kv)
    q = torch.randn(BATCH, HEADS, seq, HEAD_DIM, generator=gen, dtype=torch.float64).to(dtype)
    k, v = (
        torch.randn(BATCH, heads_kv, seq, HEAD_DIM, generator=gen, dtype=torch.float64).to(dtype)
        for _ in range(2)
    )
    for key in nan_keys:
        k[:, :, key, 0] = float("nan")
    dout = torch.randn(BATCH, HEADS, seq, HEAD_DIM, generator=gen, dtype=torch.float64).to(dtype)
    glse = torch.randn(BATCH, HEADS, seq, generator=gen, dtype=torch.float64)
    s = torch.randn(HEADS, generator=gen, dtype=torch.float64).float() if sinks else None
    return q, k, v, dout, glse, s


def _run(ctx, name, seq, dtype, layout_name, heads_kv, sinks, lse_grad, nan_keys=(), op=None):
    import ring_impl
    from harness.accounting import CollectiveLog
    from ring_impl.masks import from_spec

    spec = _spec(name, seq)
    layout = _layout(layout_name, spec, seq, ctx.world_size)
    q, k, v, dout, glse, s = _inputs(seq, dtype, heads_kv, sinks, nan_keys)
    q, k, v, dout = (
        ring_impl.shard(t, ctx.world_size, ctx.rank, layout=layout) for t in (q, k, v, dout)
    )
    glse = ring_impl.shard(glse.unsqueeze(-1), ctx.world_size, ctx.rank, layout=layout).squeeze(-1)
    q, k, v, s = leaves(q, k, v, s)
    kernel = NanHidingMath() if op == "nan_hiding" else op
    kernel = kernel or ("math" if dtype == torch.float64 else "cpu_flash")
    options = dict(mask=from_spec(spec), sinks=s, layout=layout, op=kernel, sparse_kv=True)
    with CollectiveLog() as log:
        glse = glse if lse_grad else None
        out, lse = forward_backward(q, k, v, dout, glse, log=log, group=ctx.group, **options)
    declared = ring_impl.collective_schedule(
        ctx.world_size,
        "alltoall",
        batch=BATCH,
        heads_kv=heads_kv,
        seq_kv=seq // ctx.world_size,
        head_dim=HEAD_DIM,
        dtype=dtype,
        mask=from_spec(spec),
        layout=layout,
        rank=ctx.rank,
        sparse_kv=True,
    )
    # Each rank's global positions, to count the minimum bytes from the oracle's visibility.
    positions = [
        ring_impl.shard(
            torch.arange(seq).view(1, 1, seq, 1), ctx.world_size, r, layout=layout
        ).flatten()
        for r in range(ctx.world_size)
    ]
    return local_results(
        out,
        lse,
        q,
        k,
        v,
        s,
        log=log.summary(),
        declared=declared,
        layout=layout,
        positions=positions,
    )


CASES = [
    # name, world, layout, dtype, heads_kv, sinks, lse_grad
    ("documents", 2, "work_balanced", torch.float64, 2, True, False),
    ("documents", 3, "head_tail", torch.float32, 1, False, True),
    ("documents_full", 2, "contiguous", torch.float64, 4, False, False),
    ("window", 3, "contiguous", torch.float64, 2, False, True),
    ("prefix_lm", 2, "head_tail", torch.float32, 2, True, False),
    ("documents_window", 4, "work_balanced", torch.bfloat16, 2, False, False),
    ("mask_mod_per_head", 3, "head_tail", torch.float64, 2, False, False),
]


@pytest.mark.parametrize(
    "name,world,layout,dtype,heads_kv,sinks,lse_grad",
    CASES,
    ids=[
        f"{c[0]}-W{c[1]}-{c[2]}-{str(c[3]).removeprefix('torch.')}-hkv{c[4]}"
        f"{'-sinks' if c[5] else ''}{'-lsegrad' if c[6] else ''}"
        for c in CASES
    ],
)
def test_sparse_gather_matches_the_oracle_with_minimum_bytes(
    ring, name, world, layout, dtype, heads_kv, sinks, lse_grad
) -> None:

    seq = 24 * world
    results = ring.rank_pool(world).run(
        _run, name, seq, dtype, layout, heads_kv, sinks, lse_grad, timeout=120.0
    )
    used_layout = results[0]["layout"]
    if layout == "work_balanced":  # the parent registers it too, to unshard
        _layout(layout, _spec(name, seq), seq, world)
    spec = _spec(name, seq)
    q, k, v, dout, glse, s = _inputs(seq, dtype, heads_kv, sinks)
    glse = glse if lse_grad else None
    vis = visibility(spec, seq, seq, batch=BATCH, heads=HEADS)
    ref = attention_grads(q, k, v, dout, visible=vis, sinks=s, grad_lse=glse)
    scales = error_scales(q, k, v, dout, visible=vis, sinks=s, input_dtype=dtype, grad_lse=glse)
    op = "math" if dtype == torch.float64 else "cpu_flash"
    base = _baseline(q, k, v, dout, glse, vis, s, op)  # the same kernel on one device (B)
    label = (
        f"sparse_kv, {name}, W={world}, {layout}, {dtype}, hkv={heads_kv}, sinks={sinks}, "
        f"lse_grad={lse_grad}"
    )
    got = unshard_results(results, used_layout)
    assert_results_match_oracle(label, got, ref, scales, world_size=world, dtype=dtype, base=base)
    seen = vis.any(0).any(0)  # (query, key): some batch entry and head sees it
    row = 2 * BATCH * heads_kv * HEAD_DIM
    acc = 8 if dtype == torch.float64 else 4
    for rank, r in enumerate(results):
        log, declared, pos = r["log"], r["declared"], r["positions"]
        assert log == {p: kinds for p, kinds in declared.items() if kinds}, (
            f"rank {rank}: collectives {log} != declared {declared} [{label}]"
        )
        # The minimum: this rank's keys that each other rank's queries see, once (forward, input
        # dtype); back, the dK/dV of the keys of others that its own queries saw
        # (accumulation dtype).
        sent = sum(int(seen[pos[t]][:, pos[rank]].any(0).sum()) for t in range(world) if t != rank)
        received = sum(
            int(seen[pos[rank]][:, pos[t]].any(0).sum()) for t in range(world) if t != rank
        )
        assert log["forward"]["all_to_all"]["bytes"] == sent * row * dtype.itemsize, (
            f"rank {rank}: forward {log['forward']}, the minimum is {sent} rows [{label}]"
        )
        assert log["backward"]["all_to_all"]["bytes"] == received * row * acc, (
            f"rank {rank}: backward {log['backward']}, the minimum is {received} rows of dK/dV "
            f"[{label}]"
        )


class NanHidingMath(MathOp):
    """The math op with every NaN in its results replaced by 0 (as kernels do for some inputs):
    whatever NaN a path returns, its own propagation (ring_impl.numerics.nonfinite) put there."""

    def forward(self, *args, **kwargs):
        return tuple(t.nan_to_num(0.0) for t in super().forward(*args, **kwargs))

    def backward(self, *args, **kwargs):
        return tuple(t.nan_to_num(0.0) for t in super().backward(*args, **kwargs))


@pytest.mark.parametrize("nan_keys", [(8,), (30,)], ids=["sent", "kept"])
@pytest.mark.parametrize("op", ["math", "nan_hiding"])
def test_a_nan_key_reaches_the_rows_that_see_it_whether_sent_or_kept(ring, op, nan_keys) -> None:
    """NaN in a key under ``head_tail`` at W=2: key 8 (rank 0) is in a document that crosses to
    rank 1, so it travels in the gather; key 30 (rank 1) stays in its rank's own document. Exactly
    the rows that see one (the oracle's dependency rule) get NaN outputs and LSEs; gradients are
    NaN wherever the oracle's are (a superset, as the ring's: ring_impl.numerics.nonfinite). The own
    rows' kernel calls run while the gathered rows travel, so each part must carry its own NaN
    check: with a kernel that hides NaN, only that check puts them there."""

    seq = 48
    results = ring.rank_pool(2).run(
        _run,
        "documents",
        seq,
        torch.float64,
        "head_tail",
        2,
        False,
        False,
        nan_keys,
        op,
        timeout=60.0,
    )
    q, k, v, dout, _, _ = _inputs(seq, torch.float64, 2, False, nan_keys)
    vis = visibility(_spec("documents", seq), seq, seq, batch=BATCH, heads=HEADS)
    assert_nan_where_the_oracle_has_it(
        results, attention_grads(q, k, v, dout, visible=vis), layout="head_tail"
    )


def _events(ctx):
    """Each phase's events in order: "s" the gather's all-to-all posted, "w" waited for, "k" a
    kernel call."""
    import ring_impl
    from ring_impl.exchanges import kv_gather
    from ring_impl.masks import from_spec
    from ring_impl.ops.cpu import CpuFlashOp

    events: list[str] = []

    class Recording(CpuFlashOp):
        def forward(self, *args, **kwargs):
            events.append("k")
            return super().forward(*args, **kwargs)

        def backward(self, *args, **kwargs):
            events.append("k")
            return super().backward(*args, **kwargs)

    seq = 256 * ctx.world_size
    ids = (
        torch.arange(seq) // 40
    ).tolist()  # documents of 40 tokens: whole on a rank, or split between two
    q, k, v = (
        ring_impl.shard(t, ctx.world_size, ctx.rank, layout="head_tail").requires_grad_(True)
        for t in torch.randn(3, 1, 2, seq, 8, generator=torch.Generator().manual_seed(0))
    )
    saved = kv_gather._Exchange.__init__, kv_gather._Exchange.result

    def record(original, event):
        def method(self, *args, **kwargs):
            events.append(event)
            return original(self, *args, **kwargs)

        return method

    kv_gather._Exchange.__init__, kv_gather._Exchange.result = (
        record(f, e) for f, e in zip(saved, "sw")
    )
    try:
        out = ring_impl.ring_attention(
            q,
            k,
            v,
            group=ctx.group,
            layout="head_tail",
            sparse_kv=True,
            op=Recording(),
            mask=from_spec({"kind": "document", "doc_ids": ids, "causal": True}),
        )
        forward = "".join(events)
        events.clear()
        out.sum().backward()
    finally:
        kv_gather._Exchange.__init__, kv_gather._Exchange.result = saved
    return forward, "".join(events)


def test_the_gather_computes_the_own_rows_while_its_transfers_travel(ring) -> None:
    """Forward, the calls on a rank's own rows alone run between posting the all-to-all and
    waiting for it; backward, between posting the received rows' dK/dV and waiting for this
    rank's own (the transfers' only overlap: there is no ring)."""
    for rank, phases in enumerate(ring.rank_pool(2).run(_events, timeout=60.0)):
        for phase, events in zip(("forward", "backward"), phases):
            assert events.count("s") == 1 and events.count("w") == 1, (
                f"rank {rank}, {phase}: {events}"
            )
            between = events[events.index("s") : events.index("w")]
            assert "k" in between, (
                f"rank {rank}, {phase}: no kernel call while the transfer travels: {events}"
            )
            # forward, the calls on received rows once they are there; backward, those first
            rest = (
                events[events.index("w") :] if phase == "forward" else events[: events.index("s")]
            )
            assert "k" in rest, (
                f"rank {rank}, {phase}: no kernel call on the received rows: {events}"
            )


def test_sparse_gather_sends_a_fraction_of_the_ring_for_documents() -> None:
    """Packed documents much shorter than a shard (plus one a shard long) under the work-aware
    layout: the rows some other rank's queries see are few, so the declared bytes are well under
    the ring's (W - 1) blocks per rank (benchmarks/masks.py measures 0.22 of them at W=2 and 0.31
    at W=4 on its mix)."""
    import ring_impl
    from ring_impl.masks import Documents
    from ring_impl.planning.balance import work_balanced_layout

    seq, world = 4096, 4
    lengths = [1024] + [60, 7, 130, 33, 90, 18, 200, 45] * 5
    lengths.append(seq - sum(lengths))
    docs = Documents(torch.cat([torch.full((n,), d) for d, n in enumerate(lengths)]))
    ring_impl.register_layout(
        work_balanced_layout("test_gather_fraction", docs, seq, world), replace=True
    )
    kw = dict(
        batch=1,
        heads_kv=2,
        seq_kv=seq // world,
        head_dim=16,
        dtype=torch.float32,
        layout="test_gather_fraction",
    )
    ring = ring_impl.collective_schedule(world, "alltoall", **kw)["forward"]["all_to_all"]["bytes"]
    gathered = [
        ring_impl.collective_schedule(world, "alltoall", mask=docs, rank=r, sparse_kv=True, **kw)[
            "forward"
        ]["all_to_all"]["bytes"]
        for r in range(world)
    ]
    assert max(gathered) < 0.6 * ring, f"sparse gather bytes per rank {gathered}, the ring's {ring}"


def _bad(ctx, kind: str):
    import ring_impl
    from ring_impl.masks import SlidingWindow

    q = k = v = torch.randn(1, 2, 8, 8)
    kw = {"mask": SlidingWindow(2), "sparse_kv": True}
    if kind == "no_mask":
        kw = {"sparse_kv": True}
    elif kind == "head_chunks":
        kw["head_chunks"] = 2
    elif kind == "halo_too":
        kw["halo"] = True
    elif kind == "not_bool":
        kw["sparse_kv"] = "yes"
    elif kind == "one_rank_only":
        kw["sparse_kv"] = ctx.rank == 0
    ring_impl.ring_attention(q, k, v, group=ctx.group, rotate_method="alltoall", **kw)
    return "no error"


@pytest.mark.parametrize(
    "kind,pattern",
    [
        ("no_mask", "(sparse_kv=True) needs a mask"),
        ("head_chunks", "pass head_chunks=1"),
        ("halo_too", "two different exchanges"),
        ("not_bool", "sparse_kv must be True or False"),
        ("one_rank_only", "ranks disagree on exchange (rank 0 'gather'; rank 1 'halo')"),
    ],
)
def test_bad_sparse_options_raise_on_every_rank(ring, kind, pattern) -> None:
    outcomes = ring.rank_pool(2).run_outcomes(_bad, kind, timeout=30.0)
    summary = assert_every_rank_raised(outcomes, "InputError", clip=200)
    assert all(pattern in o.exc_message for o in outcomes), summary
