"""Merging partial attention results through their log-sum-exp.

Two partial results over disjoint key sets, ``(o1, l1)`` and ``(o2, l2)``, combine to

    lse = log(exp(l1) + exp(l2))
    out = (exp(l1) * o1 + exp(l2) * o2) / exp(lse)

Written that way ``exp`` overflows for large logits. The sigmoid form below is the same
algebra with every exponential bounded (see zhuzilin/ring-flash-attention#34 for the
derivation):

    # new_lse = lse + torch.log(1 + torch.exp(block_lse - lse))
    out = out - sigmoid(block_lse - lse) * (out - block_out)
    lse = lse - logsigmoid(lse - block_lse)
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

__all__ = ["merge_into"]


def merge_into(out: torch.Tensor, lse: torch.Tensor, block_out: torch.Tensor, block_lse: torch.Tensor) -> None:
    """Merge one block's partial result into the running accumulators, in place.

    Args:
        out: running output (batch, heads, rows, head_dim) in the accumulation dtype; may be a
            view into a larger accumulator (head-tail steps update half the rows).
        lse: running LSE (batch, heads, rows), same dtype as ``out``.
        block_out: the block's output (batch, heads, rows, head_dim), any float dtype.
        block_lse: the block's normalised LSE (batch, heads, rows).
    """
    block_lse = block_lse.to(lse.dtype)
    weight = torch.sigmoid(block_lse - lse).unsqueeze(-1)
    out.sub_(weight * (out - block_out.to(out.dtype)))
    lse.sub_(F.logsigmoid(lse - block_lse))
