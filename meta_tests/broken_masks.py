"""Deliberately broken rings for masks and load balance (shared/bug-classes.md, "Masks" and
"Balance"), each caught by the balance suite (``suites/test_balance.py``), which sees every
(query, key) pair the kernels compute and every rank's work, or by the mask suite
(``suites/test_masks.py``), which judges outputs and gradients in the balancers' layouts.

- ``window_off_by_one_at_block_edge``: the sliding window lets in one key too many, exactly
  where a key/value block begins (a bound checked with ``>`` at the block's first key).
- ``documents_at_local_positions``: document ids looked up at each token's local index on its
  rank instead of its global position.
- ``balancer_long_documents_on_one_rank``: a work-aware balancer that is correct (every position
  once, equal shares, increasing order: its layout passes every layout check, the outputs are
  right) but deals the longest documents out first, filling rank 0, then rank 1, ...: one rank
  gets the long documents and most of the work.
- ``mask_dropped_for_causal``: the mask dropped and ``is_causal=True`` run in its place, as a
  context-parallel hook that keeps ``is_causal`` and drops the attention mask: a sliding,
  chunked or document layer silently trains with full causal attention.
- ``mask_rows_from_the_start``: the mask evaluated with each query's index in its rank's shard
  as its position (keys at their global positions), as a mask or index built for the global
  length and cut from its start, where the rank's own rows were meant: every rank's queries see
  what the sequence's first positions see.
- ``tail_padding_attended``: the padding after the last document taken as one more document
  (padding recognised only before or between documents): the padding tokens see each other.
- ``odd_lengths_rounded_down``: documents rebuilt from their lengths rounded down to even: each
  odd-length document loses its last token, later boundaries move, the freed tokens are padding.
- ``stale_documents_after_refill``: document ids converted to int64 once and kept while their
  storage and torch's version counter stay the same; ids refilled in place without moving the
  counter (a numpy write into a ``from_numpy`` buffer) are served stale.
- ``mask_mod_probed_at_the_start``: the ranks compare a ``MaskMod`` by its values on the first
  64 positions at batch 0, head 0 only: ranks whose masks differ elsewhere each attend under
  their own mask, with no error.
- ``mask_evaluated_at_batch_0`` / ``mask_evaluated_at_head_0``: every ``MaskMod`` evaluated with
  its batch (head) index 0, as ``create_block_mask(B=None)`` (``H=None``) builds a block mask.
- ``window_right_side_dropped``: a ``SlidingWindow(left, right)`` planned as ``(left, 0)``.
- ``window_clamped_to_stream_start``: a sliding window over packed documents whose left edge is
  ``max(q - left, 0)`` on stream positions rather than ``max(q - left, document start)`` in the
  ring's block plans: the first queries of each document see the previous document's last keys.
  (The halo exchange and Ulysses plan their blocks elsewhere: their cases pass.)
- ``halo_wider_than_the_mask``: the halo exchange sized by a window's reach plus two rows each
  way: every output is right (the kernels mask the extra rows out), but each rank sends rows no
  query of its neighbour sees, more than the schedule it declares; only the masked call's
  collectives show it (``suites/test_masks.py``).
- ``backward_plans_balanced_layout_as_contiguous``: the forward runs a balancer's layout, the
  backward plans it as ``contiguous`` (a backward that knows the built-in layouts only). The
  forward's kernel calls are exactly right, so the balance suite (forward only) passes it.

Each is ring_impl with one part replaced, wrapped as an implementation under test
(``--impl meta_tests.broken_masks:<NAME>``); ``meta_tests/test_suite_catches_bugs.py`` runs the
suite against each and requires a failure matching its ``expect`` pattern and no other's.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, replace

import torch

import ring_impl
from conformance.adapters.ring_impl import RingImplAdapter, ring_impl_mask
from meta_tests.broken import Broken, by_name, function_adapter, ring_adapter
from ring_impl import RingAttention
from ring_impl.layout import Layout, layout_runs
from ring_impl.masks import And, Documents, Mask, MaskMod, Or, SlidingWindow
from ring_impl.planning.balance import document_spans
from suites.cases_masks import MASK_DROPPED, MASK_ROWS_FROM_THE_START, WINDOW_ACROSS_DOCUMENTS

__all__ = ["BROKEN_MASKS"]


def _replace_in(mask: Mask, swap) -> Mask:
    """``mask`` with every node for which ``swap(node)`` returns a mask replaced by it."""
    new = swap(mask)
    if new is not None:
        return new
    if isinstance(mask, (And, Or)):
        return type(mask)(_replace_in(mask.a, swap), _replace_in(mask.b, swap))
    return mask


def _all_runs(cfg, seq_kv: int):
    w = cfg.group.world_size
    return [layout_runs(cfg.layout, seq_kv * w, w, r) for r in range(w)]


def _local_index(cfg, seq: int) -> torch.Tensor:
    """(seq * W,) int64: each global position's index in its rank's shard under ``cfg``'s
    layout (``seq`` tokens per rank)."""
    local = torch.zeros(seq * cfg.group.world_size, dtype=torch.int64)
    for runs in _all_runs(cfg, seq):
        held = torch.cat([torch.arange(a, b) for a, b in runs])
        local[held] = torch.arange(held.numel())
    return local


# ------------------------------------------------------------------------ window off by one


@dataclass(frozen=True, eq=False)
class _WindowPastBlockEdge(Mask):
    """The window, plus the key one past its left end when that key starts a block."""

    window: SlidingWindow
    edge: torch.Tensor  # (seq,) bool: the position is the first of a block (a run of a rank)

    def visible(self, b, h, q, kv):
        extra = (kv == q - self.window.left - 1) & self.edge.to(kv.device)[kv]
        return self.window.visible(b, h, q, kv) | extra

    def describe(self) -> str:
        return self.window.describe()


class WindowOffByOneAtBlockEdge(RingAttention):
    def plan(self, cfg, seq_q, seq_kv):
        if cfg.mask is not None:
            edge = torch.zeros(seq_kv * cfg.group.world_size, dtype=torch.bool)
            for runs in _all_runs(cfg, seq_kv):
                edge[[a for a, _ in runs]] = True
            mask = _replace_in(
                cfg.mask,
                lambda m: (
                    _WindowPastBlockEdge(m, edge)
                    if isinstance(m, SlidingWindow) and m.left is not None
                    else None
                ),
            )
            cfg = replace(cfg, mask=mask)
        return super().plan(cfg, seq_q, seq_kv)


# --------------------------------------------------------------------- documents at local positions


@dataclass(frozen=True, eq=False)
class _DocumentsAtLocalIndex(Mask):
    """Documents whose ids are read at each position's local index on its rank."""

    documents: Documents
    local: torch.Tensor  # (seq,) int64: global position -> index in its rank's shard

    def visible(self, b, h, q, kv):
        ids = torch.as_tensor(self.documents.doc_ids).to(q.device)
        local = self.local.to(q.device)
        dq, dk = ids[local[q]], ids[local[kv]]
        seen = (dq == dk) & (dq >= 0)
        return seen & (kv <= q) if self.documents.causal else seen

    def describe(self) -> str:
        return self.documents.describe()


class DocumentsAtLocalPositions(RingAttention):
    def plan(self, cfg, seq_q, seq_kv):
        if cfg.mask is not None:
            local = _local_index(cfg, seq_kv)
            mask = _replace_in(
                cfg.mask,
                lambda m: (
                    _DocumentsAtLocalIndex(m, local)
                    if isinstance(m, Documents) and m.kv_doc_ids is None
                    else None
                ),
            )
            cfg = replace(cfg, mask=mask)
        return super().plan(cfg, seq_q, seq_kv)


# ------------------------------------------------------------- mask rows read from the start


@dataclass(frozen=True, eq=False)
class _RowsAtLocalIndex(Mask):
    """A mask whose query rows are read at each query's index in its rank's shard: the rows at
    the sequence's start, as a mask built for the global length and cut from its start gives
    every rank."""

    mask: Mask
    local: torch.Tensor  # (seq,) int64: global position -> index in its rank's shard

    def visible(self, b, h, q, kv):
        return self.mask.visible(b, h, self.local.to(q.device)[q], kv)

    def describe(self) -> str:
        return self.mask.describe()


class MaskRowsFromTheStart(RingAttention):
    def plan(self, cfg, seq_q, seq_kv):
        if cfg.mask is not None:
            cfg = replace(cfg, mask=_RowsAtLocalIndex(cfg.mask, _local_index(cfg, seq_q)))
        return super().plan(cfg, seq_q, seq_kv)


# ----------------------------------------------------------------------- document ids rebuilt wrong


@dataclass(frozen=True, eq=False)
class _RebuiltDocuments(Mask):
    """Documents seen through ids :meth:`rebuilt` from the true ones (the bug), described as the
    true documents (plans are cached by the description, as a real implementation's would be)."""

    documents: Documents

    def rebuilt(self, ids: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def visible(self, b, h, q, kv):
        ids = self.rebuilt(torch.as_tensor(self.documents.doc_ids).clone()).to(q.device)
        dq, dk = ids[q], ids[kv]
        seen = (dq == dk) & (dq >= 0)
        return seen & (kv <= q) if self.documents.causal else seen

    def describe(self) -> str:
        return self.documents.describe()


class _TailPaddingAsDocument(_RebuiltDocuments):
    """The padding after the last document taken as one more document: padding recognised only
    before or between documents (a check for ``-1`` that stops at the last real token)."""

    def rebuilt(self, ids):
        real = (ids >= 0).nonzero()
        if real.numel():
            ids[int(real[-1]) + 1 :] = int(ids.max()) + 1
        return ids


class _LengthsRoundedToEven(_RebuiltDocuments):
    """Documents rebuilt from their lengths rounded down to even (as a converter to a format
    whose per-rank lengths must divide evenly might): each odd-length document loses its last
    token, later boundaries move earlier, and the tokens freed at the end become padding."""

    def rebuilt(self, ids):
        values, counts = torch.unique_consecutive(ids, return_counts=True)
        counts = torch.where(values >= 0, counts // 2 * 2, counts)
        packed = torch.repeat_interleave(values, counts)
        return torch.cat([packed, torch.full((ids.numel() - packed.numel(),), -1, dtype=ids.dtype)])


class _DocumentsRebuiltWrong(RingAttention):
    """ring_impl with every document mask (one id sequence) seen through ``rebuilt``, a
    :class:`_RebuiltDocuments` subclass."""

    def __init__(self, rebuilt: type[_RebuiltDocuments]):
        self.rebuilt = rebuilt

    def plan(self, cfg, seq_q, seq_kv):
        if cfg.mask is not None:
            mask = _replace_in(
                cfg.mask,
                lambda m: (
                    self.rebuilt(m) if isinstance(m, Documents) and m.kv_doc_ids is None else None
                ),
            )
            cfg = replace(cfg, mask=mask)
        return super().plan(cfg, seq_q, seq_kv)


# ------------------------------------------------------------------- a backward on the wrong layout


class BackwardPlansBalancedLayoutAsContiguous(RingAttention):
    def backward(self, cfg, grad_out, query, key, value, out, lse, grad_lse=None):
        if cfg.layout not in ring_impl.LAYOUTS:
            cfg = replace(cfg, layout="contiguous")
        return super().backward(cfg, grad_out, query, key, value, out, lse, grad_lse)


# -------------------------------------------------------------------- a balancer that piles up work


def _longest_first_runs(mask, seq_len: int, world_size: int) -> list[tuple[tuple[int, int], ...]]:
    """Documents longest first, each rank filled to S/W before the next (a document split where
    a rank is full); each rank's runs in increasing order: a valid layout."""
    share = seq_len // world_size
    held: list[list[tuple[int, int]]] = [[] for _ in range(world_size)]
    rank, room = 0, share
    for a, b in sorted(document_spans(mask, seq_len), key=lambda s: (s[0] - s[1], s[0])):
        while a < b:
            take = min(room, b - a)
            held[rank].append((a, a + take))
            a, room = a + take, room - take
            if room == 0 and rank + 1 < world_size:
                rank, room = rank + 1, share
    return [tuple(sorted(runs)) for runs in held]


class LongDocumentsOnOneRank(RingImplAdapter):
    def balanced_layout(self, balancer, mask, seq_len, world_size):
        mask = ring_impl_mask(mask)
        if (
            balancer != "work_aware" or len(document_spans(mask, seq_len)) < 2
        ):  # right without documents
            return super().balanced_layout(balancer, mask, seq_len, world_size)
        per_rank = _longest_first_runs(mask, seq_len, world_size)
        name = f"longest_first-{seq_len}x{world_size}-{mask.digest():08x}"
        ring_impl.register_layout(
            Layout(name, lambda length, world, rank: per_rank[rank], lambda world: world),
            replace=True,
        )
        return name, [layout_runs(name, seq_len, world_size, r) for r in range(world_size)]


# ---------------------------------------------------------------- ids kept by their version counter


def _stale_documents_ring():
    """ring_attention behind a cache of converted document ids, kept while the ids' storage and
    version counter are unchanged (writes torch does not see leave both as they were)."""
    kept: dict[int, tuple[tuple[int, int], Documents]] = {}

    def ring_attention(query, key, value, *, mask=None, **kwargs):
        if (
            isinstance(mask, Documents)
            and isinstance(mask.doc_ids, torch.Tensor)
            and mask.doc_ids.dtype != torch.int64
        ):
            stamp = (mask.doc_ids.data_ptr(), mask.doc_ids._version)
            entry = kept.get(id(mask))
            if entry is None or entry[0] != stamp:
                entry = kept[id(mask)] = (
                    stamp,
                    Documents(mask.doc_ids.to(torch.int64), mask.causal, mask.kv_doc_ids),
                )
            mask = entry[1]
        return ring_impl.ring_attention(query, key, value, mask=mask, **kwargs)

    return function_adapter("stale_documents_after_refill", ring_attention)


# ------------------------------------------------------------------------ a mask on the wrong axis


class _MaskRewritten(RingAttention):
    """ring_impl whose plans (forward and backward) see every node of the mask through ``swap``."""

    def __init__(self, swap):
        self.swap = swap

    def plan(self, cfg, seq_q, seq_kv):
        if cfg.mask is not None:
            cfg = replace(cfg, mask=_replace_in(cfg.mask, self.swap))
        return super().plan(cfg, seq_q, seq_kv)


def _at_zero(which: str):
    def swap(m):
        if type(m) is not MaskMod:
            return None
        fn = m.fn
        if which == "batch":
            return MaskMod(lambda b, h, q, kv: fn(torch.zeros_like(b), h, q, kv))
        return MaskMod(lambda b, h, q, kv: fn(b, torch.zeros_like(h), q, kv))

    return swap


def _right_dropped(m):
    return SlidingWindow(m.left, 0) if type(m) is SlidingWindow and m.right else None


def _one_stream(ids: torch.Tensor | None) -> torch.Tensor | None:
    """Document ids with every document merged into one (padding stays padding)."""
    if ids is None:
        return None
    ids = torch.as_tensor(ids)
    return torch.where(ids >= 0, torch.zeros_like(ids), torch.full_like(ids, -1))


def _window_from_stream_start(m):
    """A window over packed documents (``Documents & SlidingWindow``) whose left edge is
    ``max(q - left, 0)`` on stream positions: within the window the document starts are not
    seen, so a query near its document's start sees the previous document's last keys."""
    if type(m) is not And or {type(m.a), type(m.b)} != {Documents, SlidingWindow}:
        return None
    docs = m.a if type(m.a) is Documents else m.b
    stream = Documents(_one_stream(docs.doc_ids), docs.causal, _one_stream(docs.kv_doc_ids))
    return And(stream, m.b) if docs is m.a else And(m.a, stream)


# ------------------------------------------------------------ a mask_mod compared at its start only


@dataclass(frozen=True)
class _ProbedAtTheStart(MaskMod):
    """A MaskMod whose ranks compare its values on the first 64 positions, batch 0, head 0."""

    def agreement_text(self, batch, heads, seq_q, seq_kv, device=None) -> str:
        return self.describe()


def _probed_at_the_start_ring():
    def ring_attention(query, key, value, *, mask=None, **kwargs):
        if mask is not None:
            mask = _replace_in(
                mask, lambda m: _ProbedAtTheStart(m.fn) if type(m) is MaskMod else None
            )
        return ring_impl.ring_attention(query, key, value, mask=mask, **kwargs)

    return function_adapter("mask_mod_probed_at_the_start", ring_attention)


# ------------------------------------------------------------ a halo wider than the mask's reach


@dataclass(frozen=True)
class _ReachingFurther(SlidingWindow):
    """A sliding window that says it reaches two rows further each way than it sees."""

    def reach(self):
        left, right = super().reach()
        return tuple(None if side is None else side + 2 for side in (left, right))


def _halo_wider_than_the_mask():
    def ring_attention(query, key, value, *, mask=None, **kwargs):
        if mask is not None:
            mask = _replace_in(
                mask,
                lambda m: _ReachingFurther(m.left, m.right) if type(m) is SlidingWindow else None,
            )
        return ring_impl.ring_attention(query, key, value, mask=mask, **kwargs)

    return function_adapter("halo_wider_than_the_mask", ring_attention)


def _mask_dropped_for_causal():
    """ring_impl's call with its mask dropped and ``is_causal=True`` in its place, as a
    context-parallel hook that keeps ``is_causal`` and drops the attention mask runs a sliding,
    chunked or document layer."""
    adapter = RingImplAdapter()

    def ring_attention(query, key, value, *, mask=None, is_causal=False, **options):
        is_causal = True if mask is not None else is_causal
        return adapter.ring_attention(query, key, value, is_causal=is_causal, **options)

    return function_adapter("mask_dropped_for_causal", ring_attention)


BROKEN_MASKS: dict[str, Broken] = by_name(
    Broken(
        "window_off_by_one_at_block_edge",
        "masks: a window off by one at a block edge",
        r"sliding window off by one",
        ring_adapter("window_off_by_one_at_block_edge", WindowOffByOneAtBlockEdge()),
        suites="suites/test_balance.py",
    ),
    Broken(
        "documents_at_local_positions",
        "masks: document boundaries computed from local instead of global positions",
        r"document boundaries taken from local positions",
        ring_adapter("documents_at_local_positions", DocumentsAtLocalPositions()),
        suites="suites/test_balance.py",
    ),
    Broken(
        "mask_dropped_for_causal",
        "masks: a layer's mask dropped under context parallelism, plain causal run in its place",
        re.escape(MASK_DROPPED),
        _mask_dropped_for_causal(),
        suites="suites/test_masks.py",
        # (a per-head mask_mod whose head 0 is causal: causal attention is also that mask
        # evaluated at head 0 for every head, the narrower cause the diagnosis names first)
        select=("-k", "not mask_mod"),
    ),
    Broken(
        "mask_rows_from_the_start",
        "masks: a mask built for the global length cut from its start, the rank's rows meant",
        re.escape(MASK_ROWS_FROM_THE_START),
        ring_adapter("mask_rows_from_the_start", MaskRowsFromTheStart()),
        suites="suites/test_masks.py",
        # (a hybrid's ring cuts the rows its Ulysses all-to-all gathered, not the layout's
        # shards: its cases fail by their errors, unnamed; Ulysses and the halo exchange plan
        # elsewhere and pass)
        select=("-k", "not hybrid"),
        min_failures=10,
    ),
    Broken(
        "tail_padding_attended",
        "masks: tail padding ignored when detecting padding",
        r"tail padding attended: the \d+ padding tokens after the last document see each other",
        ring_adapter("tail_padding_attended", _DocumentsRebuiltWrong(_TailPaddingAsDocument)),
        suites="suites/test_masks.py",
    ),
    Broken(
        "odd_lengths_rounded_down",
        "masks: odd document lengths rounded down",
        r"document lengths rounded down to even",
        ring_adapter("odd_lengths_rounded_down", _DocumentsRebuiltWrong(_LengthsRoundedToEven)),
        suites="suites/test_masks.py",
    ),
    Broken(
        "balancer_long_documents_on_one_rank",
        "balance: a correct per-document balancer that gives one rank most of the work",
        r"load imbalance: max/mean work [\d.]+ > [\d.]+ declared for the work_aware balancer",
        LongDocumentsOnOneRank(name="balancer_long_documents_on_one_rank"),
        suites="suites/test_balance.py",
    ),
    Broken(
        "stale_documents_after_refill",
        "masks: document ids refilled in place served stale",
        r"stale documents: the second call ran the documents its mask's ids held at the first "
        r"call",
        _stale_documents_ring(),
        suites="suites/test_masks.py",
        select=("-k", "refilled"),
    ),
    Broken(
        "mask_mod_probed_at_the_start",
        "masks: ranks whose mask_mods differ beyond a probe of their start run silently",
        r"mask_mod_differs_\w+: no rank raised",
        _probed_at_the_start_ring(),
        suites="suites/test_bad_input.py",
        select=("-k", "mask_mod"),
    ),
    Broken(
        "mask_evaluated_at_batch_0",
        "masks: a mask_mod evaluated at batch 0 for every batch row",
        r"the mask was evaluated at batch 0 for every batch row",
        ring_adapter("mask_evaluated_at_batch_0", _MaskRewritten(_at_zero("batch"))),
        suites="suites/test_masks.py",
        select=("-k", "mask_mod_batch_head"),
        min_failures=3,
    ),
    Broken(
        "mask_evaluated_at_head_0",
        "masks: a mask_mod evaluated at head 0 for every head",
        r"the mask was evaluated at head 0 for every head",
        ring_adapter("mask_evaluated_at_head_0", _MaskRewritten(_at_zero("head"))),
        suites="suites/test_masks.py",
        select=("-k", "mask_mod_batch_head"),
        min_failures=3,
    ),
    Broken(
        "window_right_side_dropped",
        "masks: a sliding window's right side dropped",
        r"the sliding window's right side was dropped",
        ring_adapter("window_right_side_dropped", _MaskRewritten(_right_dropped)),
        suites="suites/test_masks.py",
        select=("-k", "window_wide or prefix_lm_window"),
        min_failures=3,
    ),
    Broken(
        "window_clamped_to_stream_start",
        "masks: a window over packed documents clamped to the stream start, not the document's",
        re.escape(WINDOW_ACROSS_DOCUMENTS),
        ring_adapter("window_clamped_to_stream_start", _MaskRewritten(_window_from_stream_start)),
        suites="suites/test_masks.py",
        select=("-k", "documents_window"),
        min_failures=6,
    ),
    Broken(
        "halo_wider_than_the_mask",
        "collectives: a halo exchange sends more rows than the mask's reach (outputs right)",
        r"the masked call's collectives are not the schedule declared for its mask",
        _halo_wider_than_the_mask(),
        suites="suites/test_masks.py",
        select=("-k", "collectives and window"),
        min_failures=2,
    ),
    Broken(
        "backward_plans_balanced_layout_as_contiguous",
        "balance: the backward plans a balancer's layout as another (the forward is right)",
        r"the backward did not run the layout the forward ran",
        ring_adapter(
            "backward_plans_balanced_layout_as_contiguous",
            BackwardPlansBalancedLayoutAsContiguous(),
        ),
        suites="suites/test_masks.py",
    ),
)

# Module attributes, so each is loadable as --impl meta_tests.broken_masks:<name>.
globals().update({name: b.impl for name, b in BROKEN_MASKS.items()})
