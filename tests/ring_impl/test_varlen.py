"""The varlen op (ring_impl.ops.varlen) on CPU: the emulated kernel's semantics, the packing's
exactness for any visibility, the op against the math op, and the ring through it against the
float64 oracle.

The CUDA op (``cuda_flash_varlen``) is checked on a GPU by
``tests/ring_impl/test_cuda_kernels.py -k varlen --device cuda`` (``ci/gpu_check.py`` runs it).
Everything here runs the same packing with the kernel emulated (``cpu_flash_varlen_layout``):
given a visibility, or row bounds (one key range per row, ring_impl.planning.row_bounds).
"""

from __future__ import annotations

from typing import ClassVar

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from ring_impl import masks
from ring_impl.ops import MathOp, get_op
from ring_impl.ops.varlen import MAX_LAYERS, UNBOUNDED, VarlenOp, varlen_plan
from ring_impl.ops.varlen_emulation import emulated_varlen_forward, varlen_visibility

from .oracle import assert_masked_op_matches_math, assert_ring_matches_oracle
from .rank_results import forward_backward, leaves, local_results, seeded_inputs


def _cu(*lengths: int) -> torch.Tensor:
    return torch.tensor([0, *lengths], dtype=torch.int64).cumsum(0).to(torch.int32)


# ---------------------------------------------------------------- the emulated kernel's semantics


def test_windows_align_to_each_sequences_bottom_right() -> None:
    """FlashAttention-2's documented rule, written out by hand: sequence 0 has 2 queries and 3
    keys (diagonal shifted right by 1), sequence 1 has 3 queries and 2 keys (shifted left by 1:
    its first query sees nothing under causal)."""
    cu_q, cu_k = _cu(2, 3), _cu(3, 2)
    causal = [[1, 1, 0, 0, 0], [1, 1, 1, 0, 0], [0, 0, 0, 0, 0], [0, 0, 0, 1, 0], [0, 0, 0, 1, 1]]
    assert varlen_visibility(cu_q, cu_k, (UNBOUNDED, 0)).int().tolist() == causal
    band = [
        [0, 1, 0, 0, 0],  # (left 0, right 0): only the diagonal key
        [0, 0, 1, 0, 0],
        [0, 0, 0, 0, 0],
        [0, 0, 0, 1, 0],
        [0, 0, 0, 0, 1],
    ]
    assert varlen_visibility(cu_q, cu_k, (0, 0)).int().tolist() == band
    full = [[1, 1, 1, 0, 0], [1, 1, 1, 0, 0], [0, 0, 0, 1, 1], [0, 0, 0, 1, 1], [0, 0, 0, 1, 1]]
    assert varlen_visibility(cu_q, cu_k, (UNBOUNDED, UNBOUNDED)).int().tolist() == full
    right_only = [
        [0, 1, 1, 0, 0],
        [0, 0, 1, 0, 0],
        [0, 0, 0, 1, 1],
        [0, 0, 0, 1, 1],
        [0, 0, 0, 0, 1],
    ]
    assert varlen_visibility(cu_q, cu_k, (0, UNBOUNDED)).int().tolist() == right_only


def test_a_row_that_sees_nothing_gets_the_kernels_zero_and_plus_inf() -> None:
    q, k, v = torch.randn(5, 2, 8), torch.randn(5, 2, 8), torch.randn(5, 2, 8)
    out, lse = emulated_varlen_forward(
        q, k, v, _cu(2, 3), _cu(3, 2), 3, 3, scale=0.5, window=(UNBOUNDED, 0)
    )
    assert torch.equal(out[2], torch.zeros(2, 8)) and bool(torch.isposinf(lse[:, 2]).all())
    assert bool(torch.isfinite(lse[:, [0, 1, 3, 4]]).all())


@pytest.mark.parametrize(
    "bad,match",
    [
        ({"cu_q": _cu(2, 3).long()}, "int32"),
        ({"cu_q": torch.tensor([1, 2, 5], dtype=torch.int32)}, "rise from 0"),
        ({"cu_k": _cu(3, 1)}, "rise from 0"),
        ({"max_q": 2}, "exceeds max"),
        ({"q": torch.randn(5, 8, 2).transpose(1, 2)}, "contiguous last dimension"),
        ({"k": torch.randn(5, 3, 8), "v": torch.randn(5, 3, 8)}, "divide"),
        ({"window": (-2, 0)}, "window"),
        ({"scale": 0.0}, "scale"),
    ],
)
def test_the_emulated_kernel_refuses_what_the_kernel_would_misread(bad, match) -> None:
    args = {
        "q": torch.randn(5, 2, 8),
        "k": torch.randn(5, 2, 8),
        "v": torch.randn(5, 2, 8),
        "cu_q": _cu(2, 3),
        "cu_k": _cu(3, 2),
        "max_q": 3,
        "max_k": 3,
        "scale": 0.5,
        "window": (UNBOUNDED, 0),
    } | bad
    with pytest.raises(RuntimeError, match=match):
        emulated_varlen_forward(
            args["q"],
            args["k"],
            args["v"],
            args["cu_q"],
            args["cu_k"],
            args["max_q"],
            args["max_k"],
            scale=args["scale"],
            window=args["window"],
        )


# ---------------------------------------------------------------- the packing


def _shown(plan, vis: torch.Tensor, batch: int) -> torch.Tensor:
    """(batch, rows, cols) int: how many calls show each pair, the math rows' visibility added."""
    rows, cols = vis.shape[-2:]
    count = torch.zeros(batch * rows, batch * cols, dtype=torch.int64)
    q_seen = torch.zeros(batch * rows, dtype=torch.int64)
    for c in plan.calls:
        qi = torch.arange(batch * rows) if c.q_index is None else c.q_index
        ki = torch.arange(batch * cols) if c.k_index is None else c.k_index
        assert qi.numel() == int(c.cu_q[-1]) and ki.numel() == int(c.cu_k[-1])
        assert c.max_q == int(c.cu_q.diff().max()) and c.max_k == int(c.cu_k.diff().max()), (
            "max is not the longest"
        )
        assert qi.unique().numel() == qi.numel(), "a query row twice in one call"
        q_seen[qi] += 1
        local = varlen_visibility(c.cu_q, c.cu_k, c.window).to(torch.int64)
        count.index_put_(
            (qi.view(-1, 1).expand_as(local), ki.view(1, -1).expand_as(local)),
            local,
            accumulate=True,
        )
    assert int(q_seen.max()) <= MAX_LAYERS, "a query row in more calls than layers"
    # The forward writes layer 0 and merges later layers into it: each row once in layer 0 and
    # before any later layer.
    assert [c.layer for c in plan.calls] == sorted(c.layer for c in plan.calls), (
        "calls out of layer order"
    )
    first = torch.zeros(batch * rows, dtype=torch.int64)
    for c in plan.calls:
        qi = torch.arange(batch * rows) if c.q_index is None else c.q_index
        if c.layer == 0:
            first[qi] += 1
        else:
            assert bool((first[qi] == 1).all()), f"a layer-{c.layer} row has no first-layer call"
    assert int(first.max()) <= 1, "a row written by two first-layer calls"
    shown = torch.stack(
        [count[e * rows : (e + 1) * rows, e * cols : (e + 1) * cols] for e in range(batch)]
    )
    off_diagonal = count.sum() - shown.sum()
    assert int(off_diagonal) == 0, "a call shows a query another batch element's key"
    if plan.math_rows is not None:
        assert int(q_seen.view(batch, rows)[:, plan.math_rows].sum()) == 0, (
            "a math row is also packed"
        )
        seen = vis.any(1).expand(batch, rows, cols)
        shown[:, plan.math_rows] += seen[:, plan.math_rows].to(torch.int64)
    return shown


def _check_packing(vis: torch.Tensor, batch: int) -> None:
    plan = varlen_plan(vis, batch)
    shown = _shown(plan, vis, batch)
    assert int(shown.max()) <= 1, "a pair is shown twice"
    want = vis.any(1).expand(batch, *vis.shape[-2:])
    assert torch.equal(shown.to(torch.bool), want), (
        "the calls show a pair the mask hides, or miss one"
    )
    if plan.math_rows is not None:  # only rows that are no interval, or differ between heads
        for r in plan.math_rows.tolist():
            rows_vis = vis[:, :, r]
            cols = rows_vis.any(1)
            nonzero = [c.nonzero().flatten() for c in cols]
            irregular = any(int(n.numel()) and int(n[-1] - n[0] + 1) != n.numel() for n in nonzero)
            assert irregular or not bool((rows_vis == rows_vis[:, :1]).all()), (
                f"row {r} is regular yet runs with math"
            )


@settings(max_examples=200, deadline=None, derandomize=True, database=None)
@given(data=st.data())
def test_any_visibility_is_packed_exactly(data) -> None:
    """The calls show every visible pair once and nothing else (a row in one call per run of
    keys it sees), for random, interval, band and per-batch/per-head visibilities."""
    rows = data.draw(st.integers(1, 24), label="rows")
    cols = data.draw(st.integers(1, 24), label="cols")
    batch = data.draw(st.integers(1, 3), label="batch")
    nb = data.draw(st.sampled_from([1, batch]), label="visibility batch")
    nh = data.draw(st.sampled_from([1, 2]), label="visibility heads")
    kind = data.draw(st.sampled_from(["random", "intervals", "bands", "documents"]), label="kind")
    gen = torch.Generator().manual_seed(data.draw(st.integers(0, 2**31 - 1), label="seed"))
    c = torch.arange(cols)
    if kind == "random":
        vis = torch.rand(nb, nh, rows, cols, generator=gen) < data.draw(
            st.floats(0, 1), label="density"
        )
    elif kind == "documents":
        starts = sorted(
            data.draw(
                st.sets(st.integers(1, max(1, max(rows, cols) - 1)), max_size=6), label="cuts"
            )
        )
        doc_q = torch.bucketize(
            torch.arange(rows), torch.tensor(starts, dtype=torch.int64), right=True
        )
        doc_k = torch.bucketize(c, torch.tensor(starts, dtype=torch.int64), right=True)
        vis = doc_q.view(-1, 1) == doc_k.view(1, -1)
        if data.draw(st.booleans(), label="causal"):
            vis &= c.view(1, -1) <= torch.arange(rows).view(-1, 1)
        vis = vis.expand(nb, nh, rows, cols)
    else:
        lo = torch.randint(0, cols, (nb, 1, rows, 1), generator=gen)
        if kind == "bands":
            step = data.draw(st.integers(1, 4), label="band step")
            lo = (torch.arange(rows).view(1, 1, -1, 1) // step + lo[..., :1, :]).clamp(max=cols - 1)
        width = torch.randint(0, cols + 1, (nb, 1, rows, 1), generator=gen)
        vis = ((c >= lo) & (c < lo + width)).expand(nb, nh, rows, cols)
    _check_packing(vis.contiguous(), batch)


_MASKS = {
    "documents": lambda s: masks.Documents(
        torch.repeat_interleave(torch.arange(6), torch.tensor([13, 1, 2, 30, 9, s - 55]))
    ),
    "documents_full": lambda s: masks.Documents(
        torch.repeat_interleave(torch.arange(3), torch.tensor([20, 7, s - 27])), causal=False
    ),
    "window": lambda s: masks.SlidingWindow(7),
    "window_both": lambda s: masks.SlidingWindow(5, 3),
    "chunked": lambda s: masks.ChunkedCausal(10),
    "prefix": lambda s: masks.PrefixLM(9),
    "causal": lambda s: masks.Causal(),
    "sink_and_window": lambda s: masks.MaskMod(
        lambda b, h, q, kv: (kv <= q) & ((kv < 4) | (kv >= q - 6))
    ),
}


def _counted(op_name: str = "cpu_flash_varlen_layout"):
    base = type(get_op(op_name))

    class Counted(base):  # type: ignore[misc, valid-type]
        calls: ClassVar[list] = []

        def kernel_forward(self, q, k, v, cu_q, cu_k, max_q, max_k, *, scale, window):
            Counted.calls.append(
                (window, cu_q.numel() - 1, int(varlen_visibility(cu_q, cu_k, window).sum()))
            )
            return super().kernel_forward(
                q, k, v, cu_q, cu_k, max_q, max_k, scale=scale, window=window
            )

    Counted.calls = []
    return Counted()


@pytest.mark.parametrize("name", sorted(_MASKS))
def test_structured_masks_are_packed_without_the_math_op(name: str) -> None:
    """Each row of these masks sees one or two runs of keys: the whole block runs in varlen
    calls, one per window and layer, computing exactly the visible entries (the bias kernel
    computes the rectangle)."""
    s = 64
    pos = torch.arange(s)
    vis = masks.visibility(_MASKS[name](s), pos, pos, batch=1, heads=1)
    plan = varlen_plan(vis, 2)
    assert plan.math_rows is None
    layers = 2 if name == "sink_and_window" else 1
    assert len(plan.calls) <= 3 * layers, [c.window for c in plan.calls]
    op = _counted()
    q, k, v = (torch.randn(2, 2, s, 8, dtype=torch.float64) for _ in range(3))
    op.forward(q, k, v, is_causal=False, scale=0.4, attn_mask=vis)
    assert len(op.calls) == len(plan.calls)
    assert sum(area for _, _, area in op.calls) == 2 * int(vis.sum()), (
        "computed entries differ from the visible ones"
    )


def test_many_short_documents_are_one_call() -> None:
    s = 256
    pos = torch.arange(s)
    vis = masks.visibility(
        masks.Documents(torch.arange(s) // 4), pos, pos
    )  # 64 causal documents of 4 tokens
    plan = varlen_plan(vis, 1)
    assert [(c.window, c.sequences) for c in plan.calls] == [((UNBOUNDED, 0), 64)]


# ---------------------------------------------------------------- the op against the math op


def _visibilities(sq: int, sk: int, heads: int) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(3)
    i, j = torch.arange(sq).view(-1, 1), torch.arange(sk).view(1, -1)
    doc_q, doc_k = i * 5 // sq, j * 5 // sk
    out = {
        "documents_causal": (doc_q == doc_k) & (j <= i),
        "documents_full": doc_q == doc_k,
        "window": (j <= i) & (i - j < 5),
        "prefix": (j < 6) | (j <= i),
        "random": torch.rand(sq, sk, generator=gen) < 0.3,
        "per_head": torch.stack([(j <= i) & (i - j < 3 + h) for h in range(heads)]).unsqueeze(0),
        "per_batch": torch.stack([(doc_q == doc_k) & (j <= i), (j <= i) & (i - j < 4)]).unsqueeze(
            1
        ),
        "sink_and_window": (j <= i) & ((j < 3) | (i - j < 5)),
        "three_runs": (j <= i) & ((j < 2) | ((j >= 6) & (j < 9)) | (i - j < 3)),
    }
    for name, vis in out.items():
        vis = vis.reshape(1, 1, sq, sk) if vis.dim() == 2 else vis
        vis = vis.clone()
        vis[..., 3, :] = False  # a row that sees nothing
        out[name] = vis
    return out


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize(
    "shape", [(2, 4, 2, 40, 40), (2, 2, 2, 17, 33), (1, 4, 1, 33, 17)], ids=str
)
@pytest.mark.parametrize(
    "mask",
    [
        "documents_causal",
        "documents_full",
        "window",
        "prefix",
        "random",
        "per_head",
        "per_batch",
        "sink_and_window",
        "three_runs",
    ],
)
def test_the_op_equals_the_math_op(dtype, shape, mask) -> None:
    """Forward (out, LSE) and backward on the rows that see something; those that see nothing
    get LSE 0 and a zero output gradient, as the ring gives them. GQA where heads_kv < heads."""
    b, h, hkv, sq, sk = shape
    vis = _visibilities(sq, sk, h)[mask][:b]  # per_batch: one visibility per batch element
    gen = torch.Generator().manual_seed(1)
    q, do = (torch.randn(b, h, sq, 8, dtype=dtype, generator=gen) for _ in range(2))
    k, v = (torch.randn(b, hkv, sk, 8, dtype=dtype, generator=gen) for _ in range(2))
    lse = assert_masked_op_matches_math(
        get_op("cpu_flash_varlen_layout"), q, k, v, do, vis, scale=0.3
    )
    assert lse.shape == (b, h, sq)


@pytest.mark.parametrize(
    "is_causal,sq,sk", [(False, 24, 40), (True, 24, 24), (True, 40, 24), (True, 24, 40)]
)
@pytest.mark.parametrize("scale", [0.3, -0.4, 0.0])
def test_unmasked_blocks_and_scales_the_kernel_cannot_take(is_causal, sq, sk, scale) -> None:
    """Unmasked blocks are one sequence per batch element (top-left causal on a non-square block
    becomes a visibility); a scale <= 0 goes to the math op, never to the kernel (the emulated
    kernel refuses it)."""
    gen = torch.Generator().manual_seed(2)
    q, do = (torch.randn(2, 4, sq, 8, dtype=torch.float64, generator=gen) for _ in range(2))
    k, v = (torch.randn(2, 2, sk, 8, dtype=torch.float64, generator=gen) for _ in range(2))
    op, math = get_op("cpu_flash_varlen_layout"), MathOp()
    got_out, got_lse = op.forward(q, k, v, is_causal=is_causal, scale=scale)
    want_out, want_lse = math.forward(q, k, v, is_causal=is_causal, scale=scale)
    assert torch.allclose(got_out, want_out, atol=1e-12, rtol=0) and torch.allclose(
        got_lse, want_lse, atol=1e-12, rtol=0
    )
    got = op.backward(do, q, k, v, want_out, want_lse, is_causal=is_causal, scale=scale)
    want = math.backward(do, q, k, v, want_out, want_lse, is_causal=is_causal, scale=scale)
    for what, g, w in zip(("dq", "dk", "dv"), got, want):
        assert torch.allclose(g, w, atol=1e-12, rtol=0), f"{what}: {(g - w).abs().max():.2e}"


def test_a_packer_with_its_band_window_off_by_one_is_caught(monkeypatch) -> None:
    """The checks above see a plausible packing slip: a band's window one key too wide."""
    from ring_impl.ops import varlen

    original = varlen._runs

    def slipped(per_element):
        return [
            [(r0, r1, c0, c1, (w[0] + 1, w[1]) if w[0] >= 0 else w) for r0, r1, c0, c1, w in runs]
            for runs in original(per_element)
        ]

    monkeypatch.setattr(varlen, "_runs", slipped)
    pos = torch.arange(48)
    vis = masks.visibility(masks.SlidingWindow(7), pos, pos)
    with pytest.raises(AssertionError, match="hides, or miss"):
        _check_packing(vis, 1)
    q, k, v = (torch.randn(1, 2, 48, 8, dtype=torch.float64) for _ in range(3))
    out, _ = get_op("cpu_flash_varlen_layout").forward(
        q, k, v, is_causal=False, scale=0.3, attn_mask=vis
    )
    want, _ = MathOp().forward(q, k, v, is_causal=False, scale=0.3, attn_mask=vis)
    assert not torch.allclose(out, want, atol=1e-6), "the slipped window gave the right output"


def test_the_plan_of_a_kept_visibility_is_made_once() -> None:
    pos = torch.arange(32)
    vis = masks.visibility(masks.SlidingWindow(5), pos, pos)
    op = get_op("cpu_flash_varlen_layout")
    q = torch.randn(1, 1, 32, 8)
    first, _ = op.plan(q, q, is_causal=False, attn_mask=vis)
    again, _ = op.plan(q, q, is_causal=False, attn_mask=vis)
    assert again is first
    other, _ = op.plan(q, q, is_causal=False, attn_mask=vis.clone())
    assert other is not first
    from ring_impl.ops import varlen

    kept = id(vis)
    assert kept in varlen._PLANS
    del vis
    assert kept not in varlen._PLANS, "a freed visibility's plan is still held"


def test_auto_picks_the_varlen_kernel_for_masked_calls_on_cuda_only() -> None:
    """A masked call on CUDA runs a ring step in one varlen call; an unmasked one keeps the dense
    flash kernel; dtypes varlen lacks and the CPU keep theirs."""
    from ring_impl.ops import resolve_op

    cuda, cpu = torch.device("cuda"), torch.device("cpu")
    for dtype in (torch.float16, torch.bfloat16):
        assert resolve_op("auto", cuda, dtype, 64).name == "cuda_flash"
        assert resolve_op("auto", cuda, dtype, 64, masked=True).name == "cuda_flash_varlen"
    assert resolve_op("auto", cuda, torch.float32, 64, masked=True).name == "cuda_efficient"
    assert (
        resolve_op("auto", cuda, torch.bfloat16, 512, masked=True).name != "cuda_flash_varlen"
    )  # head_dim > 256
    assert resolve_op("auto", cpu, torch.bfloat16, 64, masked=True).name == "cpu_flash"
    assert isinstance(get_op("cuda_flash_varlen"), VarlenOp)


# ---------------------------------------------------------------- the ring through it

HEADS, HEADS_KV, HEAD_DIM, SEQ = 4, 2, 8, 64
_RING_MASKS = {
    "documents": lambda: masks.Documents(
        torch.repeat_interleave(torch.arange(5), torch.tensor([21, 3, 1, 30, 9]))
    ),
    "window": lambda: masks.SlidingWindow(6),
    "prefix_chunked": lambda: masks.PrefixLM(5) | masks.ChunkedCausal(12),
}


def _inputs(dtype: torch.dtype):
    return seeded_inputs(5, dtype, 2, HEADS, HEADS_KV, SEQ, HEAD_DIM)


def _ring_with_the_varlen_op(ctx, dtype, name, layout, rotate):
    import ring_impl

    op = _counted()
    q, k, v, dout = (
        ring_impl.shard(t, ctx.world_size, ctx.rank, layout=layout) for t in _inputs(dtype)
    )
    q, k, v = leaves(q, k, v)
    mask = _RING_MASKS[name]()
    out, lse = forward_backward(
        q, k, v, dout, mask=mask, layout=layout, op=op, rotate_method=rotate
    )
    return local_results(out, lse, q, k, v, sequences=sum(n for _, n, _ in op.calls))


@pytest.mark.parametrize("dtype", [torch.float64, torch.bfloat16])
@pytest.mark.parametrize(
    "name,layout,rotate",
    [
        ("documents", "head_tail", "alltoall"),
        ("window", "contiguous", "p2p"),
        ("prefix_chunked", "head_tail", "allgather"),
    ],
)
def test_ring_with_the_emulated_varlen_op_matches_the_oracle(
    ring, dtype, name, layout, rotate
) -> None:
    """Out, LSE, dQ, dK, dV against the float64 oracle at W=2 through the varlen op (GQA, batch
    2), by the numerics policy."""

    results = ring.rank_pool(2).run(
        _ring_with_the_varlen_op, dtype, name, layout, rotate, timeout=120.0
    )
    assert all(r["sequences"] > 0 for r in results), [r["sequences"] for r in results]
    pos = torch.arange(SEQ)
    assert_ring_matches_oracle(
        f"cpu_flash_varlen_layout, {name}, W=2, {layout}, {rotate}",
        results,
        _inputs(dtype),
        masks.visibility(_RING_MASKS[name](), pos, pos),
        layout=layout,
        world_size=2,
        dtype=dtype,
    )


@pytest.mark.parametrize("name", sorted(set(_MASKS) - {"sink_and_window"}))
def test_a_mask_of_key_ranges_is_one_call_per_window_it_needs(name: str) -> None:
    """From a step's row bounds (ring_impl.planning.row_bounds): documents (causal or not, one of a
    single token), windows (their growing first rows and their band in one sequence), chunks and
    causal are one call; prefix-LM is two (its full prefix and its causal rest need two windows).
    The calls show exactly the mask's pairs."""
    from ring_impl.ops.varlen import bounds_varlen_plan, bounds_visible
    from ring_impl.planning.row_bounds import column_bounds

    s = 64
    pos = torch.arange(s)
    mask = _MASKS[name](s)
    lo, hi = column_bounds(mask, pos, pos)
    plan = bounds_varlen_plan(lo, hi, 2, s)
    assert len(plan.calls) == (2 if name == "prefix" else 1), [c.window for c in plan.calls]
    vis = masks.visibility(mask, pos, pos)
    assert torch.equal(bounds_visible(lo, hi, s), vis)
    shown = _shown(plan, vis, 2)
    assert int(shown.max()) <= 1 and torch.equal(shown.to(torch.bool), vis[0].expand(2, s, s))


@settings(max_examples=200, deadline=None, derandomize=True, database=None)
@given(data=st.data())
def test_any_row_ranges_are_packed_exactly(data) -> None:
    """Random row ranges (documents, windows, bands, one-key rows, empty rows side by side):
    every visible pair shown once, nothing else."""
    from ring_impl.ops.varlen import bounds_varlen_plan, bounds_visible

    rows, cols = (
        data.draw(st.integers(1, 30), label="rows"),
        data.draw(st.integers(1, 30), label="cols"),
    )
    lo, hi = [], []
    for _ in range(rows):
        how = data.draw(st.sampled_from(["same", "grow", "slide", "jump", "empty"]), label="row")
        a, b = (lo[-1], hi[-1]) if lo else (0, 1)
        if how == "grow":
            b += 1
        elif how == "slide":
            a, b = a + 1, b + 1
        elif how in ("jump", "empty") or not lo:
            a = data.draw(st.integers(0, cols), label="lo")
            b = a if how == "empty" else data.draw(st.integers(a, cols), label="hi")
        lo.append(min(a, cols))
        hi.append(max(min(b, cols), min(a, cols)))
    lo_t, hi_t = torch.tensor(lo), torch.tensor(hi)
    vis = bounds_visible(lo_t, hi_t, cols)
    batch = data.draw(st.integers(1, 2), label="batch")
    shown = _shown(bounds_varlen_plan(lo_t, hi_t, batch, cols), vis, batch)
    assert int(shown.max()) <= 1, "a pair is shown twice"
    assert torch.equal(shown.to(torch.bool), vis[0].expand(batch, rows, cols)), (
        "a pair shown that is hidden, or missed"
    )
