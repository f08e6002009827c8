"""Variable-length ("varlen") flash attention as the ring's kernel, masked blocks included.

FlashAttention-2's varlen kernel runs many independent sequences in one call. Queries are packed
``(total_q, heads, head_dim)``, keys and values ``(total_k, heads_kv, head_dim)``; sequence ``i``
is query rows ``cu_q[i]:cu_q[i+1]`` against key rows ``cu_k[i]:cu_k[i+1]``. Within a sequence of
``sq`` queries and ``sk`` keys, query ``t`` sees key ``j`` iff

    t + sk - sq - left  <=  j  <=  t + sk - sq + right        (left, right = -1: unbounded)

that is, causal and sliding-window masks are aligned to the *bottom right* of each sequence. One
``window = (left, right)`` per call; ``(-1, 0)`` is causal.

A masked block of the ring (packed documents, sliding windows, chunks, prefix-LM and their
intersections) shows most query rows one interval of keys, and consecutive rows form runs that
are each exactly one varlen sequence (``_sequences``), rows ``t = 0 .. n-1`` of a run seeing
``[lo_t, hi_t)``, its keys ``[lo_0, hi_{n-1})``:

    run                                             window
    every row the same interval                     (-1, -1)
    hi grows by 1 per row, lo stays   (causal)      (-1, 0)
    hi grows by 1; lo stays, then grows by 1        (w - 1, 0)
      (a window of width w, its first rows clipped at the run's first key)

(bottom-right: ``sk - sq = hi_0 - lo_0 - 1``, so row ``t`` sees up to key ``lo_0 + hi_0 - lo_0 - 1 +
t``). A run that fits several windows (one row; a causal run no window cuts) joins one the
others need, so a block of many short documents, or a window over documents, is one kernel
call computing their visible entries only, where a bias kernel computes the whole rectangle.
A block given as row bounds (``row_bounds=``, :mod:`ring_impl.planning.row_bounds`) is planned from
them in O(rows); one given as a visibility, from its rows' runs of keys.

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

import functools
import weakref
from collections import OrderedDict
from dataclasses import dataclass

import torch

from ..numerics.merge import merge_into
from ..planning.tiling import row_runs
from .contract import OpCapabilities, accumulation_dtype
from .math import MathOp

__all__ = [
    "MAX_LAYERS",
    "UNBOUNDED",
    "VarlenCall",
    "VarlenOp",
    "VarlenPlan",
    "bounds_varlen_plan",
    "bounds_visible",
    "dense_varlen_plan",
    "varlen_plan",
    "visible_of",
]

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

    @property
    def packing(self) -> tuple[torch.Tensor, torch.Tensor, int, int]:
        """(cu_q, cu_k, max_q, max_k): how the call's rows pack into sequences, as the kernel
        takes them after query, key and value (and before ``scale`` and ``window``)."""
        return self.cu_q, self.cu_k, self.max_q, self.max_k


@dataclass(frozen=True)
class VarlenPlan:
    """A block as varlen calls, plus ``math_rows``: (r,) int64 local query rows (every batch
    element) the math op runs with the block's visibility, None if none."""

    calls: tuple[VarlenCall, ...]
    math_rows: torch.Tensor | None


def visible_of(
    attn_mask: torch.Tensor | None, is_causal: bool, rows: int, cols: int, device: torch.device
) -> torch.Tensor | None:
    """The block's visibility as (batch or 1, heads or 1, rows, cols) bool, or None for an
    unmasked block the dense plan covers (not causal, or causal on a square block)."""
    if attn_mask is None and (not is_causal or rows == cols):
        return None
    vis = (
        attn_mask
        if attn_mask is not None
        else torch.ones(rows, cols, dtype=torch.bool, device=device)
    )
    vis = vis if vis.dim() == 4 else vis.reshape(1, 1, *vis.shape[-2:])
    if is_causal:  # top-left, as the op contract's is_causal
        vis = vis & torch.ones(rows, cols, dtype=torch.bool, device=device).tril()
    return vis


def dense_varlen_plan(
    batch: int, rows: int, cols: int, is_causal: bool, device: torch.device
) -> VarlenPlan:
    """An unmasked block (``is_causal`` only with ``rows == cols``): one sequence per batch
    element. Built from shapes only, so a compiled ring traces it without a graph break; eager
    calls take it from a small cache (its two ``cu_seqlens`` would be two launches per kernel
    call on a GPU)."""
    if torch.compiler.is_compiling():
        return _dense_varlen_plan(batch, rows, cols, is_causal, device)
    return _kept_dense_plan(batch, rows, cols, bool(is_causal), device)


def _dense_varlen_plan(
    batch: int, rows: int, cols: int, is_causal: bool, device: torch.device
) -> VarlenPlan:
    cu_q = torch.arange(0, (batch + 1) * rows, rows, dtype=torch.int32, device=device)
    cu_k = torch.arange(0, (batch + 1) * cols, cols, dtype=torch.int32, device=device)
    window = (UNBOUNDED, 0) if is_causal else (UNBOUNDED, UNBOUNDED)
    return VarlenPlan((VarlenCall(window, None, None, cu_q, cu_k, rows, cols),), None)


#: dense plans of eager calls, by (batch, rows, cols, is_causal, device): a few shapes per model
_kept_dense_plan = functools.lru_cache(maxsize=32)(_dense_varlen_plan)


#: A run of rows as one varlen sequence: (r0, r1, c0, c1, window), rows ``[r0, r1)`` against keys
#: ``[c0, c1)`` of the same flattened numbering, under ``window`` (bottom-right aligned).
Run = tuple[int, int, int, int, tuple[int, int]]


def _sequences(lo: list[int], hi: list[int], live: list[bool]) -> list[tuple[int, int, str, int]]:
    """Rows cut into runs that are each one varlen sequence: ``(r0, r1, form, left)``, row ``r``
    seeing keys ``[lo[r], hi[r])`` where ``live[r]``. A run's keys are ``[lo[r0], hi[r1 - 1])``.

    ``full``    every row sees the same keys: window (-1, -1); one row alone fits any window
                that shows it all (``single``).
    ``causal``  ``hi`` grows by one per row and ``lo`` stays, then (a band of width ``w``) grows by
                one per row too: ``lo[r] = max(lo[r0], hi[r] - w)``, which is FlashAttention's
                bottom-right window ``(w - 1, 0)`` clipped at the sequence's first key; ``left``
                is ``w - 1``, or -1 while ``lo`` never moves (then any left >= keys - 1 fits).
    A sliding window's first rows (a growing prefix) and its band are one sequence, so a window,
    with or without documents, is one call."""
    runs: list[tuple[int, int, str, int]] = []
    rows, r = len(lo), 0
    while r < rows:
        if not live[r]:
            r += 1
            continue
        e, width = r + 1, None
        while e < rows and live[e] and hi[e] == hi[e - 1] + 1:
            if lo[e] == lo[e - 1]:
                if width is not None:
                    break  # a band whose start stops moving: another sequence
            elif lo[e] == lo[e - 1] + 1:
                if width is None:
                    # Into the band only if it continues: a lone row whose keys end where the
                    # next rows' start (a one-token document) is better a sequence of its own.
                    if (
                        e + 1 < rows
                        and live[e + 1]
                        and hi[e + 1] == hi[e] + 1
                        and lo[e + 1] == lo[e]
                    ):
                        break
                    width = hi[e] - lo[e]
            else:
                break
            e += 1
        if e - r >= 2:
            runs.append((r, e, "causal", -1 if width is None else width - 1))
            r = e
            continue
        e = r + 1
        while e < rows and live[e] and lo[e] == lo[r] and hi[e] == hi[r]:
            e += 1
        runs.append((r, e, "full" if e - r >= 2 else "single", -1))
        r = e
    return runs


def _fits(form: str, left: int, keys: int, window: tuple[int, int]) -> bool:
    """Whether a run (``_sequences``) of ``keys`` keys computes exactly under ``window``."""
    wl, wr = window
    if form == "full":
        return window == (UNBOUNDED, UNBOUNDED)
    if form == "single" and window == (UNBOUNDED, UNBOUNDED):
        return True
    if wr != 0:
        return False
    if form == "causal" and left >= 0:
        return wl == left
    return wl == UNBOUNDED or wl >= keys - 1  # the window never cuts these rows


def _runs(per_element: list[tuple[list[int], list[int], list[bool]]]) -> list[list[Run]]:
    """Each batch element's runs with their windows, chosen so the elements' runs share as few
    windows (kernel calls) as exactness allows: runs that need one window fix it; the others
    (a one-row run, a causal run the window never cuts) join a fixed window they fit, else
    take causal (-1, 0)."""
    found = [
        [
            (r0, r1, lo[r0], hi[r1 - 1], form, left)
            for r0, r1, form, left in _sequences(lo, hi, live)
        ]
        for lo, hi, live in per_element
    ]

    def fixed_windows() -> list[tuple[int, int]]:
        return sorted(
            {
                (UNBOUNDED, UNBOUNDED) if form == "full" else (left, 0)
                for runs in found
                for _, _, _, _, form, left in runs
                if form == "full" or (form == "causal" and left >= 0)
            }
        )

    fixed = fixed_windows()
    diagonal = (0, 0)
    if diagonal in fixed and any(
        not _fits(form, left, c1 - c0, diagonal)
        for runs in found
        for _, _, c0, c1, form, left in runs
    ):
        # A band of width 1 (rows that each see one key: one-token documents side by side) is
        # as cheap as one-row sequences, which fit any window: no call of its own.
        found = [
            [
                run
                for r0, r1, c0, c1, form, left in runs
                for run in (
                    [(r, r + 1, c0 + r - r0, c0 + r - r0 + 1, "single", -1) for r in range(r0, r1)]
                    if (form, left) == ("causal", 0)
                    else [(r0, r1, c0, c1, form, left)]
                )
            ]
            for runs in found
        ]
        fixed = fixed_windows()
    out = []
    for runs in found:
        chosen = []
        for r0, r1, c0, c1, form, left in runs:
            window = next((w for w in fixed if _fits(form, left, c1 - c0, w)), None)
            if window is None:
                window = (left, 0) if form == "causal" and left >= 0 else (UNBOUNDED, 0)
            chosen.append((r0, r1, c0, c1, window))
        out.append(chosen)
    return out


def _index(ranges: list[tuple[int, int]], total: int) -> tuple[list[int], bool]:
    """The rows of ``ranges`` in order, and whether they are exactly ``0 .. total - 1``."""
    rows = [r for a, b in ranges for r in range(a, b)]
    return rows, len(rows) == total and all(
        a == (ranges[i - 1][1] if i else 0) for i, (a, _) in enumerate(ranges)
    )


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
    layer = (
        torch.arange(row.numel(), device=device) - (torch.cumsum(count, 0) - count)[row]
    )  # run number in its row
    row_at, lo_at, hi_at, layer_at = (
        row[keep].tolist(),
        lo[keep].tolist(),
        hi[keep].tolist(),
        layer[keep].tolist(),
    )
    bounds: list[tuple[list[int], list[int], list[bool]]] = []
    # each layer's (lo, hi, live) per flattened row
    for e_r, a, b, k in zip(row_at, lo_at, hi_at, layer_at):
        while len(bounds) <= k:
            bounds.append(([0] * (nb * rows), [0] * (nb * rows), [False] * (nb * rows)))
        bounds[k][0][e_r], bounds[k][1][e_r], bounds[k][2][e_r] = a, b, True
    calls = []
    for k, (lo_k, hi_k, live_k) in enumerate(bounds):
        per_batch = _runs(
            [
                (
                    lo_k[e * rows : (e + 1) * rows],
                    hi_k[e * rows : (e + 1) * rows],
                    live_k[e * rows : (e + 1) * rows],
                )
                for e in range(nb)
            ]
        )
        calls.extend(_layer_calls(per_batch, batch, rows, cols, device, k))
    return VarlenPlan(tuple(calls), to_math.nonzero().flatten() if bool(to_math.any()) else None)


def _layer_calls(
    per_batch: list[list[Run]], batch: int, rows: int, cols: int, device: torch.device, layer: int
) -> list[VarlenCall]:
    """One call per window of one layer's runs (``per_batch``: each batch element's, or one list
    that every element shares), rows and keys numbered over the flattened batch."""
    groups: dict[tuple[int, int], list[tuple[int, int, int, int]]] = {}
    for e in range(batch):
        for r0, r1, c0, c1, window in per_batch[e if len(per_batch) > 1 else 0]:
            groups.setdefault(window, []).append(
                (e * rows + r0, e * rows + r1, e * cols + c0, e * cols + c1)
            )
    return [
        _call(window, runs, batch * rows, batch * cols, device, layer)
        for window, runs in groups.items()
    ]


def bounds_varlen_plan(lo: torch.Tensor, hi: torch.Tensor, batch: int, cols: int) -> VarlenPlan:
    """The varlen calls of a block whose query row ``r`` sees key columns ``[lo[r], hi[r])``
    (``lo``, ``hi``: (rows,) int64, every batch element and head alike; ``lo >= hi``: nothing):
    one call per window, built in O(rows) from the bounds, with no visibility tensor."""
    lo_l, hi_l = lo.tolist(), hi.tolist()
    live = [a < b for a, b in zip(lo_l, hi_l)]
    return VarlenPlan(
        tuple(_layer_calls(_runs([(lo_l, hi_l, live)]), batch, len(lo_l), cols, lo.device, 0)), None
    )


def _call(
    window: tuple[int, int],
    runs: list[tuple[int, int, int, int]],
    q_total: int,
    k_total: int,
    device: torch.device,
    layer: int,
) -> VarlenCall:
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
        cu[:, 0].contiguous().to(device),
        cu[:, 1].contiguous().to(device),
        max(q_len),
        max(k_len),
        layer,
    )


#: Plans of masked blocks, by the visibility tensor (a masked plan's blocks keep theirs for the
#: whole call, forward and backward): ``id -> (weakref, batch, plan)``, oldest first.
_PLANS: OrderedDict[int, tuple[weakref.ref, int, VarlenPlan]] = OrderedDict()
_PLANS_KEPT = 256


def _kept_plan(held: torch.Tensor, batch: int, build) -> VarlenPlan:
    """``build()``, kept as long as ``held`` (the block's visibility, or its row bounds' ``lo``:
    a plan's blocks keep theirs for the whole call, forward and backward, and across calls
    while the ring's plan is cached) lives."""
    key = id(held)
    hit = _PLANS.get(key)
    if hit is not None and hit[0]() is held and hit[1] == batch:
        return hit[2]
    plan = build()

    def forget(ref: weakref.ref) -> None:  # the plan's index tensors go with what they describe
        if key in _PLANS and _PLANS[key][0] is ref:
            del _PLANS[key]

    _PLANS[key] = (weakref.ref(held, forget), batch, plan)
    while len(_PLANS) > _PLANS_KEPT:
        _PLANS.popitem(last=False)
    return plan


def bounds_visible(lo: torch.Tensor, hi: torch.Tensor, cols: int) -> torch.Tensor:
    """Row bounds as a (1, 1, rows, cols) visibility (for kernels that take a dense mask)."""
    c = torch.arange(cols, device=lo.device)
    return ((c >= lo.unsqueeze(-1)) & (c < hi.unsqueeze(-1))).view(1, 1, lo.numel(), cols)


def _packed(t: torch.Tensor) -> torch.Tensor:
    """(batch, heads, seq, head_dim) -> (batch * seq, heads, head_dim), head dim contiguous."""
    b, h, s, d = t.shape
    packed = t.transpose(1, 2).reshape(b * s, h, d)  # a view for one batch element
    return packed if packed.stride(-1) == 1 else packed.contiguous()


def _into_rows(
    out: torch.Tensor,
    lse: torch.Tensor,
    index: torch.Tensor | None,
    o: torch.Tensor,
    l_: torch.Tensor,
    *,
    merge: bool,
) -> None:
    """A call's (o (n, heads, d), l_ (heads, n)) into rows ``index`` (None: all, in order) of
    ``out`` (rows, heads, d) / ``lse`` (heads, rows): written (the rows' first layer) or merged
    with what is there by LSE (:func:`ring_impl.numerics.merge.merge_into`, the ring's own
    merge)."""
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


def _one_call(plan: VarlenPlan) -> bool:
    """Whether the plan is one call holding every query row in order, and nothing else."""
    return len(plan.calls) == 1 and plan.calls[0].q_index is None and plan.math_rows is None


def _take(t: torch.Tensor, index: torch.Tensor | None) -> torch.Tensor:
    """Rows ``index`` of packed ``t`` (a copy), or ``t`` itself for every row: the kernel takes
    strided rows and heads as long as the head dim is contiguous, as ``_packed``'s views are."""
    return t if index is None else t.index_select(0, index)


def _dense_mask(
    key: torch.Tensor,
    attn_mask: torch.Tensor | None,
    row_bounds: tuple[torch.Tensor, torch.Tensor] | None,
) -> torch.Tensor | None:
    """A block's mask as the math op takes it: ``attn_mask``, or ``row_bounds`` as a dense
    visibility."""
    return attn_mask if row_bounds is None else bounds_visible(*row_bounds, key.shape[2])


class VarlenOp:
    """The op contract (:mod:`ring_impl.ops.contract`) on a varlen kernel; subclasses give
    :meth:`kernel_forward` and :meth:`kernel_backward` and their ``name`` and ``capabilities``
    (``masks=True`` and ``gqa=True``: both are the kernel's own)."""

    name: str
    capabilities: OpCapabilities

    def kernel_forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        cu_q: torch.Tensor,
        cu_k: torch.Tensor,
        max_q: int,
        max_k: int,
        *,
        scale: float,
        window: tuple[int, int],
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """q (total_q, heads, d), k/v (total_k, heads_kv, d) -> out (total_q, heads, d), LSE
        (heads, total_q)."""
        raise NotImplementedError

    def kernel_backward(
        self,
        grad_out: torch.Tensor,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        out: torch.Tensor,
        lse: torch.Tensor,
        cu_q: torch.Tensor,
        cu_k: torch.Tensor,
        max_q: int,
        max_k: int,
        *,
        scale: float,
        window: tuple[int, int],
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Packed as :meth:`kernel_forward`; lse (heads, total_q) -> dq, dk, dv packed."""
        raise NotImplementedError

    def _forward_call(
        self,
        c: VarlenCall,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        scale: float,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Kernel call ``c`` on the packed block: q (batch * rows, heads, d), k/v (batch * cols,
        heads_kv, d) -> out (total_q, heads, d), LSE (heads, total_q) of the call's query rows
        (``c.q_index``, in that order)."""
        return self.kernel_forward(
            _take(q, c.q_index),
            _take(k, c.k_index),
            _take(v, c.k_index),
            *c.packing,
            scale=scale,
            window=c.window,
        )

    def _backward_call(
        self,
        c: VarlenCall,
        do: torch.Tensor,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        o: torch.Tensor,
        lse: torch.Tensor,
        scale: float,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The gradients of :meth:`_forward_call`: do/o packed as q, lse (heads, batch * rows) ->
        dq (total_q, heads, d) of the call's query rows, dk/dv (total_k, heads_kv, d) of its key
        rows (``c.k_index``, which may repeat a row: add them, never copy)."""
        qi = c.q_index
        return self.kernel_backward(
            _take(do, qi),
            _take(q, qi),
            _take(k, c.k_index),
            _take(v, c.k_index),
            _take(o, qi),
            lse.contiguous() if qi is None else lse.index_select(1, qi),
            *c.packing,
            scale=scale,
            window=c.window,
        )

    def plan(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        *,
        is_causal: bool,
        attn_mask: torch.Tensor | None,
        row_bounds: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> tuple[VarlenPlan, torch.Tensor | None]:
        """The block's plan and its visibility (None: unmasked, or given as ``row_bounds``)."""
        b, _, rows, _ = query.shape
        cols = key.shape[2]
        if row_bounds is not None:
            lo, hi = row_bounds
            return _kept_plan(lo, b, lambda: bounds_varlen_plan(lo, hi, b, cols)), None
        vis = visible_of(attn_mask, is_causal, rows, cols, query.device)
        if vis is None:
            return dense_varlen_plan(b, rows, cols, is_causal, query.device), None
        # A causal block is given a fresh tensor here: planned per call, not kept.
        return (
            _kept_plan(vis, b, lambda: varlen_plan(vis, b))
            if vis is attn_mask
            else varlen_plan(vis, b)
        ), vis

    def forward(self, query, key, value, *, is_causal, scale, attn_mask=None, row_bounds=None):
        if scale <= 0:
            # Kernels of this family give NaN for masked entries with scale <= 0 (measured for
            # causal on an H100 with the dense flash kernel; varlen masks sequence edges too).
            mask = _dense_mask(key, attn_mask, row_bounds)
            return _MATH.forward(
                query, key, value, is_causal=is_causal, scale=scale, attn_mask=mask
            )
        plan, vis = self.plan(
            query, key, is_causal=is_causal, attn_mask=attn_mask, row_bounds=row_bounds
        )
        b, h, rows, d = query.shape
        acc = accumulation_dtype(query.dtype)
        q, k, v = _packed(query), _packed(key), _packed(value)
        if _one_call(plan):
            # Every row in order in one call (a ring step of documents, a window): the kernel's
            # output is the block's, with no accumulator in the accumulation dtype.
            o, l_ = self._forward_call(plan.calls[0], q, k, v, scale)
            return o.reshape(b, rows, h, d).transpose(1, 2).to(query.dtype), l_.to(acc).reshape(
                h, b, rows
            ).transpose(0, 1)
        out = torch.zeros(b * rows, h, d, dtype=acc, device=query.device)
        lse = torch.full((h, b * rows), float("-inf"), dtype=acc, device=query.device)
        for c in plan.calls:
            o, l_ = self._forward_call(c, q, k, v, scale)
            _into_rows(out, lse, c.q_index, o, l_, merge=c.layer > 0)
        out = out.view(b, rows, h, d).transpose(1, 2)
        lse = lse.view(h, b, rows).transpose(0, 1)
        if plan.math_rows is not None:
            r = plan.math_rows
            m_out, m_lse = _MATH.forward(
                query[:, :, r], key, value, is_causal=False, scale=scale, attn_mask=vis[:, :, r]
            )
            out[:, :, r] = m_out.to(acc)
            lse[:, :, r] = m_lse.to(acc)
        return out.to(query.dtype), lse

    def backward(
        self,
        grad_out,
        query,
        key,
        value,
        out,
        lse,
        *,
        is_causal,
        scale,
        attn_mask=None,
        row_bounds=None,
    ):
        if scale <= 0:  # (as in forward)
            mask = _dense_mask(key, attn_mask, row_bounds)
            args = (grad_out, query, key, value, out, lse)
            return _MATH.backward(*args, is_causal=is_causal, scale=scale, attn_mask=mask)
        plan, vis = self.plan(
            query, key, is_causal=is_causal, attn_mask=attn_mask, row_bounds=row_bounds
        )
        b, h, rows, d = query.shape
        hkv, cols = key.shape[1], key.shape[2]
        acc = accumulation_dtype(query.dtype)
        do, o = _packed(grad_out.to(query.dtype)), _packed(out.to(query.dtype))
        q, k, v = _packed(query), _packed(key), _packed(value)
        lse_packed = lse.to(acc).transpose(0, 1).reshape(h, b * rows)
        if (
            _one_call(plan) and plan.calls[0].k_index is None
        ):  # every row and key in order: no accumulators
            dq, dk, dv = self._backward_call(plan.calls[0], do, q, k, v, o, lse_packed, scale)
            return (
                dq.reshape(b, rows, h, d).transpose(1, 2).to(query.dtype),
                dk.reshape(b, cols, hkv, d).transpose(1, 2).to(key.dtype),
                dv.reshape(b, cols, hkv, d).transpose(1, 2).to(value.dtype),
            )
        dq = torch.zeros(b * rows, h, d, dtype=acc, device=query.device)
        dk = torch.zeros(b * cols, hkv, d, dtype=acc, device=key.device)
        dv = torch.zeros_like(dk)
        for c in plan.calls:
            qi = c.q_index
            dq_c, dk_c, dv_c = self._backward_call(c, do, q, k, v, o, lse_packed, scale)
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
            m_dq, m_dk, m_dv = _MATH.backward(
                grad_out[:, :, r],
                query[:, :, r],
                key,
                value,
                out[:, :, r],
                lse[:, :, r],
                is_causal=False,
                scale=scale,
                attn_mask=vis[:, :, r],
            )
            dq[:, :, r] = m_dq.to(acc)
            dk += m_dk
            dv += m_dv
        return dq.to(query.dtype), dk.to(key.dtype), dv.to(value.dtype)
