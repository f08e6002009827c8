"""PyTorch limitation, context parallel: load balancing refuses non-causal attention.

With ``enable_load_balance=True`` (what the public ``context_parallel`` turns on whenever the
sequence divides by 2 x world size) the templated ring raises "Load balancing requires
`is_causal=True`" for non-causal attention, although head-tail sharding is exact for it.
One gloo rank suffices. Exit status 1 while the limitation is present, 0 once lifted.
No project import.
"""

import sys

import torch
import torch.distributed as dist
from torch.distributed.tensor.experimental._context_parallel import _attention as att

dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
att._cp_options.enable_load_balance = True
q, k, v = (torch.randn(1, 2, 8, 16) for _ in range(3))
op = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default
try:
    att._templated_ring_attention(
        dist.group.WORLD, 2, op, q, k, v, is_causal=False, dropout_p=0.0, scale=0.25
    )
    present, what = False, "ran"
except RuntimeError as exc:
    present, what = "Load balancing requires" in str(exc), f"raised: {exc}"
dist.destroy_process_group()
print(f"torch {torch.__version__}: non-causal with load balancing {what}")
print("LIMITATION PRESENT" if present else "FIXED")
sys.exit(1 if present else 0)
