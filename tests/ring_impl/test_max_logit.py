"""``ring_attention(..., return_max_logit=True)`` (ring_impl.numerics.max_logit): the per-head
maximum scaled logit, what QK-clip optimisers read.

A block's maximum for every block kind of the plan (full, causal, ranges, masked; GQA; sliced
rows), the ring's value against the float64 oracle with head_chunks, a head that sees nothing
(-inf) and NaN where it reaches (and not where it does not), the return order and gradients,
torch.compile (a graph break), the declared all-reduce, the halo's fallback to the ring, and bad
input raising on every rank.
"""

from __future__ import annotations

import math

import pytest
import torch

import ring_impl.numerics.max_logit as max_logit_module
from reference.attention import max_logit as oracle_max_logit
from reference.layout import shard, unshard
from ring_impl import collective_schedule
from ring_impl.numerics.max_logit import block_max_logit, max_logit_problem
from tests.ring_impl.outcomes import assert_input_error_on_every_rank

# ------------------------------------------------------------------------------ one block


@pytest.mark.parametrize("kind", ["full", "causal", "ranges", "masked"])
@pytest.mark.parametrize("slice_entries", [1 << 22, 7])  # 7: a few rows per slice
@pytest.mark.parametrize("scale", [0.3, -0.7, 0.0])  # a negative scale takes the minimum score
@pytest.mark.parametrize("rows,cols", [(5, 6), (7, 3)])
def test_block_max_logit_sees_what_the_block_shows(
    kind: str, slice_entries: int, scale: float, rows: int, cols: int, monkeypatch
) -> None:
    monkeypatch.setattr(max_logit_module, "_SLICE_ENTRIES", slice_entries)
    gen = torch.Generator().manual_seed(1)
    b, h, hkv, d = 2, 4, 2, 8
    q = torch.randn(b, h, rows, d, generator=gen, dtype=torch.float64)
    k = torch.randn(b, hkv, cols, d, generator=gen, dtype=torch.float64)
    r, c = torch.arange(rows).view(-1, 1), torch.arange(cols).view(1, -1)
    lo = torch.randint(0, cols + 1, (rows,), generator=gen)
    hi = torch.maximum(lo, torch.randint(0, cols + 1, (rows,), generator=gen))
    hi[-1] = lo[-1]  # the last row sees nothing
    visible = torch.rand(1, h, rows, cols, generator=gen) > 0.5
    vis = {
        "full": None,
        "causal": c <= r,
        "ranges": (c >= lo.view(-1, 1)) & (c < hi.view(-1, 1)),
        "masked": visible,
    }[kind]
    got = block_max_logit(
        q,
        k,
        scale=scale,
        kind=kind,
        visible=visible if kind == "masked" else None,
        bounds=(lo, hi) if kind == "ranges" else None,
        dtype=torch.float64,
    )
    want = oracle_max_logit(q, k, scale=scale, visible=vis)
    torch.testing.assert_close(got, want, rtol=1e-14, atol=0)


def test_block_max_logit_is_minus_inf_for_a_blind_head_and_nan_where_a_nan_reaches() -> None:
    q, k = torch.randn(1, 2, 3, 4), torch.randn(1, 2, 3, 4)
    visible = torch.ones(1, 2, 3, 3, dtype=torch.bool)
    visible[:, 1] = False  # head 1 sees nothing
    visible[:, 0, :, 2] = False  # nobody sees key 2 of head 0
    k[0, 0, 2, 1] = math.nan  # ... so its NaN reaches nothing
    got = block_max_logit(q, k, scale=1.0, kind="masked", visible=visible, dtype=torch.float32)
    assert math.isfinite(got[0]) and got[1] == -math.inf, got
    q[0, 0, 1, 0] = math.nan  # a row that sees keys 0 and 1
    got = block_max_logit(q, k, scale=1.0, kind="masked", visible=visible, dtype=torch.float32)
    assert math.isnan(got[0]) and got[1] == -math.inf, got


def test_max_logit_problem_names_the_exchange() -> None:
    assert max_logit_problem(False, exchange="halo") is None
    assert (
        max_logit_problem(True, exchange="auto") is None
        and max_logit_problem(True, exchange="ring") is None
    )
    assert "must be a bool" in max_logit_problem(1, exchange="auto")
    assert "exchange='halo' asks for the halo exchange" in max_logit_problem(True, exchange="halo")
    assert "exchange='gather' asks for the sparse gather" in max_logit_problem(
        True, exchange="gather"
    )


# ------------------------------------------------------------------------------ schedule


def test_schedule_adds_one_all_reduce_of_the_heads_and_their_nan_flags() -> None:
    kw = dict(batch=2, heads_kv=2, seq_kv=8, head_dim=16)
    # (value's own head dim, MLA's d_v != d_qk, moves at its own width with the max logit too)
    for w, method, dtype, chunks, dv in [
        (2, "p2p", torch.bfloat16, 1, None),
        (4, "allgather", torch.float64, 2, 24),
        (3, "alltoall", torch.float32, 2, 8),
        (2, "p2p", torch.float32, 1, 4),
    ]:
        sizes = dict(dtype=dtype, head_chunks=chunks, head_dim_v=dv, **kw)
        plain = collective_schedule(w, method, **sizes)
        with_max = collective_schedule(w, method, heads=6, return_max_logit=True, **sizes)
        acc = 8 if dtype == torch.float64 else 4
        assert with_max["forward"]["all_reduce"] == {
            "calls": plain["forward"]["all_reduce"]["calls"] + 1,
            "bytes": plain["forward"]["all_reduce"]["bytes"] + 2 * 6 * acc,
        }
        assert {k: v for k, v in with_max["forward"].items() if k != "all_reduce"} == {
            k: v for k, v in plain["forward"].items() if k != "all_reduce"
        }
        assert with_max["backward"] == plain["backward"]
    # compiled, the call runs eagerly: the eager schedule
    assert collective_schedule(
        3, "p2p", dtype=torch.float32, heads=2, return_max_logit=True, compiled=True, **kw
    ) == collective_schedule(3, "p2p", dtype=torch.float32, heads=2, return_max_logit=True, **kw)
    assert collective_schedule(
        1, "p2p", dtype=torch.float32, heads=2, return_max_logit=True, **kw
    ) == {"forward": {}, "backward": {}}


@pytest.mark.parametrize(
    "extra,match",
    [
        ({}, "needs heads="),
        ({"heads": 4, "strategy": "ulysses"}, "ring only"),
        ({"heads": 4, "sparse_kv": True}, "ring only"),
        ({"heads": 4, "halo": True}, "ring only"),
        ({"heads": 4, "return_max_logit": 1}, "must be a bool"),
    ],
)
def test_schedule_refuses_what_cannot_return_it(extra: dict, match: str) -> None:
    kwargs = {"return_max_logit": True, **extra}
    with pytest.raises(ValueError, match=match):
        collective_schedule(
            2, "p2p", batch=1, heads_kv=2, seq_kv=8, head_dim=4, dtype=torch.float32, **kwargs
        )


# ------------------------------------------------------------------------------ on the ring


def _inputs(seq: int, dtype=torch.float64, heads: int = 4, heads_kv: int = 2, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    return tuple(
        torch.randn(2, n, seq, 8, generator=gen, dtype=torch.float64).to(dtype)
        for n in (heads, heads_kv, heads_kv)
    )


def _head_one_blind(b, h, q_idx, kv_idx):
    """Causal, head 1 sees nothing and no head sees key 0 (nor does row 0 see anything)."""
    return (kv_idx <= q_idx) & (h != 1) & (kv_idx > 0)


def _ring_values(
    ctx, seq: int, layout: str, rotate: str, chunks: int, masked: bool, nan: str | None
):
    """Every max-logit call form on this rank: (max_logit, out, lse, dq) of return_lse on and off,
    and the out/dq of the same call without the max logit."""
    import ring_impl
    from ring_impl.masks import MaskMod

    q, k, v = _inputs(seq)
    if nan:  # key 0 of key/value head 0: every row sees it causally, none under the mask
        k[0, 0, 0, 0] = math.nan
    w, r = ctx.world_size, ctx.rank
    ql, kl, vl = (shard(t, layout, w, r, dim=2).requires_grad_() for t in (q, k, v))
    mask = MaskMod(_head_one_blind) if masked else None
    common = dict(
        group=ctx.group,
        layout=layout,
        rotate_method=rotate,
        head_chunks=chunks,
        mask=mask,
        is_causal=not masked,
    )
    out, lse, ml = ring_impl.ring_attention(
        ql, kl, vl, return_lse=True, return_max_logit=True, **common
    )
    out2, ml2 = ring_impl.ring_attention(ql, kl, vl, return_max_logit=True, **common)
    (out * 1.5).sum().backward()
    dq = ql.grad.clone()
    ql.grad = None
    plain = ring_impl.ring_attention(ql, kl, vl, **common)
    (plain * 1.5).sum().backward()
    return {
        "ml": ml,
        "ml2": ml2,
        "grad": (ml.requires_grad, ml2.requires_grad, lse.requires_grad),
        "out": out.detach(),
        "out2": out2.detach(),
        "plain": plain.detach(),
        "dq": dq,
        "dq_plain": ql.grad,
    }


@pytest.mark.parametrize(
    "world,layout,rotate,chunks,masked,nan",
    [
        (2, "head_tail", "p2p", 2, False, False),
        (3, "contiguous", "alltoall", 2, True, False),
        (3, "head_tail", "allgather", 1, True, True),  # a NaN in a key no row sees: no NaN
        (
            2,
            "contiguous",
            "p2p",
            2,
            False,
            True,
        ),  # a NaN in a key every row sees: NaN on every rank
        (1, "contiguous", "allgather", 2, True, False),
    ],
)
def test_ring_max_logit_matches_the_oracle(
    ring, world, layout, rotate, chunks, masked, nan
) -> None:
    seq = 8 * world
    results = ring.rank_pool(world).run(
        _ring_values, seq, layout, rotate, chunks, masked, nan, timeout=60.0
    )
    q, k, _ = _inputs(seq)
    if nan:
        k[0, 0, 0, 0] = math.nan
    causal = torch.ones(seq, seq, dtype=torch.bool).tril()
    vis = (
        causal & (torch.arange(4) != 1).view(1, -1, 1, 1) & (torch.arange(seq) > 0)
        if masked
        else causal
    )
    want = oracle_max_logit(q, k, visible=vis)
    if masked:
        assert want[1] == -math.inf  # head 1 sees nothing
    assert (
        bool(torch.isnan(want[:2]).all()) == (nan and not masked)
        and not torch.isnan(want[2:]).any()
    )
    for rank, res in enumerate(results):
        torch.testing.assert_close(
            res["ml"],
            want,
            rtol=1e-13,
            atol=0,
            equal_nan=True,
            msg=lambda m, rank=rank: f"rank {rank}: {m}",
        )
        assert res["ml"].dtype == torch.float64 and res["grad"] == (False, False, True), (
            rank,
            res["grad"],
        )
        assert torch.equal(res["ml2"], res["ml"]) or torch.allclose(
            res["ml2"], res["ml"], equal_nan=True
        )
        for got, name in ((res["out"], "out with lse"), (res["out2"], "out without lse")):
            assert torch.allclose(got, res["plain"], equal_nan=True), (
                f"rank {rank}: {name} differs from the plain call"
            )
        assert torch.allclose(res["dq"], res["dq_plain"], equal_nan=True), (
            f"rank {rank}: dq differs"
        )


def _compiled(ctx, backend: str):
    import ring_impl

    q, k, v = _inputs(8 * ctx.world_size, torch.float32)
    ql, kl, vl = (shard(t, "head_tail", ctx.world_size, ctx.rank, dim=2) for t in (q, k, v))

    def fn(q, k, v):
        return ring_impl.ring_attention(
            q, k, v, group=ctx.group, is_causal=True, layout="head_tail", return_max_logit=True
        )

    torch._dynamo.reset()
    out_c, ml_c = torch.compile(fn, backend=backend)(ql, kl, vl)
    out_e, ml_e = fn(ql, kl, vl)
    return out_c, ml_c, out_e, ml_e


def test_under_compile_it_runs_eagerly(ring) -> None:
    for rank, (out_c, ml_c, out_e, ml_e) in enumerate(
        ring.rank_pool(2).run(_compiled, "aot_eager", timeout=120.0)
    ):
        assert torch.equal(ml_c, ml_e), f"rank {rank}: compiled {ml_c}, eager {ml_e}"
        torch.testing.assert_close(out_c, out_e, rtol=1e-6, atol=1e-6)


def _halo_window(ctx):
    import ring_impl
    from harness.accounting import CollectiveLog
    from ring_impl.masks import SlidingWindow

    q, k, v = _inputs(8 * ctx.world_size)
    ql, kl, vl = (shard(t, "contiguous", ctx.world_size, ctx.rank, dim=2) for t in (q, k, v))
    with CollectiveLog() as log, log.phase("forward"):
        out, ml = ring_impl.ring_attention(
            ql,
            kl,
            vl,
            group=ctx.group,
            mask=SlidingWindow(2, 0),
            rotate_method="p2p",
            return_max_logit=True,
        )
    return out, ml, log.summary()


def test_a_call_the_halo_would_serve_runs_on_the_ring(ring) -> None:
    from ring_impl.masks import SlidingWindow

    world, seq = 3, 24
    results = ring.rank_pool(world).run(_halo_window, timeout=60.0)
    q, k, v = _inputs(seq)
    i = torch.arange(seq)
    vis = (i.view(1, -1) <= i.view(-1, 1)) & (i.view(1, -1) >= i.view(-1, 1) - 2)
    want = oracle_max_logit(q, k, visible=vis)
    declared = collective_schedule(
        world,
        "p2p",
        batch=2,
        heads_kv=2,
        seq_kv=8,
        head_dim=8,
        dtype=torch.float64,
        heads=4,
        mask=SlidingWindow(2, 0),
        return_max_logit=True,
    )
    out = unshard([r[0] for r in results], "contiguous", dim=2)
    from reference.attention import attention

    torch.testing.assert_close(out, attention(q, k, v, visible=vis).out, rtol=1e-12, atol=1e-12)
    for rank, (_, ml, summary) in enumerate(results):
        torch.testing.assert_close(ml, want, rtol=1e-13, atol=0)
        assert summary["forward"] == declared["forward"], (
            rank,
            summary["forward"],
            declared["forward"],
        )


def _bad(ctx, kind: str):
    import ring_impl
    from ring_impl.masks import SlidingWindow

    q, k, v = _inputs(8 * ctx.world_size)
    ql, kl, vl = (shard(t, "contiguous", ctx.world_size, ctx.rank, dim=2) for t in (q, k, v))
    kwargs = {
        "not_bool": {"return_max_logit": "yes"},
        "halo": {"return_max_logit": True, "mask": SlidingWindow(2, 0), "exchange": "halo"},
        "sparse": {"return_max_logit": True, "mask": SlidingWindow(2, 0), "exchange": "gather"},
        "ulysses": {"return_max_logit": True, "exchange": "ulysses"},
        "differ": {"return_max_logit": ctx.rank == 0},
    }[kind]
    ring_impl.ring_attention(ql, kl, vl, group=ctx.group, **kwargs)
    return "no error"


@pytest.mark.parametrize(
    "kind,pattern",
    [
        ("not_bool", "return_max_logit must be a bool"),
        ("halo", "asks for the halo exchange; pass exchange='auto'"),
        ("sparse", "asks for the sparse gather; pass exchange='auto'"),
        ("ulysses", "return_max_logit runs on the ring only (exchange='ulysses'"),
        ("differ", "return_max_logit (rank 0 True; rank 1 False)"),
    ],
)
def test_bad_max_logit_input_raises_on_every_rank(ring, kind: str, pattern: str) -> None:
    outcomes = ring.rank_pool(2).run_outcomes(_bad, kind, timeout=30.0)
    assert_input_error_on_every_rank(outcomes, pattern)
