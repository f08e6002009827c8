"""The masked memory-efficient op's bias, on CPU: ``ring_impl.ops.cuda.additive_bias`` and the CPU
emulation ``cpu_efficient_masked_layout`` (the same bias, the kernel's alignment check, its
padded LSE) against the math op and, through the ring, against the float64 oracle.

The CUDA op itself (``cuda_efficient_masked``) is checked on a GPU runner by
``tests/ring_impl/test_cuda_kernels.py::test_masked_efficient_op_against_float64``
(``--device cuda``).
"""

from __future__ import annotations

import pytest
import torch

from ring_impl.ops import get_op
from ring_impl.ops.cpu import _checked_bias
from ring_impl.ops.cuda import BIAS_ALIGNMENT, additive_bias

from .oracle import assert_masked_op_matches_math, assert_ring_matches_oracle
from .rank_results import forward_backward, leaves, local_results, seeded_inputs


@pytest.mark.parametrize(
    "shape,mask_dims",
    [
        ((1, 2, 6, 40), (1, 1)),
        ((2, 4, 40, 6), (2, 4)),
        ((2, 2, 17, 33), (2, 1)),
        ((1, 1, 3, 32), None),
    ],
)
def test_additive_bias_values_and_alignment(shape, mask_dims) -> None:
    b, h, rows, cols = shape
    gen = torch.Generator().manual_seed(0)
    visible = torch.rand(*(mask_dims or ()), rows, cols, generator=gen) < 0.5
    bias = additive_bias(visible, torch.bfloat16, shape)
    assert bias.shape == shape and bias.dtype == torch.bfloat16
    want = torch.where(visible, 0.0, float("-inf")).expand(shape)
    assert torch.equal(bias.float(), want)
    assert bias.stride(-1) == 1 and all(st % BIAS_ALIGNMENT == 0 for st in bias.stride()[:-1]), (
        bias.stride()
    )
    m = visible.reshape(1, 1, rows, cols) if mask_dims is None else visible
    assert [st == 0 for st in bias.stride()[:2]] == [
        m.shape[0] == 1 and b > 1,
        m.shape[1] == 1 and h > 1,
    ]
    _checked_bias(bias)


def test_the_emulated_alignment_check_refuses_a_misaligned_bias() -> None:
    misaligned = torch.zeros(1, 1, 4, 6)  # row stride 6
    with pytest.raises(RuntimeError, match="not aligned"):
        _checked_bias(misaligned)
    with pytest.raises(RuntimeError, match="not aligned"):
        _checked_bias(torch.zeros(1, 1, 4, 32)[..., ::2])


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize(
    "shape,mask_dims", [((1, 2, 6, 40), (1, 1)), ((2, 4, 40, 6), (2, 4)), ((2, 2, 17, 33), (2, 1))]
)
def test_emulated_masked_efficient_op_equals_math(dtype, shape, mask_dims) -> None:
    """Forward (out, LSE trimmed from its padded layout) and backward on the rows that see
    something; those that see nothing get LSE 0 and a zero output gradient, as the ring gives."""
    b, h, sq, sk = shape
    gen = torch.Generator().manual_seed(1)
    q, do = (torch.randn(b, h, sq, 8, dtype=dtype, generator=gen) for _ in range(2))
    k, v = (torch.randn(b, h, sk, 8, dtype=dtype, generator=gen) for _ in range(2))
    visible = torch.rand(*mask_dims, sq, sk, generator=gen) < 0.5
    visible[..., 1, :] = False
    op = get_op("cpu_efficient_masked_layout")
    assert op.capabilities.masks and op.capabilities.lse_layout == "bhs_padded32"
    lse = assert_masked_op_matches_math(op, q, k, v, do, visible, scale=0.3)
    assert lse.shape[-1] == -(-sq // 32) * 32


def test_auto_never_picks_the_unverified_op() -> None:
    """cuda_efficient_masked is opt-in until it has run on a GPU; cuda_efficient's masked
    blocks keep running with the math op."""
    from ring_impl.ops import resolve_op
    from ring_impl.ops.calls import block_op

    for dtype in (torch.float32, torch.bfloat16):
        assert resolve_op("auto", torch.device("cuda"), dtype, 64).name != "cuda_efficient_masked"
    assert (
        block_op(
            get_op("cuda_efficient"),
            is_causal=False,
            scale=0.1,
            visible=torch.ones(1, 1, 2, 2, dtype=torch.bool),
        ).name
        == "math"
    )


HEADS, HEADS_KV, HEAD_DIM, SEQ = 4, 2, 8, 48


def _band_per_head(b, h, q_idx, kv_idx):
    """A mask with no structure the tiler cuts into unmasked calls: masked blocks reach the op."""
    return (kv_idx <= q_idx) & (q_idx - kv_idx <= 3 + 2 * h) | (kv_idx == 0)


def _oracle_visibility() -> torch.Tensor:
    i, j = torch.arange(SEQ).view(-1, 1), torch.arange(SEQ).view(1, -1)
    return torch.stack([_band_per_head(0, h, i, j) for h in range(HEADS)]).unsqueeze(
        0
    )  # (1, heads, seq, seq)


def _inputs(dtype: torch.dtype):
    return seeded_inputs(5, dtype, 1, HEADS, HEADS_KV, SEQ, HEAD_DIM)


def _ring_with_the_emulation(ctx, dtype):
    import ring_impl
    from ring_impl.masks import MaskMod
    from ring_impl.ops.cpu import CpuEfficientMaskedLayoutOp

    class Counted(CpuEfficientMaskedLayoutOp):
        masked = 0

        def forward(self, query, key, value, *, is_causal, scale, attn_mask=None):
            Counted.masked += attn_mask is not None
            return super().forward(
                query, key, value, is_causal=is_causal, scale=scale, attn_mask=attn_mask
            )

    q, k, v, dout = (
        ring_impl.shard(t, ctx.world_size, ctx.rank, layout="head_tail") for t in _inputs(dtype)
    )
    q, k, v = leaves(q, k, v)
    options = dict(mask=MaskMod(_band_per_head), layout="head_tail", op=Counted())
    out, lse = forward_backward(q, k, v, dout, rotate_method="alltoall", **options)
    return local_results(out, lse, q, k, v, masked=Counted.masked)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_ring_with_the_emulated_masked_op_matches_the_oracle(ring, dtype) -> None:
    """The ring hands masked blocks to an op that declares masks and a padded LSE: out, LSE,
    dQ, dK, dV against the float64 oracle at W=2 (head_tail, GQA, a head-dependent mask)."""

    results = ring.rank_pool(2).run(_ring_with_the_emulation, dtype, timeout=120.0)
    assert all(r["masked"] > 0 for r in results), [r["masked"] for r in results]
    assert_ring_matches_oracle(
        "cpu_efficient_masked_layout, W=2, head_tail",
        results,
        _inputs(dtype),
        _oracle_visibility(),
        layout="head_tail",
        world_size=2,
        dtype=dtype,
    )
