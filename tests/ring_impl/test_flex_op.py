"""The flex op (flex attention's forward, the math op's backward) against the float64 oracle:
out, LSE and gradients through ``call_forward`` / ``call_backward``, causal or not, bool masks
per head and broadcast, GQA, the LSE's gradient, rows that see nothing, torch.compile without a
graph break; and the ring with ``op="flex"`` and a mask."""

from __future__ import annotations

import pytest
import torch

from reference import attention_grads
from reference.budget import assert_close, error_scales
from ring_impl import ops
from ring_impl.numerics.lse import normalize_lse
from tests.ring_impl.oracle import assert_results_match_oracle, unshard_results
from tests.ring_impl.rank_results import seeded_inputs

BATCH, HEADS, SEQ_Q, SEQ_K, HEAD_DIM = 2, 4, 6, 6, 8


def _inputs(
    heads_kv: int,
    seq_q: int = SEQ_Q,
    seq_k: int = SEQ_K,
    dtype: torch.dtype = torch.float64,
    seed: int = 0,
):
    """query (b, h, sq, d), key/value (b, hkv, sk, d),
    grad_out (b, h, sq, d), grad_lse (b, h, sq)."""
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(BATCH, HEADS, seq_q, HEAD_DIM, generator=gen, dtype=torch.float64).to(dtype)
    k, v = (
        torch.randn(BATCH, heads_kv, seq_k, HEAD_DIM, generator=gen, dtype=torch.float64).to(dtype)
        for _ in range(2)
    )
    dout = torch.randn(BATCH, HEADS, seq_q, HEAD_DIM, generator=gen, dtype=torch.float64).to(dtype)
    glse = torch.randn(BATCH, HEADS, seq_q, generator=gen, dtype=torch.float64)
    return q, k, v, dout, glse


def _mask(kind: str, seq_q: int, seq_k: int, seed: int = 1) -> torch.Tensor | None:
    """A bool visibility mask (True: the query sees the key) in the layouts the ring passes."""
    gen = torch.Generator().manual_seed(seed)
    if kind == "none":
        return None
    shape = {
        "per_head": (BATCH, HEADS, seq_q, seq_k),
        "per_batch": (BATCH, 1, seq_q, seq_k),
        "broadcast": (1, 1, seq_q, seq_k),
        "2d": (seq_q, seq_k),
    }[kind]
    m = torch.rand(shape, generator=gen) < 0.6
    m[..., 0] = True  # every row sees a key here (rows that see nothing: their own test)
    return m


def _run_op(q, k, v, dout, mask, *, is_causal: bool, grad_lse=None, scale: float = 0.3):
    """The flex op as the ring calls a block: forward, then backward with the caller's fix-up of
    rows that see nothing (LSE 0 instead of -inf, zero output and LSE gradients)."""
    op = ops.get_op("flex")
    visible = None if mask is None else (mask if mask.dim() == 4 else mask.view(1, 1, *mask.shape))
    out, raw = ops.call_forward(op, q, k, v, is_causal=is_causal, scale=scale, visible=visible)
    lse = normalize_lse(
        raw, batch=q.shape[0], heads=q.shape[1], seq_q=q.shape[2], layout=op.capabilities.lse_layout
    )
    dead = torch.isneginf(lse)
    lse_in = lse.masked_fill(dead, 0.0)
    dout = dout.masked_fill(dead.unsqueeze(-1), 0.0)
    glse = None if grad_lse is None else grad_lse.masked_fill(dead, 0.0)
    grads = ops.call_backward(
        op,
        dout,
        q,
        k,
        v,
        out,
        lse_in,
        is_causal=is_causal,
        scale=scale,
        grad_lse=glse,
        visible=visible,
    )
    return out, lse, *grads


def _oracle(q, k, v, dout, mask, *, is_causal: bool, grad_lse=None, scale: float = 0.3):
    """reference.attention_grads with the same visibility (causal folded into the mask)."""
    sq, sk = q.shape[2], k.shape[2]
    vis = None if mask is None else (mask if mask.dim() == 4 else mask.view(1, 1, sq, sk))
    if is_causal:
        tril = torch.ones(sq, sk, dtype=torch.bool).tril().view(1, 1, sq, sk)
        vis = tril if vis is None else vis & tril
    return attention_grads(q, k, v, dout, visible=vis, scale=scale, grad_lse=grad_lse)


def _assert_float64(got, ref) -> None:
    for name, x, want in zip(
        ("out", "lse", "dq", "dk", "dv"), got, (ref.out, ref.lse, ref.dq, ref.dk, ref.dv)
    ):
        assert x.dtype == torch.float64, f"{name}: {x.dtype}, expected float64"
        assert x.shape == want.shape, (
            f"{name}: shape {tuple(x.shape)}, expected {tuple(want.shape)}"
        )
        torch.testing.assert_close(x, want, atol=1e-12, rtol=0, msg=lambda m, n=name: f"{n}: {m}")


@pytest.mark.parametrize("mask", ["none", "per_head", "per_batch", "broadcast", "2d"])
@pytest.mark.parametrize("is_causal", [False, True])
@pytest.mark.parametrize("heads_kv", [4, 2, 1])
def test_matches_float64_oracle(mask: str, is_causal: bool, heads_kv: int) -> None:
    q, k, v, dout, _ = _inputs(heads_kv)
    m = _mask(mask, SEQ_Q, SEQ_K)
    _assert_float64(
        _run_op(q, k, v, dout, m, is_causal=is_causal),
        _oracle(q, k, v, dout, m, is_causal=is_causal),
    )


@pytest.mark.parametrize("is_causal", [False, True])
def test_lse_gradient(is_causal: bool) -> None:
    q, k, v, dout, glse = _inputs(2)
    m = _mask("per_head", SEQ_Q, SEQ_K)
    got = _run_op(q, k, v, dout, m, is_causal=is_causal, grad_lse=glse)
    _assert_float64(got, _oracle(q, k, v, dout, m, is_causal=is_causal, grad_lse=glse))


@pytest.mark.parametrize(
    "seq_q,seq_k,is_causal", [(37, 53, False), (130, 130, True), (1, 200, False)]
)
def test_lengths_across_flex_tiles(seq_q: int, seq_k: int, is_causal: bool) -> None:
    """Rectangular masked blocks and lengths that are not multiples of flex's 128-wide tiles."""
    q, k, v, dout, glse = _inputs(2, seq_q, seq_k, seed=3)
    m = _mask("per_head", seq_q, seq_k)
    got = _run_op(q, k, v, dout, m, is_causal=is_causal, grad_lse=glse)
    _assert_float64(got, _oracle(q, k, v, dout, m, is_causal=is_causal, grad_lse=glse))


def test_rows_that_see_nothing_stay_out_of_the_others() -> None:
    """Rows whose mask is all False (one head only, one whole batch entry, the causal first row
    cut off): no NaN anywhere, out 0 and LSE -inf there, every other row and all gradients exact."""
    q, k, v, dout, glse = _inputs(2)
    m = _mask("per_head", SEQ_Q, SEQ_K)
    m[0, 1, 2] = False  # one row of one head
    m[1, :, 4] = False  # one row of every head
    m[:, 3, 0] = False  # with is_causal, row 0 of head 3 sees only key 0: nothing left
    got = _run_op(q, k, v, dout, m, is_causal=True, grad_lse=glse)
    ref = _oracle(q, k, v, dout, m, is_causal=True, grad_lse=glse)
    out, lse = got[:2]
    dead = torch.isneginf(ref.lse)
    assert int(dead.sum()) == 1 + HEADS + BATCH
    assert not any(t.isnan().any() for t in got), "NaN from rows that see nothing"
    assert torch.equal(torch.isneginf(lse), dead), "LSE -inf exactly where a row sees nothing"
    assert out[dead].abs().max() == 0
    _assert_float64(
        (out, lse.masked_fill(dead, 0.0), *got[2:]),
        ref._replace(lse=ref.lse.masked_fill(dead, 0.0)),
    )


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_low_precision_dtypes(dtype: torch.dtype) -> None:
    """out in the input dtype, LSE float32; forward judged by the numerics policy against an
    exact kernel rounded once to the output dtype."""
    q, k, v, dout, _ = _inputs(2, 40, 40, dtype=dtype, seed=5)
    m = _mask("per_head", 40, 40)
    out, lse, dq, dk, dv = _run_op(q, k, v, dout, m, is_causal=True)
    assert (out.dtype, lse.dtype) == (dtype, torch.float32)
    assert (dq.dtype, dk.dtype, dv.dtype) == (dtype, dtype, dtype)
    ref = _oracle(q, k, v, dout, m, is_causal=True)
    vis = m & torch.ones(40, 40, dtype=torch.bool).tril()
    scales = error_scales(q, k, v, dout, visible=vis, scale=0.3, input_dtype=dtype)
    for name, x, want, result_dtype in (
        ("out", out, ref.out, dtype),
        ("lse", lse, ref.lse, torch.float32),
    ):
        assert_close(
            f"{name} [flex, {dtype}]",
            x.double(),
            want,
            want.to(result_dtype),
            dtype=dtype,
            result_dtype=result_dtype,
            scales=scales[name],
        )


def test_capabilities_and_registration() -> None:
    op = ops.get_op("flex")
    assert isinstance(op, ops.FlexOp)
    caps = op.capabilities
    assert caps.gqa and caps.lse_grad and caps.masks and caps.lse_layout == "bhs"
    assert caps.unsupported(torch.device("cpu"), torch.float64, 8) is None
    assert "device 'cuda'" in caps.unsupported(torch.device("cuda"), torch.float32, 64)
    assert ops.resolve_op("auto", torch.device("cpu"), torch.float32, 64).name != "flex"


def test_inputs_that_require_grad() -> None:
    """The ring hands the op tensors that require grad; flex refuses those on CPU, the op not."""
    q, k, v, _, _ = _inputs(2)
    q.requires_grad_(True)
    out, lse = ops.get_op("flex").forward(q, k, v, is_causal=True, scale=0.3)
    assert not out.requires_grad and not lse.requires_grad


def test_compiles_whole() -> None:
    """torch.compile(fullgraph=True) of a masked causal call: no graph break, bitwise the eager
    result (flex runs as one opaque op inside the graph); inductor with the ring's inputs that
    require grad. About 1 s on a cold inductor cache: the graph has no kernel of its own."""
    q, k, v, _, _ = _inputs(2)
    q.requires_grad_(True)
    m = _mask("per_head", SEQ_Q, SEQ_K)
    op = ops.get_op("flex")

    def attend_aot(q, k, v, m):  # one function per backend: dynamo caches compiled frames by code
        return op.forward(q, k, v, is_causal=True, scale=0.3, attn_mask=m)

    def attend_inductor(q, k, v, m):
        return op.forward(q, k, v, is_causal=True, scale=0.3, attn_mask=m)

    want = attend_aot(q, k, v, m)
    for fn, backend in ((attend_aot, "aot_eager"), (attend_inductor, "inductor")):
        got = torch.compile(fn, backend=backend, fullgraph=True)(q, k, v, m)
        assert all(torch.equal(g, w) for g, w in zip(got, want)), backend


# ---------------------------------------------------------------- the ring with op="flex"

RING_HEADS, RING_HEADS_KV = 4, 2


def _ring_inputs(seq: int, dtype: torch.dtype):
    return seeded_inputs(seq, dtype, 1, RING_HEADS, RING_HEADS_KV, seq, HEAD_DIM, dout_last=True)


def _ring_run(ctx, spec, seq, dtype, layout, rotate):
    import ring_impl
    from ring_impl.masks import from_spec

    q, k, v, dout = (
        ring_impl.shard(t, ctx.world_size, ctx.rank, layout=layout)
        for t in _ring_inputs(seq, dtype)
    )
    q, k, v = (t.requires_grad_(True) for t in (q, k, v))
    out, lse = ring_impl.ring_attention(
        q,
        k,
        v,
        group=ctx.group,
        mask=from_spec(spec),
        layout=layout,
        rotate_method=rotate,
        op="flex",
        return_lse=True,
    )
    out.backward(dout)
    return {"out": out.detach(), "lse": lse.detach(), "dq": q.grad, "dk": k.grad, "dv": v.grad}


def _documents(seq: int) -> list[int]:
    """Uneven documents crossing the shard boundary, a one-token document, padding at the end."""
    ids = [0] * 5 + [1] + [2] * (seq // 3) + [3] * 2
    return (ids + [4] * (seq - 4 - len(ids)) + [-1] * 4)[:seq]


@pytest.mark.parametrize(
    "name,layout,rotate", [("documents", "head_tail", "alltoall"), ("window", "contiguous", "p2p")]
)
def test_ring_with_flex_op_matches_the_oracle(ring, name: str, layout: str, rotate: str) -> None:
    from reference.masks import visibility

    world, seq, dtype = 2, 48, torch.float64
    spec = {
        "documents": {"kind": "document", "doc_ids": _documents(seq), "causal": True},
        "window": {"kind": "sliding_window", "left": seq // 6, "right": 0},
    }[name]
    results = ring.rank_pool(world).run(_ring_run, spec, seq, dtype, layout, rotate, timeout=120.0)
    q, k, v, dout = _ring_inputs(seq, dtype)
    vis = visibility(spec, seq, seq, batch=1, heads=RING_HEADS)
    ref = attention_grads(q, k, v, dout, visible=vis)
    scales = error_scales(q, k, v, dout, visible=vis, input_dtype=dtype)
    got = unshard_results(results, layout)
    assert_results_match_oracle(
        f"flex, {name}, W={world}, {layout}, {rotate}",
        got,
        ref,
        scales,
        world_size=world,
        dtype=dtype,
    )
