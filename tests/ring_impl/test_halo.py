"""The halo exchange (ring_impl.exchanges.halo): masks that reach at most a shard, contiguous
layout.

Judged against the float64 oracle (reference.attention / reference.masks, written independently
of ring_impl) by the numerics policy (reference.budget), at W = 2, 3, 4, for windows narrower
than a shard and as wide as one, left only, right only, left and right, a causal window,
documents with a window (rows that see nothing: out 0, LSE -inf, zero gradients), chunked causal,
GQA, sinks, a loss through the LSE, float64/float32/bfloat16. Every rank's collectives equal the
declared schedule (collective_schedule(mask=, rank=)) and its halo bytes the minimum the issue
defines (the last ``left`` rows of rank - 1, the first ``right`` of rank + 1; their dK/dV back in
the accumulation dtype), and no key/value block goes around the ring. What the halo cannot serve
(wider windows, other layouts, unbounded masks, halo=False) runs on the ring and still matches
the oracle. Bad halo= input raises on every rank.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from reference import attention_grads
from reference.budget import error_scales
from reference.masks import visibility
from ring_impl.masks import Causal, ChunkedCausal, Documents, Full, MaskMod, PrefixLM, SlidingWindow
from tests.ring_impl.oracle import assert_results_match_oracle, unshard_results
from tests.ring_impl.outcomes import assert_input_error_on_every_rank
from tests.ring_impl.rank_results import forward_backward, leaves, local_results

BATCH, HEADS, HEAD_DIM = 1, 4, 8
SHARD = 12  # local sequence length


def _window(left, right=0) -> dict:
    return {"kind": "sliding_window", "left": left, "right": right}


def _docs(seq: int, *, causal: bool = True, pad_last: int = 4) -> dict:
    """Uneven documents crossing shard boundaries (one of a single token), ``pad_last`` padding
    tokens at the end (rows that see nothing)."""
    lengths = [5, 1, seq // 3, 2]
    ids: list[int] = []
    for d, n in enumerate(lengths):
        ids += [d] * n
    ids += [len(lengths)] * max(0, seq - pad_last - len(ids))
    ids = (ids + [-1] * seq)[:seq]
    return {"kind": "document", "doc_ids": ids, "causal": causal}


def _case(name: str, world: int) -> tuple[dict, bool, tuple[int, int] | None]:
    """(oracle mask spec, is_causal, the (left, right) rows of the halo it needs: None for a
    mask the halo cannot serve)."""
    seq = SHARD * world
    cases: dict[str, tuple[dict, bool, tuple[int, int] | None]] = {
        "narrow": (_window(3), False, (3, 0)),
        "left_right": (_window(4, 2), False, (4, 2)),
        "right_only": (_window(0, 5), False, (0, 5)),
        "shard_wide": (_window(SHARD, SHARD), False, (SHARD, SHARD)),
        # is_causal=True folds Causal into the mask: the right reach becomes 0
        "causal_window": (_window(5, 4), True, (5, 0)),
        "documents_window": ({"kind": "and", "masks": [_docs(seq), _window(3)]}, False, (3, 0)),
        "documents_full_window": (
            {"kind": "and", "masks": [_docs(seq, causal=False), _window(2, 2)]},
            False,
            (2, 2),
        ),
        # the last rank holds padding only: a rank whose rows see nothing still exchanges
        # (causal documents: the window's right reach does not count)
        "padded_rank": (
            {"kind": "and", "masks": [_docs(seq, pad_last=SHARD + 2), _window(4, 1)]},
            False,
            (4, 0),
        ),
        "chunked_causal": ({"kind": "chunked_causal", "chunk": 8}, False, (7, 0)),
        # served by the ring
        "window_wide": (_window(SHARD + 1), False, None),
        "window_wide_right": (_window(2, SHARD + 1), False, None),
        "documents": (_docs(seq), False, None),
        "causal": ({"kind": "causal"}, False, None),
    }
    return cases[name]


def _oracle_spec(spec: dict, is_causal: bool) -> dict:
    return {"kind": "and", "masks": [{"kind": "causal"}, spec]} if is_causal else spec


def _inputs(seq: int, dtype: torch.dtype, heads_kv: int, sinks: bool, nan_key: int | None = None):
    gen = torch.Generator().manual_seed(seq * 11 + heads_kv + int(sinks))
    q = torch.randn(BATCH, HEADS, seq, HEAD_DIM, generator=gen, dtype=torch.float64).to(dtype)
    k, v = (
        torch.randn(BATCH, heads_kv, seq, HEAD_DIM, generator=gen, dtype=torch.float64).to(dtype)
        for _ in range(2)
    )
    dout = torch.randn(BATCH, HEADS, seq, HEAD_DIM, generator=gen, dtype=torch.float64).to(dtype)
    glse = (
        torch.randn(BATCH, HEADS, seq, generator=gen, dtype=torch.float64).float().double()
    )  # exact in float32
    s = torch.randn(HEADS, generator=gen, dtype=torch.float64).float() if sinks else None
    if nan_key is not None:
        k[:, :, nan_key, 0] = float("nan")
    return q, k, v, dout, glse, s


def _run(
    ctx,
    spec,
    is_causal,
    dtype,
    op,
    heads_kv,
    sinks,
    layout="contiguous",
    halo=None,
    lse_grad=False,
    nan_key=None,
):
    import ring_impl
    from harness.accounting import CollectiveLog
    from ring_impl.masks import from_spec

    w, r = ctx.world_size, ctx.rank
    q, k, v, dout, glse, s = _inputs(SHARD * w, dtype, heads_kv, sinks, nan_key)
    q, k, v, dout, glse = (ring_impl.shard(t, w, r, layout=layout) for t in (q, k, v, dout, glse))
    q, k, v, s = leaves(q, k, v, s)
    ring = dict(group=ctx.group, rotate_method="alltoall", op=op, halo=halo)
    masked = dict(mask=from_spec(spec), is_causal=is_causal, sinks=s, layout=layout)
    glse = glse if lse_grad else None
    with CollectiveLog() as log:
        out, lse = forward_backward(q, k, v, dout, glse, log=log, **ring, **masked)
    return local_results(out, lse, q, k, v, s, log=log.summary())


def _schedule(world, dtype, heads_kv, **kwargs) -> dict:
    """The declared alltoall schedule of a case's shards (``kwargs``: the mask, rank, ...)."""
    import ring_impl

    return ring_impl.collective_schedule(
        world,
        "alltoall",
        batch=BATCH,
        heads_kv=heads_kv,
        seq_kv=SHARD,
        head_dim=HEAD_DIM,
        dtype=dtype,
        **kwargs,
    )


def _declared(spec, is_causal, world, rank, dtype, heads_kv, layout="contiguous", halo=None):
    from ring_impl.masks import from_spec

    mask = from_spec(spec)
    return _schedule(
        world, dtype, heads_kv, mask=mask, is_causal=is_causal, layout=layout, rank=rank, halo=halo
    )


def _nonzero(schedule: dict) -> dict:
    return {phase: kinds for phase, kinds in schedule.items() if kinds}


def _halo_minimum(
    world: int, rank: int, left: int, right: int, heads_kv: int, dtype: torch.dtype
) -> dict:
    """Bytes rank ``rank`` must send and receive per phase: the issue's minimum, written apart
    from ring_impl. Forward: its first ``right`` key/value rows to rank - 1, its last ``left`` to
    rank + 1 (nothing past the ends); backward: the reverse, in the accumulation dtype."""
    row = 2 * BATCH * heads_kv * HEAD_DIM
    acc = 8 if dtype == torch.float64 else 4
    item = torch.finfo(dtype).bits // 8
    sent = (right if rank > 0 else 0) + (left if rank < world - 1 else 0)
    received = (left if rank > 0 else 0) + (right if rank < world - 1 else 0)
    return {
        "forward": {"send": sent * row * item, "recv": received * row * item},
        "backward": {"send": received * row * acc, "recv": sent * row * acc},
    }


def _visible_rows_sent(vis: torch.Tensor, world: int, rank: int) -> int:
    """Key rows of ``rank`` that the queries of each other rank see, summed over those ranks
    (contiguous layout): what must leave ``rank`` in any exchange, from the oracle's mask."""
    seen = vis.any(0).any(0)
    mine = slice(rank * SHARD, (rank + 1) * SHARD)
    total = 0
    for other in range(world):
        if other != rank:
            total += int(seen[other * SHARD : (other + 1) * SHARD, mine].any(0).sum())
    return total


def _judge(
    results,
    spec,
    is_causal,
    world,
    dtype,
    heads_kv,
    sinks,
    op,
    layout="contiguous",
    lse_grad=False,
    label="",
):
    seq = SHARD * world
    q, k, v, dout, glse, s = _inputs(seq, dtype, heads_kv, sinks)
    glse = glse if lse_grad else None
    vis = visibility(_oracle_spec(spec, is_causal), seq, seq, batch=BATCH, heads=HEADS)
    ref = attention_grads(q, k, v, dout, visible=vis, sinks=s, grad_lse=glse)
    scales = error_scales(q, k, v, dout, visible=vis, grad_lse=glse, sinks=s, input_dtype=dtype)
    base = _baseline(q, k, v, dout, glse, vis, s, op)
    got = unshard_results(results, layout)
    assert_results_match_oracle(label, got, ref, scales, world_size=world, dtype=dtype, base=base)
    return vis


def _baseline(q, k, v, dout, glse, vis, sinks, op_name: str) -> dict[str, torch.Tensor]:
    """The policy's B: the same kernel on one device over the whole sequence with the mask (rows
    that see nothing set as the contract says), the sink term applied as ring_impl applies it;
    as the mask suite's baseline (suites/cases_masks.py)."""
    from ring_impl.numerics.lse import normalize_lse
    from ring_impl.ops import call_backward, call_forward, default_scale, get_op
    from ring_impl.sinks import with_sinks

    op, scale = get_op(op_name), default_scale(HEAD_DIM)
    layout = (op if op.capabilities.masks else get_op("math")).capabilities.lse_layout
    out, raw = call_forward(op, q, k, v, is_causal=False, scale=scale, visible=vis)
    lse = normalize_lse(raw, batch=BATCH, heads=HEADS, seq_q=q.shape[2], layout=layout)
    dead = ~vis.any(-1).expand(lse.shape)
    out = torch.where(dead.unsqueeze(-1), torch.zeros((), dtype=out.dtype), out)
    lse = torch.where(dead, torch.full((), float("-inf"), dtype=lse.dtype), lse)
    o, l_ = out.detach().requires_grad_(True), lse.detach().requires_grad_(True)
    sk = None if sinks is None else sinks.detach().clone().requires_grad_(True)
    o2, l2 = (o, l_) if sk is None else with_sinks(o, l_, sk)
    loss = (o2.double() * dout.double()).sum()
    if glse is not None:
        loss = loss + torch.where(torch.isfinite(l2), l2, 0.0).double().mul(glse).sum()
    loss.backward()
    zero = torch.zeros((), dtype=q.dtype)
    grad_out = torch.where(dead.unsqueeze(-1), zero, o.grad.to(q.dtype))
    grad_lse = None if l_.grad is None else torch.where(dead, 0.0, l_.grad)
    dq, dk, dv = call_backward(
        op,
        grad_out,
        q,
        k,
        v,
        out,
        torch.where(dead, 0.0, lse),
        is_causal=False,
        scale=scale,
        grad_lse=grad_lse,
        visible=vis,
    )
    result = {"out": o2.detach(), "lse": l2.detach(), "dq": dq, "dk": dk, "dv": dv}
    if sk is not None:
        result["dsinks"] = sk.grad
    return result


_DTYPES = ((torch.float64, "math"), (torch.float32, "cpu_flash"), (torch.bfloat16, "cpu_flash"))
_HALO_CASES = []
for _i, (_name, _world) in enumerate(
    (
        ("narrow", 2),
        ("narrow", 3),
        ("narrow", 4),
        ("left_right", 2),
        ("left_right", 3),
        ("left_right", 4),
        ("right_only", 3),
        ("shard_wide", 2),
        ("shard_wide", 4),
        ("causal_window", 3),
        ("causal_window", 4),
        ("documents_window", 2),
        ("documents_window", 4),
        ("documents_full_window", 3),
        ("padded_rank", 3),
        ("chunked_causal", 3),
    )
):
    for _j, (_dtype, _op) in enumerate(_DTYPES):
        _hkv = 2 if (_i + _j) % 2 else 4
        _sinks = (_i + _j) % 3 == 0
        _lse = (_i + _j) % 4 == 1
        _HALO_CASES.append(
            pytest.param(
                _name,
                _world,
                _dtype,
                _op,
                _hkv,
                _sinks,
                _lse,
                id=(
                    f"{_name}-W{_world}-{str(_dtype).removeprefix('torch.')}-hkv{_hkv}"
                    f"{'-sinks' if _sinks else ''}{'-lsegrad' if _lse else ''}"
                ),
            )
        )


@pytest.mark.parametrize("name,world,dtype,op,heads_kv,sinks,lse_grad", _HALO_CASES)
def test_halo_matches_the_oracle_and_sends_the_minimum(
    ring, name, world, dtype, op, heads_kv, sinks, lse_grad
) -> None:
    spec, is_causal, rows = _case(name, world)
    assert rows is not None
    results = ring.rank_pool(world).run(
        _run, spec, is_causal, dtype, op, heads_kv, sinks, lse_grad=lse_grad, timeout=120.0
    )
    label = (
        f"halo, {name}, W={world}, {dtype}, {op}, hkv={heads_kv}, sinks={sinks}, "
        f"lse_grad={lse_grad}"
    )
    vis = _judge(
        results, spec, is_causal, world, dtype, heads_kv, sinks, op, lse_grad=lse_grad, label=label
    )
    for rank, r in enumerate(results):
        declared = _nonzero(_declared(spec, is_causal, world, rank, dtype, heads_kv))
        assert r["log"] == declared, (
            f"rank {rank}: issued {r['log']}, declared {declared} [{label}]"
        )
        # No key/value block around the ring: only the input check and the neighbours' halos.
        assert set(r["log"]["forward"]) <= {"all_reduce", "send", "recv"}, r["log"]
        minimum = _halo_minimum(world, rank, *rows, heads_kv, dtype)
        for phase in ("forward", "backward"):
            for kind in ("send", "recv"):
                got = r["log"].get(phase, {}).get(kind, {"bytes": 0})["bytes"]
                assert got == minimum[phase][kind], (
                    f"rank {rank} {phase}/{kind}: {got} bytes, the halo minimum is "
                    f"{minimum[phase][kind]} [{label}]"
                )
        if spec["kind"] == "sliding_window":  # the minimum is what the oracle's mask needs
            row = 2 * BATCH * heads_kv * HEAD_DIM * (torch.finfo(dtype).bits // 8)
            assert minimum["forward"]["send"] == _visible_rows_sent(vis, world, rank) * row


_FALLBACK = [
    pytest.param("window_wide", 3, "contiguous", None, id="window_wider_than_shard"),
    pytest.param("window_wide_right", 2, "contiguous", None, id="right_reach_wider_than_shard"),
    pytest.param("documents", 3, "contiguous", None, id="documents_unbounded"),
    pytest.param("causal", 2, "contiguous", None, id="causal_unbounded"),
    pytest.param("narrow", 2, "head_tail", None, id="head_tail_layout"),
    pytest.param("left_right", 3, "contiguous", False, id="halo_false"),
]


@pytest.mark.parametrize("name,world,layout,halo", _FALLBACK)
def test_what_the_halo_cannot_serve_runs_on_the_ring(ring, name, world, layout, halo) -> None:
    """The oracle's result, and the ring's schedule (the declaration falls back with the call)."""

    spec, is_causal, _ = _case(name, world)
    dtype, op, heads_kv, label = torch.float32, "cpu_flash", 2, f"ring, {name}, W={world}, {layout}"
    results = ring.rank_pool(world).run(
        _run, spec, is_causal, dtype, op, heads_kv, False, layout=layout, halo=halo, timeout=120.0
    )
    _judge(results, spec, is_causal, world, dtype, heads_kv, False, op, layout=layout, label=label)
    ring_sched = _nonzero(_schedule(world, dtype, heads_kv))
    for rank, r in enumerate(results):
        declared = _nonzero(
            _declared(spec, is_causal, world, rank, dtype, heads_kv, layout=layout, halo=halo)
        )
        assert declared == ring_sched
        assert r["log"] == declared, (
            f"rank {rank}: issued {r['log']}, declared the ring's {declared} [{name}]"
        )


def _kernel_calls(ctx, spec):
    import ring_impl
    from ring_impl.masks import from_spec
    from ring_impl.ops import get_op

    base = get_op("math")
    calls = {"forward": 0, "backward": 0}

    class Counting:
        name = "counting_math"
        capabilities = base.capabilities

        def forward(self, *a, **kw):
            calls["forward"] += 1
            return base.forward(*a, **kw)

        def backward(self, *a, **kw):
            calls["backward"] += 1
            return base.backward(*a, **kw)

    q, k, v, dout, _, _ = _inputs(SHARD * ctx.world_size, torch.float64, 2, False)
    q, k, v, dout = (ring_impl.shard(t, ctx.world_size, ctx.rank) for t in (q, k, v, dout))
    q.requires_grad_(True)
    out = ring_impl.ring_attention(q, k, v, group=ctx.group, mask=from_spec(spec), op=Counting())
    out.backward(dout)
    return calls


def test_one_kernel_call_per_rank_and_none_where_nothing_is_seen(ring) -> None:
    """The halo path runs the kernel once per pass on [halo | local | halo]; the rank whose rows
    are all padding runs none, yet exchanges (its neighbours wait for its rows)."""
    calls = ring.rank_pool(4).run(_kernel_calls, _window(3, 2), timeout=60.0)
    assert calls == [{"forward": 1, "backward": 1}] * 4, calls
    spec, _, _ = _case("padded_rank", 3)
    calls = ring.rank_pool(3).run(_kernel_calls, spec, timeout=60.0)
    assert calls == [{"forward": 1, "backward": 1}] * 2 + [{"forward": 0, "backward": 0}], calls


def test_a_nan_in_a_halo_key_reaches_the_neighbour_rows_that_see_it(ring) -> None:
    """A NaN in rank 0's last key travels in the halo: exactly the rows that see it (rank 0's last
    row, rank 1's first three) get NaN outputs and LSEs, as the oracle's dependency rule says;
    gradients are NaN wherever the oracle's are (a superset, as the ring's:
    ring_impl.numerics.nonfinite)."""
    world, spec, nan_key = 2, _window(3), SHARD - 1
    results = ring.rank_pool(world).run(
        _run, spec, False, torch.float64, "math", 2, False, nan_key=nan_key, timeout=60.0
    )
    q, k, v, dout, _, _ = _inputs(SHARD * world, torch.float64, 2, False, nan_key)
    vis = visibility(spec, SHARD * world, SHARD * world, batch=BATCH, heads=HEADS)
    ref = attention_grads(q, k, v, dout, visible=vis)
    assert_nan_where_the_oracle_has_it(results, ref)


def assert_nan_where_the_oracle_has_it(
    results: list[dict], ref, layout: str = "contiguous"
) -> None:
    """The ranks' unsharded out and LSE are NaN exactly where the oracle's ``ref`` are; dQ, dK and
    dV at least there (a superset, as the ring's NaN propagation: ring_impl.numerics.nonfinite)."""
    import ring_impl

    for n in ("out", "lse", "dq", "dk", "dv"):
        got = ring_impl.unshard([r[n] for r in results], layout=layout)
        want_nan = torch.isnan(getattr(ref, n))
        assert bool(want_nan.any()), n
        shown = (
            f"{n}: NaN at {torch.isnan(got).nonzero().tolist()[:6]} vs oracle "
            f"{want_nan.nonzero().tolist()[:6]}"
        )
        if n in ("out", "lse"):
            assert torch.equal(torch.isnan(got), want_nan), shown
        else:
            assert bool(torch.isnan(got)[want_nan].all()), shown


def _bad(ctx, kind: str):
    import ring_impl

    q = torch.randn(1, 2, 8, 8)
    k = v = torch.randn(1, 2, 8, 8)
    kwargs: dict = {"mask": SlidingWindow(3)}
    if kind == "forced_too_wide":
        kwargs.update(mask=SlidingWindow(9), halo=True)
    elif kind == "forced_head_tail":
        kwargs.update(layout="head_tail", halo=True)
    elif kind == "forced_unbounded":
        kwargs.update(mask=SlidingWindow(None, 0), halo=True)
    elif kind == "not_a_bool":
        kwargs.update(halo="yes")
    elif kind == "differs":  # rank 0 forces the ring, the others take the halo path
        kwargs.update(halo=False if ctx.rank == 0 else None)
    elif kind == "forced_ulysses":
        kwargs.update(halo=True, strategy="ulysses")
    ring_impl.ring_attention(q, k, v, group=ctx.group, rotate_method="alltoall", **kwargs)
    return "no error"


@pytest.mark.parametrize(
    "kind,pattern",
    [
        ("forced_too_wide", "reaches 9 keys back and 0 forward, more than a shard (8 tokens)"),
        ("forced_head_tail", "needs layout='contiguous'"),
        ("forced_unbounded", "does not bound how far a query looks back"),
        ("not_a_bool", "halo must be None (automatic), True or False, got 'yes'"),
        ("differs", "ranks disagree on exchange (rank 0 'ring'; rank 1 'halo')"),
        ("forced_ulysses", "runs with strategy='ring' only"),
    ],
)
def test_bad_halo_input_raises_on_every_rank(ring, kind: str, pattern: str) -> None:
    outcomes = ring.rank_pool(2).run_outcomes(_bad, kind, timeout=30.0)
    assert_input_error_on_every_rank(outcomes, pattern)


# ----------------------------------------------------------------- single-process pieces


def test_mask_reach() -> None:
    docs = Documents(torch.zeros(16, dtype=torch.int64))
    assert SlidingWindow(3, 2).reach() == (3, 2)
    assert SlidingWindow(None, 0).reach() == (None, 0)
    assert (Causal() & SlidingWindow(3, 2)).reach() == (3, 0)
    assert (docs & SlidingWindow(4, None)).reach() == (4, 0)  # causal documents
    assert (
        Documents(torch.zeros(16, dtype=torch.int64), causal=False) & SlidingWindow(4, None)
    ).reach() == (4, None)
    assert (
        Documents(torch.zeros(16, dtype=torch.int64), causal=False) & SlidingWindow(2, 5)
    ).reach() == (2, 5)
    assert (SlidingWindow(3, 0) | SlidingWindow(1, 2)).reach() == (3, 2)
    assert (SlidingWindow(3, 0) | Causal()).reach() == (None, 0)
    assert ChunkedCausal(4).reach() == (3, 0)
    assert (
        Causal().reach() == docs.reach() == PrefixLM(0).reach() == PrefixLM(1).reach() == (None, 0)
    )
    assert PrefixLM(3).reach() == (None, 2)  # query 0 sees keys 0..2
    assert (PrefixLM(6) & SlidingWindow(2, 2)).reach() == (2, 2)
    assert Full().reach() == MaskMod(lambda b, h, q, kv: kv <= q).reach() == (None, None)


@settings(max_examples=200, deadline=None, derandomize=True, database=None)
@given(data=st.data())
def test_reach_bounds_the_mask(data) -> None:
    """Every pair a mask shows lies within its reach (the halo relies on it): any built-in
    mask, and ``&`` / ``|`` of two."""
    from ring_impl.masks import (
        Causal,
        ChunkedCausal,
        Documents,
        Full,
        PrefixLM,
        SlidingWindow,
        visibility,
    )

    seq = 16
    side = st.one_of(st.none(), st.integers(0, seq + 1))

    def leaf():
        return st.one_of(
            st.just(Causal()),
            st.just(Full()),
            st.builds(SlidingWindow, side, side),
            st.builds(ChunkedCausal, st.integers(1, seq + 1)),
            st.builds(PrefixLM, st.integers(0, seq)),
            st.builds(
                lambda ids, causal: Documents(torch.tensor(sorted(ids)), causal),
                st.lists(st.integers(-1, 3), min_size=seq, max_size=seq),
                st.booleans(),
            ),
        )

    mask = data.draw(leaf(), label="mask")
    if data.draw(st.booleans(), label="joined"):
        other = data.draw(leaf(), label="other")
        mask = mask & other if data.draw(st.booleans(), label="and") else mask | other
    left, right = mask.reach()
    pos = torch.arange(seq)
    seen = visibility(mask, pos, pos)[0, 0]
    d = pos.view(1, -1) - pos.view(-1, 1)  # kv - q
    outside = torch.zeros_like(seen)
    if left is not None:
        outside |= d < -left
    if right is not None:
        outside |= d > right
    assert not bool((seen & outside).any()), (
        f"{mask.describe()} reaches {(left, right)} but shows pairs beyond it"
    )


def test_halo_schedule_declaration_errors_and_fallbacks() -> None:
    import ring_impl

    kw = dict(batch=1, heads_kv=2, seq_kv=8, head_dim=4, dtype=torch.float32)
    with pytest.raises(ValueError, match="pass rank="):
        ring_impl.collective_schedule(3, "p2p", mask=SlidingWindow(3), **kw)
    # a mask ring_attention refuses (plain data, a name) has no schedule to declare
    for not_a_mask in ({"kind": "sliding_window", "left": 3, "right": 0}, "window"):
        with pytest.raises(ValueError, match=r"mask must be a ring_impl\.masks\.Mask"):
            ring_impl.collective_schedule(3, "p2p", mask=not_a_mask, rank=0, **kw)
    with pytest.raises(ValueError, match="eagerly only"):
        ring_impl.collective_schedule(3, "p2p", mask=SlidingWindow(3), rank=0, compiled=True, **kw)
    with pytest.raises(ValueError, match="halo=True but"):
        ring_impl.collective_schedule(3, "p2p", mask=SlidingWindow(9), rank=0, halo=True, **kw)
    ring_sched = ring_impl.collective_schedule(3, "p2p", **kw)
    for extra in (
        {"mask": SlidingWindow(9)},
        {"mask": SlidingWindow(3), "layout": "head_tail"},
        {"mask": SlidingWindow(3), "halo": False},
        {"mask": Documents(torch.zeros(24, dtype=torch.int64))},
        {"mask": SlidingWindow(3), "seq_q": 4},
    ):
        assert ring_impl.collective_schedule(3, "p2p", **extra, **kw) == ring_sched, extra
    assert ring_impl.collective_schedule(1, "p2p", mask=SlidingWindow(3), **kw) == {
        "forward": {},
        "backward": {},
    }
    # a window of no rows: nothing to exchange, only the input check
    sched = ring_impl.collective_schedule(3, "p2p", mask=SlidingWindow(0, 0), rank=1, **kw)
    assert sched == {"forward": {"all_reduce": ring_sched["forward"]["all_reduce"]}, "backward": {}}
