"""The per-head maximum attention logit (``ring_attention(..., return_max_logit=True)``).

What QK-clip optimisers (MuonClip) read after each step to rescale the query and key
projections: per query head, the largest scaled logit ``scale * q_i . k_j`` over the batch, every
query row on every rank and every key that row sees under causality and the mask, before the
softmax (TransformerEngine's ``return_max_logit``, MagiAttention's ``return_max_logits``: the
maximum of the masked score matrix, shape (heads,)). Sink logits are not logits of keys and are
not part of it. Rows that see nothing contribute nothing; a head that sees nothing gets -inf. A
NaN that reaches a logit some row sees (a NaN in that query row or that key) makes its head's
maximum NaN; a NaN in a key no row of a head sees does not. Not differentiable.

Attention kernels do not return it and it cannot be recovered from the LSE (the LSE bounds it
only: ``max <= lse``), so the ring computes it per ring step from the step's query and key
blocks, one block matmul per kernel call of the step's plan (:mod:`ring_impl.plan`: skipped
steps, trimmed rows and columns and masked-out entries are excluded as the kernel excludes
them), in the accumulation dtype (float32; float64 for float64), and keeps the running maximum
across steps. The group agrees with one ``all_reduce`` (MAX) at the end of the forward. Nothing
of this runs without ``return_max_logit``.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

__all__ = ["block_max_logit", "max_logit_problem", "reduce_max_logit"]

#: Score entries one slice of a block's matmul holds at once (bounds the extra memory to 16 MiB
#: in float32 whatever the block's size).
_SLICE_ENTRIES = 1 << 22


def block_max_logit(
    q: torch.Tensor,
    k: torch.Tensor,
    *,
    scale: float,
    kind: str,
    visible: torch.Tensor | None = None,
    bounds: tuple[torch.Tensor, torch.Tensor] | None = None,
    dtype: torch.dtype,
) -> torch.Tensor:
    """(heads,) in ``dtype``: the largest ``scale * q_i . k_j`` over the (i, j) the block shows.

    q (batch, heads, rows, head_dim), k (batch, heads_kv, cols, head_dim) (GQA: query head ``h``
    reads key head ``h // (heads // heads_kv)``); ``kind`` as :class:`ring_impl.plan.Block`:
    ``full`` (every entry), ``causal`` (top-left: row ``t`` sees columns ``0..t``), ``masked``
    (``visible``: (batch or 1, heads or 1, rows, cols) bool) or ``ranges`` (``bounds``: (lo, hi),
    (rows,), row ``r`` sees columns ``lo[r] .. hi[r] - 1``). -inf for a head that sees nothing;
    NaN for one a NaN logit reaches."""
    b, h, rows, d = q.shape
    hkv, cols = k.shape[1], k.shape[2]
    group = h // hkv
    kk = k.to(dtype).unsqueeze(2)  # (b, hkv, 1, cols, d)
    best = torch.full((h,), float("-inf"), dtype=dtype, device=q.device)
    step = max(1, _SLICE_ENTRIES // max(1, b * h * cols))
    for r0 in range(0, rows, step):
        r1 = min(rows, r0 + step)
        qs = q[:, :, r0:r1].to(dtype).reshape(b, hkv, group, r1 - r0, d)
        s = (qs @ kk.transpose(-2, -1)).reshape(b, h, r1 - r0, cols) * scale
        seen = _seen(kind, r0, r1, cols, visible, bounds, q.device)
        if seen is not None:
            s = torch.where(seen, s, torch.full((), float("-inf"), dtype=dtype, device=q.device))
        best = torch.maximum(best, s.amax(dim=(0, 2, 3)))
    return best


def _seen(kind: str, r0: int, r1: int, cols: int, visible, bounds, device) -> torch.Tensor | None:
    """Rows [r0, r1) of the block's visibility, broadcastable to (batch, heads, rows, cols); None
    for a full block."""
    if kind == "full":
        return None
    col = torch.arange(cols, device=device)
    if kind == "causal":
        return col.view(1, -1) <= torch.arange(r0, r1, device=device).view(-1, 1)
    if kind == "ranges":
        assert bounds is not None
        lo, hi = bounds[0][r0:r1].view(-1, 1), bounds[1][r0:r1].view(-1, 1)
        return (col.view(1, -1) >= lo) & (col.view(1, -1) < hi)
    if kind == "masked":
        assert visible is not None
        return visible[:, :, r0:r1]
    raise ValueError(f"block kind {kind!r} has no max-logit rule")


def reduce_max_logit(
    local: torch.Tensor, pg: dist.ProcessGroup, *, stage_on_host: bool = False
) -> torch.Tensor:
    """The group's maximum of every rank's ``local`` (heads,), in one all-reduce (MAX).

    A collective's MAX need not carry NaN (gloo's takes ``max(a, b)``, which drops a NaN in
    ``b``), so NaN travels as a flag beside the values: the all-reduce's input is (2, heads),
    the values with NaN as -inf and 1 where a rank's value is NaN."""
    nan = torch.isnan(local)
    packed = torch.stack([local.masked_fill(nan, float("-inf")), nan.to(local.dtype)])
    staged = packed.cpu() if stage_on_host else packed
    dist.all_reduce(staged, op=dist.ReduceOp.MAX, group=pg)
    packed = staged.to(local.device) if stage_on_host else staged
    return torch.where(
        packed[1] > 0,
        torch.full((), float("nan"), dtype=local.dtype, device=local.device),
        packed[0],
    )


def max_logit_problem(return_max_logit, *, halo, sparse_kv) -> str | None:
    """What is wrong with ``return_max_logit`` for a ``strategy="ring"`` call, or None: it is a
    bool, and only the ring computes it (the halo exchange and the sparse gather do not)."""
    if return_max_logit is False:
        return None
    if not isinstance(return_max_logit, bool):
        kind = type(return_max_logit).__name__
        return f"return_max_logit must be a bool, got {return_max_logit!r} ({kind})"
    if halo is True:
        return (
            "return_max_logit=True runs on the ring only, and halo=True asks for the halo "
            "exchange; pass halo=None (the ring then serves the call)"
        )
    if sparse_kv is True:
        return (
            "return_max_logit=True runs on the ring only, and sparse_kv=True asks for the sparse "
            "gather; pass sparse_kv=False"
        )
    return None
