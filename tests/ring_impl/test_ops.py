"""The local attention ops against torch's float64 math SDPA:
the ring is only as right as they are."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from ring_impl import ops
from ring_impl.numerics.lse import normalize_lse

CPU_OPS = ["math", "cpu_flash", "cpu_efficient_layout", "cpu_cudnn_layout"]


def _sdpa64(q, k, v, is_causal, scale):
    """float64 output, LSE and gradients from autograd of torch's math attention."""
    q, k, v = (t.detach().double().requires_grad_() for t in (q, k, v))
    g = q.shape[1] // k.shape[1]
    kk, vv = k.repeat_interleave(g, 1), v.repeat_interleave(g, 1)
    s = q @ kk.transpose(-1, -2) * scale
    if is_causal:
        s = s.masked_fill(~torch.ones(s.shape[-2:], dtype=torch.bool).tril(), float("-inf"))
    out = torch.softmax(s, -1) @ vv
    return q, k, v, out, s.logsumexp(-1)


def _in_memory(t: torch.Tensor, memory: str) -> torch.Tensor:
    """``t`` as a view with the given memory: "contiguous"; "bshd", the transposed view of a
    (batch, seq, heads, dim) tensor; "strided_head_dim", every other element of a buffer twice
    as wide (``x[..., ::2]``), NaN between, so a kernel that ignores the stride reads NaN."""
    if memory == "bshd":
        return t.transpose(1, 2).contiguous().transpose(1, 2)
    if memory == "strided_head_dim":
        return torch.stack([t, torch.full_like(t, float("nan"))], dim=-1)[..., 0]
    return t


@pytest.mark.parametrize("name", CPU_OPS)
@pytest.mark.parametrize("is_causal", [False, True])
@pytest.mark.parametrize("heads_kv", [4, 2, 1])
@pytest.mark.parametrize("memory", ["contiguous", "bshd", "strided_head_dim"])
def test_forward_backward_match_float64_attention(
    name: str, is_causal: bool, heads_kv: int, memory: str
) -> None:
    """Any strides: aten's CPU flash kernel reads a head dim of stride 2 as if it were 1 (torch
    2.13), which gave Ulysses on one rank (no all-to-all to copy its inputs) wrong answers."""
    torch.manual_seed(0)
    q = torch.randn(2, 4, 6, 8, dtype=torch.float64)
    k = torch.randn(2, heads_kv, 6, 8, dtype=torch.float64)
    v = torch.randn(2, heads_kv, 6, 8, dtype=torch.float64)
    grad = torch.randn(2, 4, 6, 8, dtype=torch.float64)
    op = ops.get_op(name)
    scale = 0.3
    qm, km, vm, gm = (_in_memory(t, memory) for t in (q, k, v, grad))
    out, raw_lse = ops.call_forward(op, qm, km, vm, is_causal=is_causal, scale=scale)
    lse = normalize_lse(raw_lse, batch=2, heads=4, seq_q=6, layout=op.capabilities.lse_layout)
    dq, dk, dv = ops.call_backward(
        op, gm, qm, km, vm, _in_memory(out, memory), lse, is_causal=is_causal, scale=scale
    )
    rq, rk, rv, rout, rlse = _sdpa64(q, k, v, is_causal, scale)
    rout.backward(grad)
    for got, want in ((out, rout), (lse, rlse), (dq, rq.grad), (dk, rk.grad), (dv, rv.grad)):
        assert got.dtype == torch.float64
        torch.testing.assert_close(got, want.detach(), atol=1e-12, rtol=0)


@pytest.mark.parametrize("name", CPU_OPS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_low_precision_output_dtype_and_lse_dtype(name: str, dtype: torch.dtype) -> None:
    q = torch.randn(1, 2, 5, 8, dtype=dtype)
    op = ops.get_op(name)
    out, raw_lse = op.forward(q, q, q, is_causal=False, scale=0.5)
    assert out.dtype == dtype
    assert raw_lse.dtype == torch.float32


def test_math_op_is_float64_accurate_with_cross_lengths() -> None:
    q, k = (
        torch.randn(1, 2, 3, 8, dtype=torch.float64),
        torch.randn(1, 2, 11, 8, dtype=torch.float64),
    )
    out, lse = ops.get_op("math").forward(q, k, k, is_causal=False, scale=1 / math.sqrt(8))
    want = F.scaled_dot_product_attention(q, k, k)
    torch.testing.assert_close(out, want, atol=1e-13, rtol=0)
    torch.testing.assert_close(
        lse, (q @ k.transpose(-1, -2) / math.sqrt(8)).logsumexp(-1), atol=1e-13, rtol=0
    )


def test_efficient_layout_pads_lse_with_garbage_that_trimming_removes() -> None:
    q = torch.randn(1, 2, 5, 8)
    op = ops.get_op("cpu_efficient_layout")
    _, padded = op.forward(q, q, q, is_causal=False, scale=0.3)
    assert padded.shape == (1, 2, 32)
    _, plain = ops.get_op("cpu_flash").forward(q, q, q, is_causal=False, scale=0.3)
    # The padding must not look like a valid LSE, or untrimmed merges would go unnoticed.
    assert (padded[..., 5:] - plain.mean()).abs().min() > 1.0
    torch.testing.assert_close(
        normalize_lse(padded, batch=1, heads=2, seq_q=5, layout="bhs_padded32"), plain
    )


def test_cudnn_layout_has_trailing_dim() -> None:
    q = torch.randn(1, 2, 5, 8)
    _, lse = ops.get_op("cpu_cudnn_layout").forward(q, q, q, is_causal=True, scale=0.3)
    assert lse.shape == (1, 2, 5, 1)
    assert normalize_lse(lse, batch=1, heads=2, seq_q=5, layout="bhs1").shape == (1, 2, 5)


def test_normalize_lse_rejects_a_shape_that_contradicts_the_declared_layout() -> None:
    with pytest.raises(RuntimeError, match="declares layout 'bhs'"):
        normalize_lse(
            torch.zeros(1, 2, 32), batch=1, heads=2, seq_q=5, layout="bhs", op_name="my_op"
        )


def test_registry_errors_name_the_fix() -> None:
    with pytest.raises(ValueError, match=r"registered ops: .*cpu_flash"):
        ops.get_op("no_such_op")
    with pytest.raises(ValueError, match="replace=True"):
        ops.register_op(ops.MathOp())
    with pytest.raises(TypeError, match="lacks"):
        ops.resolve_op(object(), torch.device("cpu"), torch.float32, 8)


def test_auto_picks_cpu_flash_on_cpu() -> None:
    assert ops.resolve_op("auto", torch.device("cpu"), torch.bfloat16, 64).name == "cpu_flash"


def test_capabilities_explain_what_is_unsupported() -> None:
    caps = ops.get_op("cuda_flash").capabilities
    assert "device 'cpu'" in caps.unsupported(torch.device("cpu"), torch.bfloat16, 64)
    assert "dtype float64" in caps.unsupported(torch.device("cuda"), torch.float64, 64)
    assert "multiple of 8" in caps.unsupported(torch.device("cuda"), torch.bfloat16, 12)
    assert caps.unsupported(torch.device("cuda"), torch.bfloat16, 64) is None


class _BoundedHeadDims:
    """CPU flash declaring head dims up to 32 (as CUDA kernels bound theirs); records the head
    dims its backward is given."""

    name = "cpu_flash_up_to_32"

    def __init__(self):
        from dataclasses import replace

        self._flash = ops.get_op("cpu_flash")
        self.capabilities = replace(self._flash.capabilities, head_dims=(8, 32))
        self.backward_head_dims: list[int] = []

    def forward(self, query, key, value, *, is_causal, scale):
        return self._flash.forward(query, key, value, is_causal=is_causal, scale=scale)

    def backward(self, grad_out, query, key, value, out, lse, *, is_causal, scale):
        self.backward_head_dims.append(query.shape[-1])
        args = (grad_out, query, key, value, out, lse)
        return self._flash.backward(*args, is_causal=is_causal, scale=scale)


@pytest.mark.parametrize("head_dim, padded", [(24, 32), (32, None)])
@pytest.mark.parametrize("is_causal", [False, True])
def test_lse_gradient_reaches_an_op_without_it_or_the_math_op(head_dim, padded, is_causal) -> None:
    """The LSE's gradient folded into a padded head dim (ops.calls._with_lse_grad) where the op
    takes that head dim (24 -> 32); the math op, with the gradient as it is, where it does not
    (32 -> 40 > the op's 32): both the float64 gradients of out . grad_out + lse . grad_lse."""
    torch.manual_seed(0)
    q, k, v, grad = (torch.randn(2, 4, 6, head_dim, dtype=torch.float64) for _ in range(4))
    grad_lse = torch.randn(2, 4, 6, dtype=torch.float64)
    op, scale = _BoundedHeadDims(), 0.3
    out, lse = ops.call_forward(op, q, k, v, is_causal=is_causal, scale=scale)
    dq, dk, dv = ops.call_backward(
        op, grad, q, k, v, out, lse, is_causal=is_causal, scale=scale, grad_lse=grad_lse
    )
    assert op.backward_head_dims == ([padded] if padded else [])
    rq, rk, rv, rout, rlse = _sdpa64(q, k, v, is_causal, scale)
    ((rout * grad).sum() + (rlse * grad_lse).sum()).backward()
    for got, want in ((dq, rq.grad), (dk, rk.grad), (dv, rv.grad)):
        torch.testing.assert_close(got, want, atol=1e-12, rtol=0)
