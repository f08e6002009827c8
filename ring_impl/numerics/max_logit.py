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
blocks, one block matmul per kernel call of the step's plan (:mod:`ring_impl.planning.plan`: skipped
steps, trimmed rows and columns and masked-out entries are excluded as the kernel excludes
them), in the accumulation dtype (float32; float64 for float64), in row slices of at most
``_SLICE_ENTRIES`` scores, and keeps the running maximum across steps. A causal block's slice
computes only the columns its rows can see; the scale multiplies the (heads,) result, not every
score (``max(scale * s)`` is ``scale * max(s)`` for a positive scale and ``scale * min(s)`` for a
negative one, exactly: rounding is monotone). The group agrees with one ``all_reduce`` (MAX) at
the end of the forward. Nothing of this runs without ``return_max_logit``.
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
    reads key head ``h // (heads // heads_kv)``); ``kind`` as
    :class:`ring_impl.planning.plan.Block`: ``full`` (every entry), ``causal`` (top-left: row ``t``
    sees columns ``0..t``), ``masked`` (``visible``: (batch or 1, heads or 1, rows, cols) bool) or
    ``ranges`` (``bounds``: (lo, hi), (rows,), row ``r`` sees columns ``lo[r] .. hi[r] - 1``). -inf
    for a head that sees nothing; NaN for one a NaN logit reaches."""
    b, h, rows, d = q.shape
    hkv, cols = k.shape[1], k.shape[2]
    group = h // hkv
    kt = k.to(dtype).transpose(-2, -1)  # (b, hkv, d, cols)
    # max(scale * s) is scale * max(s) for scale > 0 and scale * min(s) for scale < 0, exactly
    # (rounding is monotone): the scale multiplies (heads,) values, not every score.
    sign = 1.0 if scale > 0 else -1.0 if scale < 0 else 0.0
    best = torch.full((h,), float("-inf"), dtype=dtype, device=q.device)
    step = max(1, _SLICE_ENTRIES // max(1, b * h * cols))
    for r0 in range(0, rows, step):
        r1 = min(rows, r0 + step)
        # causal: these rows see no column from r1 on, and every column before r0
        c1 = min(cols, r1) if kind == "causal" else cols
        # a key/value head's query heads stacked on the rows: one plain batched matmul
        qs = q[:, :, r0:r1].to(dtype).reshape(b, hkv, group * (r1 - r0), d)
        s = (qs @ kt[..., :c1]).view(b, h, r1 - r0, c1)
        if sign < 0:
            s.neg_()
        elif sign == 0:
            s.mul_(0.0)  # 0 where finite, NaN where a score is NaN or infinite
        _hide(s, kind, r0, r1, visible, bounds)
        best = torch.maximum(best, s.amax(dim=(0, 2, 3)))
    return best if sign == 0 else best * scale if sign > 0 else best.neg() * scale


def _hide(s: torch.Tensor, kind: str, r0: int, r1: int, visible, bounds) -> None:
    """Set -inf in ``s`` (batch, heads, r1 - r0, cols), the block's rows [r0, r1), where they see
    nothing; a full block hides nothing."""
    if kind == "full":
        return
    device, cols = s.device, s.shape[-1]
    if kind == "causal":  # row t sees columns 0..t: only columns r0.. can be hidden
        if cols > r0 + 1:
            tri = torch.ones(r1 - r0, cols - r0, dtype=torch.bool, device=device).triu(1)
            s[..., r0:].masked_fill_(tri, float("-inf"))
        return
    if kind == "ranges":
        assert bounds is not None
        col = torch.arange(cols, device=device).view(1, -1)
        lo, hi = bounds[0][r0:r1].view(-1, 1), bounds[1][r0:r1].view(-1, 1)
        s.masked_fill_((col < lo) | (col >= hi), float("-inf"))
        return
    if kind == "masked":
        assert visible is not None
        s.masked_fill_(~visible[:, :, r0:r1], float("-inf"))
        return
    raise ValueError(f"block kind {kind!r} has no max-logit rule")


def reduce_max_logit(
    local: torch.Tensor, pg: dist.ProcessGroup | None, *, stage_on_host: bool = False
) -> torch.Tensor:
    """The group's maximum of every rank's ``local`` (heads,), in one all-reduce (MAX) over
    ``pg`` (None: the default group, as torch.distributed takes it).

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


def max_logit_problem(return_max_logit, *, exchange: str) -> str | None:
    """What is wrong with ``return_max_logit`` for a call of the ring's exchanges, or None: it is
    a bool, and only the ring computes it (the halo exchange and the sparse gather do not)."""
    if return_max_logit is False:
        return None
    if not isinstance(return_max_logit, bool):
        kind = type(return_max_logit).__name__
        return f"return_max_logit must be a bool, got {return_max_logit!r} ({kind})"
    if exchange in ("halo", "gather"):
        return (
            f"return_max_logit=True runs on the ring only, and exchange={exchange!r} asks for the "
            f"{'halo exchange' if exchange == 'halo' else 'sparse gather'}; pass exchange='auto' "
            "(the ring then serves the call)"
        )
    return None
