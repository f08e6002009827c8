"""Variable-length ("varlen") flash attention as the ring's kernel, masked blocks included.

FlashAttention-2's varlen kernel runs many independent sequences in one call. Queries are packed
``(total_q, heads, head_dim)``, keys and values ``(total_k, heads_kv, head_dim)``; sequence ``i``
is query rows ``cu_q[i]:cu_q[i+1]`` against key rows ``cu_k[i]:cu_k[i+1]``. Within a sequence of
``sq`` queries and ``sk`` keys, query ``t`` sees key ``j`` iff

    t + sk - sq - left  <=  j  <=  t + sk - sq + right        (left, right = -1: unbounded)

that is, causal and sliding-window masks are aligned to the *bottom right* of each sequence. One
``window = (left, right)`` per call; ``(-1, 0)`` is causal.

A masked block of the ring (packed documents, sliding windows, chunks, prefix-LM and their
intersections: :mod:`ring_impl.tiling`) shows most query rows one interval of keys, moving by a
constant per row over runs of rows (tiling's :class:`~ring_impl.tiling.Segment`). Each run is
exactly one varlen sequence, with ``[lo, hi)`` the interval of its first row and ``t = 0 .. n-1``
its rows:

    row t sees              keys packed            window
    [lo, hi)                [lo, hi)               (-1, -1)
    [lo, hi + t)  causal    [lo, hi + n - 1)       (-1, 0)
    [lo + t, hi + t) band   [lo, hi + n - 1)       (hi - lo - 1, 0)

(check the causal row: ``sk - sq = hi - lo - 1``, so row ``t`` sees up to key ``lo + hi - lo - 1 +
t``). So a block holding many short documents is one kernel call that computes their visible
entries only, where a bias kernel computes the whole rectangle. Runs are grouped by window, one
call per window.

A row that sees several runs of keys (sink tokens and a window; prefix-LM with chunks) is in
one *layer* per run: layer ``k`` is the ``k``-th run of every row, packed as above, and the
layers' results merge by their LSE; their gradients add, each layer being a disjoint part of
the row's keys. Rows with more than :data:`MAX_LAYERS` runs, or whose keys differ between heads,
run with the math op; rows that see nothing are not computed (out 0, LSE -inf; the ring sets
them anyway). An unmasked block is one sequence per batch element (causal only on square
blocks, where the bottom-right and top-left diagonals coincide).

:class:`VarlenOp` holds all of that and leaves the kernel to subclasses with FlashAttention-2's
signature: :class:`ring_impl.ops.cuda.CudaFlashVarlenOp` (``aten._flash_attention_forward`` /
``_backward``) and, on CPU, :class:`ring_impl.ops.cpu.CpuFlashVarlenLayoutOp`, whose kernel
(:mod:`ring_impl.ops.varlen_emulation`) evaluates the formula above with the math op.
"""

from __future__ import annotations

import weakref
from collections import OrderedDict
from dataclasses import dataclass

import torch

from ..merge import merge_into
from ..tiling import row_runs, segments_from_bounds
from .contract import OpCapabilities, accumulation_dtype
from .math import MathOp

__all__ = ["MAX_LAYERS", "UNBOUNDED", "VarlenCall", "VarlenOp", "VarlenPlan", "dense_varlen_plan", "varlen_plan", "visible_of"]

#: A window side with no bound.
UNBOUNDED = -1
#: Runs of visible keys per row packed as separate calls (merged by their LSE); a row with more
#: runs (a scattered mask) runs with the math op.
MAX_LAYERS = 4

_MATH = MathOp()


@dataclass(frozen=True)
class VarlenCall:
    """One kernel call: sequence ``i`` is query rows ``q_index[cu_q[i]:cu_q[i+1]]`` of the
    flattened ``(batch * rows)`` queries against key rows ``k_index[cu_k[i]:cu_k[i+1]]`` of the
    flattened ``(batch * cols)`` keys, under ``window``.

    q_index, k_index: (total,) int64 on the device, or None for every row in order. Query rows
    of one call are distinct (a row is in one call per run of keys it sees: its layers); key
    rows may repeat (two runs seeing the same keys), so gradients are added, never copied.
    cu_q, cu_k: (sequences + 1,) int32 on the device. max_q, max_k: the longest sequence.
    layer: which run of its rows' keys the call holds (0: the first; later layers merge into it).
    """

    window: tuple[int, int]
    q_index: torch.Tensor | None
    k_index: torch.Tensor | None
    cu_q: torch.Tensor
    cu_k: torch.Tensor
    max_q: int
    max_k: int
    layer: int = 0

    @property
    def sequences(self) -> int:
        return self.cu_q.numel() - 1


@dataclass(frozen=True)
class VarlenPlan:
    """A block as varlen calls, plus ``math_rows``: (r,) int64 local query rows (every batch
    element) the math op runs with the block's visibility, None if none."""

    calls: tuple[VarlenCall, ...]
    math_rows: torch.Tensor | None


def visible_of(attn_mask: torch.Tensor | None, is_causal: bool, rows: int, cols: int,
               device: torch.device) -> torch.Tensor | None:
    """The block's visibility as (batch or 1, heads or 1, rows, cols) bool, or None for an
    unmasked block the dense plan covers (not causal, or causal on a square block)."""
    if attn_mask is None and (not is_causal or rows == cols):
        return None
    vis = attn_mask if attn_mask is not None else torch.ones(rows, cols, dtype=torch.bool, device=device)
    vis = vis if vis.dim() == 4 else vis.reshape(1, 1, *vis.shape[-2:])
    if is_causal:  # top-left, as the op contract's is_causal
        vis = vis & torch.ones(rows, cols, dtype=torch.bool, device=device).tril()
    return vis


def dense_varlen_plan(batch: int, rows: int, cols: int, is_causal: bool, device: torch.device) -> VarlenPlan:
    """An unmasked block (``is_causal`` only with ``rows == cols``): one sequence per batch
    element. Built from shapes only, so a compiled ring traces it without a graph break."""
    cu_q = torch.arange(0, (batch + 1) * rows, rows, dtype=torch.int32, device=device)
    cu_k = torch.arange(0, (batch + 1) * cols, cols, dtype=torch.int32, device=device)
    window = (UNBOUNDED, 0) if is_causal else (UNBOUNDED, UNBOUNDED)
    return VarlenPlan((VarlenCall(window, None, None, cu_q, cu_k, rows, cols),), None)


def _runs(lo: list[int], hi: list[int], live: list[bool]) -> list[tuple[int, int, int, int, tuple[int, int]]]:
    """(r0, r1, c0, c1, window) per run of rows, row ``r`` seeing keys ``[lo[r], hi[r])`` where
    ``live[r]``."""
    out = []
    for s in segments_from_bounds(lo, hi, live, live):
        n = s.r1 - s.r0
        if n == 1 or (s.dlo, s.dhi) == (0, 0):
            out.append((s.r0, s.r1, s.lo, s.hi, (UNBOUNDED, UNBOUNDED)))
        elif (s.dlo, s.dhi) == (0, 1):
            out.append((s.r0, s.r1, s.lo, s.hi + n - 1, (UNBOUNDED, 0)))
        else:  # (1, 1): a band of width hi - lo
            out.append((s.r0, s.r1, s.lo, s.hi + n - 1, (s.hi - s.lo - 1, 0)))
    return out


def _index(ranges: list[tuple[int, int]], total: int) -> tuple[list[int], bool]:
    """The rows of ``ranges`` in order, and whether they are exactly ``0 .. total - 1``."""
    rows = [r for a, b in ranges for r in range(a, b)]
    return rows, len(rows) == total and all(a == (ranges[i - 1][1] if i else 0) for i, (a, _) in enumerate(ranges))


def varlen_plan(vis: torch.Tensor, batch: int) -> VarlenPlan:
    """The varlen calls of a masked block (module docstring).

    vis: (batch or 1, heads or 1, rows, cols) bool, True where a query sees a key; ``batch`` the
    queries' batch size (a visibility of batch 1 applies to every element). Calls come in layer
    order: layer ``k`` holds the ``k``-th run of visible keys of each row (a row seeing sink
    tokens and a window has two runs), so a row may be in several calls, one per layer."""
    nb, nh, rows, cols = vis.shape
    device = vis.device
    seen = vis.any(1)  # (nb, rows, cols)
    row, lo, hi = row_runs(seen)  # row: e * rows + r
    count = torch.bincount(row, minlength=nb * rows)
    to_math = (count > MAX_LAYERS).view(nb, rows).any(0)  # (rows,): for every batch element
    if nh > 1:  # a row the heads see differently is no sequence of one call
        to_math |= (vis.all(1) != seen).any(-1).any(0)
    keep = ~to_math.repeat(nb)[row]
    layer = torch.arange(row.numel(), device=device) - (torch.cumsum(count, 0) - count)[row]  # run number in its row
    row, lo, hi, layer = row[keep].tolist(), lo[keep].tolist(), hi[keep].tolist(), layer[keep].tolist()
    bounds: list[tuple[list[int], list[int], list[bool]]] = []
    for e_r, a, b, k in zip(row, lo, hi, layer):  # each layer's (lo, hi, live) per flattened row
        while len(bounds) <= k:
            bounds.append(([0] * (nb * rows), [0] * (nb * rows), [False] * (nb * rows)))
        bounds[k][0][e_r], bounds[k][1][e_r], bounds[k][2][e_r] = a, b, True
    calls = []
    for layer, (lo_k, hi_k, live_k) in enumerate(bounds):
        per_batch = [_runs(lo_k[e * rows:(e + 1) * rows], hi_k[e * rows:(e + 1) * rows], live_k[e * rows:(e + 1) * rows])
                     for e in range(nb)]
        groups: dict[tuple[int, int], list[tuple[int, int, int, int]]] = {}
        for e in range(batch):
            for r0, r1, c0, c1, window in per_batch[e if nb > 1 else 0]:
                groups.setdefault(window, []).append((e * rows + r0, e * rows + r1, e * cols + c0, e * cols + c1))
        calls.extend(_call(window, runs, batch * rows, batch * cols, device, layer) for window, runs in groups.items())
    return VarlenPlan(tuple(calls), to_math.nonzero().flatten() if bool(to_math.any()) else None)


def _call(window: tuple[int, int], runs: list[tuple[int, int, int, int]], q_total: int, k_total: int,
          device: torch.device, layer: int) -> VarlenCall:
    """One call of ``runs`` ((q0, q1, k0, k1) on the flattened rows) under ``window``."""
    q_rows, q_all = _index([(a, b) for a, b, _, _ in runs], q_total)
    k_rows, k_all = _index([(c, d) for _, _, c, d in runs], k_total)
    q_len = [b - a for a, b, _, _ in runs]
    k_len = [d - c for _, _, c, d in runs]
    cu = torch.tensor([[0, 0], *zip(q_len, k_len)], dtype=torch.int64).cumsum(0).to(torch.int32)
    return VarlenCall(
        window,
        None if q_all else torch.tensor(q_rows, dtype=torch.int64, device=device),
        None if k_all else torch.tensor(k_rows, dtype=torch.int64, device=device),
        cu[:, 0].contiguous().to(device), cu[:, 1].contiguous().to(device), max(q_len), max(k_len), layer,
    )


#: Plans of masked blocks, by the visibility tensor (a masked plan's blocks keep theirs for the
#: whole call, forward and backward): ``id -> (weakref, batch, plan)``, oldest first.
_PLANS: OrderedDict[int, tuple[weakref.ref, int, VarlenPlan]] = OrderedDict()
_PLANS_KEPT = 256


def _masked_plan(vis: torch.Tensor, batch: int) -> VarlenPlan:
    key = id(vis)
    hit = _PLANS.get(key)
    if hit is not None and hit[0]() is vis and hit[1] == batch:
        return hit[2]
    plan = varlen_plan(vis, batch)

    def forget(ref: weakref.ref) -> None:  # the plan's index tensors go with their visibility
        if key in _PLANS and _PLANS[key][0] is ref:
            del _PLANS[key]

    _PLANS[key] = (weakref.ref(vis, forget), batch, plan)
    while len(_PLANS) > _PLANS_KEPT:
        _PLANS.popitem(last=False)
    return plan


def _packed(t: torch.Tensor) -> torch.Tensor:
    """(batch, heads, seq, head_dim) -> (batch * seq, heads, head_dim), head dim contiguous."""
    b, h, s, d = t.shape
    return t.transpose(1, 2).reshape(b * s, h, d)


def _into_rows(out: torch.Tensor, lse: torch.Tensor, index: torch.Tensor | None, o: torch.Tensor,
               l_: torch.Tensor, *, merge: bool) -> None:
    """A call's (o (n, heads, d), l_ (heads, n)) into rows ``index`` (None: all, in order) of
    ``out`` (rows, heads, d) / ``lse`` (heads, rows): written (the rows' first layer) or merged
    with what is there by LSE (:func:`ring_impl.merge.merge_into`, the ring's own merge)."""
    if merge:
        cur_o = out if index is None else out.index_select(0, index)
        cur_l = lse if index is None else lse.index_select(1, index)
        merge_into(cur_o.transpose(0, 1), cur_l, o.transpose(0, 1), l_)  # in place on the rows
        if index is None:
            return
        o, l_ = cur_o, cur_l
    if index is None:
        out.copy_(o)
        lse.copy_(l_)
    else:
        out.index_copy_(0, index, o.to(out.dtype))
        lse.index_copy_(1, index, l_.to(lse.dtype))


def _take(t: torch.Tensor, index: torch.Tensor | None) -> torch.Tensor:
    return t.contiguous() if index is None else t.index_select(0, index)


class VarlenOp:
    """The op contract (:mod:`ring_impl.ops.contract`) on a varlen kernel; subclasses give
    :meth:`kernel_forward` and :meth:`kernel_backward` and their ``name`` and ``capabilities``
    (``masks=True`` and ``gqa=True``: both are the kernel's own)."""

    name: str
    capabilities: OpCapabilities

    def kernel_forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_q: torch.Tensor,
                       cu_k: torch.Tensor, max_q: int, max_k: int, *, scale: float,
                       window: tuple[int, int]) -> tuple[torch.Tensor, torch.Tensor]:
        """q (total_q, heads, d), k/v (total_k, heads_kv, d) -> out (total_q, heads, d), LSE
        (heads, total_q)."""
        raise NotImplementedError

    def kernel_backward(self, grad_out: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                        out: torch.Tensor, lse: torch.Tensor, cu_q: torch.Tensor, cu_k: torch.Tensor,
                        max_q: int, max_k: int, *, scale: float,
                        window: tuple[int, int]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Packed as :meth:`kernel_forward`; lse (heads, total_q) -> dq, dk, dv packed."""
        raise NotImplementedError

    def plan(self, query: torch.Tensor, key: torch.Tensor, *, is_causal: bool,
             attn_mask: torch.Tensor | None) -> tuple[VarlenPlan, torch.Tensor | None]:
        """The block's plan and its visibility (None: unmasked)."""
        b, _, rows, _ = query.shape
        cols = key.shape[2]
        vis = visible_of(attn_mask, is_causal, rows, cols, query.device)
        if vis is None:
            return dense_varlen_plan(b, rows, cols, is_causal, query.device), None
        # A causal block is given a fresh tensor here: planned per call, not kept.
        return (_masked_plan(vis, b) if vis is attn_mask else varlen_plan(vis, b)), vis

    def forward(self, query, key, value, *, is_causal, scale, attn_mask=None):
        if scale <= 0:
            # Kernels of this family give NaN for masked entries with scale <= 0 (measured for
            # causal on an H100 with the dense flash kernel; varlen masks sequence edges too).
            return _MATH.forward(query, key, value, is_causal=is_causal, scale=scale, attn_mask=attn_mask)
        plan, vis = self.plan(query, key, is_causal=is_causal, attn_mask=attn_mask)
        b, h, rows, d = query.shape
        acc = accumulation_dtype(query.dtype)
        q, k, v = _packed(query), _packed(key), _packed(value)
        out = torch.zeros(b * rows, h, d, dtype=acc, device=query.device)
        lse = torch.full((h, b * rows), float("-inf"), dtype=acc, device=query.device)
        for c in plan.calls:
            o, l_ = self.kernel_forward(_take(q, c.q_index), _take(k, c.k_index), _take(v, c.k_index), c.cu_q, c.cu_k,
                                        c.max_q, c.max_k, scale=scale, window=c.window)
            _into_rows(out, lse, c.q_index, o, l_, merge=c.layer > 0)
        out = out.view(b, rows, h, d).transpose(1, 2)
        lse = lse.view(h, b, rows).transpose(0, 1)
        if plan.math_rows is not None:
            r = plan.math_rows
            m_out, m_lse = _MATH.forward(query[:, :, r], key, value, is_causal=False, scale=scale, attn_mask=vis[:, :, r])
            out[:, :, r] = m_out.to(acc)
            lse[:, :, r] = m_lse.to(acc)
        return out.to(query.dtype), lse

    def backward(self, grad_out, query, key, value, out, lse, *, is_causal, scale, attn_mask=None):
        if scale <= 0:
            return _MATH.backward(grad_out, query, key, value, out, lse, is_causal=is_causal, scale=scale,
                                  attn_mask=attn_mask)
        plan, vis = self.plan(query, key, is_causal=is_causal, attn_mask=attn_mask)
        b, h, rows, d = query.shape
        hkv, cols = key.shape[1], key.shape[2]
        acc = accumulation_dtype(query.dtype)
        do, o = _packed(grad_out.to(query.dtype)), _packed(out.to(query.dtype))
        q, k, v = _packed(query), _packed(key), _packed(value)
        lse_packed = lse.to(acc).transpose(0, 1).reshape(h, b * rows)
        dq = torch.zeros(b * rows, h, d, dtype=acc, device=query.device)
        dk = torch.zeros(b * cols, hkv, d, dtype=acc, device=key.device)
        dv = torch.zeros_like(dk)
        for c in plan.calls:
            qi = c.q_index
            l_ = lse_packed.contiguous() if qi is None else lse_packed.index_select(1, qi)
            dq_c, dk_c, dv_c = self.kernel_backward(
                _take(do, qi), _take(q, qi), _take(k, c.k_index), _take(v, c.k_index), _take(o, qi), l_,
                c.cu_q, c.cu_k, c.max_q, c.max_k, scale=scale, window=c.window)
            # A row in several layers gets the sum of their gradients: each layer is a disjoint
            # part of its keys, under the row's final output and LSE.
            if qi is None:
                dq.add_(dq_c)
            else:
                dq.index_add_(0, qi, dq_c.to(acc))
            if c.k_index is None:
                dk.add_(dk_c)
                dv.add_(dv_c)
            else:
                dk.index_add_(0, c.k_index, dk_c.to(acc))
                dv.index_add_(0, c.k_index, dv_c.to(acc))
        dq = dq.view(b, rows, h, d).transpose(1, 2)
        dk = dk.view(b, cols, hkv, d).transpose(1, 2)
        dv = dv.view(b, cols, hkv, d).transpose(1, 2)
        if plan.math_rows is not None:
            r = plan.math_rows
            m_dq, m_dk, m_dv = _MATH.backward(grad_out[:, :, r], query[:, :, r], key, value, out[:, :, r], lse[:, :, r],
                                              is_causal=False, scale=scale, attn_mask=vis[:, :, r])
            dq[:, :, r] = m_dq.to(acc)
            dk += m_dk
            dv += m_dv
        return dq.to(query.dtype), dk.to(key.dtype), dv.to(value.dtype)
