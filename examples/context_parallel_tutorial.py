"""PyTorch's "Introduction to Context Parallel" example, on CPU + gloo, with this package.

Run:  torchrun --standalone --nproc-per-node=4 examples/context_parallel_tutorial.py

The only changes from the tutorial: the imports come from ``ring_impl``, the device is the
CPU with gloo, and the CPU flash kernel stands in for SDPBackend.FLASH_ATTENTION (on CUDA the
same script runs unchanged with backend "nccl" and device "cuda").
"""

import os
import sys

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.device_mesh import init_device_mesh
from torch.nn.attention import SDPBackend, sdpa_kernel

from ring_impl import context_parallel, context_parallel_unshard


def context_parallel_sdpa_example(world_size: int, rank: int) -> None:
    device_type = "cuda" if torch.cuda.is_available() else "cpu"
    if device_type == "cuda":
        torch.cuda.set_device(f"cuda:{rank}")
    torch.manual_seed(0)

    dist.init_process_group(
        backend="nccl" if device_type == "cuda" else "gloo",
        init_method="env://",
        world_size=world_size,
        rank=rank,
    )
    device_mesh = init_device_mesh(
        device_type=device_type, mesh_shape=(world_size,), mesh_dim_names=("cp",)
    )

    batch = 8
    nheads = 8
    qkv_len = 64
    dim = 32
    backend = SDPBackend.FLASH_ATTENTION
    dtype = (
        torch.bfloat16
        if backend in (SDPBackend.FLASH_ATTENTION, SDPBackend.CUDNN_ATTENTION)
        else torch.float32
    )

    qkv = [
        torch.rand(
            (batch, nheads, qkv_len, dim), dtype=dtype, requires_grad=True, device=device_type
        )
        for _ in range(3)
    ]
    # specify the SDPBackend to use
    with sdpa_kernel(backend):
        out = F.scaled_dot_product_attention(*qkv, is_causal=True)

    # make a clean copy of QKV for output comparison
    cp_qkv = [t.detach().clone() for t in qkv]

    with sdpa_kernel(backend):
        # `context_parallel()` shards the tensors in `buffers` in place along `buffer_seq_dims`
        # and runs `F.scaled_dot_product_attention` as ring attention while active.
        with context_parallel(device_mesh, buffers=tuple(cp_qkv), buffer_seq_dims=(2, 2, 2)):
            cp_out = F.scaled_dot_product_attention(*cp_qkv, is_causal=True)

        # cp_out is sharded like QKV; unshard it to compare with the single-device result.
        (cp_out,) = context_parallel_unshard(device_mesh, [cp_out], [2])

    assert torch.allclose(
        cp_out,
        out,
        atol=(1e-08 if dtype == torch.float32 else 1e-03 * world_size),
    ), f"max difference {(cp_out.float() - out.float()).abs().max().item():.3e}"
    if rank == 0:
        print(
            f"context parallel SDPA on {world_size} ranks matches single-process SDPA "
            f"(max difference {(cp_out.float() - out.float()).abs().max().item():.1e})"
        )


LAUNCH = "torchrun --standalone --nproc-per-node=4 examples/context_parallel_tutorial.py"

if __name__ == "__main__":
    if "RANK" not in os.environ or "WORLD_SIZE" not in os.environ:
        # Started without a launcher: there are no other ranks to rendezvous with.
        sys.exit(
            f"context_parallel_tutorial.py runs one process per rank; launch it with: {LAUNCH}"
        )
    rank = int(os.environ["RANK"])
    world_size = int(os.environ["WORLD_SIZE"])

    try:
        context_parallel_sdpa_example(world_size, rank)
    finally:
        dist.barrier()
        dist.destroy_process_group()
