"""Attention masks on **global** token positions, composable, for ``ring_attention(mask=...)``.

A mask says which key/value positions each query position sees, in global positions of the
whole sequence, whatever the layout and the rank: the ring evaluates it on the positions each
rank holds (:mod:`ring_impl.layout`) and plans every ring step from it (:mod:`ring_impl.plan`:
blocks nobody sees are skipped, fully visible ones run unmasked, causal-shaped ones with the
kernel's causal flag, the rest with the block's mask).

Masks (``visible(q_pos, kv_pos)`` -> bool, True = sees):

``Causal()``                     ``kv <= q``
``Documents(doc_ids, causal)``   same document (per-token ids, ``-1`` = padding that sees nothing
                                 and is seen by nothing), causal within a document or not;
                                 ``Documents.from_cu_seqlens(cu_seqlens, seq_len)`` from
                                 cumulative lengths (tokens past the last document are padding)
``SlidingWindow(left, right=0)`` ``q - left <= kv <= q + right``
``ChunkedCausal(chunk)``         causal within chunks of ``chunk`` tokens
``PrefixLM(prefix)``             causal, plus every query sees the first ``prefix`` tokens
``a & b``, ``a | b``             intersection, union
``MaskMod(fn)``                  flex attention's convention: ``fn(b, h, q_idx, kv_idx)`` -> bool
                                 tensor, called on broadcastable index tensors

Visibility is ``(batch or 1, heads or 1, rows, cols)``: only ``MaskMod`` may depend on batch and
head. Every rank must pass an equal mask; each mask has a :meth:`Mask.digest` the ranks compare.

:meth:`Mask.reach` bounds how far a query looks: ``(left, right)`` with every visible pair
satisfying ``q - left <= kv <= q + right`` (None on a side: not bounded, or not known to be). A
mask bounded on both sides by less than a shard runs as a halo exchange (:mod:`ring_impl.halo`).
"""

from __future__ import annotations

import hashlib
import zlib
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

__all__ = [
    "And",
    "Causal",
    "ChunkedCausal",
    "Documents",
    "Full",
    "Mask",
    "MaskMod",
    "Or",
    "PrefixLM",
    "SlidingWindow",
    "from_spec",
    "mask_code",
    "mask_problem",
    "masking_problem",
    "visibility",
]


class Mask:
    """Base of the masks: ``visible`` on broadcastable position tensors, ``digest`` for the
    cross-rank check, ``check`` for bad parameters (a message, or None)."""

    def visible(self, b: torch.Tensor, h: torch.Tensor, q: torch.Tensor, kv: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def describe(self) -> str:
        raise NotImplementedError

    def check(self, seq_q: int, seq_kv: int) -> str | None:
        return None

    def reach(self) -> tuple[int | None, int | None]:
        """``(left, right)``: every pair the mask shows has ``q - left <= kv <= q + right``;
        None on a side that is unbounded (or that this mask cannot bound: the default)."""
        return None, None

    @property
    def exact_digest(self) -> bool:
        """Whether :meth:`describe` determines :meth:`visible` completely, so that plans may be
        cached by it (ring_impl.plan.masked_plan): the built-in masks themselves (and ``&``/``|``
        of them), not ``MaskMod`` (its description only probes its fn) and not subclasses, which
        may change ``visible`` under the parent's description. A subclass whose description
        covers all its data may override this."""
        return type(self) in _EXACT_TYPES

    def digest(self) -> int:
        """31 bits equal on ranks with equal masks (and, with overwhelming odds, only then)."""
        return zlib.crc32(self.describe().encode()) & 0x7FFFFFFF

    def __and__(self, other: Mask) -> Mask:
        return And(self, other)

    def __or__(self, other: Mask) -> Mask:
        return Or(self, other)


@dataclass(frozen=True)
class Full(Mask):
    def visible(self, b, h, q, kv):
        return torch.ones_like(kv <= q)

    def describe(self) -> str:
        return "full"


@dataclass(frozen=True)
class Causal(Mask):
    def visible(self, b, h, q, kv):
        return kv <= q

    def describe(self) -> str:
        return "causal"

    def reach(self):
        return None, 0


@dataclass(frozen=True)
class SlidingWindow(Mask):
    """``q - left <= kv <= q + right`` (``right=0``: causal sliding window; None: unbounded)."""

    left: int | None
    right: int | None = 0

    def visible(self, b, h, q, kv):
        seen = torch.ones_like(kv <= q)
        if self.left is not None:
            seen = seen & (kv >= q - self.left)
        if self.right is not None:
            seen = seen & (kv <= q + self.right)
        return seen

    def describe(self) -> str:
        return f"window({self.left},{self.right})"

    def reach(self):
        return self.left, self.right

    def check(self, seq_q, seq_kv):
        for name, v in (("left", self.left), ("right", self.right)):
            if v is not None and (isinstance(v, bool) or not isinstance(v, int) or v < 0):
                return f"SlidingWindow.{name} must be an int >= 0 (or None: unbounded), got {v!r}"
        return None


@dataclass(frozen=True)
class ChunkedCausal(Mask):
    chunk: int

    def visible(self, b, h, q, kv):
        return (kv <= q) & (torch.div(kv, self.chunk, rounding_mode="floor") == torch.div(q, self.chunk, rounding_mode="floor"))

    def describe(self) -> str:
        return f"chunked_causal({self.chunk})"

    def reach(self):
        return self.chunk - 1, 0

    def check(self, seq_q, seq_kv):
        if isinstance(self.chunk, bool) or not isinstance(self.chunk, int) or self.chunk < 1:
            return f"ChunkedCausal.chunk must be an int >= 1, got {self.chunk!r}"
        return None


@dataclass(frozen=True)
class PrefixLM(Mask):
    prefix: int

    def visible(self, b, h, q, kv):
        return (kv <= q) | (kv < self.prefix)

    def describe(self) -> str:
        return f"prefix_lm({self.prefix})"

    def reach(self):
        # Causal, plus the prefix seen from every query: query 0 sees keys up to prefix - 1.
        return None, max(0, self.prefix - 1)

    def check(self, seq_q, seq_kv):
        if isinstance(self.prefix, bool) or not isinstance(self.prefix, int) or self.prefix < 0:
            return f"PrefixLM.prefix must be an int >= 0, got {self.prefix!r}"
        return None


@dataclass(frozen=True, eq=False)
class Documents(Mask):
    """Packed documents: ``doc_ids`` (seq_len,) integer ids per global position, non-decreasing
    over the documents (``-1``: padding, anywhere); a query sees keys of its own document
    (causally when ``causal``). For cross attention, ``kv_doc_ids`` gives the keys' ids."""

    doc_ids: torch.Tensor
    causal: bool = True
    kv_doc_ids: torch.Tensor | None = None
    _cache: dict = field(default_factory=dict, repr=False, compare=False)

    @staticmethod
    def from_cu_seqlens(cu_seqlens, seq_len: int, causal: bool = True) -> Documents:
        """Documents from cumulative lengths ``[0, l0, l0 + l1, ...]``; tokens from the last
        entry to ``seq_len`` are padding."""
        cu = torch.as_tensor(cu_seqlens, dtype=torch.int64).flatten()
        if cu.numel() < 1 or int(cu[0]) != 0 or bool((cu[1:] < cu[:-1]).any()) or int(cu[-1]) > seq_len:
            raise ValueError(
                f"cu_seqlens must start at 0, not decrease and end at most at seq_len {seq_len}, got {cu.tolist()}"
            )
        ids = torch.full((seq_len,), -1, dtype=torch.int64)
        for d, (a, b) in enumerate(zip(cu[:-1].tolist(), cu[1:].tolist())):
            ids[a:b] = d
        return Documents(ids, causal)

    def _ids(self, kv: bool, device: torch.device) -> torch.Tensor:
        """The ids as int64 on ``device``; a converted copy is kept while the ids are unchanged
        (their storage and version counter: ids updated in place are converted again, never
        served stale, as their description, which keys the plans, is computed afresh)."""
        src = self.kv_doc_ids if kv and self.kv_doc_ids is not None else self.doc_ids
        if not isinstance(src, torch.Tensor):
            return torch.as_tensor(src, dtype=torch.int64, device=device)
        stamp = (src.data_ptr(), src._version)
        kept = self._cache.get((kv, device))
        if kept is None or kept[0] != stamp:
            kept = (stamp, src.to(device=device, dtype=torch.int64))
            self._cache[(kv, device)] = kept
        return kept[1]

    def visible(self, b, h, q, kv):
        dq, dk = self._ids(False, q.device)[q], self._ids(True, kv.device)[kv]
        seen = (dq == dk) & (dq >= 0)
        return seen & (kv <= q) if self.causal else seen

    def reach(self):
        # Bounded by the longest document, but a halo that wide is rarely narrower than a
        # shard: documents alone run on the ring (combine them with a SlidingWindow for a halo).
        return None, (0 if self.causal else None)

    def describe(self) -> str:
        parts = [torch.as_tensor(self.doc_ids)]
        if self.kv_doc_ids is not None:
            parts.append(torch.as_tensor(self.kv_doc_ids))
        # 128 bits of the ids: plans are cached by this description, so two documents layouts
        # must not share one by chance (a 32-bit checksum would, over a long run).
        crcs = ",".join(f"{t.numel()}:{hashlib.blake2b(t.to(torch.int64).contiguous().cpu().numpy().tobytes(), digest_size=16).hexdigest()}"
                        for t in parts)
        return f"documents({'causal' if self.causal else 'full'},{crcs})"

    def check(self, seq_q, seq_kv):
        for name, ids, n in (("doc_ids", self.doc_ids, seq_q), ("kv_doc_ids", self.kv_doc_ids, seq_kv)):
            if ids is None:
                continue
            if not isinstance(ids, torch.Tensor) or ids.dim() != 1 or ids.is_floating_point() or ids.is_complex():
                return f"Documents.{name} must be a 1-D integer tensor of global positions, got {type(ids).__name__}" + (
                    f" of shape {tuple(ids.shape)}, dtype {ids.dtype}" if isinstance(ids, torch.Tensor) else "")
            if ids.numel() != n:
                return (f"Documents.{name} has {ids.numel()} entries but the global sequence has {n} tokens "
                        "(local length x world size): give one id per global position")
            real = ids[ids >= 0]
            if bool((ids < -1).any()):
                return f"Documents.{name}: ids must be >= 0, or -1 for padding"
            if real.numel() > 1 and bool((real[1:] < real[:-1]).any()):
                return f"Documents.{name} decrease along the sequence; packed documents are numbered in order"
        if self.kv_doc_ids is None and seq_q != seq_kv:
            return "Documents on query and key/value sequences of different lengths needs kv_doc_ids"
        if not isinstance(self.causal, bool):
            return f"Documents.causal must be a bool, got {self.causal!r}"
        return None


@dataclass(frozen=True)
class And(Mask):
    a: Mask
    b: Mask

    @property
    def exact_digest(self) -> bool:
        return type(self) in _EXACT_TYPES and bool(getattr(self.a, "exact_digest", False) and getattr(self.b, "exact_digest", False))

    def visible(self, b, h, q, kv):
        return self.a.visible(b, h, q, kv) & self.b.visible(b, h, q, kv)

    def describe(self) -> str:
        return f"and({self.a.describe()},{self.b.describe()})"

    def reach(self):
        (la, ra), (lb, rb) = self.a.reach(), self.b.reach()
        return _bound(min, la, lb), _bound(min, ra, rb)

    def check(self, seq_q, seq_kv):
        return self.a.check(seq_q, seq_kv) or self.b.check(seq_q, seq_kv)


@dataclass(frozen=True)
class Or(Mask):
    a: Mask
    b: Mask

    @property
    def exact_digest(self) -> bool:
        return type(self) in _EXACT_TYPES and bool(getattr(self.a, "exact_digest", False) and getattr(self.b, "exact_digest", False))

    def visible(self, b, h, q, kv):
        return self.a.visible(b, h, q, kv) | self.b.visible(b, h, q, kv)

    def describe(self) -> str:
        return f"or({self.a.describe()},{self.b.describe()})"

    def reach(self):
        (la, ra), (lb, rb) = self.a.reach(), self.b.reach()
        return _bound(max, la, lb), _bound(max, ra, rb)

    def check(self, seq_q, seq_kv):
        return self.a.check(seq_q, seq_kv) or self.b.check(seq_q, seq_kv)


@dataclass(frozen=True, eq=False)
class MaskMod(Mask):
    """``fn(b, h, q_idx, kv_idx)`` as in flex attention, called once on broadcastable int64
    tensors of shapes (B, 1, 1, 1), (1, H, 1, 1), (1, 1, rows, 1), (1, 1, 1, cols). Its digest
    is its qualified name plus its values on a probe grid of the first 64 positions (fewer for a
    fn that cannot take 64), batch 0, head 0 (a closure differing between ranks outside that
    grid is not detected)."""

    fn: Callable

    def visible(self, b, h, q, kv):
        return self.fn(b, h, q, kv)

    def describe(self) -> str:
        name = getattr(self.fn, "__qualname__", type(self.fn).__name__)
        zero = torch.zeros(1, 1, 1, 1, dtype=torch.int64)
        # The first 64 positions, fewer where the fn cannot take them (a mask_mod indexing a
        # table of a shorter sequence): the same grid on every rank for the same fn and data.
        for size in (64, 32, 16, 8, 4, 2, 1):
            n = torch.arange(size)
            try:
                probe = torch.as_tensor(self.fn(zero, zero, n.view(1, 1, -1, 1), n.view(1, 1, 1, -1)))
            except (IndexError, RuntimeError, ValueError):
                continue
            bits = probe.to(torch.bool).expand(1, 1, size, size).contiguous().numpy().tobytes()
            return f"mask_mod({name},{size},{zlib.crc32(bits)})"
        return f"mask_mod({name},unprobed)"


def fold_causal(mask: Mask | None, is_causal) -> Mask | None:
    """The mask a call runs: ``mask`` intersected with ``Causal()`` when ``is_causal`` (None stays None)."""
    if mask is None or not is_causal:
        return mask
    return Causal() & mask


#: The masks whose description determines them (Mask.exact_digest).
_EXACT_TYPES = frozenset({Full, Causal, SlidingWindow, ChunkedCausal, PrefixLM, Documents, And, Or})


def _bound(pick, a: int | None, b: int | None) -> int | None:
    """``pick`` (min: intersection, max: union) of two reaches, None being unbounded."""
    if a is not None and b is not None:
        return pick(a, b)
    if pick is min:  # an intersection is as bounded as its bounded part
        return a if b is None else b
    return None


def visibility(mask: Mask, q_pos: torch.Tensor, kv_pos: torch.Tensor, *, batch: int = 1, heads: int = 1) -> torch.Tensor:
    """(batch or 1, heads or 1, len(q_pos), len(kv_pos)) bool: what each query position sees."""
    dev = q_pos.device
    b = torch.arange(batch, device=dev).view(-1, 1, 1, 1)
    h = torch.arange(heads, device=dev).view(1, -1, 1, 1)
    q = q_pos.to(torch.int64).view(1, 1, -1, 1)
    kv = kv_pos.to(torch.int64).view(1, 1, 1, -1)
    v = torch.as_tensor(mask.visible(b, h, q, kv), device=dev)
    if v.dtype != torch.bool:
        raise TypeError(f"mask {mask.describe()} returned {v.dtype}, not bool")
    while v.dim() < 4:
        v = v.unsqueeze(0)
    bm, hm = (batch if v.shape[0] == batch else 1), (heads if v.shape[1] == heads else 1)
    return v.expand(bm, hm, q.shape[2], kv.shape[3])


def mask_problem(mask, *, seq_q: int, seq_kv: int, batch: int, heads: int) -> str | None:
    """What is wrong with ``mask`` for global lengths ``seq_q``/``seq_kv``, or None. Never raises:
    a mask whose evaluation fails on some positions is a problem here, before any collective."""
    if mask is None:
        return None
    if not isinstance(mask, Mask):
        return f"mask must be a ring_impl.masks.Mask (Causal, Documents, SlidingWindow, ..., MaskMod), got {type(mask).__name__}"
    try:
        problem = mask.check(seq_q, seq_kv)
        if problem is not None:
            return problem
        # Evaluated on every position pair's corners and a strided grid: a mask_mod that fails
        # (index out of range, wrong shape or dtype) fails here on every rank alike.
        qs = torch.unique(torch.cat([torch.arange(0, seq_q, max(1, seq_q // 16)), torch.tensor([seq_q - 1])]))
        ks = torch.unique(torch.cat([torch.arange(0, seq_kv, max(1, seq_kv // 16)), torch.tensor([seq_kv - 1])]))
        visibility(mask, qs, ks, batch=batch, heads=heads)
        mask.digest()
    except Exception as exc:  # a mask that cannot be evaluated is bad input, not a crash
        return f"mask {type(mask).__name__} cannot be evaluated on the global positions ({type(exc).__name__}: {exc})"
    return None


def masking_problem(query, key, mask, sinks, *, world_size: int) -> str | None:
    """The problem with ``mask=`` / ``sinks=`` of a ring call on local shards, or None."""
    from .sinks import sinks_problem

    if mask is None and sinks is None:
        return None
    if not (isinstance(query, torch.Tensor) and isinstance(key, torch.Tensor) and query.dim() == 4 and key.dim() == 4):
        return None  # the shape problem is reported by the input checks
    b, h, sq, _ = query.shape
    problem = mask_problem(mask, seq_q=sq * world_size, seq_kv=key.shape[2] * world_size, batch=b, heads=h)
    return problem or sinks_problem(sinks, h)


def mask_code(mask, sinks) -> int:
    """31 bits for the cross-rank check: equal on ranks with equal masks and sinks; 0 for
    neither (what every strategy's check sends then, so the texts agree on "no mask")."""
    if mask is None and sinks is None:
        return 0
    parts = [mask.describe() if mask is not None else "-"]
    if sinks is not None:
        parts.append(str(zlib.crc32(sinks.detach().to(torch.float64).cpu().contiguous().numpy().tobytes())))
    return zlib.crc32("|".join(parts).encode()) & 0x7FFFFFFF


def from_spec(spec) -> Mask:
    """A mask from the plain-data description the oracle reads (reference.masks): ``{"kind":
    "causal"}``, ``{"kind": "document", "doc_ids" | "cu_seqlens": ..., "causal": bool}``, ...;
    ``seq_len`` for ``cu_seqlens`` is given as ``spec["seq_len"]``."""
    kind = spec.get("kind")
    if kind == "full":
        return Full()
    if kind == "causal":
        return Causal()
    if kind == "document":
        causal = bool(spec.get("causal", True))
        if "doc_ids" in spec:
            return Documents(torch.as_tensor(spec["doc_ids"], dtype=torch.int64), causal)
        return Documents.from_cu_seqlens(spec["cu_seqlens"], int(spec["seq_len"]), causal)
    if kind == "sliding_window":
        return SlidingWindow(spec.get("left"), spec.get("right", 0))
    if kind == "chunked_causal":
        return ChunkedCausal(spec["chunk"])
    if kind == "prefix_lm":
        return PrefixLM(spec["prefix"])
    if kind in ("and", "or"):
        masks = [from_spec(m) for m in spec["masks"]]
        out = masks[0]
        for m in masks[1:]:
            out = And(out, m) if kind == "and" else Or(out, m)
        return out
    if kind == "mask_mod":
        return MaskMod(spec["fn"])
    raise ValueError(f"unknown mask kind {kind!r}")
