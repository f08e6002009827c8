"""PyTorch defect, CPU flash kernel: NaN in the inputs does not always reach the outputs.

In exact arithmetic a NaN query element makes its whole output row NaN, and a NaN key makes
every row that sees it NaN. F.scaled_dot_product_attention on CPU (the flash kernel) returns
0 for a row whose query holds NaN, and a finite output for the first row of a causal call whose
only key holds NaN. PyTorch's context parallel runs this kernel on every block, so the ring
hides those NaNs too.
Exit status 1 while the defect is present, 0 once fixed. No project import.
"""

import sys

import torch
import torch.nn.functional as F

torch.manual_seed(0)
q, k, v = (torch.randn(1, 1, 8, 16) for _ in range(3))
bad_q = q.clone()
bad_q[0, 0, 5, 1] = float("nan")
row = F.scaled_dot_product_attention(bad_q, k, v)[0, 0, 5]
bad_k = k.clone()
bad_k[0, 0, 0, 1] = float("nan")
first = F.scaled_dot_product_attention(q, bad_k, v, is_causal=True)[0, 0, 0]
query_hidden, key_hidden = not bool(row.isnan().all()), not bool(first.isnan().all())
print(f"torch {torch.__version__}: row with a NaN query: {row[:4].tolist()} (NaN expected)")
print(
    f"torch {torch.__version__}: causal row 0, its one key NaN: {first[:4].tolist()} (NaN expected)"
)
present = query_hidden or key_hidden
print("DEFECT PRESENT" if present else "FIXED")
sys.exit(1 if present else 0)
