"""A value head dim other than query's and key's (``d_v != d_qk``: multi-head latent attention).

value ``(batch, heads_kv, seq_kv_local, head_dim_v)`` gives an output ``(batch, heads,
seq_q_local, head_dim_v)``, dV of value's shape and dQ/dK of query's and key's. Judged against the
float64 oracle (reference.attention, which takes any value head dim) by the numerics policy on
every exchange: the ring (every rotation, both layouts, causal, GQA, head_chunks, a loss through
the LSE, W = 1, 2, 4), a mask on the ring, the halo exchange, the sparse gather, Ulysses and the
hybrid; each rank's collectives equal ``collective_schedule(..., head_dim_v=)`` and the ring's
key/value bytes are those of key and value as they are (no padding travels). The kernels that
declare ``OpCapabilities.value_head_dim`` take it, ``op="auto"`` picks one, an op that cannot is
refused on every rank with what to do, and ranks that disagree on value's head dim raise together.
"""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from reference import attention_grads
from reference.budget import error_scales
from reference.masks import visibility
from tests.ring_impl.oracle import QUANTITIES, assert_results_match_oracle
from tests.ring_impl.rank_results import backward, leaves, local_results

BATCH, HEADS = 1, 4
D_QK, D_V = 12, 20  # value's head dim wider than query's and key's...
D_QK_WIDE, D_V_NARROW = 24, 8  # ...and narrower (DeepSeek: 192 and 128)
SHARD = 8


def _inputs(seq: int, dtype: torch.dtype, heads_kv: int, d: int, dv: int, seed: int = 0):
    """Global (query, key, value, grad_out, grad_lse), drawn in float64 and rounded to ``dtype``."""
    gen = torch.Generator().manual_seed(seed * 1000 + seq * 7 + heads_kv * 3 + d + dv)

    def draw(*shape):
        return torch.randn(*shape, generator=gen, dtype=torch.float64).to(dtype)

    q, k, v = (
        draw(BATCH, HEADS, seq, d),
        draw(BATCH, heads_kv, seq, d),
        draw(BATCH, heads_kv, seq, dv),
    )
    dout = draw(BATCH, HEADS, seq, dv)
    glse = (
        torch.randn(BATCH, HEADS, seq, generator=gen, dtype=torch.float64).float().double()
    )  # exact in float32
    return q, k, v, dout, glse


# ---------------------------------------------------------------------------- the kernels


def test_kernels_declare_a_value_head_dim_and_auto_picks_one() -> None:
    from ring_impl.ops import get_op, resolve_op

    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    takes = {
        name: get_op(name).capabilities.value_head_dim
        for name in (
            "math",
            "flex",
            "cpu_flash",
            "cpu_flash_varlen_layout",
            "cuda_flash",
            "cuda_flash_varlen",
            "cudnn",
            "cuda_efficient",
            "cuda_efficient_masked",
        )
    }
    assert takes == {
        "math": True,
        "flex": True,
        "cpu_flash": False,
        "cpu_flash_varlen_layout": False,
        "cuda_flash": False,
        "cuda_flash_varlen": False,
        "cudnn": False,
        "cuda_efficient": True,
        "cuda_efficient_masked": True,
    }
    why = get_op("cpu_flash").capabilities.unsupported(cpu, torch.float32, 16, head_dim_v=24)
    assert why is not None and "value head_dim 24 differs from query/key head_dim 16" in why
    assert (
        get_op("cpu_flash").capabilities.unsupported(cpu, torch.float32, 16, head_dim_v=16) is None
    )
    # a kernel that takes it still bounds value's head dim by its own limits
    from ring_impl.ops import OpCapabilities

    bounded = OpCapabilities(
        devices=frozenset({"cuda"}), head_dims=(8, 256), head_dim_multiple=8, value_head_dim=True
    )
    assert bounded.unsupported(cuda, torch.float32, 64, head_dim_v=32) is None
    assert "value head_dim 12 outside [8, 256] or not a multiple of 8" in bounded.unsupported(
        cuda, torch.float32, 64, head_dim_v=12
    )
    assert resolve_op("auto", cpu, torch.float32, 16, head_dim_v=24).name == "math"
    assert resolve_op("auto", cpu, torch.float32, 16, head_dim_v=16).name == "cpu_flash"
    for masked in (False, True):
        assert (
            resolve_op("auto", cuda, torch.bfloat16, 64, head_dim_v=32, masked=masked).name
            == "cuda_efficient"
        )
    assert resolve_op("auto", cuda, torch.bfloat16, 64, head_dim_v=64).name == "cuda_flash"


@pytest.mark.parametrize("name", ["math", "flex"])
@pytest.mark.parametrize("d,dv", [(D_QK, D_V), (D_QK_WIDE, D_V_NARROW)])
def test_kernels_that_declare_it_match_the_oracle(name: str, d: int, dv: int) -> None:
    from ring_impl.ops import call_backward, call_forward, default_scale, get_op

    op, scale = get_op(name), default_scale(d)
    for dtype in (torch.float64, torch.float32):
        q, k, v, dout, glse = _inputs(16, dtype, 2, d, dv)
        out, lse = call_forward(op, q, k, v, is_causal=True, scale=scale)
        assert out.shape == (BATCH, HEADS, 16, dv) and out.dtype == dtype
        ref = attention_grads(
            *(t.double() for t in (q, k, v, dout)),
            scale=scale,
            grad_lse=glse,
            visible=torch.ones(16, 16, dtype=torch.bool).tril(),
        )
        dq, dk, dv_ = call_backward(
            op,
            dout,
            q,
            k,
            v,
            out,
            lse.to(torch.float64 if dtype == torch.float64 else torch.float32),
            is_causal=True,
            scale=scale,
            grad_lse=glse.to(lse.dtype),
        )
        assert (dq.shape, dk.shape, dv_.shape) == (q.shape, k.shape, v.shape)
        tol = 1e-12 if dtype == torch.float64 else 2e-5
        for got, want in (
            (out, ref.out),
            (lse, ref.lse),
            (dq, ref.dq),
            (dk, ref.dk),
            (dv_, ref.dv),
        ):
            assert (got.double() - want).abs().max() <= tol * max(1.0, want.abs().max()), name


def test_the_lse_gradient_padding_goes_on_values_side() -> None:
    """A kernel that takes value's head dim but no LSE gradient gets the gradient as extra columns
    of value, out and grad_out only (ring_impl.ops.calls._with_lse_grad): its dQ/dK/dV are those
    of a kernel that takes the LSE gradient itself."""
    from ring_impl.ops import MathOp, call_backward, call_forward, default_scale

    class NoLseGradMath(MathOp):
        name = "math_without_lse_grad"
        capabilities = replace(MathOp.capabilities, lse_grad=False)

        def backward(self, grad_out, query, key, value, out, lse, **options):
            assert query.shape[-1] == key.shape[-1] == D_QK, (
                "query and key are padded only to match value"
            )
            assert value.shape[-1] == out.shape[-1] == grad_out.shape[-1] > D_V
            return super().backward(grad_out, query, key, value, out, lse, **options)

    q, k, v, dout, glse = _inputs(16, torch.float64, 4, D_QK, D_V)
    scale = default_scale(D_QK)
    out, lse = call_forward(MathOp(), q, k, v, is_causal=False, scale=scale)
    want = call_backward(
        MathOp(), dout, q, k, v, out, lse, is_causal=False, scale=scale, grad_lse=glse
    )
    got = call_backward(
        NoLseGradMath(), dout, q, k, v, out, lse, is_causal=False, scale=scale, grad_lse=glse
    )
    for g, w in zip(got, want, strict=True):
        assert g.shape == w.shape
        torch.testing.assert_close(g, w, rtol=1e-12, atol=1e-12)


# ---------------------------------------------------------------------------- every exchange


def _run(ctx, dtype, d, dv, heads_kv, kwargs, lse_grad, mask_spec=None, mesh=None, seed=0):
    import ring_impl
    from harness.accounting import CollectiveLog
    from ring_impl.masks import from_spec

    w, r = ctx.world_size, ctx.rank
    kwargs = dict(kwargs)
    layout = kwargs.get("layout", "contiguous")
    strategy = kwargs.get("strategy", "ring")
    q, k, v, dout, glse = _inputs(SHARD * w, dtype, heads_kv, d, dv, seed)
    if strategy == "ring":
        q, k, v, dout, glse = (
            ring_impl.shard(t, w, r, layout=layout) for t in (q, k, v, dout, glse)
        )
        group = ctx.group
    else:
        from reference.strategies import shard as strategy_shard

        u, rows = mesh
        group = (
            ctx.group if strategy == "ulysses" else ctx.device_mesh((rows, u), ("ring", "ulysses"))
        )
        q, k, v, dout = (strategy_shard(t, strategy, layout, mesh, r) for t in (q, k, v, dout))
        glse = strategy_shard(glse.unsqueeze(-1), strategy, layout, mesh, r).squeeze(-1)
    if mask_spec is not None:
        kwargs["mask"] = from_spec(mask_spec)
    q, k, v = leaves(q, k, v)
    with CollectiveLog() as log:
        with log.phase("forward"):
            out, lse = ring_impl.ring_attention(q, k, v, group=group, return_lse=True, **kwargs)
        with log.phase("backward"):
            backward(out, lse, dout, glse if lse_grad else None)
    shapes = [tuple(t.shape) for t in (out, q.grad, k.grad, v.grad)]
    return local_results(out, lse, q, k, v, log=log.summary(), shapes=shapes)


def _unshard(parts, kwargs, world, mesh):
    import ring_impl

    strategy = kwargs.get("strategy", "ring")
    if strategy == "ring":
        return ring_impl.unshard(parts, layout=kwargs.get("layout", "contiguous"))
    from reference.strategies import unshard as strategy_unshard

    layout = kwargs.get("layout", "contiguous")
    if parts[0].dim() == 3:  # the LSE
        return strategy_unshard([p.unsqueeze(-1) for p in parts], strategy, layout, mesh).squeeze(
            -1
        )
    return strategy_unshard(parts, strategy, layout, mesh)


def _judge(
    results, dtype, d, dv, heads_kv, kwargs, lse_grad, mask_spec=None, mesh=None, seed=0, label=""
):
    from conformance.baseline import single_device_baseline

    world = len(results)
    seq = SHARD * world
    q, k, v, dout, glse = _inputs(seq, dtype, heads_kv, d, dv, seed)
    glse = glse if lse_grad else None
    spec = mask_spec
    if kwargs.get("is_causal"):
        spec = (
            {"kind": "causal"}
            if spec is None
            else {"kind": "and", "masks": [{"kind": "causal"}, spec]}
        )
    vis = None if spec is None else visibility(spec, seq, seq, batch=BATCH, heads=HEADS)
    ref = attention_grads(q, k, v, dout, visible=vis, grad_lse=glse)
    scales = error_scales(q, k, v, dout, visible=vis, grad_lse=glse, input_dtype=dtype)
    # B: the kernel every call here runs (op="auto" on CPU: the math op) on one device
    base = single_device_baseline(q, k, v, dout, op_spec="auto", visible=vis, grad_lse=glse)
    for rank, r in enumerate(results):
        sq = seq // world
        assert r["shapes"] == [
            (BATCH, HEADS, sq, dv),
            (BATCH, HEADS, sq, d),
            (BATCH, heads_kv, sq, d),
            (BATCH, heads_kv, sq, dv),
        ], f"rank {rank}: out, dq, dk, dv shapes {r['shapes']} [{label}]"
    got = {n: _unshard([r[n] for r in results], kwargs, world, mesh) for n in QUANTITIES}
    assert_results_match_oracle(label, got, ref, scales, world_size=world, dtype=dtype, base=base)


def _schedule(world, rotate, dtype, d, dv, heads_kv, **kwargs) -> dict:
    """The declared schedule of a case's shards (``kwargs``: the mask, strategy, ...)."""
    import ring_impl

    return ring_impl.collective_schedule(
        world,
        rotate,
        batch=BATCH,
        heads_kv=heads_kv,
        seq_kv=SHARD,
        head_dim=d,
        dtype=dtype,
        head_dim_v=dv,
        **kwargs,
    )


def _assert_issued_as_declared(results, declared, label: str) -> None:
    """Each rank's collectives (its ``log``) are ``declared(rank)``'s, less the empty kinds."""
    __tracebackhide__ = True
    for rank, r in enumerate(results):
        want = declared(rank)
        assert r["log"] == {p: k for p, k in want.items() if k}, (
            f"rank {rank}: {r['log']} != {want} [{label}]"
        )


_RING_CASES = []
for _w in (1, 2, 4):
    for _i, (_rotate, _layout, _causal) in enumerate(
        (
            ("allgather", "contiguous", False),
            ("alltoall", "head_tail", True),
            ("p2p", "contiguous", True),
            ("p2p", "head_tail", False),
            ("allgather", "head_tail", True),
            ("alltoall", "contiguous", False),
        )
    ):
        _dtype = (torch.float64, torch.float32)[(_i + _w) % 2]
        _d, _dv = ((D_QK, D_V), (D_QK_WIDE, D_V_NARROW))[_i % 2]
        _hkv = (4, 2, 1)[_i % 3]
        _chunks = 2 if _hkv >= 2 and _i % 2 == 0 else 1
        _lse = _i % 3 != 1
        _RING_CASES.append(
            pytest.param(
                _w,
                _rotate,
                _layout,
                _causal,
                _dtype,
                _d,
                _dv,
                _hkv,
                _chunks,
                _lse,
                id=(
                    f"W{_w}-{_rotate}-{_layout}-{'causal' if _causal else 'full'}-{str(_dtype)[6:]}"
                    f"-d{_d}-dv{_dv}-hkv{_hkv}-chunks{_chunks}{'-lsegrad' if _lse else ''}"
                ),
            )
        )


@pytest.mark.parametrize(
    "world,rotate,layout,causal,dtype,d,dv,heads_kv,chunks,lse_grad", _RING_CASES
)
def test_ring_with_a_value_head_dim_matches_the_oracle_and_its_schedule(
    ring, world, rotate, layout, causal, dtype, d, dv, heads_kv, chunks, lse_grad
) -> None:

    kwargs = {"rotate_method": rotate, "layout": layout, "is_causal": causal, "head_chunks": chunks}
    results = ring.rank_pool(world).run(
        _run, dtype, d, dv, heads_kv, kwargs, lse_grad, timeout=120.0
    )
    label = (
        f"ring W={world} {rotate} {layout} causal={causal} {dtype} d={d} dv={dv} hkv={heads_kv} "
        f"chunks={chunks}"
    )
    _judge(results, dtype, d, dv, heads_kv, kwargs, lse_grad, label=label)
    declared = _schedule(world, rotate, dtype, d, dv, heads_kv, head_chunks=chunks)
    _assert_issued_as_declared(results, lambda rank: declared, label)
    if (
        world > 1
    ):  # the forward moves key and value as they are: (d + dv) per row, no padding to the wider
        kv_bytes = BATCH * heads_kv * SHARD * (d + dv) * dtype.itemsize
        moved = {
            "allgather": kv_bytes,
            "alltoall": (world - 1) * kv_bytes,
            "p2p": (world - 1) * kv_bytes,
        }[rotate]
        kind = {"allgather": "all_gather", "alltoall": "all_to_all", "p2p": "send"}[rotate]
        assert results[0]["log"]["forward"][kind]["bytes"] == moved, (results[0]["log"], label)


def _docs(seq: int) -> dict:
    lengths = [5, 1, seq // 3, 2]
    ids: list[int] = []
    for i, n in enumerate(lengths):
        ids += [i] * n
    ids += [len(lengths)] * max(0, seq - 3 - len(ids))
    return {"kind": "document", "doc_ids": (ids + [-1] * seq)[:seq], "causal": True}


@pytest.mark.parametrize(
    "path,world", [("ring", 2), ("ring", 4), ("halo", 2), ("halo", 4), ("sparse", 2), ("sparse", 4)]
)
def test_masked_paths_with_a_value_head_dim_match_the_oracle_and_their_schedule(
    ring, path, world
) -> None:
    from ring_impl.masks import from_spec

    seq = SHARD * world
    window = {"kind": "sliding_window", "left": 3, "right": 2}
    spec = {
        "ring": _docs(seq),
        "halo": {"kind": "and", "masks": [_docs(seq), window]},
        "sparse": _docs(seq),
    }[path]
    kwargs = {
        "rotate_method": "alltoall",
        "layout": "head_tail" if path == "sparse" else "contiguous",
        "halo": False if path == "ring" else None,
        "sparse_kv": path == "sparse",
    }
    dtype, d, dv, hkv = (
        (torch.float64, D_QK, D_V, 2) if world == 2 else (torch.float32, D_QK_WIDE, D_V_NARROW, 4)
    )
    results = ring.rank_pool(world).run(_run, dtype, d, dv, hkv, kwargs, True, spec, timeout=120.0)
    label = f"{path} W={world} {dtype} d={d} dv={dv}"
    _judge(results, dtype, d, dv, hkv, kwargs, True, spec, label=label)
    masked = {
        "mask": from_spec(spec),
        "layout": kwargs["layout"],
        "halo": kwargs["halo"],
        "sparse_kv": path == "sparse",
    }
    _assert_issued_as_declared(
        results,
        lambda rank: _schedule(
            world, "alltoall", dtype, d, dv, hkv, rank=rank, heads=HEADS, seq_q=SHARD, **masked
        ),
        label,
    )
    if path == "halo":  # no block around the ring
        assert all(set(r["log"]["forward"]) <= {"all_reduce", "send", "recv"} for r in results)


@pytest.mark.parametrize(
    "strategy,mesh,heads_kv",
    [("ulysses", (2, 1), 1), ("ulysses", (4, 1), 4), ("hybrid", (2, 2), 2)],
)
def test_head_parallel_strategies_with_a_value_head_dim(ring, strategy, mesh, heads_kv) -> None:

    world = mesh[0] * mesh[1]
    kwargs = {
        "strategy": strategy,
        "is_causal": True,
        "layout": "head_tail",
        "rotate_method": "p2p",
    }
    results = ring.rank_pool(world).run(
        _run, torch.float64, D_QK, D_V, heads_kv, kwargs, True, None, mesh, timeout=120.0
    )
    label = f"{strategy} mesh={mesh} hkv={heads_kv}"
    _judge(results, torch.float64, D_QK, D_V, heads_kv, kwargs, True, mesh=mesh, label=label)
    declared = _schedule(
        world,
        "p2p",
        torch.float64,
        D_QK,
        D_V,
        heads_kv,
        strategy=strategy,
        mesh_shape=mesh,
        heads=HEADS,
        seq_q=SHARD,
        return_lse=True,
    )
    _assert_issued_as_declared(results, lambda rank: declared, label)


# ---------------------------------------------------------------------------- refusals


def _refused(ctx, case: str):
    import ring_impl

    w, r = ctx.world_size, ctx.rank
    q, k = torch.randn(1, 2, 4, 8), torch.randn(1, 2, 4, 8)
    v = torch.randn(1, 2, 4, 16)
    kwargs = {}
    if case == "op_cannot":
        kwargs["op"] = "cpu_flash"
    elif case == "ranks_disagree":
        v = torch.randn(1, 2, 4, 16 if r == w - 1 else 12)
    elif case == "value_length":
        v = torch.randn(1, 2, 3 if r == 0 else 4, 16)
    try:
        ring_impl.ring_attention(q, k, v, group=ctx.group, **kwargs)
    except ring_impl.InputError as exc:
        return str(exc)
    return None


@pytest.mark.parametrize(
    "case,words",
    [
        ("op_cannot", "value head_dim 16 differs from query/key head_dim 8"),
        ("ranks_disagree", "head_dim_v"),
        ("value_length", "key and value shapes differ before the head dim"),
    ],
)
def test_what_cannot_run_is_refused_on_every_rank(rank_pool, case: str, words: str) -> None:
    errors = rank_pool(2).run(_refused, case, timeout=60.0)
    assert all(e is not None for e in errors), f"{case}: a rank did not raise: {errors}"
    assert any(words in e for e in errors), errors
    if case == "op_cannot":
        assert all("op='auto' picks one that takes value's head dim" in e for e in errors), errors


def test_schedule_counts_value_bytes_with_its_own_head_dim() -> None:
    import ring_impl

    kw = dict(batch=2, heads_kv=2, seq_kv=8, dtype=torch.bfloat16)
    mla = ring_impl.collective_schedule(4, "alltoall", head_dim=24, head_dim_v=8, **kw)
    same = ring_impl.collective_schedule(4, "alltoall", head_dim=16, **kw)
    assert mla == same  # 24 + 8 columns travel as 16 + 16 do
    kv = 2 * 2 * 8 * (24 + 8) * 2
    dkv = 2 * 2 * 8 * (24 + 8) * 4
    assert mla["forward"]["all_to_all"]["bytes"] == 3 * kv
    assert mla["backward"]["all_to_all"]["bytes"] == 3 * (kv + dkv)
    assert ring_impl.collective_schedule(4, "alltoall", head_dim=24, **kw) != mla
    assert ring_impl.collective_schedule(4, "alltoall", head_dim=16, head_dim_v=None, **kw) == same
    with pytest.raises(ValueError, match="head_dim_v must be an int >= 1"):
        ring_impl.collective_schedule(4, "alltoall", head_dim=16, head_dim_v=0, **kw)
    # Ulysses: value and output columns at value's head dim
    u = ring_impl.collective_schedule(
        2,
        "alltoall",
        head_dim=24,
        head_dim_v=8,
        strategy="ulysses",
        heads=4,
        seq_q=8,
        return_lse=False,
        **kw,
    )
    qkv = 2 * ((4 * 8 + 2 * 8) * 24 + 2 * 8 * 8) * 2
    out = 2 * 4 * 8 * 8 * 2
    assert u["forward"]["all_to_all"]["bytes"] == qkv + out


# ---------------------------------------------------------------------------- torch.compile


def _compiled_vs_eager(ctx, masked: bool, strategy: str):
    import ring_impl
    from ring_impl.masks import SlidingWindow

    torch._dynamo.reset()
    w, r = ctx.world_size, ctx.rank
    q, k, v, dout, _ = _inputs(SHARD * w, torch.float64, 2, D_QK_WIDE, D_V_NARROW, seed=5)
    q, k, v, dout = (ring_impl.shard(t, w, r) for t in (q, k, v, dout))
    kwargs = {
        "group": ctx.group,
        "is_causal": True,
        "rotate_method": "alltoall",
        "strategy": strategy,
    }
    if masked:
        kwargs["mask"] = SlidingWindow(5, 0)
        if strategy == "ring":
            kwargs["halo"] = False  # the ring's masked custom op, not the halo's

    def attention(q, k, v):
        return ring_impl.ring_attention(q, k, v, **kwargs)

    grads = []
    for fn in (torch.compile(attention, backend="aot_eager", fullgraph=True), attention):
        leaves = [t.detach().clone().requires_grad_(True) for t in (q, k, v)]
        out = fn(*leaves)
        out.backward(dout)
        grads.append([out.detach(), *(t.grad for t in leaves)])
    return grads


@pytest.mark.parametrize("masked,strategy", [(False, "ring"), (True, "ring"), (True, "ulysses")])
def test_compiled_calls_with_a_value_head_dim_equal_eager(ring, masked, strategy) -> None:
    """fullgraph=True: the ring's autograd Function, the masked ring's custom op (whose fake
    output takes value's head dim) and Ulysses give eager's output and gradients."""
    for rank, (compiled, eager) in enumerate(
        ring.rank_pool(2).run(_compiled_vs_eager, masked, strategy, timeout=300.0)
    ):
        assert compiled[0].shape == (BATCH, HEADS, SHARD, D_V_NARROW), compiled[0].shape
        for name, c, e in zip(("out", "dq", "dk", "dv"), compiled, eager, strict=True):
            assert c.shape == e.shape, (name, c.shape, e.shape)
            torch.testing.assert_close(
                c, e, rtol=1e-12, atol=1e-12, msg=lambda m, n=name, r=rank: f"{n}, rank {r}: {m}"
            )
