"""One step's visibility cut into kernel calls: exact pieces where the mask has structure,
masked rectangles where it has none, merged where a call costs more than the area it saves.

Input: the visibility of one block of a ring step (or of the halo block), ``vis`` (batch or 1,
heads or 1, rows, cols) bool on local rows and columns. Output: kernel calls ``(kind, q_rows,
kv_rows, visible)`` on disjoint (query, key) rectangles that together cover every visible pair
and nothing a full or causal call would show that the mask hides:

``full``    every query of the rectangle sees every key of it, for every batch and head;
``causal``  top-left causal within the rectangle (query ``t`` sees keys ``0 .. t``);
``masked``  ``visible``: the rectangle's own (batch or 1, heads or 1, rows, cols) visibility.

How. Most masks in use show each query row an **interval** of key columns ``[lo, hi)`` (causal,
packed documents causal or not, sliding windows, chunked causal, prefix-LM, their
intersections, on any layout whose key positions increase along the local order). Consecutive
rows whose interval moves by a constant ``(dlo, dhi)`` per row form a *segment*:

``(0, 0)``  the same interval for every row: one ``full`` call;
``(0, 1)``  a growing prefix (causal): ``full`` on the columns every row sees, ``causal`` on the
            diagonal (as :func:`ring_impl.planning.plan.step_blocks`);
``(1, 1)``  a band (a sliding window): cut into ``band_rows`` tall ``masked`` rectangles
            ``band_rows x (width + band_rows - 1)``; ``band_rows ~ sqrt(call_cost)`` minimises
            (calls x call_cost + computed area) per row.

Rows whose visibility is no interval, or differs between batches or heads, are *irregular*: cut
into ``tile`` row tiles, each a masked rectangle per run of non-empty ``tile``-wide column tiles.

A kernel call costs ``call_cost`` score entries beyond its area (a masked one ``MASK_OVERHEAD``
more per entry, for its additive mask). Many tiny segments (short documents) would each pay a
call: a dynamic program over consecutive segments (in row order) merges runs of them into one
masked rectangle where that costs less. The cost model only decides how the work is cut; every
cut is exact.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

__all__ = [
    "CALL_COST",
    "Call",
    "Segment",
    "call_cost_for",
    "row_runs",
    "row_segments",
    "segments_from_bounds",
    "split_visibility",
]

#: Score entries one kernel call costs beyond its area on CPU (forward + backward through the
#: ring: slicing, the kernel's fixed cost, NaN propagation, the merge): about a 64 x 64 block,
#: from ``python benchmarks/masks.py --call-cost`` (CPU flash, 8 heads, head_dim 64).
CALL_COST = 4096
#: On a GPU a call's fixed cost (launches) is worth far more score entries.
CALL_COST_CUDA = 128 * 128 * 4
#: Extra cost per entry of a masked call (its additive mask is built and read).
MASK_OVERHEAD = 0.1
#: Segments considered for one merge (bounds the dynamic program).
MERGE_SPAN = 64
TILE = 64

#: (kind, (row0, row1), (col0, col1), visible or None)
Call = tuple[str, tuple[int, int], tuple[int, int], "torch.Tensor | None"]

_SLOPES = ((0, 0), (0, 1), (1, 1))


def call_cost_for(device: torch.device | str | None) -> int:
    """The per-call cost in score entries for kernels on ``device``."""
    return CALL_COST_CUDA if torch.device(device or "cpu").type == "cuda" else CALL_COST


@dataclass
class Segment:
    """Rows ``r0 .. r1 - 1`` of a visibility. ``regular``: each row sees one interval of keys,
    row ``r0 + t`` sees ``[lo + t * dlo, hi + t * dhi)``, ``(dlo, dhi)`` one of ``_SLOPES``."""

    r0: int
    r1: int
    lo: int  # interval of row r0 (regular); column bounds of the rows (irregular)
    hi: int
    regular: bool
    dlo: int = 0
    dhi: int = 0
    c0: int = 0  # column bounding box of every row
    c1: int = 0


def _area(kind: str, rows: int, cols: int) -> float:
    if kind == "causal":  # top-left: row i computes min(i + 1, cols) entries
        k = min(rows, cols)
        return k * (k + 1) / 2 + (rows - k) * cols
    return rows * cols * (1 + MASK_OVERHEAD if kind == "masked" else 1)


def _cost(calls, call_cost: int) -> float:
    return sum(call_cost + _area(kind, r1 - r0, c1 - c0) for kind, (r0, r1), (c0, c1) in calls)


def row_runs(seen: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Every run of visible keys of every row: ``(row, lo, hi)`` int64 tensors, the run being
    keys ``lo .. hi - 1`` of flattened row ``row`` of ``seen`` (..., rows, cols), in row order
    and, within a row, in key order. Found from the row's change points alone (one comparison
    and one nonzero over the block, not a reduction per statistic)."""
    cols = seen.shape[-1]
    flat = seen.reshape(-1, cols)
    edge = torch.zeros(flat.shape[0], 1, dtype=torch.bool, device=seen.device)
    padded = torch.cat([edge, flat, edge], 1)
    at = (padded[:, 1:] != padded[:, :-1]).nonzero()  # per row: start, end, start, end ...
    pairs = at.view(-1, 2, 2)
    return pairs[:, 0, 0], pairs[:, 0, 1], pairs[:, 1, 1]


def row_segments(seen: torch.Tensor, every: torch.Tensor | None) -> list[Segment]:
    """Row segments of ``seen`` (rows, cols), in row order, rows that see nothing left out;
    ``every``: visible for every batch/head (None: same as seen); a row where the two differ is
    irregular."""
    rows, cols = seen.shape
    row, lo, hi = row_runs(seen)
    count = torch.bincount(row, minlength=rows)
    first = torch.full((rows,), cols, dtype=torch.int64, device=seen.device).scatter_reduce(
        0, row, lo, "amin"
    )
    last = torch.zeros(rows, dtype=torch.int64, device=seen.device).scatter_reduce(
        0, row, hi, "amax"
    )
    ok = count == 1
    if every is not None:
        ok &= (seen == every).all(1)
    return segments_from_bounds(first.tolist(), last.tolist(), ok.tolist(), (count > 0).tolist())


def segments_from_bounds(
    lo_l: list[int], hi_l: list[int], ok_l: list[bool], any_l: list[bool]
) -> list[Segment]:
    """Row segments from each row's key bounds ``[lo, hi)``, whether the row sees exactly that
    interval (``ok``) and anything at all (``any``)."""
    segs: list[Segment] = []
    for r in range(len(lo_l)):
        if not any_l[r]:
            continue
        a, b = lo_l[r], hi_l[r]
        last = segs[-1] if segs and segs[-1].r1 == r else None
        if ok_l[r]:
            if last is not None and last.regular:
                n = r - last.r0
                if n == 1 and (a - last.lo, b - last.hi) in _SLOPES:
                    last.dlo, last.dhi = a - last.lo, b - last.hi
                    last.r1, last.c1 = r + 1, b
                    continue
                if n > 1 and a == last.lo + last.dlo * n and b == last.hi + last.dhi * n:
                    last.r1, last.c1 = r + 1, b
                    continue
            segs.append(Segment(r, r + 1, a, b, True, c0=a, c1=b))
        elif last is not None and not last.regular:
            last.r1, last.c0, last.c1 = r + 1, min(last.c0, a), max(last.c1, b)
        else:
            segs.append(Segment(r, r + 1, a, b, False, c0=a, c1=b))
    return segs


def _segment_calls(
    s: Segment, seen: torch.Tensor, call_cost: int, tile: int
) -> list[tuple[str, tuple[int, int], tuple[int, int]]]:
    """The calls of one segment (masked ones without their visibility yet)."""
    n = s.r1 - s.r0
    if (s.regular and (s.dlo, s.dhi) == (0, 0)) or (n == 1 and s.regular):
        return [("full", (s.r0, s.r1), (s.lo, s.hi))]
    if s.regular and (s.dlo, s.dhi) == (0, 1):
        calls = [("full", (s.r0, s.r1), (s.lo, s.hi - 1))] if s.hi - 1 > s.lo else []
        return [*calls, ("causal", (s.r0, s.r1), (s.hi - 1, s.hi - 1 + n))]
    if s.regular:  # a band (1, 1) of width hi - lo
        m = max(1, min(n, round(math.sqrt(call_cost))))
        calls = []
        for a in range(0, n, m):
            k = min(m, n - a)
            kind = "full" if k == 1 else "masked"
            calls.append((kind, (s.r0 + a, s.r0 + a + k), (s.lo + a, s.hi + a + k - 1)))
        return calls
    calls = []  # irregular: row tiles, each cut at runs of empty column tiles
    for a in range(s.r0, s.r1, tile):
        b = min(a + tile, s.r1)
        cols_seen = seen[a:b].any(0)
        width = cols_seen.numel()
        pad = (-width) % tile
        tiles = torch.cat([cols_seen, cols_seen.new_zeros(pad)]).view(-1, tile).any(1).tolist()
        t = 0
        while t < len(tiles):
            if not tiles[t]:
                t += 1
                continue
            u = t
            while u < len(tiles) and tiles[u]:
                u += 1
            hit = cols_seen[t * tile : min(u * tile, width)].nonzero().flatten()
            calls.append(("masked", (a, b), (t * tile + int(hit[0]), t * tile + int(hit[-1]) + 1)))
            t = u
    return calls


def _classify(kind: str, rows: tuple[int, int], cols: tuple[int, int], vis: torch.Tensor) -> Call:
    """A masked rectangle that is in fact full or causal becomes that kind;
    else carries its visibility."""
    if kind != "masked":
        return kind, rows, cols, None
    trimmed = vis[..., rows[0] : rows[1], cols[0] : cols[1]].any(0).any(0)
    r_any, c_any = trimmed.any(1).nonzero().flatten(), trimmed.any(0).nonzero().flatten()
    r0, r1 = rows[0] + int(r_any[0]), rows[0] + int(r_any[-1]) + 1
    c0, c1 = cols[0] + int(c_any[0]), cols[0] + int(c_any[-1]) + 1
    box = vis[..., r0:r1, c0:c1]
    if bool(box.all()):
        return "full", (r0, r1), (c0, c1), None
    if r1 - r0 == c1 - c0 and bool(
        (box == torch.ones(r1 - r0, c1 - c0, dtype=torch.bool, device=box.device).tril()).all()
    ):
        return "causal", (r0, r1), (c0, c1), None
    return "masked", (r0, r1), (c0, c1), box.contiguous()


def split_visibility(
    vis: torch.Tensor, *, call_cost: int = CALL_COST, tile: int = TILE
) -> list[Call]:
    """The kernel calls covering ``vis`` (batch or 1, heads or 1, rows, cols) bool (module
    docstring), in row order; none when nothing is visible."""
    seen = vis.any(0).any(0)
    every = None if vis.shape[0] * vis.shape[1] == 1 else vis.all(0).all(0)
    segs = row_segments(seen, every)
    if not segs:
        return []
    own = [_segment_calls(s, seen, call_cost, tile) for s in segs]
    own_cost = [_cost(c, call_cost) for c in own]
    # best[j]: the cheapest cut of segments [0, j); choice[j]: where its last group starts.
    best, choice = [0.0] * (len(segs) + 1), [0] * (len(segs) + 1)
    for j in range(1, len(segs) + 1):
        best[j], choice[j] = best[j - 1] + own_cost[j - 1], j - 1
        c0, c1 = segs[j - 1].c0, segs[j - 1].c1
        for i in range(j - 2, max(-1, j - 1 - MERGE_SPAN), -1):
            c0, c1 = min(c0, segs[i].c0), max(c1, segs[i].c1)
            merged = best[i] + call_cost + _area("masked", segs[j - 1].r1 - segs[i].r0, c1 - c0)
            if merged < best[j]:
                best[j], choice[j] = merged, i
    groups, j = [], len(segs)
    while j > 0:
        groups.append((choice[j], j))
        j = choice[j]
    calls: list[Call] = []
    for i, j in reversed(groups):
        if j - i == 1:
            calls += [_classify(kind, rows, cols, vis) for kind, rows, cols in own[i]]
        else:
            c0, c1 = min(s.c0 for s in segs[i:j]), max(s.c1 for s in segs[i:j])
            calls.append(_classify("masked", (segs[i].r0, segs[j - 1].r1), (c0, c1), vis))
    return calls
