"""NaN and inf in the inputs reach exactly the outputs they reach in exact arithmetic, whatever
the local kernel does with them.

Attention in exact arithmetic turns a non-finite input into NaN in everything that depends on
it: a query row poisons its own output row and LSE (when it sees a key: a row that sees none
is out 0 and LSE -inf whatever it holds); a key poisons the rows that see it; a value
element poisons that feature of the rows that see it; in the backward, a poisoned row poisons
its dQ row and the dK/dV rows of every key it sees. Kernels do not all honour this (the CPU
flash kernel returns a query row holding NaN as out 0, LSE 0), and a ring must not hide a NaN
its inputs carry, nor spread one further: a kernel given a NaN at a key its mask hides (an
additive mask adds -inf to a NaN score, which stays NaN) returns NaN for rows that never see it.
So a block whose inputs are not all finite runs its kernel on :func:`finite_parts` of them
(non-finite entries as 0) and its result is then passed through these masks, computed from the
block's own inputs and its visibility, with no host sync (no branch on whether a flag is set:
the ring reads a flag only where that is free, on CPU, or once per call: a one-rank forward
reads one flag of its query, key and value, right before its kernel; a multi-rank forward
learns whether every rank's are finite from the cross-rank check's all-reduce, read with it; on
a GPU the blocks of a call whose group holds a non-finite input take this path). A backward
whose query, key and value are known finite reads one flag of its gradients (one rank: right
before its kernel; more: after launching its first step's kernels as if they were finite,
running those again when they are not), and only when one is not finite needs their
propagation alone (:class:`GradientFlags`, :func:`poison_gradients`: its per-feature range
counts over every row cost more than the read's sync on a GPU), made once per call (``"full"``,
top-left ``"causal"``, ``"masked"`` with the block's visibility, or ``"ranges"`` with its rows' key
ranges: a prefix count over the keys): elementwise flags and a prefix ``any`` over keys (one
reduction), O(seq * head_dim) per step against the kernel's O(seq^2 * head_dim), with no
data-dependent branch (compiles into the graph). The rule is the float64 oracle's
(``reference.attention.nonfinite_reach``): dependency through the visibility.

Shapes: query/out/grad_out (batch, heads, rows, head_dim), lse (batch, heads, rows),
key/value (batch, heads_kv, cols, head_dim); GQA: query head h reads key/value head
h // (heads // heads_kv).
"""

from __future__ import annotations

from typing import Any, NamedTuple, TypeVarTuple

import torch

__all__ = [
    "GradientFlags",
    "finite_parts",
    "gradient_flags",
    "poison_backward",
    "poison_forward",
    "poison_gradients",
]

#: the types of :func:`finite_parts`' arguments, each torch.Tensor or None (a TypeVarTuple has no
#: bound): its results have them too, so a caller unpacks tensors as tensors
_Parts = TypeVarTuple("_Parts")


def _bad(t: torch.Tensor) -> torch.Tensor:
    return ~torch.isfinite(t)


def finite_parts(*tensors: *_Parts) -> tuple[*_Parts]:
    """The tensors with their non-finite entries replaced by 0 (None stays None): what a block's
    kernel runs on when its inputs are not all finite, so that it computes finite numbers
    everywhere and the poison masks alone decide where NaN goes."""
    return _finite_parts(tensors)


def _finite_parts(tensors: tuple[Any, ...]) -> Any:
    """:func:`finite_parts`' body, typed loosely: mypy cannot map each member of a TypeVarTuple
    to its result."""
    return tuple(
        None
        if t is None
        else torch.where(torch.isfinite(t), t, torch.zeros((), dtype=t.dtype, device=t.device))
        for t in tensors
    )


def _to_query_heads(flags: torch.Tensor, heads: int) -> torch.Tensor:
    """(batch, heads_kv, ...) -> (batch, heads, ...):
    each query head gets its key/value head's flags."""
    group = heads // flags.shape[1]
    return flags if group == 1 else flags.repeat_interleave(group, dim=1)


def _to_kv_heads(flags: torch.Tensor, heads_kv: int) -> torch.Tensor:
    """(batch, heads, ...) -> (batch, heads_kv, ...): any over each GQA group."""
    b, h = flags.shape[:2]
    return (
        flags
        if h == heads_kv
        else flags.reshape(b, heads_kv, h // heads_kv, *flags.shape[2:]).any(2)
    )


def _prefix_any(flags: torch.Tensor, rows: int) -> torch.Tensor:
    """(batch, heads, cols[, d]) flags -> (batch, heads, rows[, d]): row i has a flag among
    0..i. A row index against the first flag's index: a reduction, not a scan (cummax on CUDA
    also writes int64 indices for every element)."""
    cols = flags.shape[2]
    first = torch.where(
        flags.any(dim=2, keepdim=True), flags.view(torch.uint8).argmax(dim=2, keepdim=True), cols
    )
    pos = torch.arange(rows, device=flags.device).view(1, 1, rows, *([1] * (flags.dim() - 3)))
    return pos >= first


def _suffix_any(flags: torch.Tensor, cols: int) -> torch.Tensor:
    """(batch, heads, rows[, d]) flags -> (batch, heads, cols[, d]):
    col j has a flag among rows j..end."""
    rows = flags.shape[2]
    trailing = [1] * (flags.dim() - 3)
    # the last flagged row, as the first one counted from the end (bytes, as in _prefix_any:
    # no int64 position per element); -1: none
    from_end = flags.view(torch.uint8).flip(2).argmax(dim=2, keepdim=True)
    last = torch.where(flags.any(dim=2, keepdim=True), rows - 1 - from_end, -1)
    return torch.arange(cols, device=flags.device).view(1, 1, cols, *trailing) <= last


Bounds = tuple[torch.Tensor, torch.Tensor]


def _ranges_seen(flags: torch.Tensor, bounds: Bounds) -> torch.Tensor:
    """For key flags (batch, heads, cols[, d]) and row ranges ``[lo, hi)`` (rows,): whether each
    row's range holds a flag, (batch, heads, rows[, d]), from one prefix count over the keys."""
    count = torch.cumsum(flags.to(torch.int32), dim=2)
    count = torch.cat(
        [torch.zeros_like(count.narrow(2, 0, 1)), count], dim=2
    )  # count[j]: flags in 0..j-1
    lo, hi = bounds
    return count.index_select(2, hi) > count.index_select(2, lo)


def _ranges_seeing(flags: torch.Tensor, bounds: Bounds, cols: int) -> torch.Tensor:
    """For row flags (batch, heads, rows[, d]) and row ranges ``[lo, hi)``: whether each key is in
    the range of a flagged row, (batch, heads, cols[, d]), from one difference array."""
    lo, hi = bounds
    f = flags.to(torch.int32)
    shape = list(f.shape)
    shape[2] = cols + 1
    diff = (
        torch.zeros(shape, dtype=torch.int32, device=f.device)
        .index_add_(2, lo, f)
        .index_add_(2, hi, -f)
    )
    return torch.cumsum(diff, dim=2).narrow(2, 0, cols) > 0


def _seen_by_rows(
    flags: torch.Tensor,
    kind: str,
    rows: int,
    visible: torch.Tensor | None = None,
    bounds: Bounds | None = None,
) -> torch.Tensor:
    """For key flags (batch, heads, cols[, d]): whether each query row sees a flagged key:
    (batch, heads, rows[, d]). ``causal``: row i sees keys 0..i (rows == cols); ``masked``: as
    ``visible`` (batch or 1, heads or 1, rows, cols) says; ``ranges``: as ``bounds`` say."""
    if kind == "ranges" and bounds is not None:
        return _ranges_seen(flags, bounds)
    if kind == "masked" and visible is not None:
        return _through(visible, flags)
    if kind == "causal":
        return _prefix_any(flags, rows)
    return _any_to_all(flags, rows)


def _seeing_cols(
    flags: torch.Tensor,
    kind: str,
    cols: int,
    visible: torch.Tensor | None = None,
    bounds: Bounds | None = None,
) -> torch.Tensor:
    """For query-row flags (batch, heads, rows[, d]): whether each key is seen by a flagged row:
    (batch, heads, cols[, d]). ``causal``: key j is seen by rows j..rows-1; ``masked``: as
    ``visible``; ``ranges``: as ``bounds``."""
    if kind == "ranges" and bounds is not None:
        return _ranges_seeing(flags, bounds, cols)
    if kind == "masked" and visible is not None:
        return _through(visible.transpose(-2, -1), flags)
    if kind == "causal":
        return _suffix_any(flags, cols)
    return _any_to_all(flags, cols)


def _through(visible: torch.Tensor, flags: torch.Tensor) -> torch.Tensor:
    """visible (b or 1, h or 1, m, n), flags (b, h, n[, d]) -> (b, h, m[, d]): whether each of
    the m sees a flagged one of the n."""
    f = flags.to(torch.float32)
    seen = visible.to(torch.float32) @ (f if f.dim() == 4 else f.unsqueeze(-1))
    return (seen > 0) if f.dim() == 4 else (seen > 0).squeeze(-1)


def _any_to_all(flags: torch.Tensor, n: int) -> torch.Tensor:
    """Flags (b, h, m[, d]) seen by all of n (an unmasked block) -> (b, h, n[, d])."""
    seen = flags.any(dim=2, keepdim=True)
    return seen.expand(*seen.shape[:2], n, *seen.shape[3:])


def poison_forward(
    out: torch.Tensor,
    lse: torch.Tensor,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    kind: str,
    visible: torch.Tensor | None = None,
    bounds: Bounds | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The block's (out, lse) with NaN wherever a non-finite input reaches them (``visible``:
    a masked block's visibility; ``bounds``: a ``ranges`` block's row ranges)."""
    heads, rows = query.shape[1], query.shape[2]
    bad_k = _to_query_heads(_bad(key).any(-1), heads)  # (b, h, cols)
    bad_v = _to_query_heads(_bad(value), heads)  # (b, h, cols, d)
    bad_q = _bad(query).any(-1)  # (b, h, rows)
    sees = _rows_seeing(visible, bounds)
    if sees is not None:  # a row the block hides computes nothing here, whatever its query
        bad_q = bad_q & sees
    row_bad = bad_q | _seen_by_rows(bad_k, kind, rows, visible, bounds)  # (b, h, rows)
    feature_bad = row_bad.unsqueeze(-1) | _seen_by_rows(
        bad_v, kind, rows, visible, bounds
    )  # (b, h, rows, d)
    nan = torch.full((), float("nan"), dtype=out.dtype, device=out.device)
    return torch.where(feature_bad, nan, out), torch.where(row_bad, nan.to(lse.dtype), lse)


def poison_backward(
    dq: torch.Tensor,
    dk: torch.Tensor,
    dv: torch.Tensor,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    grad_out: torch.Tensor,
    kind: str,
    visible: torch.Tensor | None = None,
    grad_lse: torch.Tensor | None = None,
    bounds: Bounds | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The block's (dq, dk, dv) with NaN exactly where a non-finite input reaches them.

    ``out``/``lse`` are the call's merged output and LSE for the block's rows (a row that saw a
    non-finite key or value anywhere carries it there). A row's probabilities are poisoned when
    its query or LSE is non-finite or it sees a non-finite key here; its dS (and so its dQ row
    and the dK rows of every key it sees) also when its output, output gradient or LSE gradient
    is, or it sees a non-finite value here (dP = dO V^T). dV[j, d] = sum_i P_ij dO[i, d] is
    poisoned only by the probabilities of the rows that see key j and by feature d of their
    output gradients, never by a value.
    """
    heads, rows = query.shape[1], query.shape[2]
    probs_bad = (
        _bad(query).any(-1)
        | _bad(lse)
        | _seen_by_rows(_to_query_heads(_bad(key).any(-1), heads), kind, rows, visible, bounds)
    )  # (b, h, rows)
    feature_bad = _bad(grad_out)
    row_bad = (
        probs_bad
        | _bad(out).any(-1)
        | feature_bad.any(-1)
        | _seen_by_rows(_to_query_heads(_bad(value).any(-1), heads), kind, rows, visible, bounds)
    )
    if grad_lse is not None:
        row_bad = row_bad | _bad(grad_lse)
    return _poisoned(dq, dk, dv, probs_bad, row_bad, feature_bad, kind, visible, bounds)


class GradientFlags(NamedTuple):
    """A backward's output gradients made safe for its kernels, and where they were not: the NaN
    propagation of a call whose query, key and value are known finite (so are out and the LSE:
    a row's output is a convex combination of finite values), where only the gradients can carry
    NaN. Built once per call from the rank's whole gradients, with no host read; each block takes
    its rows. Costs a few elementwise passes over grad_out per call (and per block, one over its
    gradients), where a decision by reading a flag costs a device sync.

    grad_out (batch, heads, rows, head_dim_v) with its non-finite entries as 0; grad_lse (batch,
    heads, rows) likewise, or None; feature_bad (batch, heads, rows, head_dim_v): grad_out's
    non-finite entries; row_bad (batch, heads, rows): rows whose grad_out or grad_lse holds one."""

    grad_out: torch.Tensor
    grad_lse: torch.Tensor | None
    feature_bad: torch.Tensor
    row_bad: torch.Tensor


def gradient_flags(grad_out: torch.Tensor, grad_lse: torch.Tensor | None = None) -> GradientFlags:
    """:class:`GradientFlags` of a backward's gradients."""
    feature_bad = _bad(grad_out)
    row_bad = feature_bad.any(-1)
    safe = grad_out.masked_fill(feature_bad, 0.0)
    if grad_lse is not None:
        lse_bad = _bad(grad_lse)
        row_bad = row_bad | lse_bad
        grad_lse = grad_lse.masked_fill(lse_bad, 0.0)
    return GradientFlags(safe, grad_lse, feature_bad, row_bad)


def poison_gradients(
    dq: torch.Tensor,
    dk: torch.Tensor,
    dv: torch.Tensor,
    row_bad: torch.Tensor,
    feature_bad: torch.Tensor,
    kind: str,
    visible: torch.Tensor | None = None,
    bounds: Bounds | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """:func:`poison_backward` for a block whose query, key, value, out and LSE are finite: its
    rows' :class:`GradientFlags` (``row_bad``, ``feature_bad``, the block's rows of them) alone
    say where NaN goes. A poisoned row poisons its dQ row and the dK rows of the keys it sees;
    a non-finite grad_out feature, that feature of the dV rows of the keys its row sees. The
    kernel's results are written in place (they are the block's own)."""
    return _poisoned(dq, dk, dv, None, row_bad, feature_bad, kind, visible, bounds, in_place=True)


def _poisoned(
    dq: torch.Tensor,
    dk: torch.Tensor,
    dv: torch.Tensor,
    probs_bad: torch.Tensor | None,
    row_bad: torch.Tensor,
    feature_bad: torch.Tensor,
    kind: str,
    visible: torch.Tensor | None,
    bounds: Bounds | None,
    in_place: bool = False,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(dq, dk, dv) with NaN where the block's poisoned rows reach: ``probs_bad`` (batch, heads,
    rows) rows whose probabilities are poisoned (None: none are), ``row_bad`` rows whose dS is,
    ``feature_bad`` (batch, heads, rows, head_dim_v) the non-finite entries of grad_out. A row
    the block hides computes nothing here, whatever it holds."""
    heads_kv, cols = dk.shape[1], dk.shape[2]
    sees = _rows_seeing(visible, bounds)
    if sees is not None:
        row_bad = row_bad & sees
        probs_bad = None if probs_bad is None else probs_bad & sees
    dk_bad = _to_kv_heads(_seeing_cols(row_bad, kind, cols, visible, bounds), heads_kv).unsqueeze(
        -1
    )  # (b, hkv, cols, 1)
    dv_flags = feature_bad if probs_bad is None else probs_bad.unsqueeze(-1) | feature_bad
    dv_bad = _to_kv_heads(_seeing_cols(dv_flags, kind, cols, visible, bounds), heads_kv)
    return (
        _nan_where(dq, row_bad.unsqueeze(-1), in_place),
        _nan_where(dk, dk_bad, in_place),
        _nan_where(dv, dv_bad, in_place),
    )


def _rows_seeing(visible: torch.Tensor | None, bounds: Bounds | None) -> torch.Tensor | None:
    """(batch or 1, heads or 1, rows) True where a row of the block sees one of its keys; None
    when every row does (full and causal blocks)."""
    if bounds is not None:
        return (bounds[1] > bounds[0]).view(1, 1, -1)
    if visible is not None:
        return visible.any(-1)
    return None


def _nan_where(t: torch.Tensor, flags: torch.Tensor, in_place: bool) -> torch.Tensor:
    """``t`` with NaN where ``flags`` (broadcast to it) are set; written into ``t`` itself when
    ``in_place`` and it is dense (a kernel's output: no second gradient-sized tensor)."""
    if in_place and t.is_contiguous():
        return t.masked_fill_(flags, float("nan"))
    return t.masked_fill(flags, float("nan"))
