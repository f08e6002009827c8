"""PyTorch defect, CPU flash kernel: causal attention with scale <= 0 returns NaN.

F.scaled_dot_product_attention on CPU picks the flash kernel, which masks with -inf * scale
(NaN for scale 0, +inf for scale < 0); the math backend is finite. PyTorch's context parallel
runs this kernel on every block, so a causal call with scale <= 0 is NaN on every rank.
Exit status 1 while the defect is present, 0 once fixed. No project import.
"""

import sys

import torch
import torch.nn.functional as F

torch.manual_seed(0)
q, k, v = (torch.randn(1, 1, 8, 16) for _ in range(3))
present = False
for scale in (0.0, -0.3):
    flash = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale)
    math_ = torch.ops.aten._scaled_dot_product_attention_math(q, k, v, is_causal=True, scale=scale)[
        0
    ]
    bad = bool(flash.isnan().any()) and not bool(math_.isnan().any())
    present |= bad
    print(
        f"torch {torch.__version__}: causal, scale {scale}: flash NaN {bool(flash.isnan().any())}, "
        f"math NaN {bool(math_.isnan().any())}"
    )
print("DEFECT PRESENT" if present else "FIXED")
sys.exit(1 if present else 0)
