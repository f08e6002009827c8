"""Normalising the log-sum-exp of every kernel to one layout before the merge.

Kernels disagree on LSE layout (see :data:`ring_impl.ops.LSE_LAYOUTS`): memory-efficient
attention pads the sequence dim to a multiple of 32 and leaves undefined values in the padding;
cuDNN adds a trailing dim of 1. Merging an untrimmed LSE silently mixes garbage into the result,
so the shape is checked against the op's declaration and a mismatch is an error, not a guess.
"""

from __future__ import annotations

import torch

__all__ = ["normalize_lse"]


def normalize_lse(
    lse: torch.Tensor, *, batch: int, heads: int, seq_q: int, layout: str, op_name: str = "op"
) -> torch.Tensor:
    """Return the LSE as a contiguous ``(batch, heads, seq_q)`` tensor.

    Args:
        lse: the LSE as the op returned it, in its native ``layout``.
        layout: ``"bhs"``, ``"bhs_padded32"`` or ``"bhs1"``.
    """
    if layout == "bhs":
        expected: tuple[int, ...] = (batch, heads, seq_q)
    elif layout == "bhs_padded32":
        expected = (batch, heads, -(-seq_q // 32) * 32)
    elif layout == "bhs1":
        expected = (batch, heads, seq_q, 1)
    else:
        raise ValueError(
            f"{op_name}: unknown LSE layout {layout!r}; expected one of bhs, bhs_padded32, bhs1"
        )
    if tuple(lse.shape) != expected:
        raise RuntimeError(
            f"{op_name} returned LSE of shape {tuple(lse.shape)} but declares layout {layout!r}, "
            f"which for (batch={batch}, heads={heads}, seq_q={seq_q}) means {expected}; "
            "fix the op's capabilities.lse_layout"
        )
    if layout == "bhs_padded32":
        lse = lse[..., :seq_q]  # the padding holds undefined values
    elif layout == "bhs1":
        lse = lse.squeeze(-1)
    return lse.contiguous()
