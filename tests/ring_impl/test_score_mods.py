"""``ring_attention(score_mod=...)``: soft-capping, ALiBi, a post-scale bias and flex-style
callables on global positions and heads, through the ring (every rotation, both layouts,
head_chunks, GQA, the LSE's gradient) against the float64 oracle; the math op's explicit
backward through a score_mod; the descriptors' data; refusals on every rank."""

from __future__ import annotations

import math
import re

import pytest
import torch

from tests.ring_impl.oracle import QUANTITIES, assert_float64_results_match_oracle
from tests.ring_impl.rank_results import leaves, local_results

HEADS, HEADS_KV, HEAD_DIM = 4, 2, 8


def head_and_position_mod(score, b, h, q_idx, kv_idx):
    """Reads the head (GQA: the query head; head_chunks: the call's index) and both positions."""
    return score * (1 + 0.25 * h) - 0.1 * (q_idx - kv_idx).abs().to(score.dtype) + 0.05 * b


#: name -> (ring_impl descriptor or callable, reference.score_mods data)
def _mods(heads: int, seq: int):
    from ring_impl.score_mods import Alibi, PostScaleBias, SoftCap, alibi_slopes

    gen = torch.Generator().manual_seed(5)
    bias = torch.randn(2, 1, seq, seq, generator=gen, dtype=torch.float64)
    return {
        "softcap": (SoftCap(0.7), {"kind": "softcap", "cap": 0.7}),
        "alibi": (
            Alibi(heads),
            {"kind": "alibi", "slopes": alibi_slopes(heads).tolist(), "symmetric": False},
        ),
        "alibi_steep": (
            Alibi(4 * alibi_slopes(heads), symmetric=True),
            {"kind": "alibi", "slopes": (4 * alibi_slopes(heads)).tolist(), "symmetric": True},
        ),
        "bias": (PostScaleBias(bias), {"kind": "bias", "bias": bias}),
        "callable": (head_and_position_mod, {"kind": "score_mod", "fn": head_and_position_mod}),
    }


def _inputs(seq: int, batch: int = 2):
    gen = torch.Generator().manual_seed(3)
    q = torch.randn(batch, HEADS, seq, HEAD_DIM, generator=gen, dtype=torch.float64)
    k, v = (
        torch.randn(batch, HEADS_KV, seq, HEAD_DIM, generator=gen, dtype=torch.float64)
        for _ in range(2)
    )
    dout = torch.randn(batch, HEADS, seq, HEAD_DIM, generator=gen, dtype=torch.float64)
    dlse = torch.randn(batch, HEADS, seq, generator=gen, dtype=torch.float64)
    return q, k, v, dout, dlse


def _scored(q, k, v, dout, dlse, mod, **options) -> dict:
    """``ring_attention`` of this rank's shards with the score_mod ``mod`` and ``options``, and its
    backward (out's gradient ``dout``, the LSE's ``dlse``): this rank's results."""
    import ring_impl

    q, k, v = leaves(q, k, v)
    out, lse = ring_impl.ring_attention(q, k, v, return_lse=True, score_mod=mod, **options)
    torch.autograd.backward([out, lse], [dout, dlse])
    return local_results(out, lse, q, k, v)


def _run(ctx, name, seq, layout, rotate, head_chunks, is_causal):
    import ring_impl

    mod = _mods(HEADS, seq)[name][0]
    q, k, v, dout, dlse = (
        ring_impl.shard(t, ctx.world_size, ctx.rank, layout=layout) for t in _inputs(seq)
    )
    options = dict(
        is_causal=is_causal, layout=layout, rotate_method=rotate, head_chunks=head_chunks
    )
    return _scored(q, k, v, dout, dlse, mod, group=ctx.group, **options)


@pytest.mark.parametrize(
    "name,world,layout,rotate,head_chunks,is_causal",
    [
        ("softcap", 2, "head_tail", "p2p", 1, True),
        (
            "alibi",
            4,
            "contiguous",
            "alltoall",
            2,
            True,
        ),  # head chunks: each chunk's slopes are its heads'
        ("alibi_steep", 2, "contiguous", "allgather", 1, False),
        ("bias", 3, "contiguous", "p2p", 1, False),
        ("callable", 4, "head_tail", "allgather", 2, True),
        ("callable", 2, "contiguous", "alltoall", 1, False),
    ],
)
def test_float64_ring_with_a_score_mod_matches_the_oracle(
    ring, name, world, layout, rotate, head_chunks, is_causal
) -> None:
    """out, LSE and dQ/dK/dV (the loss using the LSE too) in float64 against the oracle, to the
    numerics policy's float64 bounds (about 1e-12 relative)."""
    import ring_impl
    from reference import attention_grads
    from reference.budget import error_scales

    seq = 24
    results = ring.rank_pool(world).run(
        _run, name, seq, layout, rotate, head_chunks, is_causal, timeout=120.0
    )
    q, k, v, dout, dlse = _inputs(seq)
    data = _mods(HEADS, seq)[name][1]
    vis = torch.ones(seq, seq, dtype=torch.bool).tril() if is_causal else None
    ref = attention_grads(q, k, v, dout, visible=vis, grad_lse=dlse, score_mod=data)
    plain = attention_grads(q, k, v, dout, visible=vis, grad_lse=dlse)
    scales = error_scales(q, k, v, dout, visible=vis, grad_lse=dlse, score_mod=data)
    got = {n: ring_impl.unshard([r[n] for r in results], layout=layout) for n in QUANTITIES}
    label = f"{name}, W={world}, {layout}, {rotate}, head_chunks={head_chunks}"
    assert_float64_results_match_oracle(label, got, ref, scales, world_size=world)
    for n in QUANTITIES:
        # the score_mod changed the result: a ring that ignored it would not pass the check above
        assert float((getattr(ref, n) - getattr(plain, n)).abs().max()) > 1e-3, (
            f"{name} does not change {n}"
        )


def test_math_op_backward_through_a_score_mod_is_autograd_of_its_forward() -> None:
    """The explicit backward (dS carried back by d score_mod / d s) equals float64 autograd of the
    op's own forward, for a descriptor with its own derivative and for a callable (autograd)."""
    from ring_impl.ops import MathOp
    from ring_impl.score_mods import ScoreModFn, SoftCap, block_scores

    op = MathOp()
    q, k, v, dout, dlse = _inputs(12, batch=1)
    for mod in (SoftCap(0.5), ScoreModFn(head_and_position_mod)):
        scores = block_scores(
            mod,
            batch=1,
            heads=(0, HEADS),
            q_pos=((3, 9), (20, 26)),
            kv_pos=((0, 12),),
            device=q.device,
        )
        qq, kk, vv = (t.clone().requires_grad_(True) for t in (q, k, v))
        out, lse = op.forward(qq, kk, vv, is_causal=False, scale=0.4, score_mod=scores)
        torch.autograd.backward([out, lse], [dout, dlse])
        dq, dk, dv = op.backward(
            dout,
            q,
            k,
            v,
            out.detach(),
            lse.detach(),
            is_causal=False,
            scale=0.4,
            grad_lse=dlse,
            score_mod=scores,
        )
        for got, want in ((dq, qq.grad), (dk, kk.grad), (dv, vv.grad)):
            assert torch.allclose(got, want, rtol=0, atol=1e-12), (
                type(mod).__name__,
                float((got - want).abs().max()),
            )


def test_alibi_slopes_are_the_papers() -> None:
    """Powers of two: 2^(-8 i / n); otherwise the largest power of two's and every other slope of
    the next (ALiBi's reference code)."""
    from ring_impl.score_mods import alibi_slopes

    assert torch.equal(
        alibi_slopes(8), torch.tensor([2.0**-i for i in range(1, 9)], dtype=torch.float64)
    )
    want6 = [2.0**-2, 2.0**-4, 2.0**-6, 2.0**-8, 2.0**-1, 2.0**-3]
    assert torch.allclose(
        alibi_slopes(6), torch.tensor(want6, dtype=torch.float64), rtol=1e-15, atol=0
    )


def test_auto_picks_an_op_that_takes_a_score_mod() -> None:
    from ring_impl.ops import resolve_op

    op = resolve_op("auto", torch.device("cpu"), torch.float32, 64, score_mod=True)
    assert op.capabilities.score_mod and op.name == "math"
    assert not resolve_op("auto", torch.device("cpu"), torch.float32, 64).capabilities.score_mod


def test_a_function_reading_device_tables_is_checked_and_probed_on_the_inputs_device() -> None:
    """A flex-style score_mod closes over tables on the inputs' device (flex attention's
    convention); evaluated on CPU positions it fails (CUDA tensor + CPU tensor), so its check
    and its cross-rank probe run on the call's device. A table on the meta device stands in for
    one on a GPU: it too refuses CPU operands."""
    from ring_impl.score_mods import ScoreModFn

    table = torch.zeros(64, device="meta")
    mod = ScoreModFn(lambda score, b, h, q, kv: score + table[kv] - table[q])
    sizes = dict(batch=1, heads=2, seq_q=8, seq_kv=8)
    assert mod.check(**sizes, device=torch.device("meta")) is None
    assert "cannot be evaluated" in (mod.check(**sizes) or "")  # (on the CPU: the mix fails)
    # the probe reaches the function on the device (meta values cannot be read: unprobed there,
    # but not for the device mismatch a CPU evaluation meets)
    seen: list[torch.device] = []
    probe = ScoreModFn(lambda score, b, h, q, kv: seen.append(score.device) or score + kv)
    probe.agreement_text(1, 2, 8, 8, torch.device("meta"))
    assert seen and all(d.type == "meta" for d in seen)


def test_descriptor_digests_tell_data_apart() -> None:
    """What the ranks compare changes with every piece of a descriptor's data."""
    from ring_impl.score_mods import Alibi, PostScaleBias, ScoreModFn, SoftCap

    dims = (1, 4, 16, 16)
    texts = [
        SoftCap(30.0),
        SoftCap(30.000001),
        Alibi(4),
        Alibi(torch.ones(4)),
        Alibi(torch.ones(4), symmetric=True),
        PostScaleBias(torch.zeros(1, 1, 16, 16)),
        PostScaleBias(torch.zeros(1, 1, 16, 16).index_fill(3, torch.tensor([9]), 1.0)),
        ScoreModFn(head_and_position_mod),
        ScoreModFn(lambda s, b, h, q, kv: s * 2),
    ]
    codes = [m.agreement_text(*dims) for m in texts]
    assert len(set(codes)) == len(codes), codes
    assert SoftCap(30.0).agreement_text(*dims) == SoftCap(30.0).agreement_text(*dims)


def _refused(ctx, kind):
    import ring_impl
    from ring_impl.score_mods import Alibi, SoftCap

    q = torch.randn(1, HEADS, 8, HEAD_DIM)
    k = v = torch.randn(1, HEADS_KV, 8, HEAD_DIM)
    kwargs = {"score_mod": SoftCap(20.0)}
    last = ctx.rank == ctx.world_size - 1
    if kind == "fused_op":
        kwargs["op"] = "cpu_flash"
    elif kind == "one_rank_only" and last:
        kwargs["score_mod"] = SoftCap(21.0)
    elif kind == "alibi_slopes" and last:
        kwargs["score_mod"] = Alibi(torch.ones(3))
    elif kind == "fn_fails" and last:
        kwargs["score_mod"] = lambda s, b, h, qi, ki: s + torch.zeros(4)[ki]  # index out of range
    elif kind == "halo":
        kwargs["exchange"] = "halo"
        kwargs["mask"] = ring_impl.masks.SlidingWindow(2)
    elif kind == "gather":
        kwargs["exchange"] = "gather"
        kwargs["mask"] = ring_impl.masks.SlidingWindow(2)
    elif kind == "not_callable":
        kwargs["score_mod"] = 3.0
    try:
        ring_impl.ring_attention(q, k, v, group=ctx.group, **kwargs)
    except Exception as exc:  # the message is the result
        return f"{type(exc).__name__}: {exc}"
    return "no error"


@pytest.mark.parametrize(
    "kind,pattern,culprit",
    [
        ("fused_op", r"'cpu_flash' cannot apply a score_mod .* op='auto' or op='math'", None),
        ("one_rank_only", r"ranks disagree on mask \(.*score_mod digest", None),
        ("alibi_slopes", r"Alibi.slopes must have shape \(4,\)", 1),
        ("fn_fails", r"score_mod .* cannot be evaluated on the global positions \(IndexError", 1),
        ("halo", r"exchange='halo' but the halo exchange takes no score_mod", None),
        ("gather", r"exchange='gather' but the sparse gather takes no score_mod", None),
        ("not_callable", r"score_mod must be a callable", None),
    ],
)
def test_bad_score_mods_raise_on_every_rank(ring, kind, pattern, culprit) -> None:
    """The rank with the bad argument names it, the others raise naming that rank; none hangs."""
    messages = ring.rank_pool(2).run(_refused, kind, timeout=120.0)
    for rank, msg in enumerate(messages):
        want = pattern if culprit in (None, rank) else rf"rank {culprit} rejected their input"
        assert msg.startswith("InputError"), f"rank {rank}: {msg}"
        assert re.search(want, msg), f"rank {rank}: {msg}"


def _compiled(ctx, fullgraph):
    import ring_impl
    from ring_impl.score_mods import SoftCap

    torch._dynamo.reset()
    q, k, v, _, _ = (ring_impl.shard(t, ctx.world_size, ctx.rank) for t in _inputs(16, batch=1))

    def fn(q, k, v):
        return (
            ring_impl.ring_attention(
                q, k, v, group=ctx.group, is_causal=True, score_mod=SoftCap(0.5)
            )
            * 2
        )

    eager = fn(q, k, v)
    try:
        compiled = torch.compile(fn, backend="aot_eager", fullgraph=fullgraph)(q, k, v)
    except Exception as exc:
        return f"{type(exc).__name__}: {exc}"
    return float((compiled - eager).abs().max())


def test_compiled_call_with_a_score_mod_runs_eagerly(ring) -> None:
    """Under torch.compile a score_mod call is a graph break: it runs eagerly, with the eager
    result; with fullgraph=True dynamo refuses it, naming the reason (SCORE_MODS_RUN_EAGERLY)."""
    diffs = ring.rank_pool(2).run(_compiled, False, timeout=120.0)
    assert all(d == 0.0 for d in diffs), diffs
    errors = ring.rank_pool(2).run(_compiled, True, timeout=120.0)
    for msg in errors:
        assert isinstance(msg, str) and "score_mod=...) runs eagerly inside torch.compile" in msg, (
            msg
        )


def test_softcap_derivative() -> None:
    from ring_impl.score_mods import SoftCap

    s = torch.linspace(-5, 5, 11, dtype=torch.float64, requires_grad=True)
    cap = SoftCap(1.5)
    (d,) = torch.autograd.grad(cap.apply(s, None, None, None, None).sum(), s)
    assert torch.allclose(cap.derivative(s.detach(), None, None, None, None), d, atol=1e-15)
    assert math.isclose(float(cap.apply(torch.tensor(1e9), None, None, None, None)), 1.5)


def _strategy_run(ctx, strategy, mesh_shape, layout, name, is_causal):
    from reference.strategies import shard

    seq = 32
    group = (
        ctx.device_mesh(mesh_shape[::-1], ("ring", "ulysses"))
        if strategy == "hybrid"
        else ctx.group
    )
    mod = _mods(HEADS, seq)[name][0]
    q, k, v, dout, dlse = (shard(t, strategy, layout, mesh_shape, ctx.rank) for t in _inputs(seq))
    options = dict(strategy=strategy, is_causal=is_causal, layout=layout)
    return _scored(q, k, v, dout, dlse, mod, group=group, **options)


@pytest.mark.parametrize(
    "strategy,mesh_shape,layout,name,is_causal",
    [
        ("ulysses", (4, 1), "head_tail", "alibi", True),  # each rank's heads: slice rank of 4
        ("ulysses", (4, 1), "contiguous", "callable", False),
        ("hybrid", (2, 2), "head_tail", "callable", True),
        ("hybrid", (2, 2), "contiguous", "bias", False),
    ],
)
def test_strategies_with_a_score_mod_match_the_oracle(
    ring, strategy, mesh_shape, layout, name, is_causal
) -> None:
    """Ulysses (the gathered sequence's global positions, each rank's global head indices; 2
    key/value heads replicated over 4 ranks) and the hybrid (its ring's blocks) in float64."""
    from reference import attention_grads
    from reference.budget import assert_close, error_scales
    from reference.strategies import unshard

    seq = 32
    results = ring.rank_pool(4).run(
        _strategy_run, strategy, mesh_shape, layout, name, is_causal, timeout=120.0
    )
    q, k, v, dout, dlse = _inputs(seq)
    data = _mods(HEADS, seq)[name][1]
    vis = torch.ones(seq, seq, dtype=torch.bool).tril() if is_causal else None
    ref = attention_grads(q, k, v, dout, visible=vis, grad_lse=dlse, score_mod=data)
    scales = error_scales(q, k, v, dout, visible=vis, grad_lse=dlse, score_mod=data)
    for n in ("out", "lse", "dq", "dk", "dv"):
        got = unshard([r[n] for r in results], strategy, layout, mesh_shape)
        want = getattr(ref, n)
        assert_close(
            f"{n} [{strategy} {mesh_shape}, {layout}, {name}]",
            got,
            want,
            want,
            world_size=4,
            dtype=torch.float64,
            result_dtype=torch.float64,
            scales=scales[n],
        )
