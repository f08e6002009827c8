"""PyTorch behaviour, context parallel: float64 attention is merged in float32 by default.

``_cp_options.convert_to_f32`` (default True) casts every block's partial output and LSE to
float32 before the merge, even for float64 inputs, so a float64 ring is about 1e-7 off where
float64 attention is about 1e-15 off; it shows at one rank already.
Exit status 1 while it is so, 0 once float64 stays float64. No project import.
"""

import sys

import torch
import torch.distributed as dist
from torch.distributed.tensor.experimental._context_parallel import _attention as att

dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
att._cp_options.enable_load_balance = False
torch.manual_seed(0)
q, k, v = (torch.randn(1, 2, 16, 16, dtype=torch.float64) for _ in range(3))
op = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default
ring = att._templated_ring_attention(
    dist.group.WORLD, 2, op, q, k, v, is_causal=True, dropout_p=0.0, scale=0.25
)[0]
exact = torch.ops.aten._scaled_dot_product_attention_math(q, k, v, is_causal=True, scale=0.25)[0]
dist.destroy_process_group()
err = float((ring - exact).abs().max())
print(
    f"torch {torch.__version__}: float64 ring vs float64 attention at W=1: max difference {err:.3g}"
)
present = err > 1e-12
print("PRESENT" if present else "FIXED")
sys.exit(1 if present else 0)
