"""What the suites hand an implementation under test for a mask and a score_mod: plain data.

A vendor consumes no class of this project's implementation: a mask is a :class:`MaskSpec`, a
built-in score_mod a :class:`ScoreModSpec`. Each is a read-only mapping of the plain-data
description the float64 oracle reads (:mod:`reference.masks`, :mod:`reference.score_mods`), so
an implementation may read its fields (``spec["kind"]``, ``spec["doc_ids"]``, ``spec["left"]``,
...) and build its own objects from them, plus a view in flex attention's convention for one
that only evaluates it:

- ``MaskSpec.visible(b, h, q_idx, kv_idx)`` -> bool, a ``mask_mod``;
- ``ScoreModSpec(score, b, h, q_idx, kv_idx)`` -> scores, a ``score_mod``.

Index tensors broadcast against each other (flex's (B, 1, 1, 1), (1, H, 1, 1), (1, 1, rows, 1),
(1, 1, 1, cols)); positions are global. The data is what the oracle reads, so whatever an
implementation builds from it is judged against the same description.

Tensors in the data are the caller's, not copies: document ids refilled in place between two
calls on one spec are the new documents of the second call (the mask suite's refill cases).
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import Any

from torch import Tensor

from reference.masks import MASK_KINDS, visible_at
from reference.score_mods import SCORE_MOD_KINDS, score_mod_at

__all__ = ["MaskSpec", "ScoreModSpec"]


class _Spec(Mapping[str, Any]):
    """A read-only mapping over a plain-data description with a ``"kind"`` of ``KINDS``."""

    KINDS: tuple[str, ...] = ()
    WHAT = "spec"

    __slots__ = ("__weakref__", "_data")

    def __init__(self, data: Mapping[str, Any]):
        kind = data.get("kind")
        if kind not in self.KINDS:
            raise ValueError(f"unknown {self.WHAT} kind {kind!r}; expected one of {self.KINDS}")
        self._data = dict(data)

    @property
    def kind(self) -> str:
        return str(self._data["kind"])

    def __getitem__(self, key: str) -> Any:
        return self._data[key]

    def __iter__(self) -> Iterator[str]:
        return iter(self._data)

    def __len__(self) -> int:
        return len(self._data)

    def __repr__(self) -> str:
        fields = ", ".join(f"{k}={_short(v)}" for k, v in self._data.items() if k != "kind")
        return f"{type(self).__name__}({self.kind}{', ' if fields else ''}{fields})"

    # Specs are compared and hashed as the objects they are: their data may hold tensors (whose
    # equality is elementwise) and callables.
    __eq__ = object.__eq__
    __hash__ = object.__hash__


def _short(value: Any) -> str:
    if isinstance(value, Tensor):
        return f"tensor{tuple(value.shape)}:{str(value.dtype).removeprefix('torch.')}"
    if isinstance(value, (list, tuple)) and len(value) > 8:
        return f"[{len(value)} values]"
    return getattr(value, "__name__", None) or repr(value)


class MaskSpec(_Spec):
    """A mask on global positions: the data of :mod:`reference.masks` (``{"kind": "document",
    "doc_ids": ..., "causal": True}``, ``{"kind": "sliding_window", "left": 128, "right": 0}``,
    ``{"kind": "and", "masks": [...]}``, ``{"kind": "mask_mod", "fn": f}``, ...)."""

    KINDS = MASK_KINDS
    WHAT = "mask"
    __slots__ = ()

    def visible(self, b: Tensor, h: Tensor, q_idx: Tensor, kv_idx: Tensor) -> Tensor:
        """Bool visibility at broadcasting index tensors (flex attention's ``mask_mod``), on
        the positions' device."""
        return visible_at(self._data, b, h, q_idx, kv_idx)


class ScoreModSpec(_Spec):
    """A built-in score_mod: the data of :mod:`reference.score_mods` (``{"kind": "softcap",
    "cap": c}``, ``{"kind": "alibi", "slopes": tensor (heads,), "symmetric": bool}``,
    ``{"kind": "bias", "bias": tensor (1 or batch, 1 or heads, seq_q, seq_kv)}``), callable as
    flex attention's ``score_mod``. Its tensors are in the dtype the implementation computes
    scores in (float64 for float64 inputs, else float32)."""

    KINDS = tuple(k for k in SCORE_MOD_KINDS if k != "score_mod")
    WHAT = "score_mod"
    __slots__ = ()

    def __call__(self, score: Tensor, b: Tensor, h: Tensor, q_idx: Tensor, kv_idx: Tensor):
        """The modified scores, in ``score``'s dtype (differentiable in ``score``)."""
        return score_mod_at(self._data, score, b, h, q_idx, kv_idx)
