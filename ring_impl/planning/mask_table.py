"""A mask as a table of bits on the global grid: how a ``MaskMod`` enters a compiled graph.

A ``MaskMod`` is a Python function. A compiled graph cannot carry a function as data (the custom
ops of :mod:`ring_impl.compiled.masked_call` take tensors and literals), and finding it again by
identity serves a stale function (closures of one code object look alike). What the graph can
do is *run* the function: traced code calls it on the global grid of positions
(:func:`pack_visibility`), dynamo traces it into the graph (tensors it closes over, such as
documents' ids, become graph inputs), and the op receives the result, one bit per (query, key)
position pair, as :class:`VisibilityTable`, a built-in mask that the plan reads like any other.

Cost: ``ceil(seq_kv / 8)`` bytes per query position (and per batch element or head only when the
function depends on them): 8 MiB at 8192 tokens, 128 MiB at 32768. The function is evaluated in
chunks of rows, so its temporaries stay near :data:`CHUNK_ENTRIES` entries. A table larger than
:data:`MAX_TABLE_BITS` is not built: the call then runs eagerly inside the compiled region, where
the ring evaluates the function block by block (a graph break, refused by ``fullgraph=True``).

The table is the mask, exactly: its description holds a 128-bit hash of every bit, so the ranks
compare the whole mask (a ``MaskMod`` run eagerly compares only a probe of its first positions)
and plans are cached by it.

A function that fails on some data fails when the graph runs, not while it is traced: an index
out of range (a table of document ids with one corrupt entry) or an integer divided by zero.
Raised there, on the ranks whose data fails only, it would leave the others waiting in the op's
cross-rank check. So the function is evaluated under :class:`EvaluationGuard`, which clamps such
indices and divisors and records that it did: the flag travels with the table, and the op
refuses the call on every rank (:meth:`VisibilityTable.check`), as the eager call refuses a
``mask_mod`` that raises on the positions a rank attends.
"""

from __future__ import annotations

import contextlib
import hashlib
from dataclasses import dataclass, field

import torch
from torch.overrides import TorchFunctionMode

from ..masks import Mask, visibility

__all__ = [
    "CHUNK_ENTRIES",
    "MAX_TABLE_BITS",
    "EvaluationGuard",
    "VisibilityTable",
    "pack_visibility",
]

#: the largest table built (bits, batch and head dims included): 2**30 bits is 128 MiB, 32768 x
#: 32768 positions for a function of the positions alone
MAX_TABLE_BITS = 1 << 30
#: entries of the (batch, heads, rows, seq_kv) grid evaluated at once (bounds the function's
#: temporaries: an int64 one is 8 bytes an entry)
CHUNK_ENTRIES = 1 << 22

_BIT_WEIGHTS = (1, 2, 4, 8, 16, 32, 64, 128)


def packed_bits(seen: torch.Tensor) -> torch.Tensor:
    """``seen`` (..., n) bool as (..., ceil(n / 8)) uint8 on its own device: position 8j + i is
    bit i of byte j, the last byte's missing positions 0."""
    n = seen.shape[-1]
    width = -(-n // 8)
    if width * 8 != n:
        seen = torch.nn.functional.pad(seen, (0, width * 8 - n), value=False)
    # summed in int64: with a uint8 sum the table compiled by inductor differed from eager
    bits = seen.reshape(*seen.shape[:-1], width, 8).to(torch.int64)
    weights = torch.tensor(_BIT_WEIGHTS, dtype=torch.int64, device=seen.device)
    return (bits * weights).sum(-1).to(torch.uint8)


def bits_digest(bits: torch.Tensor) -> str:
    """A 128-bit hash (hex) of the bytes of a uint8 tensor, read to the host."""
    data = bits.detach().to("cpu", torch.uint8).contiguous().numpy().tobytes()
    return hashlib.blake2b(data, digest_size=16).hexdigest()


def _is_int(x) -> bool:
    return (
        isinstance(x, torch.Tensor)
        and not x.dtype.is_floating_point
        and not x.dtype.is_complex
        and x.dtype != torch.bool
    )


def _in_range(index: torch.Tensor, n: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``index`` into a dim of ``n`` clamped to [-n, n - 1], and whether any entry was outside."""
    return index.clamp(-n, n - 1), ((index < -n) | (index >= n)).any()


def _index_width(x) -> int:
    """Dims of the indexed tensor one item of an index tuple consumes."""
    if x is None or x is Ellipsis:
        return 0
    if isinstance(x, torch.Tensor) and x.dtype == torch.bool:
        return x.dim()
    return 1


#: integer divisions, the divisor second (tuples, not a dict: dynamo guards a dict lookup of a
#: function key in a way that fails on the frame that made it, torch 2.13)
_DIVISIONS = (
    torch.floor_divide,
    torch.Tensor.floor_divide,
    torch.Tensor.__floordiv__,
    torch.remainder,
    torch.Tensor.remainder,
    torch.Tensor.__mod__,
    torch.fmod,
    torch.Tensor.fmod,
    torch.div,
    torch.Tensor.div,
)
#: the same with the divisor first
_REVERSED_DIVISIONS = (torch.Tensor.__rfloordiv__, torch.Tensor.__rmod__)


class EvaluationGuard(TorchFunctionMode):
    """While active, the integer indexing and integer division that fail on data (not on shapes)
    do not raise: an index outside its dim is clamped into it, a zero divisor becomes 1, and
    :attr:`failed` (a bool scalar tensor, a value of the traced graph) records that either
    happened. Covers ``t[...]`` with integer tensors in the index, ``index_select``, ``gather``,
    ``take``, ``//``, ``%``, ``floor_divide``, ``remainder``, ``fmod`` and ``div`` with a rounding
    mode. Traceable by dynamo (``fullgraph=True`` included). Results where it intervened are
    meaningless: a call whose flag is set is refused."""

    def __init__(self):
        super().__init__()
        self.failed = torch.zeros((), dtype=torch.bool)

    def _note(self, bad: torch.Tensor) -> None:
        self.failed = self.failed | bad

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is torch.Tensor.__getitem__:
            t, index = args
            items = index if isinstance(index, tuple) else (index,)
            if any(_is_int(x) for x in items):
                rest = t.dim() - sum(
                    _index_width(x) for x in items
                )  # the dims an Ellipsis stands for
                dim, fixed = 0, []
                for x in items:
                    if _is_int(x) and dim < t.dim():
                        x, bad = _in_range(x, t.shape[dim])
                        self._note(bad)
                    fixed.append(x)
                    dim += rest if x is Ellipsis else _index_width(x)
                index = tuple(fixed) if isinstance(index, tuple) else fixed[0]
            return func(t, index)
        if func in (
            torch.index_select,
            torch.Tensor.index_select,
            torch.gather,
            torch.Tensor.gather,
        ):
            t, dim, index, *more = args
            if _is_int(index):
                index, bad = _in_range(index, t.shape[dim])
                self._note(bad)
            return func(t, dim, index, *more, **kwargs)
        if func in (torch.take, torch.Tensor.take):
            t, index = args
            if _is_int(index):
                index, bad = _in_range(index, t.numel())
                self._note(bad)
            return func(t, index)
        at = 1 if func in _DIVISIONS else 0 if func in _REVERSED_DIVISIONS else None
        if (
            at is not None
            and len(args) == 2
            and (
                func not in (torch.div, torch.Tensor.div) or kwargs.get("rounding_mode") is not None
            )
        ):
            divisor, dividend = args[at], args[1 - at]
            if _is_int(divisor) and (isinstance(dividend, int) or _is_int(dividend)):
                zero = divisor == 0
                self._note(zero.any())
                divisor = torch.where(zero, torch.ones_like(divisor), divisor)
                args = (dividend, divisor) if at == 1 else (divisor, dividend)
        return func(*args, **kwargs)


def pack_visibility(
    mask: Mask,
    *,
    seq_q: int,
    seq_kv: int,
    batch: int,
    heads: int,
    max_bits: int | None = None,
    guard: EvaluationGuard | None = None,
) -> torch.Tensor | None:
    """``mask`` on every global position pair, packed: (batch or 1, heads or 1, seq_q,
    ceil(seq_kv / 8)) uint8, bit ``j % 8`` (least significant first) of byte ``j // 8`` of a row
    set when its query sees key ``j``; None when that would exceed ``max_bits`` bits (default
    :data:`MAX_TABLE_BITS`, read at the call), or when the mask does not give bool (the eager
    call's checks then say so on every rank).

    The batch and head dims are 1 unless the mask depends on them (seen on one position pair).
    Runs on the host; traceable by dynamo (a plain function of the positions). With ``guard``,
    the mask is evaluated under it (:class:`EvaluationGuard`: failures on data are recorded in
    ``guard.failed`` instead of raised)."""
    evaluating = guard if guard is not None else contextlib.nullcontext()

    def seen_by(q, kv):
        with evaluating:
            return visibility(mask, q, kv, batch=batch, heads=heads)

    qs, ks = torch.arange(seq_q), torch.arange(seq_kv)
    first = torch.zeros(1, 1, 1, 1, dtype=torch.int64)
    with evaluating:
        if torch.as_tensor(mask.visible(first, first, first, first)).dtype != torch.bool:
            return None
    corner = seen_by(qs[:1], ks[:1])
    bm, hm = corner.shape[0], corner.shape[1]
    width = -(-seq_kv // 8)
    if bm * hm * seq_q * width * 8 > (MAX_TABLE_BITS if max_bits is None else max_bits):
        return None
    rows = max(1, CHUNK_ENTRIES // (bm * hm * width * 8))
    pieces = []
    for r0 in range(0, seq_q, rows):
        r1 = min(seq_q, r0 + rows)
        pieces.append(packed_bits(seen_by(qs[r0:r1], ks)))
    return torch.cat(pieces, dim=2)


@dataclass(frozen=True)
class VisibilityTable(Mask):
    """A mask given as packed bits on the global grid (:func:`pack_visibility`'s form):
    ``bits`` (batch or 1, heads or 1, seq_q, ceil(seq_kv / 8)) uint8; ``seq_kv`` the keys' global
    length."""

    bits: torch.Tensor
    seq_kv: int
    #: a bool scalar: set when the function's evaluation failed on this rank's data
    #: (:class:`EvaluationGuard`), or None
    failed: torch.Tensor | None = None
    _cache: dict = field(default_factory=dict, repr=False, compare=False)

    @property
    def exact_digest(self) -> bool:
        return True  # the description hashes every bit

    def _on(self, device: torch.device) -> torch.Tensor:
        if device not in self._cache:
            self._cache[device] = self.bits.to(device)
        return self._cache[device]

    def visible(self, b, h, q, kv):
        bits = self._on(q.device)
        bi = b if bits.shape[0] > 1 else torch.zeros_like(b)
        hi = h if bits.shape[1] > 1 else torch.zeros_like(h)
        byte = bits[bi, hi, q, torch.div(kv, 8, rounding_mode="floor")].to(torch.int64)
        return ((byte >> torch.remainder(kv, 8)) & 1) != 0

    def describe(self) -> str:
        if "describe" not in self._cache:
            digest = bits_digest(self.bits)
            self._cache["describe"] = (
                f"table({'x'.join(map(str, self.bits.shape))},{self.seq_kv},{digest})"
            )
        return self._cache["describe"]

    def check(self, seq_q, seq_kv):
        if self.failed is not None and bool(self.failed):
            return (
                "mask MaskMod cannot be evaluated on the positions this rank attends (an index "
                "out of range or an integer divided by zero on this rank's data, found where the "
                "compiled graph evaluated its table)"
            )
        t = self.bits
        if not isinstance(t, torch.Tensor) or t.dim() != 4 or t.dtype != torch.uint8:
            return (
                "VisibilityTable.bits must be a 4-D uint8 tensor (batch or 1, heads or 1, seq_q, "
                "ceil(seq_kv / 8))"
            )
        want = (seq_q, -(-seq_kv // 8))
        if (t.shape[2], t.shape[3]) != want or self.seq_kv != seq_kv:
            return (
                f"VisibilityTable covers {t.shape[2]} x {self.seq_kv} positions but the global "
                f"sequence is {seq_q} x {seq_kv}: build it on the global sequence"
            )
        return None
