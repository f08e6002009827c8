"""A mask as a table of bits on the global grid: how a ``MaskMod`` enters a compiled graph.

A ``MaskMod`` is a Python function. A compiled graph cannot carry a function as data (the custom
ops of :mod:`ring_impl.compiled_masks` take tensors and literals), and finding it again by
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
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field

import torch

from .masks import Mask, visibility

__all__ = ["CHUNK_ENTRIES", "MAX_TABLE_BITS", "VisibilityTable", "pack_visibility"]

#: the largest table built (bits, batch and head dims included): 2**30 bits is 128 MiB, 32768 x
#: 32768 positions for a function of the positions alone
MAX_TABLE_BITS = 1 << 30
#: entries of the (batch, heads, rows, seq_kv) grid evaluated at once (bounds the function's
#: temporaries: an int64 one is 8 bytes an entry)
CHUNK_ENTRIES = 1 << 22

_BIT_WEIGHTS = (1, 2, 4, 8, 16, 32, 64, 128)


def pack_visibility(mask: Mask, *, seq_q: int, seq_kv: int, batch: int, heads: int,
                    max_bits: int | None = None) -> torch.Tensor | None:
    """``mask`` on every global position pair, packed: (batch or 1, heads or 1, seq_q,
    ceil(seq_kv / 8)) uint8, bit ``j % 8`` (least significant first) of byte ``j // 8`` of a row
    set when its query sees key ``j``; None when that would exceed ``max_bits`` bits (default
    :data:`MAX_TABLE_BITS`, read at the call), or when the mask does not give bool (the eager
    call's checks then say so on every rank).

    The batch and head dims are 1 unless the mask depends on them (seen on one position pair).
    Runs on the host; traceable by dynamo (a plain function of the positions)."""
    qs, ks = torch.arange(seq_q), torch.arange(seq_kv)
    first = torch.zeros(1, 1, 1, 1, dtype=torch.int64)
    if torch.as_tensor(mask.visible(first, first, first, first)).dtype != torch.bool:
        return None
    corner = visibility(mask, qs[:1], ks[:1], batch=batch, heads=heads)
    bm, hm = corner.shape[0], corner.shape[1]
    width = -(-seq_kv // 8)
    if bm * hm * seq_q * width * 8 > (MAX_TABLE_BITS if max_bits is None else max_bits):
        return None
    weights = torch.tensor(_BIT_WEIGHTS, dtype=torch.int64)
    rows = max(1, CHUNK_ENTRIES // (bm * hm * width * 8))
    pieces = []
    for r0 in range(0, seq_q, rows):
        r1 = min(seq_q, r0 + rows)
        seen = visibility(mask, qs[r0:r1], ks, batch=batch, heads=heads)
        if width * 8 != seq_kv:  # pad the last byte's missing keys as not seen
            seen = torch.nn.functional.pad(seen, (0, width * 8 - seq_kv), value=False)
        bits = seen.reshape(bm, hm, r1 - r0, width, 8).to(torch.int64)
        pieces.append((bits * weights).sum(-1).to(torch.uint8))
    return torch.cat(pieces, dim=2)


@dataclass(frozen=True)
class VisibilityTable(Mask):
    """A mask given as packed bits on the global grid (:func:`pack_visibility`'s form):
    ``bits`` (batch or 1, heads or 1, seq_q, ceil(seq_kv / 8)) uint8; ``seq_kv`` the keys' global
    length."""

    bits: torch.Tensor
    seq_kv: int
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
            data = self.bits.detach().to("cpu", torch.uint8).contiguous().numpy().tobytes()
            digest = hashlib.blake2b(data, digest_size=16).hexdigest()
            self._cache["describe"] = f"table({'x'.join(map(str, self.bits.shape))},{self.seq_kv},{digest})"
        return self._cache["describe"]

    def check(self, seq_q, seq_kv):
        t = self.bits
        if not isinstance(t, torch.Tensor) or t.dim() != 4 or t.dtype != torch.uint8:
            return "VisibilityTable.bits must be a 4-D uint8 tensor (batch or 1, heads or 1, seq_q, ceil(seq_kv / 8))"
        want = (seq_q, -(-seq_kv // 8))
        if (t.shape[2], t.shape[3]) != want or self.seq_kv != seq_kv:
            return (f"VisibilityTable covers {t.shape[2]} x {self.seq_kv} positions but the global sequence is "
                    f"{seq_q} x {seq_kv}: build it on the global sequence")
        return None
