"""Attention masks on **global** token positions, composable, for ``ring_attention(mask=...)``.

A mask says which key/value positions each query position sees, in global positions of the
whole sequence, whatever the layout and the rank: the ring evaluates it on the positions each
rank holds (:mod:`ring_impl.layout`) and plans every ring step from it
(:mod:`ring_impl.planning.plan`: blocks nobody sees are skipped, fully visible ones run unmasked,
causal-shaped ones with the kernel's causal flag, the rest with the block's mask).

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
``KeyRanges(start, end)``        ``start[q] <= kv < end[q]``: one range of keys per query;
                                 ``tabulate(mask, seq)`` evaluates a mask of that form once

Visibility is ``(batch or 1, heads or 1, rows, cols)``: only ``MaskMod`` may depend on batch and
head. Every rank must pass an equal mask; each mask has a :meth:`Mask.digest` the ranks compare.

:meth:`Mask.reach` bounds how far a query looks: ``(left, right)`` with every visible pair
satisfying ``q - left <= kv <= q + right`` (None on a side: not bounded, or not known to be). A
mask bounded on both sides by less than a shard runs as a halo exchange
(:mod:`ring_impl.exchanges.halo`).
"""

from __future__ import annotations

import collections
import contextvars
import hashlib
import operator
import zlib
from collections.abc import Callable
from dataclasses import dataclass, field, replace

import torch

__all__ = [
    "And",
    "AtQueryPositions",
    "Causal",
    "ChunkedCausal",
    "Documents",
    "Full",
    "IdsCheck",
    "KeyRanges",
    "Mask",
    "MaskMod",
    "Or",
    "PrefixLM",
    "SlidingWindow",
    "StaleIds",
    "bounds_hash",
    "from_spec",
    "mask_code",
    "mask_problem",
    "masking_problem",
    "probe_grid",
    "probe_text",
    "snapshot",
    "tabulate",
    "visibility",
    "visible_ranges",
]


def _plain_int(value):
    """``value`` as a Python int when it is an integer of another kind (numpy's, a 0-d integer
    tensor): the masks' parameters are plain values, compared and described as such. Anything
    else (bool, float, None, a wrong type) stays as it is, for ``check`` to refuse."""
    if isinstance(value, (bool, int)) or value is None or not hasattr(value, "__index__"):
        return value
    try:
        return operator.index(value)
    except TypeError:
        return value


class Mask:
    """Base of the masks: ``visible`` on broadcastable position tensors, ``digest`` for the
    cross-rank check, ``check`` for bad parameters (a message, or None)."""

    def visible(
        self, b: torch.Tensor, h: torch.Tensor, q: torch.Tensor, kv: torch.Tensor
    ) -> torch.Tensor:
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
        cached by it (ring_impl.planning.plan.masked_plan): the built-in masks themselves (and
        ``&``/``|`` of them), not ``MaskMod`` (its description only probes its fn) and not
        subclasses, which may change ``visible`` under the parent's description. A subclass whose
        description covers all its data may override this."""
        return type(self) in _EXACT_TYPES

    def digest(self) -> int:
        """31 bits equal on ranks with equal masks (and, with overwhelming odds, only then)."""
        return zlib.crc32(self.describe().encode()) & 0x7FFFFFFF

    def frozen(self) -> Mask:
        """The mask with its data copied as it is now (:func:`snapshot`): masks of plain values
        are their own snapshot; masks holding tensors copy them."""
        return self

    def agreement_text(self, batch: int, heads: int, seq_q: int, seq_kv: int, device=None) -> str:
        """What the ranks of a call compare (the cross-rank check) for a call of these global
        sizes: the description, which determines a built-in mask; a ``MaskMod`` adds its values
        over the whole (batch, head, query, key) range (:func:`probe_text`)."""
        return self.describe()

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

    def __post_init__(self):
        object.__setattr__(self, "left", _plain_int(self.left))
        object.__setattr__(self, "right", _plain_int(self.right))

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

    def __post_init__(self):
        object.__setattr__(self, "chunk", _plain_int(self.chunk))

    def visible(self, b, h, q, kv):
        return (kv <= q) & (
            torch.div(kv, self.chunk, rounding_mode="floor")
            == torch.div(q, self.chunk, rounding_mode="floor")
        )

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

    def __post_init__(self):
        object.__setattr__(self, "prefix", _plain_int(self.prefix))

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
    #: True for a snapshot (:meth:`frozen`): ids this object owns, that nobody else can write,
    #: so their description and their per-device copies may be kept
    _owned: bool = field(default=False, repr=False, compare=False)

    @staticmethod
    def from_cu_seqlens(cu_seqlens, seq_len: int, causal: bool = True) -> Documents:
        """Documents from cumulative lengths ``[0, l0, l0 + l1, ...]``; tokens from the last
        entry to ``seq_len`` are padding."""
        raw = torch.as_tensor(cu_seqlens).flatten()
        if raw.is_floating_point():  # (float64: the message shows the values given)
            raw = torch.as_tensor(cu_seqlens, dtype=torch.float64).flatten()
        if raw.is_complex() or (raw.is_floating_point() and not bool((raw == raw.round()).all())):
            raise ValueError(
                f"cu_seqlens must be integers (cumulative document lengths), got {raw.tolist()}"
            )
        cu = raw.to(torch.int64)
        if (
            cu.numel() < 1
            or int(cu[0]) != 0
            or bool((cu[1:] < cu[:-1]).any())
            or int(cu[-1]) > seq_len
        ):
            raise ValueError(
                f"cu_seqlens must start at 0, not decrease and end at most at seq_len {seq_len}, "
                f"got {cu.tolist()}"
            )
        ids = torch.full((seq_len,), -1, dtype=torch.int64)
        for d, (a, b) in enumerate(zip(cu[:-1].tolist(), cu[1:].tolist())):
            ids[a:b] = d
        return Documents(ids, causal)

    def frozen(self) -> Documents:
        """A snapshot: the ids copied (int64, on their device) into tensors only it holds.

        A call plans with the snapshot it takes when it starts (:func:`snapshot`), so its plan
        and the description that keys the plan cache come from the same data, whatever the
        caller writes into its ids later (in place, through ``.data``, through a numpy buffer
        the tensor shares, none of which a version counter sees)."""
        if self._owned:
            return self
        tensors = [t for t in (self.doc_ids, self.kv_doc_ids) if t is not None]
        if not all(
            isinstance(t, torch.Tensor)
            and not (t.is_floating_point() or t.is_complex())
            and t.device.type != "meta"
            for t in tensors
        ):
            return self  # ids the checks refuse (on every rank, through the cross-rank agreement)

        # The last snapshot serves again while the ids equal the copy kept of them (one compare
        # per call instead of a copy, a hash and the checks of a new snapshot); the kept copy is
        # this object's own, so no write to the caller's ids can reach it. Ids on a device are
        # compared there, read later with a read the call makes anyway (IdsCheck).
        check = _UNVERIFIED.get()
        on_device = not all(map(reads_are_free, tensors)) and not torch.compiler.is_compiling()
        kind = _ids_kind(self, tensors) if on_device else None
        # Ids on a device in a new object (a data loader hands every step new tensors) serve the
        # last snapshot of ids of their kind too: what decides is the compare, never the object.
        last = self._cache.get("snapshot")
        if last is None and check is not None and kind is not None:
            last = _DEVICE_SNAPSHOTS.get(kind)
        if last is not None and len(last[0]) == len(tensors):
            if all(map(_same_layout, tensors, last[0])):
                if check is not None and kind is not None:
                    # the compare stays on the device, unread (IdsCheck)
                    check.compare(tensors, last[0])
                    self._cache["snapshot"] = last
                    return last[1]
                if all(map(torch.equal, tensors, last[0])):
                    return last[1]

        def copy(t):
            return None if t is None else t.detach().to(dtype=torch.int64, copy=True)

        snap = replace(
            self,
            doc_ids=copy(self.doc_ids),
            kv_doc_ids=copy(self.kv_doc_ids),
            _cache={},
            _owned=True,
        )
        kept = [
            u if t.dtype == torch.int64 else t.detach().clone()
            for t, u in zip(tensors, [x for x in (snap.doc_ids, snap.kv_doc_ids) if x is not None])
        ]
        self._cache["snapshot"] = (kept, snap)
        if kind is not None:
            _DEVICE_SNAPSHOTS[kind] = (kept, snap)
            _DEVICE_SNAPSHOTS.move_to_end(kind)
            while len(_DEVICE_SNAPSHOTS) > _DEVICE_SNAPSHOTS_KEPT:
                _DEVICE_SNAPSHOTS.popitem(last=False)
        return snap

    def _ids(self, kv: bool, device: torch.device) -> torch.Tensor:
        """The ids as int64 on ``device``. A snapshot keeps its converted copies; ids held by the
        caller are converted on every use (their data may change without a trace)."""
        src = self.kv_doc_ids if kv and self.kv_doc_ids is not None else self.doc_ids
        if not self._owned:
            return torch.as_tensor(src).to(device=device, dtype=torch.int64)
        kept = self._cache.get((kv, device))
        if kept is None:
            kept = self._cache[(kv, device)] = src.to(device=device, dtype=torch.int64)
        return kept

    def visible(self, b, h, q, kv):
        dq, dk = self._ids(False, q.device)[q], self._ids(True, kv.device)[kv]
        seen = (dq == dk) & (dq >= 0)
        return seen & (kv <= q) if self.causal else seen

    def reach(self):
        # Bounded by the longest document, but a halo that wide is rarely narrower than a
        # shard: documents alone run on the ring (combine them with a SlidingWindow for a halo).
        return None, (0 if self.causal else None)

    def describe(self) -> str:
        if self._owned and "describe" in self._cache:
            return self._cache["describe"]
        text = self._describe()
        if self._owned:
            self._cache["describe"] = text
        return text

    def _describe(self) -> str:
        parts = [torch.as_tensor(self.doc_ids)]
        if self.kv_doc_ids is not None:
            parts.append(torch.as_tensor(self.kv_doc_ids))
        # 128 bits of the ids: plans are cached by this description, so two documents layouts
        # must not share one by chance (a 32-bit checksum would, over a long run).
        crcs = ",".join(
            f"{t.numel()}:{hashlib.blake2b(t.to(torch.int64).contiguous().cpu().numpy().tobytes(), digest_size=16).hexdigest()}"  # noqa: E501
            for t in parts
        )
        return f"documents({'causal' if self.causal else 'full'},{crcs})"

    def check(self, seq_q, seq_kv):
        if not self._owned:
            return self._check(seq_q, seq_kv)
        key = ("check", seq_q, seq_kv)  # a snapshot's ids never change: checked once
        if key not in self._cache:
            self._cache[key] = self._check(seq_q, seq_kv)
        return self._cache[key]

    def _check(self, seq_q, seq_kv):
        for name, ids, n in (
            ("doc_ids", self.doc_ids, seq_q),
            ("kv_doc_ids", self.kv_doc_ids, seq_kv),
        ):
            if ids is None:
                continue
            if (
                not isinstance(ids, torch.Tensor)
                or ids.dim() != 1
                or ids.is_floating_point()
                or ids.is_complex()
            ):
                return (
                    f"Documents.{name} must be a 1-D integer tensor of global positions, got "
                    f"{type(ids).__name__}"
                    + (
                        f" of shape {tuple(ids.shape)}, dtype {ids.dtype}"
                        if isinstance(ids, torch.Tensor)
                        else ""
                    )
                )
            if ids.device.type == "meta":
                return (
                    f"Documents.{name} is on the meta device, which holds no values: give the ids "
                    "as a CPU (or the inputs' device) tensor"
                )
            if ids.numel() != n:
                whole = (
                    "local length x world size; with replicated_kv=True, the key/value every "
                    "rank holds"
                    if name == "kv_doc_ids"
                    else "local length x world size"
                )
                return (
                    f"Documents.{name} has {ids.numel()} entries but the global sequence has {n} "
                    f"tokens ({whole}): give one id per global position"
                )
            ids = ids.to(torch.int64)  # (an unsigned dtype compares -1 as its largest value)
            real = ids[ids >= 0]
            if bool((ids < -1).any()):
                return f"Documents.{name}: ids must be >= 0, or -1 for padding"
            if real.numel() > 1 and bool((real[1:] < real[:-1]).any()):
                return (
                    f"Documents.{name} decrease along the sequence; packed documents are numbered "
                    "in order"
                )
        if self.kv_doc_ids is None and seq_q != seq_kv:
            return (
                "Documents on query and key/value sequences of different lengths needs kv_doc_ids"
            )
        if not isinstance(self.causal, bool):
            return f"Documents.causal must be a bool, got {self.causal!r}"
        return None


@dataclass(frozen=True)
class _Join(Mask):
    """Two masks joined (:class:`And`, :class:`Or`): what the two share."""

    a: Mask
    b: Mask

    def frozen(self) -> Mask:
        a, b = self.a.frozen(), self.b.frozen()
        return self if (a is self.a and b is self.b) else replace(self, a=a, b=b)

    def agreement_text(self, batch, heads, seq_q, seq_kv, device=None) -> str:
        return (
            f"{type(self).__name__.lower()}("
            f"{self.a.agreement_text(batch, heads, seq_q, seq_kv, device)},"
            f"{self.b.agreement_text(batch, heads, seq_q, seq_kv, device)})"
        )

    @property
    def exact_digest(self) -> bool:
        return type(self) in _EXACT_TYPES and bool(
            getattr(self.a, "exact_digest", False) and getattr(self.b, "exact_digest", False)
        )

    def check(self, seq_q, seq_kv):
        return self.a.check(seq_q, seq_kv) or self.b.check(seq_q, seq_kv)


@dataclass(frozen=True)
class And(_Join):
    def visible(self, b, h, q, kv):
        return self.a.visible(b, h, q, kv) & self.b.visible(b, h, q, kv)

    def describe(self) -> str:
        return f"and({self.a.describe()},{self.b.describe()})"

    def reach(self):
        (la, ra), (lb, rb) = self.a.reach(), self.b.reach()
        return _bound(min, la, lb), _bound(min, ra, rb)


@dataclass(frozen=True)
class Or(_Join):
    def visible(self, b, h, q, kv):
        return self.a.visible(b, h, q, kv) | self.b.visible(b, h, q, kv)

    def describe(self) -> str:
        return f"or({self.a.describe()},{self.b.describe()})"

    def reach(self):
        (la, ra), (lb, rb) = self.a.reach(), self.b.reach()
        return _bound(max, la, lb), _bound(max, ra, rb)


@dataclass(frozen=True, eq=False)
class MaskMod(Mask):
    """``fn(b, h, q_idx, kv_idx)`` as in flex attention, called once on broadcastable int64
    tensors of shapes (B, 1, 1, 1), (1, H, 1, 1), (1, 1, rows, 1), (1, 1, 1, cols).

    Its description is its qualified name plus its values on the first 64 positions at batch 0,
    head 0 (plans are never cached by it: a MaskMod is evaluated on every call, and each step's
    blocks are cached by a hash of what it shows: each row's key range, or every bit of its
    visibility). What the ranks of a call compare (:meth:`agreement_text`) is its values over
    the call's whole range: :func:`probe_text`."""

    fn: Callable

    def visible(self, b, h, q, kv):
        return self.fn(b, h, q, kv)

    def agreement_text(self, batch, heads, seq_q, seq_kv, device=None) -> str:
        name = getattr(self.fn, "__qualname__", type(self.fn).__name__)
        return f"mask_mod({name},{probe_text(self.fn, batch, heads, seq_q, seq_kv, device)})"

    def describe(self) -> str:
        name = getattr(self.fn, "__qualname__", type(self.fn).__name__)
        zero = torch.zeros(1, 1, 1, 1, dtype=torch.int64)
        # The first 64 positions, fewer where the fn cannot take them (a mask_mod indexing a
        # table of a shorter sequence): the same grid on every rank for the same fn and data.
        for size in (64, 32, 16, 8, 4, 2, 1):
            n = torch.arange(size)
            try:
                probe = torch.as_tensor(
                    self.fn(zero, zero, n.view(1, 1, -1, 1), n.view(1, 1, 1, -1))
                )
            except (IndexError, RuntimeError, ValueError):
                continue
            # (.cpu(): a fn reading a table on the GPU returns its values there)
            bits = (
                probe.to(torch.bool).expand(1, 1, size, size).cpu().contiguous().numpy().tobytes()
            )
            return f"mask_mod({name},{size},{zlib.crc32(bits)})"
        return f"mask_mod({name},unprobed)"


@dataclass(frozen=True, eq=False)
class KeyRanges(Mask):
    """One range of keys per query: the query at global position ``i`` sees the keys at positions
    ``start[i] <= j < end[i]`` (``start[i] >= end[i]``: none). ``start``, ``end``: (seq_q,)
    integer tensors, copied (int64, on the host) when the mask is made, so writes to the tensors
    given never reach it; the same for every batch entry and head.

    Every mask that shows each query one contiguous run of keys has this form: causal, sliding
    windows, packed documents, chunked causal, prefix-LM and their intersections, and any
    ``MaskMod`` spelling one of them. :func:`tabulate` evaluates such a mask once into this
    form. Its description hashes both tensors, so calls with an equal ``KeyRanges`` (a model's
    layers, forward and backward) share their plans, and a kernel that takes row bounds
    (``OpCapabilities.row_bounds``) runs each ring step as one call."""

    start: torch.Tensor
    end: torch.Tensor
    _cache: dict = field(default_factory=dict, repr=False, compare=False)

    def __post_init__(self):
        for name in ("start", "end"):
            given = getattr(self, name)
            if isinstance(given, (list, tuple)):
                given = torch.as_tensor(given)
            if (
                isinstance(given, torch.Tensor)
                and given.device.type != "meta"
                and not (
                    given.is_floating_point() or given.is_complex() or given.dtype == torch.bool
                )
            ):
                given = given.detach().to(device="cpu", dtype=torch.int64, copy=True)
            object.__setattr__(self, name, given)  # else as given, for check to refuse

    def _on(self, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        if device not in self._cache:
            self._cache[device] = (self.start.to(device), self.end.to(device))
        return self._cache[device]

    def visible(self, b, h, q, kv):
        start, end = self._on(q.device)
        return (kv >= start[q]) & (kv < end[q])

    def bounds(self, q: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``(start, end)`` of the queries at positions ``q`` (int64, on ``q``'s device)."""
        start, end = self._on(q.device)
        return start[q], end[q]

    def reach(self):
        if "reach" not in self._cache:
            q = torch.arange(self.start.numel())
            seen = self.end > self.start
            if not bool(seen.any()):
                self._cache["reach"] = (0, 0)
            else:
                left = int((q - self.start)[seen].max())
                right = int((self.end - 1 - q)[seen].max())
                self._cache["reach"] = (max(left, 0), max(right, 0))
        return self._cache["reach"]

    def describe(self) -> str:
        if "describe" not in self._cache:
            parts = (self.start, self.end)
            if not all(isinstance(t, torch.Tensor) and t.dtype == torch.int64 for t in parts):
                return f"key_ranges({type(self.start).__name__},{type(self.end).__name__})"
            # 128 bits of both tensors: plans are cached by this description
            digest = bounds_hash(*parts)
            sizes = "x".join(str(t.numel()) for t in parts)
            self._cache["describe"] = f"key_ranges({sizes},{digest})"
        return self._cache["describe"]

    def check(self, seq_q, seq_kv):
        key = ("check", seq_q, seq_kv)  # its tensors are its own: checked once per sizes
        if key not in self._cache:
            self._cache[key] = self._check(seq_q, seq_kv)
        return self._cache[key]

    def _check(self, seq_q, seq_kv):
        for name in ("start", "end"):
            t = getattr(self, name)
            if not (
                isinstance(t, torch.Tensor) and t.dtype == torch.int64 and t.device.type == "cpu"
            ):
                got = (
                    f"{t.dtype} on {t.device}" if isinstance(t, torch.Tensor) else type(t).__name__
                )
                return f"KeyRanges.{name} must be an integer tensor with values, got {got}"
            if t.dim() != 1 or t.numel() != seq_q:
                return (
                    f"KeyRanges.{name} has shape {tuple(t.shape)} but the global query sequence "
                    f"has {seq_q} tokens (local length x world size): give one entry per query"
                )
            if t.numel() and (int(t.min()) < 0 or int(t.max()) > seq_kv):
                return (
                    f"KeyRanges.{name} must lie in [0, {seq_kv}] (the global key sequence), got "
                    f"values in [{int(t.min())}, {int(t.max())}]"
                )
        return None


def tabulate(
    mask: Mask,
    seq_q: int,
    seq_kv: int | None = None,
    *,
    batch: int = 1,
    heads: int = 1,
    device: torch.device | str | None = None,
) -> KeyRanges:
    """``mask`` evaluated once over a global sequence of ``seq_q`` queries and ``seq_kv`` keys
    (default ``seq_q``), as :class:`KeyRanges`: build it once (per batch of data, as flex
    attention's ``create_block_mask``) and pass it to every layer's call, which then neither
    evaluates the mask nor plans again. Meant for a ``MaskMod`` (evaluated on every call
    otherwise); ``device``: where its function runs (a function reading a table on a GPU runs
    there). The mask is evaluated a band of query rows at a time (about 2^26 entries), so memory
    stays O(seq) whatever the length.

    Raises ValueError when the mask is refused by its checks, or when some query sees keys that
    are not one contiguous range or that differ between batch entries or heads (``batch``,
    ``heads``: how many to evaluate it for; a mask that depends on them has no KeyRanges form):
    pass such a mask to the call as it is."""
    seq_kv = seq_q if seq_kv is None else seq_kv
    problem = mask_problem(
        mask, seq_q=seq_q, seq_kv=seq_kv, batch=batch, heads=heads, device=device
    )
    if problem is not None:
        raise ValueError(f"tabulate: {problem}")
    kv = torch.arange(seq_kv)
    band = max(1, _TABULATE_ENTRIES // max(1, seq_kv * batch * heads))
    starts, ends = [], []
    for r0 in range(0, seq_q, band):
        q = torch.arange(r0, min(seq_q, r0 + band))
        vis = visibility(mask, q, kv, batch=batch, heads=heads, device=device, keep=True)
        bounds = visible_ranges(vis)
        if bounds is None:
            raise ValueError(
                f"tabulate: {mask.describe()} shows some query among positions {r0}.."
                f"{r0 + q.numel() - 1} keys that are not one contiguous range, or that differ "
                "between batch entries or heads: it has no KeyRanges form; pass it to the call "
                "as it is"
            )
        starts.append(bounds[0])
        ends.append(bounds[1])
    return KeyRanges(torch.cat(starts), torch.cat(ends))


#: How many (batch, head, query, key) entries :func:`tabulate` evaluates at once.
_TABULATE_ENTRIES = 1 << 26


def bounds_hash(lo: torch.Tensor, hi: torch.Tensor) -> str:
    """A 128-bit hash (hex) of every entry of two host int64 tensors of row bounds: what plans
    cut from those bounds are cached by (:class:`KeyRanges`, and a MaskMod's ranges)."""
    data = torch.cat([lo.flatten(), hi.flatten()]).numpy().tobytes()
    return hashlib.blake2b(data, digest_size=16).hexdigest()


def visible_ranges(vis: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | None:
    """Each row's visible columns as one range ``[lo, hi)`` (``lo == hi``: none), int64 (rows,)
    on the host, when ``vis`` (batch or 1, heads or 1, rows, cols) is the same for every batch
    entry and head and each of its rows sees one range; else None. Reductions over ``vis`` on its
    device and one read of their results (two where ``vis`` has more than one batch entry or
    head: whether they agree is read first, so a mask that depends on them costs no more)."""
    if vis.shape[-1] == 0 or vis.shape[-2] == 0:
        return None
    if vis.shape[0] * vis.shape[1] != 1 and not bool(
        (vis.all(0).all(0) == vis.any(0).any(0)).all()
    ):
        return None
    rows = vis[0, 0]
    cols = rows.shape[-1]
    count = rows.sum(-1)
    seen = count > 0
    as_bytes = rows.view(torch.uint8)
    lo = torch.where(seen, as_bytes.argmax(-1), 0)
    hi = torch.where(seen, cols - as_bytes.flip(-1).argmax(-1), 0)
    # lo, hi and whether every row is one range, read together (one device sync)
    one_range = (count == hi - lo).all().view(1).to(torch.int64)
    read = torch.cat([lo, hi, one_range]).cpu()
    if not bool(read[-1]):
        return None
    n = lo.numel()
    return read[:n], read[n : 2 * n]


#: How many (batch, head, query, key) entries a MaskMod's cross-rank probe evaluates at most.
PROBE_ENTRIES = 1 << 20
#: In a sampled probe: the first and last positions of each sequence always, the rest drawn.
PROBE_EDGE = 16


def _probe_positions(n: int, take: int, gen: torch.Generator) -> torch.Tensor:
    """``take`` of ``range(n)`` (all when n <= take): the first and last PROBE_EDGE, the rest drawn
    uniformly without replacement from those between; sorted."""
    if n <= take:
        return torch.arange(n)
    edge = min(PROBE_EDGE, take // 4)
    middle = torch.arange(edge, n - edge)
    drawn = middle[torch.randperm(middle.numel(), generator=gen)[: take - 2 * edge]]
    return torch.cat([torch.arange(edge), drawn, torch.arange(n - edge, n)]).sort().values


def probe_grid(batch: int, heads: int, seq_q: int, seq_kv: int) -> tuple[torch.Tensor, ...]:
    """The (batch, head, query, key) indices a MaskMod's cross-rank probe evaluates, the same on
    every rank: every entry when ``batch * heads * seq_q * seq_kv <= PROBE_ENTRIES``; else up to 8
    batch rows, 16 heads and an equal number of query and key positions within that budget, drawn
    by a generator seeded by the sizes alone (the first and last 16 positions always among them)."""
    if batch * heads * seq_q * seq_kv <= PROBE_ENTRIES:
        return torch.arange(batch), torch.arange(heads), torch.arange(seq_q), torch.arange(seq_kv)
    gen = torch.Generator().manual_seed(zlib.crc32(f"{batch},{heads},{seq_q},{seq_kv}".encode()))
    bs = _probe_positions(batch, 8, gen)
    hs = _probe_positions(heads, 16, gen)
    side = max(2, int((PROBE_ENTRIES / (bs.numel() * hs.numel())) ** 0.5))
    return bs, hs, _probe_positions(seq_q, side, gen), _probe_positions(seq_kv, side, gen)


def probe_text(fn, batch: int, heads: int, seq_q: int, seq_kv: int, device=None) -> str:
    """A MaskMod's values on :func:`probe_grid`, as text the ranks of a call compare.

    Power: when the call's whole grid has at most PROBE_ENTRIES (2^20) entries, every entry is
    evaluated, so masks differing anywhere are told apart (up to a 32-bit checksum). Beyond, the
    probe takes every batch row and head up to 8 and 16 (else 8 and 16 of them, the first and last
    included) and m query and m key positions (m = sqrt(2^20 / (batches x heads)): 90 for 8 x 16,
    512 for 1 x 4): the first and last 16 and the rest drawn uniformly. A difference on a
    fraction f of the query rows (or key columns), at the probed batches and heads, is then found
    with probability at least 1 - (1 - f)^(m - 32) (f = 5%: 95% at m = 90); one confined to a few
    entries in the middle of a long sequence is likely missed. Evaluated on ``device`` (the
    inputs'), else on the CPU."""
    bs, hs, qs, ks = probe_grid(batch, heads, seq_q, seq_kv)
    failure = "unprobed"
    for where in dict.fromkeys([device, torch.device("cpu")]):
        if where is None:
            continue
        try:
            crc = 0
            for start in range(
                0, qs.numel(), max(1, (1 << 18) // max(1, bs.numel() * hs.numel() * ks.numel()))
            ):
                rows = qs[
                    start : start
                    + max(1, (1 << 18) // max(1, bs.numel() * hs.numel() * ks.numel()))
                ]
                vis = torch.as_tensor(
                    fn(
                        bs.to(where).view(-1, 1, 1, 1),
                        hs.to(where).view(1, -1, 1, 1),
                        rows.to(where).view(1, 1, -1, 1),
                        ks.to(where).view(1, 1, 1, -1),
                    )
                )
                bits = (
                    vis.to(torch.bool)
                    .expand(bs.numel(), hs.numel(), rows.numel(), ks.numel())
                    .cpu()
                )
                crc = zlib.crc32(bits.contiguous().numpy().tobytes(), crc)
            return f"{bs.numel()}x{hs.numel()}x{qs.numel()}x{ks.numel()}:{crc}"
        except Exception as exc:  # a fn failing here fails the call's own checks, on every rank
            failure = f"unprobed:{type(exc).__name__}"
    return failure


#: (type, causal, the ids' dtypes, shapes and devices) -> the last snapshot of device ids of
#: that kind (the kept copies of the ids, the snapshot): served to an equal new object with its
#: compare left unread (Documents.frozen). The 8 most recent kinds.
_DEVICE_SNAPSHOTS: collections.OrderedDict[tuple, tuple[list[torch.Tensor], Documents]] = (
    collections.OrderedDict()
)
_DEVICE_SNAPSHOTS_KEPT = 8


def _ids_kind(documents, tensors) -> tuple:
    """The :data:`_DEVICE_SNAPSHOTS` key of ``documents`` holding the id tensors ``tensors``."""
    return (
        type(documents),
        documents.causal,
        documents.kv_doc_ids is None,
        tuple((t.dtype, tuple(t.shape), t.device) for t in tensors),
    )


def _same_layout(t: torch.Tensor, kept: torch.Tensor) -> bool:
    """Whether ``t`` may hold what ``kept`` does: dtype, shape and device (the host knows them)."""
    return t.dtype == kept.dtype and t.shape == kept.shape and t.device == kept.device


def reads_are_free(t: torch.Tensor) -> bool:
    """Whether the host reads ``t``'s values without a device sync (it lives on the CPU)."""
    return t.device.type == "cpu"


@dataclass(frozen=True, eq=False)
class AtQueryPositions(Mask):
    """``mask`` with each local query row read at its global position: what a ring of one plans
    (``replicated_kv=True``: the rank's rows ``0..n-1`` against the whole key/value ``0..L-1``)
    when the user's mask is defined on the query's global positions and the key's index.

    ``positions`` (n,) int64: the global position of each local query row (the layout's runs of
    the rank, in order)."""

    mask: Mask
    positions: torch.Tensor

    def visible(self, b, h, q, kv):
        return self.mask.visible(b, h, self.positions.to(q.device)[q], kv)

    def describe(self) -> str:
        rows = self.positions.to(torch.int64).cpu().contiguous().numpy().tobytes()
        return (
            f"at_query_positions({zlib.crc32(rows)},{self.positions.numel()},"
            f"{self.mask.describe()})"
        )

    @property
    def exact_digest(self) -> bool:
        # the positions are in the description (their checksum and count), the mask its own
        return self.mask.exact_digest


class StaleIds(Exception):
    """Document ids a call served from their last snapshot without reading them
    (:class:`IdsCheck`) differ from it: the call runs again from a snapshot of what they hold
    now, its first run's results unused."""


class IdsCheck:
    """The unread compare of one call's document ids with the snapshot it serves.

    Comparing ids that live on a GPU with the copy kept of them is a device sync. A call
    that passes an IdsCheck to :func:`snapshot` instead serves the last snapshot of ids whose
    dtype, shape and device match it, and the compare stays on the device as a 0-dim bool
    (True: they differ). The call then reads it together with a read it makes anyway, before a
    kernel works on the plan: a one-rank forward's finiteness read
    (:meth:`ring_impl.exchanges.ring.RingAttention.all_finite`) or the cross-rank check's
    all-reduce (:func:`ring_impl.checks.inputs.agree`). Where the ids differ, the call raises
    :class:`StaleIds` and runs again without an IdsCheck. A call that ends with the compare
    still unread reads it then (:meth:`settle`), so no stale snapshot serves a call
    unnoticed."""

    def __init__(self) -> None:
        self._differs: torch.Tensor | None = None

    def compare(self, tensors, kept) -> None:
        """Add "``tensors`` differ from ``kept``" to the unread compare."""
        for t, k in zip(tensors, kept):
            differs = torch.ne(t, k).any()
            self._differs = differs if self._differs is None else self._differs | differs

    def take(self) -> torch.Tensor | None:
        """The unread compare (None: nothing to compare), for the caller to read with its own
        read; the check holds nothing afterwards."""
        differs, self._differs = self._differs, None
        return differs

    def settle(self) -> None:
        """Read what nobody took (one device sync): StaleIds when the ids differ."""
        differs = self.take()
        if differs is not None and bool(differs):
            raise StaleIds()


#: The IdsCheck of the snapshot being taken (:func:`snapshot`); None: compare on the host.
_UNVERIFIED: contextvars.ContextVar[IdsCheck | None] = contextvars.ContextVar(
    "ring_impl_unverified_ids", default=None
)


def snapshot(mask, check: IdsCheck | None = None):
    """The mask a call plans with: ``mask.frozen()`` (its tensors copied once, when the call
    starts), so the plan and the description that keys the plan cache are made from the same
    data; anything that is not a Mask is returned as it is, for the input checks to refuse.

    ``check``: ids on a device that match their last snapshot's dtype, shape and device serve it
    with their compare left in ``check``, unread (:class:`IdsCheck`); without it they are
    compared on the host."""
    if not isinstance(mask, Mask):
        return mask
    token = _UNVERIFIED.set(check)
    try:
        return mask.frozen()
    finally:
        _UNVERIFIED.reset(token)


def fold_causal(mask: Mask | None, is_causal) -> Mask | None:
    """The mask a call runs: ``mask`` intersected with
    ``Causal()`` when ``is_causal`` (None stays None)."""
    if mask is None or not is_causal:
        return mask
    return Causal() & mask


#: The masks whose description determines them (Mask.exact_digest).
_EXACT_TYPES = frozenset(
    {Full, Causal, SlidingWindow, ChunkedCausal, PrefixLM, Documents, KeyRanges, And, Or}
)


def _bound(pick, a: int | None, b: int | None) -> int | None:
    """``pick`` (min: intersection, max: union) of two reaches, None being unbounded."""
    if a is not None and b is not None:
        return pick(a, b)
    if pick is min:  # an intersection is as bounded as its bounded part
        return a if b is None else b
    return None


def _holds_mask_mod(mask) -> bool:
    if isinstance(mask, _Join):
        return _holds_mask_mod(mask.a) or _holds_mask_mod(mask.b)
    return isinstance(mask, MaskMod)


def _evaluation_device(mask, dev: torch.device, device) -> torch.device:
    """Where :func:`visibility` evaluates ``mask``: a MaskMod on ``device`` when given (its
    tables live with the inputs), everything else on the positions' own device ``dev``."""
    if device is not None and _holds_mask_mod(mask):
        from .group import as_device

        return as_device(device)
    return dev


def _evaluated(mask, q_pos, kv_pos, batch: int, heads: int, where: torch.device) -> torch.Tensor:
    b = torch.arange(batch, device=where).view(-1, 1, 1, 1)
    h = torch.arange(heads, device=where).view(1, -1, 1, 1)
    q = q_pos.to(where, torch.int64).view(1, 1, -1, 1)
    kv = kv_pos.to(where, torch.int64).view(1, 1, 1, -1)
    return torch.as_tensor(mask.visible(b, h, q, kv), device=where)


def visibility(
    mask: Mask,
    q_pos: torch.Tensor,
    kv_pos: torch.Tensor,
    *,
    batch: int = 1,
    heads: int = 1,
    device: torch.device | str | None = None,
    keep: bool = False,
) -> torch.Tensor:
    """(batch or 1, heads or 1, len(q_pos), len(kv_pos)) bool: what each query position sees, on
    ``q_pos``'s device.

    A ``MaskMod`` whose function reads tables on a GPU (``doc_ids[q] == doc_ids[kv]`` with
    ``doc_ids`` on CUDA, as flex attention's mask_mods are written) cannot run on CPU positions:
    it is evaluated on ``device`` (the call's inputs' device) when given, else, where CPU
    positions fail, on the current CUDA device, and its result brought back (``keep``: left on
    the device it was evaluated on)."""
    dev = q_pos.device
    where = _evaluation_device(mask, dev, device)
    try:
        v = _evaluated(mask, q_pos, kv_pos, batch, heads, where)
    except RuntimeError:
        if where.type != "cpu" or not (_holds_mask_mod(mask) and torch.cuda.is_available()):
            raise
        where = torch.device("cuda", torch.cuda.current_device())
        v = _evaluated(mask, q_pos, kv_pos, batch, heads, where)
    if v.device != dev and not keep:
        v = v.to(dev)
    if v.dtype != torch.bool:
        raise TypeError(f"mask {mask.describe()} returned {v.dtype}, not bool")
    while v.dim() < 4:
        v = v.unsqueeze(0)
    bm, hm = (batch if v.shape[0] == batch else 1), (heads if v.shape[1] == heads else 1)
    return v.expand(bm, hm, q_pos.numel(), kv_pos.numel())


def mask_problem(
    mask, *, seq_q: int, seq_kv: int, batch: int, heads: int, device=None
) -> str | None:
    """What is wrong with ``mask`` for global lengths ``seq_q``/``seq_kv``, or None. Never raises:
    a mask whose evaluation fails on some positions is a problem here, before any collective.
    ``device``: the inputs' (where a MaskMod's function runs, :func:`visibility`)."""
    if mask is None:
        return None
    if not isinstance(mask, Mask):
        return (
            "mask must be a ring_impl.masks.Mask (Causal, Documents, SlidingWindow, ..., "
            f"MaskMod), got {type(mask).__name__}"
        )
    if not settled(mask):
        return _mask_problem(
            mask, seq_q=seq_q, seq_kv=seq_kv, batch=batch, heads=heads, device=device
        )
    # A mask its description determines has the same problem whenever it is described alike:
    # found once per (description, sizes), as its plans are (a model's layers, its steps)
    try:
        key = (mask.describe(), seq_q, seq_kv, batch, heads)
    except Exception:  # (described when it is checked, below)
        return _mask_problem(mask, seq_q=seq_q, seq_kv=seq_kv, batch=batch, heads=heads)
    if key not in _PROBLEMS:
        _PROBLEMS[key] = _mask_problem(mask, seq_q=seq_q, seq_kv=seq_kv, batch=batch, heads=heads)
        while len(_PROBLEMS) > _PROBLEMS_KEPT:
            _PROBLEMS.pop(next(iter(_PROBLEMS)))
    return _PROBLEMS[key]


def settled(mask) -> bool:
    """Whether the description of ``mask`` determines it and its problems: built-in masks of
    plain values, snapshots of documents (ids this module owns and has checked as they are), and
    ``&``/``|`` of them. Not ids the caller holds (their dtype is not in the description)."""
    if type(mask) in (And, Or):
        return settled(mask.a) and settled(mask.b)
    if type(mask) is Documents:
        return mask._owned
    return type(mask) in (Full, Causal, SlidingWindow, ChunkedCausal, PrefixLM, KeyRanges)


#: (description, seq_q, seq_kv, batch, heads) -> problem of masks its description determines
_PROBLEMS: dict[tuple, str | None] = {}
_PROBLEMS_KEPT = 256


def _mask_problem(
    mask, *, seq_q: int, seq_kv: int, batch: int, heads: int, device=None
) -> str | None:
    try:
        problem = mask.check(seq_q, seq_kv)
        if problem is not None:
            return problem
        # Evaluated on every position pair's corners and a strided grid: a mask_mod that fails
        # (index out of range, wrong shape or dtype) fails here on every rank alike.
        qs = torch.unique(
            torch.cat([torch.arange(0, seq_q, max(1, seq_q // 16)), torch.tensor([seq_q - 1])])
        )
        ks = torch.unique(
            torch.cat([torch.arange(0, seq_kv, max(1, seq_kv // 16)), torch.tensor([seq_kv - 1])])
        )
        visibility(mask, qs, ks, batch=batch, heads=heads, device=device)
        mask.digest()
    except Exception as exc:  # a mask that cannot be evaluated is bad input, not a crash
        return (
            f"mask {type(mask).__name__} cannot be evaluated on the global positions "
            f"({type(exc).__name__}: {exc})"
        )
    return None


def masking_problem(
    query, key, mask, sinks, *, world_size: int, kv_world_size: int | None = None
) -> str | None:
    """The problem with ``mask=`` / ``sinks=`` of a ring call on local shards, or None.
    ``kv_world_size``: how many shards make the global key/value (1: every rank holds it whole,
    ``replicated_kv=True``); ``world_size`` when None."""
    from .sinks import sinks_problem

    if mask is None and sinks is None:
        return None
    if not (
        isinstance(query, torch.Tensor)
        and isinstance(key, torch.Tensor)
        and query.dim() == 4
        and key.dim() == 4
    ):
        return None  # the shape problem is reported by the input checks
    b, h, sq, _ = query.shape
    problem = mask_problem(
        mask,
        seq_q=sq * world_size,
        seq_kv=key.shape[2] * (world_size if kv_world_size is None else kv_world_size),
        batch=b,
        heads=h,
        device=query.device,
    )
    return problem or sinks_problem(sinks, h)


def mask_code(
    mask, sinks, dims: tuple[int, int, int, int] | None = None, device=None, score_mod=None
) -> int:
    """31 bits for the cross-rank check: equal on ranks with equal masks, sinks and score_mods
    (ring_impl.score_mods); 0 for none of them (what every strategy's check sends then, so the
    texts agree on "no mask"). ``dims``: the call's global (batch, heads, seq_q, seq_kv), over
    which a MaskMod or a score_mod function is probed (:meth:`Mask.agreement_text`); without
    them, the description."""
    if mask is None and sinks is None and score_mod is None:
        return 0
    if mask is None:
        text = "-"
    else:
        text = mask.agreement_text(*dims, device) if dims is not None else mask.describe()
    parts = [text]
    if sinks is not None:
        parts.append(
            str(zlib.crc32(sinks.detach().to(torch.float64).cpu().contiguous().numpy().tobytes()))
        )
    if score_mod is not None:
        text = score_mod.agreement_text(*dims, device) if dims is not None else score_mod.describe()
        parts.append("score_mod:" + text)
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
            ids = spec["doc_ids"]
            # a tensor is held as given (the caller's, in its dtype: a refill in place is seen
            # by the call's snapshot); plain numbers become int64 ids
            if not isinstance(ids, torch.Tensor):
                ids = torch.as_tensor(ids, dtype=torch.int64)
            return Documents(ids, causal)
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
