"""``flex_attention(q, k, v, block_mask=...)`` under a route runs as ring attention with the block
mask's mask_mod on global positions: forward and backward (flex attention itself has no CPU
backward in torch 2.13) against the float64 oracle; refusals on every rank; outside a route it
is flex attention itself."""

from __future__ import annotations

import pytest
import torch

from .oracle import assert_ring_matches_oracle
from .rank_results import local_results, seeded_inputs

HEADS, HEADS_KV, HEAD_DIM = 4, 2, 8

#: documents over 48 global positions: they cross shard boundaries at W = 2 and 3; one token alone
DOC_IDS = torch.tensor([0] * 7 + [1] + [2] * 20 + [3] * 20)


def document_causal(b, h, q_idx, kv_idx):
    """flex's mask_mod convention: causal within each document."""
    return (DOC_IDS[q_idx] == DOC_IDS[kv_idx]) & (kv_idx <= q_idx)


def _oracle_visibility(seq: int) -> torch.Tensor:
    """(1, 1, seq, seq) by evaluating the mask_mod's rule position by position (plain Python)."""
    ids = DOC_IDS.tolist()
    return torch.tensor(
        [[ids[i] == ids[j] and j <= i for j in range(seq)] for i in range(seq)]
    ).view(1, 1, seq, seq)


def _inputs(seq: int, dtype: torch.dtype):
    return seeded_inputs(11, dtype, 1, HEADS, HEADS_KV, seq, HEAD_DIM, dout_last=True)


def _run(ctx, layout, dtype, via_module):
    import torch.nn.attention.flex_attention as flex_module

    import ring_impl
    from ring_impl.torch_api.sdpa_route import sdpa_routed_to_ring

    seq = DOC_IDS.numel()
    block_mask = flex_module.create_block_mask(document_causal, None, None, seq, seq, device="cpu")
    q, k, v, dout = (
        ring_impl.shard(t, ctx.world_size, ctx.rank, layout=layout) for t in _inputs(seq, dtype)
    )
    q, k, v = (t.requires_grad_(True) for t in (q, k, v))
    with sdpa_routed_to_ring(
        ctx.group, layout=layout, op="math" if dtype == torch.float64 else None
    ):
        # Looked up at call time through the module, or ring_impl's own name.
        fn = flex_module.flex_attention if via_module else ring_impl.flex_attention
        out, lse = fn(q, k, v, block_mask=block_mask, enable_gqa=True, return_lse=True)
    out.backward(dout)
    routed_back = flex_module.flex_attention is not ring_impl.flex_attention
    return local_results(out, lse, q, k, v, restored=routed_back)


@pytest.mark.parametrize(
    "world,layout,dtype,via_module",
    [
        (2, "head_tail", torch.float64, True),
        (3, "contiguous", torch.float64, False),
        (2, "contiguous", torch.float32, True),
    ],
)
def test_flex_call_under_a_route_matches_the_oracle(ring, world, layout, dtype, via_module) -> None:
    results = ring.rank_pool(world).run(_run, layout, dtype, via_module, timeout=120.0)
    assert all(r["restored"] for r in results), (
        "flex_attention was not put back when the route ended"
    )
    seq = DOC_IDS.numel()
    assert_ring_matches_oracle(
        f"flex routed, W={world}, {layout}",
        results,
        _inputs(seq, dtype),
        _oracle_visibility(seq),
        layout=layout,
        world_size=world,
        dtype=dtype,
    )


def _refused(ctx, kind, compiled):
    import torch.nn.attention.flex_attention as flex_module

    import ring_impl
    from ring_impl.torch_api.sdpa_route import sdpa_routed_to_ring

    seq_local = DOC_IDS.numel() // ctx.world_size
    q = torch.randn(1, 2, seq_local, 8)
    k = v = torch.randn(1, 2, seq_local, 8)
    length = DOC_IDS.numel() if not (kind == "local_block_mask" and ctx.rank == 0) else seq_local
    block_mask = flex_module.create_block_mask(
        document_causal, None, None, length, length, device="cpu"
    )
    kwargs = {"block_mask": block_mask}
    if (
        kind == "score_mod" and ctx.rank == ctx.world_size - 1
    ):  # one rank only: every rank must raise
        kwargs["score_mod"] = lambda score, b, h, qi, ki: score * 2
    if kind == "kernel_options":
        kwargs["kernel_options"] = {"BLOCK_M": 64}
    call = ring_impl.flex_attention
    if compiled:  # the refusal then comes from the compiled check's op, when the graph runs
        torch._dynamo.reset()
        options, kwargs = kwargs, {}
        call = torch.compile(
            lambda q, k, v: ring_impl.flex_attention(q, k, v, **options),
            backend="aot_eager",
            fullgraph=True,
        )
    with sdpa_routed_to_ring(ctx.group, layout="contiguous"):
        try:
            call(q, k, v, **kwargs)
        except Exception as exc:  # the message is the result
            return f"{type(exc).__name__}: {exc}"
    return "no error"


@pytest.mark.parametrize(
    "kind,pattern,culprit",
    [
        ("score_mod", r"score_mod is not supported", 1),  # on the last rank only
        (
            "kernel_options",
            r"kernel_options .* tune flex attention's own kernel",
            None,
        ),  # every rank
        (
            "local_block_mask",
            r"block_mask was built for .* global sequence is \(48, 48\)",
            0,
        ),  # rank 0 only
    ],
)
@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
def test_unsupported_flex_calls_raise_on_every_rank(ring, kind, pattern, culprit, compiled) -> None:
    """The rank with the bad call names the cause; the others raise too, naming that rank; and
    every rank names the function called, compiled (fullgraph) as eagerly."""
    import re

    messages = ring.rank_pool(2).run(_refused, kind, compiled, timeout=120.0)
    for rank, msg in enumerate(messages):
        want = pattern if culprit in (None, rank) else rf"rank {culprit} rejected their input"
        assert re.search(want, msg), f"rank {rank}: {msg}"
        assert msg.startswith("InputError: flex_attention under context parallel"), (
            f"rank {rank}: {msg}"
        )


# torch 2.13 deprecates return_lse= for return_aux=; the router passes either form through as given
@pytest.mark.filterwarnings("ignore:return_lse is deprecated:FutureWarning")
def test_outside_a_route_it_is_flex_attention() -> None:
    import torch.nn.attention.flex_attention as flex_module

    import ring_impl

    seq = DOC_IDS.numel()
    block_mask = flex_module.create_block_mask(document_causal, None, None, seq, seq, device="cpu")
    q, k, v, _ = _inputs(seq, torch.float32)
    k, v = k.repeat_interleave(2, 1), v.repeat_interleave(2, 1)
    got, lse = ring_impl.flex_attention(q, k, v, block_mask=block_mask, return_lse=True)
    want, want_lse = flex_module.flex_attention(q, k, v, block_mask=block_mask, return_lse=True)
    assert torch.equal(got, want) and torch.equal(lse, want_lse)
