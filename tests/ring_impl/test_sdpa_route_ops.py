"""Which kernel a routed SDPA call runs: SDPA's own choice among the enabled backends.

Under ``context_parallel`` an ``F.scaled_dot_product_attention`` call becomes ring attention;
with no ``op=`` the ring runs the kernel of the first enabled SDPA backend that takes the call.
On a GPU run (torch 2.11, H100) a float64 call went to FlashAttention, which rejects float64, so
every float64 model under ``context_parallel`` failed on CUDA; SDPA itself sends it to math.
The choice is made from tensor metadata only, so it is checked here without a GPU.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from torch.nn.attention import SDPBackend, sdpa_kernel

from ring_impl.torch_api.sdpa_route import Route, _ops_from_sdpa_kernel

ALL_CUDA = ("cuda_flash", "cudnn", "cuda_efficient", "math")


def _query(device: str, dtype: torch.dtype, head_dim: int = 64):
    # op_for reads the device, dtype and head size only: no CUDA tensor is needed.
    return SimpleNamespace(device=torch.device(device), dtype=dtype, shape=(1, 2, 8, head_dim))


def _route(cuda_ops: tuple[str, ...], cpu_ops: tuple[str, ...] = ("cpu_flash", "math")) -> Route:
    group = SimpleNamespace(group_name="g")
    return Route(
        group=group,
        layout="contiguous",
        rotate_method=None,
        op=None,  # type: ignore[arg-type]
        kernel_ops=(("cpu", cpu_ops), ("cuda", cuda_ops)),
    )


@pytest.mark.parametrize(
    ("dtype", "expected"),
    [
        (torch.bfloat16, "cuda_flash"),
        (torch.float16, "cuda_flash"),
        (torch.float32, "cuda_efficient"),  # flash and cuDNN take 16-bit inputs only
        (torch.float64, "math"),  # no fused CUDA kernel takes float64
    ],
)
def test_cuda_call_runs_the_first_enabled_kernel_that_takes_its_dtype(dtype, expected) -> None:
    assert _route(ALL_CUDA).op_for(_query("cuda", dtype), None, False) == expected


def test_causal_nonpositive_scale_avoids_kernels_that_fault_there() -> None:
    # FlashAttention and cuDNN return inf/NaN for causal attention with scale <= 0 (measured on
    # an H100); the memory-efficient kernel does not.
    route = _route(ALL_CUDA)
    q = _query("cuda", torch.bfloat16)
    assert route.op_for(q, -0.3, True) == "cuda_efficient"
    assert route.op_for(q, 0.0, True) == "cuda_efficient"
    assert route.op_for(q, -0.3, False) == "cuda_flash"
    assert (
        _route(("cpu_flash", "math")).op_for(_query("cpu", torch.float32), None, False)
        == "cpu_flash"
    )
    assert _route(ALL_CUDA).op_for(_query("cpu", torch.float32), -0.3, True) == "math"


def test_head_size_outside_a_kernel_goes_to_the_next() -> None:
    # cuDNN takes head_dim <= 128 and flash <= 256: head_dim 192 in bf16 with flash disabled
    # goes past cuDNN to the memory-efficient kernel.
    route = _route(("cudnn", "cuda_efficient", "math"))
    assert (
        route.op_for(_query("cuda", torch.bfloat16, head_dim=192), None, False) == "cuda_efficient"
    )


def test_no_enabled_kernel_takes_the_call_names_the_first() -> None:
    # SDPA raises when no enabled backend takes a call; the ring runs the first kernel, whose
    # input check then raises on every rank with its reason.
    assert (
        _route(("cuda_flash",)).op_for(_query("cuda", torch.float64), None, False) == "cuda_flash"
    )


def test_the_route_own_op_wins() -> None:
    route = Route(
        group=SimpleNamespace(group_name="g"),
        layout="contiguous",
        rotate_method=None,  # type: ignore[arg-type]
        op="math",
        kernel_ops=(("cuda", ALL_CUDA),),
    )
    assert route.op_for(_query("cuda", torch.bfloat16), None, False) == "math"


@pytest.mark.parametrize(
    ("backends", "cuda", "cpu"),
    [
        (None, ("cuda_flash", "cudnn", "cuda_efficient", "math"), ("cpu_flash", "math")),
        ([SDPBackend.EFFICIENT_ATTENTION], ("cuda_efficient",), ("cpu_flash",)),
        ([SDPBackend.MATH], ("math",), ("math",)),
        (
            [SDPBackend.FLASH_ATTENTION, SDPBackend.MATH],
            ("cuda_flash", "math"),
            ("cpu_flash", "math"),
        ),
        ([SDPBackend.CUDNN_ATTENTION], ("cudnn",), ("cpu_flash",)),
    ],
)
def test_enabled_backends_in_the_ring_preference_order(backends, cuda, cpu) -> None:
    if backends is None:
        assert _ops_from_sdpa_kernel("cuda") == cuda and _ops_from_sdpa_kernel("cpu") == cpu
        return
    with sdpa_kernel(backends):
        assert _ops_from_sdpa_kernel("cuda") == cuda
        assert _ops_from_sdpa_kernel("cpu") == cpu
