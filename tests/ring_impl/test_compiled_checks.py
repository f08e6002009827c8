"""The cross-rank input check inside ``torch.compile`` (``ring_impl.compiled.checks``): a compiled
unmasked call whose input is bad on one rank, or whose ranks disagree, raises InputError on every
rank when the graph runs, with the eager call's words, instead of leaving the other ranks in their
ring collectives; the next good call runs on every rank. Ring, Ulysses and routed SDPA calls,
``fullgraph=True``."""

from __future__ import annotations

import pytest
import torch

HEADS, HEAD_DIM, LOCAL = 4, 8, 8


def _unregistered_op():
    """A CPU flash op object registered under no name (a vendor's kernel, say)."""
    from ring_impl.ops.cpu import CpuFlashOp

    class VendorFlash(CpuFlashOp):
        name = "vendor_flash_unregistered"

    return VendorFlash()


def _compiled_refusal(ctx, case: str, op_kind: str = "name") -> dict:
    import ring_impl

    torch._dynamo.reset()
    gen = torch.Generator().manual_seed(ctx.rank)
    q, k, v = (torch.randn(1, HEADS, LOCAL, HEAD_DIM, generator=gen) for _ in range(3))
    good = {"layout": "head_tail", "scale": 0.25, "strategy": "ring"}
    bad = dict(good)
    if case == "layout_bad_on_rank_0" and ctx.rank == 0:
        bad["layout"] = "no_such_layout"  # refused by rank 0's own checks, while tracing
    elif case == "scales_differ":
        bad["scale"] = 0.25 * (
            ctx.rank + 1
        )  # each rank's input fine alone: only the agreement sees it
    elif case == "ulysses_head_dim_differs" and ctx.rank == 1:
        good["strategy"] = bad["strategy"] = "ulysses"
        q, k, v = (t[..., : HEAD_DIM // 2].contiguous() for t in (q, k, v))
    elif case == "ulysses_head_dim_differs":
        good["strategy"] = bad["strategy"] = "ulysses"
    elif case == "windowed_grad_on_rank_1_only":
        from ring_impl.masks import SlidingWindow

        bad["mask"] = SlidingWindow(3, 0)
    # Inside the graph the check op's tensors carry no requires_grad: only the trace knows that
    # rank 0's output needs no backward (rank 1 would wait in its backward's collectives).
    grad = not (case.endswith("grad_on_rank_1_only") and ctx.rank == 0)

    op = _unregistered_op() if op_kind == "object" else None

    def attention(q, k, v, **options):  # (layout, scale, strategy and mask)
        out = ring_impl.ring_attention(
            q, k, v, group=ctx.group, rotate_method="alltoall", op=op, **options
        )
        return out * 2.0

    compiled = torch.compile(attention, backend="aot_eager", fullgraph=True)
    result: dict = {}
    try:
        compiled(q.requires_grad_(grad), k, v, **bad).sum().backward()
        result["bad"] = "no error"
    except Exception as exc:  # the message is the result
        result["bad"] = f"{type(exc).__name__}: {exc}"
    # A good call afterwards runs on every rank, and equals the eager call. (A fresh compile: a
    # float argument that changed between calls is traced as a symbol, which the checks refuse.)
    torch._dynamo.reset()
    compiled = torch.compile(attention, backend="aot_eager", fullgraph=True)
    q2, k2, v2 = (torch.randn(1, HEADS, LOCAL, HEAD_DIM, generator=gen) for _ in range(3))
    good["scale"] = 0.25
    result["good_equal"] = torch.equal(compiled(q2, k2, v2, **good), attention(q2, k2, v2, **good))
    return result


@pytest.mark.parametrize(
    "case,culprit,pattern",
    [
        ("layout_bad_on_rank_0", 0, r"layout 'no_such_layout'|unknown layout|no_such_layout"),
        ("scales_differ", None, r"ranks disagree on scale"),
        ("ulysses_head_dim_differs", None, r"head_dim"),
        ("grad_on_rank_1_only", None, r"ranks disagree on backward \(rank 0 False; rank 1 True\)"),
        (
            "windowed_grad_on_rank_1_only",
            None,
            r"ranks disagree on backward \(rank 0 False; rank 1 True\)",
        ),
    ],
)
@pytest.mark.parametrize("op_kind", ["name", "object"])
def test_compiled_call_refuses_bad_input_on_every_rank(
    ring, case, culprit, pattern, op_kind
) -> None:
    """``op_kind="object"``: an op object registered under no name, carried to the check op by a
    key (before, such a call was traced without the check, and a rank refusing its own input
    left the others in their ring collectives)."""
    import re

    for rank, run in enumerate(
        ring.rank_pool(2).run(_compiled_refusal, case, op_kind, timeout=120.0)
    ):
        msg = run["bad"]
        assert msg.startswith("InputError"), f"rank {rank}: {msg}"
        want = pattern if culprit in (None, rank) else rf"rank {culprit} rejected their input"
        assert re.search(want, msg), f"rank {rank}: {msg}"
        assert run["good_equal"], (
            f"rank {rank}: the good compiled call after the refusal differs from eager"
        )


def _routed_sdpa_mask_on_one_rank(ctx) -> dict:
    from ring_impl.torch_api.sdpa_route import sdpa_routed_to_ring

    torch._dynamo.reset()
    x = torch.randn(1, 2, LOCAL, HEAD_DIM)
    mask = torch.ones(LOCAL, LOCAL, dtype=torch.bool) if ctx.rank == 0 else None
    fn = torch.compile(
        lambda x, m: torch.nn.functional.scaled_dot_product_attention(x, x, x, attn_mask=m),
        backend="aot_eager",
        fullgraph=True,
    )
    result = {}
    with sdpa_routed_to_ring(ctx.group):
        try:
            fn(x, mask)
            result["bad"] = "no error"
        except Exception as exc:
            result["bad"] = f"{type(exc).__name__}: {exc}"
        result["good_shape"] = tuple(fn(x, None).shape)
    return result


def test_compiled_routed_sdpa_refusal_reaches_every_rank(ring) -> None:
    """The SDPA route under torch.compile: rank 0's attn_mask is refused on both ranks (it used
    to raise on rank 0 alone, while tracing, and leave rank 1 in its ring)."""
    runs = ring.rank_pool(2).run(_routed_sdpa_mask_on_one_rank, timeout=120.0)
    assert "attn_mask is not supported" in runs[0]["bad"], runs[0]
    assert "rank 0 rejected their input" in runs[1]["bad"], runs[1]
    # The refusal raises from the check op when the graph runs, and still names the function called.
    assert all(
        r["bad"].startswith("InputError: scaled_dot_product_attention under context parallel")
        for r in runs
    ), runs
    assert all(r["good_shape"] == (1, 2, LOCAL, HEAD_DIM) for r in runs), runs
