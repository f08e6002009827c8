"""The per-step plan of the ring: which local query rows see which local key/value rows.

Convention: at ring step ``s`` (``0 <= s < W``) rank ``r`` holds the key/value shard of rank
``(r - s) mod W``. A step's plan is a list of :class:`Block` s, each one kernel call on a
rectangle of local rows: ``full`` (every query row sees every key/value row of the rectangle)
or ``causal`` (top-left: the rectangle's query row ``t`` sees its key/value rows ``0 .. t``). A
step with no block is skipped (its key/value block is still rotated). Rows and columns no query
sees are trimmed away, so a block is never larger than the visible region needs.

The plan is derived from the layout's positions (:func:`ring_impl.layout.layout_runs`), never
written per layout: with key/value positions increasing along local order, the key/value rows a
query at global position ``p`` sees under a causal mask are the prefix of the ``c(p)`` rows
whose positions are ``<= p``. Along a run of query positions ``c`` grows by 0 (a full block
``rows x [0, c)``) or by 1 per row (a diagonal: a causal block, plus a full block to its left);
consecutive pieces that continue one another are joined. For the built-in layouts that gives one
block per step:

contiguous, causal
    step 0: the rank's own block, causal. kv from an earlier rank: full. From a later rank: skipped.
head_tail, causal (local rows are [chunk r | chunk 2W-1-r], each ``n`` rows)
    step 0: causal over the whole local block (chunk r precedes chunk 2W-1-r).
    ``kv_rank < rank``: all query rows x kv rows ``[0, n)``, full.
    ``kv_rank > rank``: query rows ``[n, 2n)`` x all kv rows, full.
non-causal: one full block per step, any layout.

A plan is plain Python on ints (cached), so it is a constant under ``torch.compile``.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from itertools import pairwise
from typing import Any, TypeVar

import torch

from ..group import as_device
from ..layout import Runs, check_layout, layout_runs
from ..masks import bounds_hash, visible_ranges
from ..memo import host_memo

__all__ = [
    "Block",
    "StepPlan",
    "cached_by_mask",
    "mask_blocks",
    "masked_plan",
    "plan_ahead",
    "range_blocks",
    "ring_plan",
    "runs_rows",
    "step_blocks",
    "visibility_blocks",
    "with_positions",
]

T = TypeVar("T")


@dataclass(frozen=True)
class Block:
    """One kernel call of one step: local query rows ``q_rows`` x local key/value rows
    ``kv_rows`` (half-open ``(start, stop)`` ranges on the sequence dim), ``kind`` "full",
    "causal" (top-left within the rectangle), "masked" (``visible``: (batch or 1, heads or 1,
    rows, cols) bool, True where a query sees a key; some rows may see nothing) or "ranges"
    (``bounds``: (lo, hi), (rows,) int64, row ``r`` of the rectangle sees its columns
    ``lo[r] .. hi[r] - 1``, for every batch element and head; for ops that take row bounds)."""

    step: int
    kv_rank: int
    kind: str
    q_rows: tuple[int, int]
    kv_rows: tuple[int, int]
    visible: torch.Tensor | None = field(default=None, compare=False, repr=False)
    bounds: tuple[torch.Tensor, torch.Tensor] | None = field(
        default=None, compare=False, repr=False
    )
    #: the global positions of the block's query rows and key/value rows, as runs ``((start,
    #: stop), ...)`` in row order; set for a call with a score_mod (:func:`with_positions`)
    q_pos: Runs | None = field(default=None, compare=False, repr=False)
    kv_pos: Runs | None = field(default=None, compare=False, repr=False)
    #: device -> (visible, bounds) there, ("hidden", device) -> its hidden rows: a cached plan's
    #: block is moved once per device, not per call (a kernel keeps its own plan of the block by
    #: the tensor it is given)
    _moved: dict = field(default_factory=dict, init=False, compare=False, repr=False)

    def masking_on(
        self, device: torch.device
    ) -> tuple[torch.Tensor | None, tuple[torch.Tensor, torch.Tensor] | None]:
        """``(visible, bounds)`` on ``device`` (None where the block has none)."""
        if self.visible is None and self.bounds is None:
            return None, None
        key = str(device)
        moved = self._moved.get(key)
        if moved is None:
            visible = None if self.visible is None else self.visible.to(device)
            bounds = (
                None
                if self.bounds is None
                else (self.bounds[0].to(device), self.bounds[1].to(device))
            )
            moved = self._moved[key] = (visible, bounds)
        return moved

    def hidden_rows_on(self, device: torch.device) -> torch.Tensor | None:
        """(batch or 1, heads or 1, rows) bool on ``device``: the rows the block hides completely;
        None when it hides none (decided once per block on the plan's own tensors, so a call on a
        device reads nothing back for it)."""
        if self.visible is None and self.bounds is None:
            return None
        key = ("hidden", str(device))
        if key not in self._moved:
            if self.bounds is not None:
                hidden = (self.bounds[0] >= self.bounds[1]).view(1, 1, -1)
            else:
                assert self.visible is not None  # (the return above: no bounds, so visible)
                hidden = ~self.visible.any(-1)
            # (read on the host when the plan lives there; a plan on a device keeps its rows,
            # as reading them would be a sync)
            on_host = hidden.device.type == "cpu"
            self._moved[key] = None if on_host and not bool(hidden.any()) else hidden.to(device)
        return self._moved[key]

    @property
    def work(self) -> int:
        """Score entries the block computes that some
        query sees (its visible area, any batch/head)."""
        rows, cols = self.q_rows[1] - self.q_rows[0], self.kv_rows[1] - self.kv_rows[0]
        if self.kind == "full":
            return rows * cols
        if self.kind == "causal":
            return _triangle(rows, cols)
        if self.kind == "ranges":
            assert self.bounds is not None
            return int((self.bounds[1] - self.bounds[0]).clamp(min=0).sum())
        assert self.visible is not None
        return int(self.visible.any(0).any(0).sum())

    @property
    def area(self) -> int:
        """Score entries the kernel computes: the rectangle, its top-left triangle for ``causal``,
        the rows' ranges for ``ranges``."""
        rows, cols = self.q_rows[1] - self.q_rows[0], self.kv_rows[1] - self.kv_rows[0]
        if self.kind == "ranges":
            return self.work
        return _triangle(rows, cols) if self.kind == "causal" else rows * cols

    @property
    def is_causal(self) -> bool:
        return self.kind == "causal"

    @property
    def skipped(self) -> bool:  # a block is never empty; kept so a block reads like a step plan
        return False


def runs_rows(runs: Runs, rows: tuple[int, int]) -> Runs:
    """The runs of global positions of local rows ``[start, stop)`` of a shard at ``runs``."""
    start, stop = rows
    out, row = [], 0
    for a, b in runs:
        lo, hi = max(start, row), min(stop, row + b - a)
        if lo < hi:
            out.append((a + lo - row, a + hi - row))
        row += b - a
    return tuple(out)


def with_positions(
    plans: list[StepPlan], q_runs: Runs, kv_runs: Callable[[int], Runs]
) -> list[StepPlan]:
    """``plans`` with every block's global positions set (``Block.q_pos``/``kv_pos``): query rows
    of the shard at ``q_runs``, key/value rows of the shard of ``kv_runs(kv_rank)``. New blocks:
    cached plans are shared, never changed."""
    from dataclasses import replace

    def placed(b: Block) -> Block:
        return replace(
            b, q_pos=runs_rows(q_runs, b.q_rows), kv_pos=runs_rows(kv_runs(b.kv_rank), b.kv_rows)
        )

    return [StepPlan(p.step, p.kv_rank, tuple(placed(b) for b in p.blocks)) for p in plans]


def _triangle(rows: int, cols: int) -> int:
    """Entries of a top-left causal rows x cols block: row i sees min(i + 1, cols) keys."""
    k = min(rows, cols)
    return k * (k + 1) // 2 + (rows - k) * cols


@dataclass(frozen=True)
class StepPlan:
    """What one rank computes at one ring step: ``blocks`` in order (none: the step is skipped)."""

    step: int
    kv_rank: int
    blocks: tuple[Block, ...]

    @property
    def skipped(self) -> bool:
        return not self.blocks

    @property
    def kind(self) -> str:
        """ "skip", the single block's kind, or "blocks" for a step of several blocks."""
        if not self.blocks:
            return "skip"
        return self.blocks[0].kind if len(self.blocks) == 1 else "blocks"


def ring_plan(
    rank: int, world_size: int, *, layout: str, is_causal: bool, seq_q: int, seq_kv: int
) -> list[StepPlan]:
    """The plan of every ring step for ``rank``; ``seq_q``/``seq_kv`` are local lengths."""
    check_layout(layout)
    return list(_ring_plan(rank, world_size, layout, bool(is_causal), seq_q, seq_kv))


@host_memo(maxsize=512)
def _ring_plan(
    rank: int, world_size: int, layout: str, is_causal: bool, seq_q: int, seq_kv: int
) -> tuple[StepPlan, ...]:
    plans = []
    q_runs = layout_runs(layout, seq_q * world_size, world_size, rank) if is_causal else ()
    for step in range(world_size):
        kv_rank = (rank - step) % world_size
        if not is_causal:
            blocks: tuple[Block, ...] = (Block(step, kv_rank, "full", (0, seq_q), (0, seq_kv)),)
        else:
            kv_runs = layout_runs(layout, seq_kv * world_size, world_size, kv_rank)
            blocks = tuple(
                Block(step, kv_rank, kind, q, kv) for kind, q, kv in step_blocks(q_runs, kv_runs)
            )
        plans.append(StepPlan(step, kv_rank, blocks))
    return tuple(plans)


def step_blocks(q_runs: Runs, kv_runs: Runs) -> list[tuple[str, tuple[int, int], tuple[int, int]]]:
    """The (kind, q_rows, kv_rows) kernel calls for causal attention of queries at ``q_runs``
    over keys at ``kv_runs`` (both runs of global positions in local order; ``kv_runs``
    increasing)."""
    # Pieces (row0, row1, c0, slope): rows [row0, row1) see kv rows [0, c0 + slope * (row - row0)).
    pieces: list[list[int]] = []
    row = 0
    for qa, qb in q_runs:
        cuts = sorted({qa, qb, *(x for a, b in kv_runs for x in (a, b) if qa < x < qb)})
        for x, y in pairwise(cuts):
            slope = int(any(a <= x < b for a, b in kv_runs))
            c0 = sum(min(max(x - a + 1, 0), b - a) for a, b in kv_runs)
            r0, r1 = row + x - qa, row + y - qa
            last = pieces[-1] if pieces else None
            if (
                last is not None
                and last[1] == r0
                and last[3] == slope
                and last[2] + slope * (r0 - last[0]) == c0
            ):
                last[1] = r1  # continues the previous piece
            else:
                pieces.append([r0, r1, c0, slope])
        row += qb - qa
    blocks = []
    for r0, r1, c0, slope in pieces:
        if slope == 0:
            if c0 > 0:
                blocks.append(("full", (r0, r1), (0, c0)))
            continue
        if c0 > 1:  # the columns every row of the diagonal sees
            blocks.append(("full", (r0, r1), (0, c0 - 1)))
        blocks.append(("causal", (r0, r1), (c0 - 1, c0 - 1 + r1 - r0)))
    return blocks


def masked_plan(
    rank: int,
    world_size: int,
    *,
    layout: str,
    mask,
    seq_q: int,
    seq_kv: int,
    batch: int,
    heads: int,
    device: torch.device | None = None,
    head_span: tuple[int, int] | None = None,
    memo: dict | None = None,
    ranges: bool = False,
) -> list[StepPlan]:
    """The plan of every ring step for ``rank`` under ``mask`` (ring_impl.masks, on global
    positions); ``seq_q``/``seq_kv`` are local lengths. Per step the kernel calls of
    :func:`ring_impl.planning.tiling.split_visibility`: none (skipped, still rotated), or ``full``,
    ``causal`` and ``masked`` blocks on disjoint rectangles trimmed to what some query sees.
    ``head_span``: the query heads [start, stop) of ``heads`` a head chunk runs; a mask that
    depends on the head is planned for those heads only.

    Costs one boolean (rows x cols) evaluation of the mask per step. Plans of masks whose
    digest covers all their data (:attr:`ring_impl.masks.Mask.exact_digest`: every built-in
    mask, not ``MaskMod``) are cached by digest and the layout's runs, so the forward, the
    backward and every layer of a step share one; other plans are kept in ``memo`` (one call's,
    see :func:`cached_by_mask`) when given, and each of their steps is evaluated on every call
    but cut into blocks once per distinct result (:func:`ranges_digest` of the rows' key ranges
    with ``ranges``, else :func:`visibility_digest`).

    ``ranges`` (the op takes row bounds, ``OpCapabilities.row_bounds``): a step whose mask is one
    key range per query row (:mod:`ring_impl.planning.row_bounds`: every built-in mask but unions)
    is one block, ``full``, ``causal`` or ``ranges``, found from the mask's parameters in O(rows +
    cols) without evaluating it per pair; other steps are cut as above."""
    check_layout(layout)
    device = as_device(device)
    q_runs = layout_runs(layout, seq_q * world_size, world_size, rank)
    kv_runs = tuple(
        layout_runs(layout, seq_kv * world_size, world_size, r) for r in range(world_size)
    )
    # What the plan depends on besides the mask (whose description cached_by_mask adds).
    args = (rank, world_size, seq_q, seq_kv, batch, heads, head_span, q_runs, kv_runs, ranges)
    key = ("ring", str(device), *args)
    return list(cached_by_mask(mask, key, lambda: _masked_plan(mask, device, *args), memo=memo))


_PLAN_CACHE: dict[tuple, tuple[Any, int]] = {}  # key -> (plan, bytes of visibility it holds)
_PLAN_CACHE_SIZE = 64
#: Plans holding more visibility than this (irregular masks on long shards) are not kept, and
#: the cache as a whole holds at most _PLAN_CACHE_BYTES of it.
_PLAN_ENTRY_BYTES = 16 << 20
_PLAN_CACHE_BYTES = 256 << 20


def cached_by_mask(mask, key: tuple, build: Callable[[], T], memo: dict | None = None) -> T:
    """``build()``, cached by the mask's description and ``key`` (everything else the result
    depends on) when the description determines the mask
    (:attr:`ring_impl.masks.Mask.exact_digest`); least recently used entries go first. Results are
    shared: never modify one.

    Other masks (a ``MaskMod``, alone or combined) are known only by evaluating them: their
    results are kept in ``memo``, one call's dict (``RingConfig.plan_memo``), when given. The
    call builds them before its cross-rank check (:func:`plan_ahead`); its forward takes them
    from there, and its backward too unless they hold more than ``_PLAN_ENTRY_BYTES`` of
    visibility (then the forward's use drops them and the backward builds them again)."""
    if not getattr(mask, "exact_digest", False):
        if memo is None:
            return build()
        if key not in memo:
            memo[key] = build()
            return memo[key]
        kept = memo[key]
        if _visibility_bytes(kept) > _PLAN_ENTRY_BYTES:
            del memo[key]
        return kept
    return _remembered((mask.describe(), *key), build)


def _remembered(full: tuple, build: Callable[[], T]) -> T:
    """``build()``, kept in the plan cache under ``full`` (a key that determines the result);
    least recently used entries go first, and a result holding more than ``_PLAN_ENTRY_BYTES`` of
    visibility is not kept."""
    hit = _PLAN_CACHE.pop(full, None)
    if hit is None:
        plan = build()
        held = _visibility_bytes(plan)
        if held > _PLAN_ENTRY_BYTES:
            return plan
        hit = (plan, held)
        while _PLAN_CACHE and (
            len(_PLAN_CACHE) >= _PLAN_CACHE_SIZE
            or sum(b for _, b in _PLAN_CACHE.values()) + held > _PLAN_CACHE_BYTES
        ):
            _PLAN_CACHE.pop(next(iter(_PLAN_CACHE)))
    _PLAN_CACHE[full] = hit  # most recently used last
    return hit[0]


def visibility_digest(vis: torch.Tensor) -> str:
    """A 128-bit hash of every bit of a boolean visibility ``vis``, with its shape: the key of
    the blocks cut from it, for a mask whose description does not determine it (a ``MaskMod``).
    Costs one copy of the bits to the host (one eighth of the bool tensor's bytes)."""
    from .mask_table import bits_digest, packed_bits

    return f"{'x'.join(map(str, vis.shape))}:{bits_digest(packed_bits(vis))}"


def ranges_digest(lo: torch.Tensor, hi: torch.Tensor) -> str:
    """A 128-bit hash of row bounds ``lo``, ``hi`` (host int64 (rows,)), with their length: the
    key of the block cut from them, for a mask whose description does not determine them."""
    return f"{lo.numel()}:{bounds_hash(lo, hi)}"


def _visibility_bytes(plan) -> int:
    """Bytes of the masked blocks' visibility a plan (StepPlans or Blocks, in tuples, or an
    object with ``blocks``) holds; a visibility tensor's own bytes (Ulysses keeps one)."""
    if isinstance(plan, torch.Tensor):
        return plan.numel() * plan.element_size()
    items = plan if isinstance(plan, (tuple, list)) else (plan,)
    total = 0
    for item in items:
        blocks = item.blocks if hasattr(item, "blocks") else (item,)
        total += sum(
            b.visible.numel() * b.visible.element_size() for b in blocks if b.visible is not None
        )
    return total


def _masked_plan(
    mask,
    device,
    rank,
    world_size,
    seq_q,
    seq_kv,
    batch,
    heads,
    head_span,
    q_runs,
    kv_runs,
    ranges=False,
) -> tuple[StepPlan, ...]:
    def positions(runs: Runs) -> torch.Tensor:
        return torch.cat([torch.arange(a, b, device=device) for a, b in runs])

    q_pos = positions(q_runs)
    plans = []
    for step in range(world_size):
        kv_rank = (rank - step) % world_size
        blocks = mask_blocks(
            mask,
            q_pos,
            positions(kv_runs[kv_rank]),
            step,
            kv_rank,
            batch=batch,
            heads=heads,
            head_span=head_span,
            device=device,
            ranges=ranges,
        )
        plans.append(StepPlan(step, kv_rank, blocks))
    return tuple(plans)


def mask_blocks(
    mask,
    q_pos: torch.Tensor,
    kv_pos: torch.Tensor,
    step: int,
    kv_rank: int,
    *,
    batch: int,
    heads: int,
    head_span: tuple[int, int] | None,
    device: torch.device | None,
    ranges: bool,
) -> tuple[Block, ...]:
    """The blocks of one step (or the halo block) of ``mask`` between query positions ``q_pos``
    and key positions ``kv_pos``: with ``ranges`` (an op taking row bounds), one block from
    :func:`range_blocks` when the mask has that form; else the mask evaluated for ``batch``
    and ``heads`` (the query heads ``head_span`` of them, when given) and cut by
    :func:`visibility_blocks`."""
    from ..masks import visibility

    if ranges:
        blocks = range_blocks(mask, q_pos, kv_pos, step, kv_rank)
        if blocks is not None:
            return blocks
    exact = getattr(mask, "exact_digest", False)
    vis = visibility(mask, q_pos, kv_pos, batch=batch, heads=heads, device=device, keep=not exact)
    if head_span is not None and vis.shape[1] > 1:
        vis = vis[:, head_span[0] : head_span[1]]
    if exact:  # (its plan is cached whole, by its description)
        return visibility_blocks(vis, step, kv_rank, device)
    # A mask known only by evaluating it (a MaskMod): evaluated on every call, as its function
    # may read data that changed, but cut once per distinct result, keyed by every bit of it, so
    # that repeated calls (and layers) share the blocks and the kernels' plans of them.
    if ranges:  # rows that each see one range of keys: one block, as Documents
        bounds = visible_ranges(vis)
        if bounds is not None:
            lo, hi = bounds
            cut = ("ranges", ranges_digest(lo, hi), step, kv_rank)
            return _remembered(cut, lambda: bounds_blocks(lo, hi, step, kv_rank))
    vis = vis.to(q_pos.device)
    key = ("visibility", visibility_digest(vis), step, kv_rank, str(device))
    return _remembered(key, lambda: visibility_blocks(vis, step, kv_rank, device))


def visibility_blocks(
    vis: torch.Tensor, step: int, kv_rank: int, device: torch.device | None
) -> tuple[Block, ...]:
    """The blocks of one step whose visibility is ``vis`` (batch or 1, heads or 1, rows, cols):
    :func:`ring_impl.planning.tiling.split_visibility`'s calls, at the per-call cost of
    ``device``."""
    from .tiling import call_cost_for, split_visibility

    calls = split_visibility(vis, call_cost=call_cost_for(device))
    return tuple(
        Block(step, kv_rank, kind, rows, cols, visible=box) for kind, rows, cols, box in calls
    )


def range_blocks(
    mask, q_pos: torch.Tensor, kv_pos: torch.Tensor, step: int, kv_rank: int
) -> tuple[Block, ...] | None:
    """The one block of a step whose mask shows each query row one range of keys
    (:func:`ring_impl.planning.row_bounds.column_bounds`): none if no row sees anything, else the
    rectangle trimmed to what some row sees, ``full`` or top-left ``causal`` when it is that,
    else ``ranges`` with its rows' bounds. None when the mask has no such form."""
    from .row_bounds import column_bounds

    bounds = column_bounds(mask, q_pos, kv_pos)
    if bounds is None:
        return None
    return bounds_blocks(*bounds, step, kv_rank)


def bounds_blocks(lo: torch.Tensor, hi: torch.Tensor, step: int, kv_rank: int) -> tuple[Block, ...]:
    """The one block of a step whose query row ``r`` sees key columns ``lo[r] .. hi[r] - 1``
    (host int64 tensors (rows,)): :func:`range_blocks`."""
    live = (hi > lo).nonzero().flatten()
    if live.numel() == 0:
        return ()
    r0, r1 = int(live[0]), int(live[-1]) + 1
    lo, hi = lo[r0:r1], hi[r0:r1]
    seen = hi > lo
    c0, c1 = int(lo[seen].min()), int(hi[seen].max())
    lo, hi = torch.where(seen, lo - c0, 0), torch.where(seen, hi - c0, 0)
    rows, cols = r1 - r0, c1 - c0
    if bool(seen.all()) and bool((lo == 0).all()):
        if bool((hi == cols).all()):
            return (Block(step, kv_rank, "full", (r0, r1), (c0, c1)),)
        if bool((hi == torch.arange(1, rows + 1, device=hi.device).clamp(max=cols)).all()):
            return (Block(step, kv_rank, "causal", (r0, r1), (c0, c1)),)
    return (
        Block(
            step, kv_rank, "ranges", (r0, r1), (c0, c1), bounds=(lo.contiguous(), hi.contiguous())
        ),
    )


def plan_ahead(build: Callable[[], Any], mask) -> str | None:
    """Run ``build`` (a call's planning, which fills its ``plan_memo``) before the call's
    cross-rank check when ``mask`` is known only by evaluating it; the problem, in words, when
    evaluating it fails.

    The check evaluates a mask on a strided grid of positions; a ``mask_mod`` that fails
    elsewhere (an index out of range at one position) would otherwise fail while this rank plans
    its first ring step, after its first collective, and leave the other ranks waiting. Planned
    here, the failure is this rank's problem, and every rank raises InputError. Every position a
    rank's kernels need is evaluated by its own plan, so a failure anywhere is some rank's."""
    if mask is None or getattr(mask, "exact_digest", False):
        return None
    try:
        build()
    except Exception as exc:  # a mask that cannot be evaluated is bad input, not a crash
        return (
            f"mask {type(mask).__name__} cannot be evaluated on the positions this rank attends "
            f"({type(exc).__name__}: {exc})"
        )
    return None
