"""ring_impl's public call: errors that say which rank has what (a backward on some ranks only
too), ranks outside the group, gradients of the inputs each rank asks for, gradients with
``create_graph=True``, the LSE's gradient, and NaN/inf in the inputs."""

from __future__ import annotations

import math

import pytest
import torch

from reference.attention import attention_grads
from reference.masks import visibility
from ring_impl import ring_attention, shard, unshard
from ring_impl.checks.inputs import SIGNATURE_FIELDS, disagreement
from ring_impl.masks import SlidingWindow
from ring_impl.numerics.nonfinite import poison_forward
from ring_impl.ops import call_backward, call_forward, get_op


def _raise_on_dtype_or_length(ctx, what: str) -> str:
    last = ctx.rank == ctx.world_size - 1
    dtype = torch.float64 if (what == "dtype" and last) else torch.float32
    seq = 10 if (what == "length" and last) else 8
    q, k, v = (torch.randn(1, 2, seq, 8, dtype=dtype) for _ in range(3))
    ring_attention(q, k, v, group=ctx.group)
    return "no error"


@pytest.mark.parametrize("what", ["dtype", "length"])
def test_disagreement_says_which_rank_has_what(rank_pool, what: str) -> None:
    outcomes = rank_pool(3).run_outcomes(_raise_on_dtype_or_length, what, timeout=30.0)
    messages = [o.exc_message for o in outcomes]
    assert all(not o.ok and o.exc_type.endswith("InputError") for o in outcomes), messages
    if what == "dtype":
        assert all("dtype (ranks 0-1 float32; rank 2 float64)" in m for m in messages), messages
        assert not any("pad" in m for m in messages), messages  # padding would not help
    else:
        assert all(
            "seq_q (ranks 0-1 8; rank 2 10)" in m and "pad the global sequence" in m
            for m in messages
        ), messages
        # every rank passed the same layout: its positions differ with the lengths alone
        assert not any("layout (" in m for m in messages), messages


def test_disagreement_table_in_words() -> None:
    from ring_impl.checks.inputs import layout_code, layout_names

    rows = [[0] * len(SIGNATURE_FIELDS) for _ in range(4)]
    for row in rows:
        row[SIGNATURE_FIELDS.index("layout")] = layout_code("contiguous", 4, 8, 8)
    rows[3][SIGNATURE_FIELDS.index("layout")] = layout_code("head_tail", 4, 8, 8)
    assert disagreement(rows, {}, layout_names(4, 8, 8)) == (
        "ranks disagree on layout (ranks 0-2 'contiguous'; rank 3 'head_tail'); every rank must "
        "pass shards of equal shape and the same options"
    )
    assert disagreement([rows[0], rows[0]], {}, {}) is None


def _backward_on_some_ranks(ctx, how: str, exchange: str) -> str:
    last = ctx.rank == ctx.world_size - 1
    q, k, v = (torch.randn(1, 2, 8, 8, dtype=torch.float64) for _ in range(3))
    if how == "requires_grad":  # the last rank's inputs are constants
        q, k, v = (t.requires_grad_(not last) for t in (q, k, v))
    else:  # the last rank runs under torch.no_grad()
        q.requires_grad_()
    with torch.set_grad_enabled(how == "requires_grad" or not last):
        out = ring_attention(q, k, v, group=ctx.group, exchange=exchange)
    if out.requires_grad:
        out.sum().backward()  # would wait for the last rank's share of the gradients forever
    return "ran"


@pytest.mark.parametrize("exchange", ["ring", "ulysses"])
@pytest.mark.parametrize("how", ["requires_grad", "no_grad"])
def test_ranks_that_disagree_on_running_a_backward_raise_together(
    rank_pool, how: str, exchange: str
) -> None:
    outcomes = rank_pool(2).run_outcomes(_backward_on_some_ranks, how, exchange, timeout=30.0)
    messages = [o.exc_message for o in outcomes]
    assert all(not o.ok and o.exc_type.endswith("InputError") for o in outcomes), messages
    assert all("backward (rank 0 True; rank 1 False)" in m for m in messages), messages
    assert all("torch.is_grad_enabled()" in m for m in messages), messages


def _some_inputs_need_grad(ctx, exchange: str) -> dict:
    """Rank 0 differentiates its query only, rank 1 its key and value only: both run a
    backward, and each gets the gradients it asked for."""
    gen = torch.Generator().manual_seed(4)
    q, k, v, do = (torch.randn(1, 2, 16, 8, generator=gen, dtype=torch.float64) for _ in range(4))
    w, r = ctx.world_size, ctx.rank
    wants = (True, False, False) if r == 0 else (False, True, True)
    leaves = [shard(t, w, r).requires_grad_(want) for t, want in zip((q, k, v), wants)]
    window = SlidingWindow(5, 0)  # the halo exchange serves it too
    out = ring_attention(*leaves, group=ctx.group, mask=window, exchange=exchange)
    (out * shard(do, w, r)).sum().backward()
    return {name: t.grad for name, t in zip(("dq", "dk", "dv"), leaves)}


@pytest.mark.parametrize("exchange", ["ring", "halo", "ulysses"])
def test_ranks_that_differentiate_different_inputs_get_their_gradients(
    rank_pool, exchange: str
) -> None:
    results = rank_pool(2).run(_some_inputs_need_grad, exchange, timeout=60.0)
    gen = torch.Generator().manual_seed(4)
    q, k, v, do = (torch.randn(1, 2, 16, 8, generator=gen, dtype=torch.float64) for _ in range(4))
    window = visibility({"kind": "sliding_window", "left": 5, "right": 0}, 16, 16)
    ref = attention_grads(q, k, v, do, visible=window)
    assert results[0]["dk"] is None and results[1]["dq"] is None
    for name, rank, want in (("dq", 0, ref.dq), ("dk", 1, ref.dk), ("dv", 1, ref.dv)):
        got = results[rank][name]
        assert float((got - shard(want, 2, rank)).abs().max()) < 1e-12, (name, exchange)


def _outside_the_group(ctx) -> str:
    group = torch.distributed.new_group([0, 1])
    q = torch.randn(1, 2, 8, 8)
    ring_attention(q, q, q, group=group)
    return "ran"


def test_a_rank_outside_the_group_is_told_so(rank_pool) -> None:
    outcomes = rank_pool(3).run_outcomes(_outside_the_group, timeout=30.0)
    assert [o.ok for o in outcomes] == [True, True, False], outcomes
    assert "not a member of the process group" in outcomes[2].exc_message


def _create_graph(ctx) -> dict:
    gen = torch.Generator().manual_seed(5)
    q, k, v = (
        torch.randn(1, 2, 8, 8, generator=gen, dtype=torch.float64).requires_grad_()
        for _ in range(3)
    )
    out = ring_attention(
        q, k, v, group=ctx.group, is_causal=True, layout="head_tail", rotate_method="alltoall"
    )
    plain = torch.autograd.grad(out.sum(), (q, k, v), retain_graph=True)
    with_graph = torch.autograd.grad(out.sum(), (q, k, v), create_graph=True)
    result = {"equal": all(torch.equal(a, b) for a, b in zip(plain, with_graph))}
    try:
        torch.autograd.grad(with_graph[0].sum(), q)
        result["second"] = "no error"
    except RuntimeError as exc:
        result["second"] = str(exc)
    return result


def test_create_graph_gives_first_order_gradients_and_a_clear_error_for_the_second(
    rank_pool,
) -> None:
    results = rank_pool(2).run(_create_graph, timeout=60.0)
    for rank, r in enumerate(results):
        assert r["equal"], (
            f"rank {rank}: gradients with create_graph=True differ from the plain ones"
        )
        assert "once_differentiable" in r["second"] or "does not require grad" in r["second"], (
            rank,
            r["second"],
        )
    assert results[0]["second"] == results[1]["second"]


@pytest.mark.parametrize(
    "op_name", ["cpu_flash", "math", "cpu_efficient_layout", "cpu_cudnn_layout"]
)
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("is_causal", [False, True])
def test_every_op_backpropagates_the_lse_gradient(
    op_name: str, dtype: torch.dtype, is_causal: bool
) -> None:
    """call_backward with grad_lse (math: natively; the aten kernels: folded into out) against
    float64 autograd of (out * dO).sum() + (lse * g).sum(), on one device."""
    op = get_op(op_name)
    gen = torch.Generator().manual_seed(7)
    q, k, v, do = (
        torch.randn(2, 4, 12, 16, generator=gen, dtype=torch.float64).to(dtype) for _ in range(4)
    )
    g = torch.randn(2, 4, 12, generator=gen, dtype=torch.float64).to(dtype)
    out, lse = call_forward(op, q, k, v, is_causal=is_causal, scale=0.25)
    lse = (
        lse[..., :12].reshape(2, 4, 12).float()
        if dtype != torch.float64
        else lse[..., :12].reshape(2, 4, 12)
    )
    got = call_backward(op, do, q, k, v, out, lse, is_causal=is_causal, scale=0.25, grad_lse=g)
    without = call_backward(op, do, q, k, v, out, lse, is_causal=is_causal, scale=0.25)
    ref = attention_grads(q, k, v, do, is_causal=is_causal, scale=0.25, grad_lse=g)
    tol = {torch.float64: 1e-12, torch.float32: 1e-5, torch.bfloat16: 5e-2}[dtype]
    for name, x, r, w in zip(("dq", "dk", "dv"), got, (ref.dq, ref.dk, ref.dv), without):
        err = float((x.double() - r).abs().max())
        assert err <= tol * max(1.0, float(r.abs().max())), (
            f"{name}: max err {err:.2e} ({op_name}, {dtype})"
        )
        if name != "dv":  # the LSE's gradient changes dq and dk (dv does not depend on it)
            assert float((w.double() - r).abs().max()) > 10 * err, (
                f"{name}: grad_lse made no difference"
            )


def test_the_lse_is_differentiable_through_the_ring(rank_pool) -> None:
    results = rank_pool(2).run(_lse_only_loss, timeout=60.0)
    gen = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(1, 2, 16, 8, generator=gen, dtype=torch.float64) for _ in range(3))
    g = torch.randn(1, 2, 16, generator=gen, dtype=torch.float64)
    ref = attention_grads(q, k, v, torch.zeros_like(q), is_causal=True, grad_lse=g)
    for name, r in (("dq", ref.dq), ("dk", ref.dk), ("dv", ref.dv)):
        x = unshard([res[name] for res in results], layout="head_tail")
        assert float((x - r).abs().max()) < 1e-12, name


def _lse_only_loss(ctx) -> dict:
    gen = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(1, 2, 16, 8, generator=gen, dtype=torch.float64) for _ in range(3))
    g = torch.randn(1, 2, 16, generator=gen, dtype=torch.float64)
    w, r = ctx.world_size, ctx.rank
    ql, kl, vl = (shard(t, w, r, layout="head_tail").requires_grad_() for t in (q, k, v))
    gl = shard(g.unsqueeze(-1), w, r, layout="head_tail").squeeze(-1)
    _out, lse = ring_attention(
        ql, kl, vl, group=ctx.group, is_causal=True, layout="head_tail", return_lse=True
    )
    (lse * gl).sum().backward()  # out unused: its gradient is None, not zeros
    return {"dq": ql.grad, "dk": kl.grad, "dv": vl.grad}


def test_poison_forward_marks_exactly_what_a_nan_reaches() -> None:
    q, k, v = (torch.zeros(1, 2, 6, 4) for _ in range(3))
    k[0, 1, 2, 0] = math.nan  # key 2 of kv head 1: rows 2.. of query head 1 (causal)
    v[0, 0, 4, 3] = math.inf  # value 4, feature 3 of head 0: rows 4.. of head 0, feature 3
    q[0, 0, 1, 2] = math.nan  # query row 1 of head 0
    out, lse = poison_forward(torch.zeros(1, 2, 6, 4), torch.zeros(1, 2, 6), q, k, v, "causal")
    assert torch.isnan(lse[0, 1]).tolist() == [False, False, True, True, True, True]
    assert torch.isnan(lse[0, 0]).tolist() == [False, True, False, False, False, False]
    assert torch.isnan(out[0, 0, :, 3]).tolist() == [False, True, False, False, True, True]
    assert torch.isnan(out[0, 0, :, 0]).tolist() == [False, True, False, False, False, False]
    full_out, _ = poison_forward(torch.zeros(1, 2, 6, 4), torch.zeros(1, 2, 6), q, k, v, "full")
    assert torch.isnan(full_out[0, 1]).all() and torch.isnan(full_out[0, 0, :, 3]).all()


def test_auto_routes_around_cpu_flash_causal_nonpositive_scale() -> None:
    from ring_impl.ops import resolve_op

    cpu = torch.device("cpu")
    assert resolve_op("auto", cpu, torch.float32, 16, scale=-0.5, is_causal=True).name == "math"
    assert (
        resolve_op("auto", cpu, torch.float32, 16, scale=-0.5, is_causal=False).name == "cpu_flash"
    )
    assert resolve_op("auto", cpu, torch.float32, 16, scale=0.5, is_causal=True).name == "cpu_flash"
    why = get_op("cpu_flash").capabilities.unsupported(
        cpu, torch.float32, 16, scale=0.0, is_causal=True
    )
    assert why is not None and "scale 0.0 <= 0" in why
