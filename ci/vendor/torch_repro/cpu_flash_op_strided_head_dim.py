"""PyTorch defect, CPU flash op: inputs whose head dim is strided give wrong results, silently.

``aten._scaled_dot_product_flash_attention_for_cpu`` reads query/key/value as if their last dim
were contiguous; given a view with a stride on it (``t[..., ::2]``) it returns wrong numbers
without an error. F.scaled_dot_product_attention is right (it makes the inputs contiguous
first), but PyTorch's context parallel ring calls the op directly on the tensors it is given.
Exit status 1 while the defect is present, 0 once fixed (right, or an error). No project import.
"""

import sys

import torch

op = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default
torch.manual_seed(0)
q, k, v = (torch.randn(1, 2, 16, 32)[..., ::2] for _ in range(3))  # head_dim 16, stride 2
try:
    strided = op(q, k, v, 0.0, True, scale=0.25)[0]
except RuntimeError as exc:
    print(f"torch {torch.__version__}: the op refuses a strided head dim: {exc}")
    print("FIXED")
    sys.exit(0)
dense = op(q.contiguous(), k.contiguous(), v.contiguous(), 0.0, True, scale=0.25)[0]
err = float((strided - dense).abs().max())
print(f"torch {torch.__version__}: strided head dim vs contiguous copies: max difference {err:.3g}")
present = err > 1e-5
print("DEFECT PRESENT" if present else "FIXED")
sys.exit(1 if present else 0)
