"""Score modifications on **global** positions, for ``ring_attention(score_mod=...)``.

A score_mod changes each scaled logit ``s = scale * q . k`` of a (query, key) pair before the
mask and the softmax, as flex attention's ``score_mod(score, b, h, q_idx, kv_idx)``:

``SoftCap(cap)``                 ``cap * tanh(s / cap)`` (Gemma 2's logit soft-capping)
``Alibi(slopes)``                ``s + slopes[h] * (kv - q)`` (ALiBi; ``symmetric=True``:
                                 ``s - slopes[h] * |q - kv|``); ``slopes`` a (heads,) tensor, or
                                 an int ``n``: the standard geometric slopes of ``n`` heads
                                 (:func:`alibi_slopes`)
``PostScaleBias(bias)``          ``s + bias[b, h, q, kv]``: a (1 or batch, 1 or heads, seq_q,
                                 seq_kv) tensor on the *global* sequence (TransformerEngine's
                                 ``post_scale_bias``)
``ScoreModFn(fn)``               ``fn(score, b, h, q_idx, kv_idx)``: flex attention's signature,
                                 called once per kernel block on broadcastable tensors (score
                                 (B, H, rows, cols), b (B, 1, 1, 1), h (1, H, 1, 1), q_idx
                                 (1, 1, rows, 1), kv_idx (1, 1, 1, cols)); a plain callable
                                 passed as ``score_mod=`` is wrapped in it

``q_idx``/``kv_idx`` are global token positions whatever the layout and the rank, ``h`` the
global query head (GQA: the query head, not its key/value head; under ``head_chunks`` the
head's index in the call), ``b`` the batch row. Each ring step applies the score_mod inside its
own block, before that block's softmax statistics (so before the LSE merge: the merge of
modified blocks is the softmax of the modified scores).

Gradients flow to query, key and value through the score_mod (the op's explicit backward
multiplies dS by ``d score_mod / d s``: ``1 - tanh(s / cap)^2`` for the soft-cap, 1 for ALiBi
and the bias, autograd of the function for ``ScoreModFn``). ALiBi's slopes, the bias and any
tensor a function closes over are constants of the call: they get no gradient.

Every rank must pass an equal score_mod; the ranks compare :meth:`ScoreMod.agreement_text`
(the descriptors' data, a function's values on a probe grid) in the cross-rank check.
"""

from __future__ import annotations

import hashlib
import math
import struct
import zlib
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor

from .group import as_device

__all__ = [
    "Alibi",
    "BlockScores",
    "PostScaleBias",
    "ScoreMod",
    "ScoreModFn",
    "SoftCap",
    "alibi_slopes",
    "as_score_mod",
    "block_scores",
    "from_spec",
    "score_mod_code",
    "score_mod_problem",
]


def alibi_slopes(heads: int) -> torch.Tensor:
    """(heads,) float64: the ALiBi paper's geometric slopes ``2^(-8 i / n)``, i = 1..n, for a
    power of two ``n``; otherwise those of the largest power of two below and every other slope
    of the next one (the reference implementation's rule, as in HuggingFace's)."""

    def power_of_two(n: int) -> list[float]:
        start = 2.0 ** (-(2.0 ** -(math.log2(n) - 3)))
        return [start ** (i + 1) for i in range(n)]

    if heads < 1:
        raise ValueError(f"alibi_slopes needs at least one head, got {heads}")
    closest = 2 ** math.floor(math.log2(heads))
    slopes = power_of_two(closest)
    if closest != heads:
        slopes += power_of_two(2 * closest)[0::2][: heads - closest]
    return torch.tensor(slopes, dtype=torch.float64)


def _tensor_digest(t: torch.Tensor) -> str:
    """Shape and 128 bits of the values (float64) of ``t``."""
    data = t.detach().to(torch.float64).contiguous().cpu().numpy().tobytes()
    return f"{tuple(t.shape)}:{hashlib.blake2b(data, digest_size=16).hexdigest()}"


class ScoreMod:
    """Base of the score_mods: :meth:`apply` on broadcastable tensors, :meth:`derivative`
    (``d apply / d score``, elementwise; None: 1), :meth:`check` for bad parameters (a message, or
    None) and :meth:`agreement_text` for the cross-rank check."""

    def apply(self, score: Tensor, b: Tensor, h: Tensor, q: Tensor, kv: Tensor) -> Tensor:
        raise NotImplementedError

    def __call__(self, score, b, h, q_idx, kv_idx):
        """:meth:`apply`: a descriptor is a flex-style score_mod too, so an implementation that
        takes only callables can run it."""
        return self.apply(score, b, h, q_idx, kv_idx)

    def derivative(
        self, score: Tensor, b: Tensor, h: Tensor, q: Tensor, kv: Tensor
    ) -> Tensor | None:
        return None

    def check(self, *, batch: int, heads: int, seq_q: int, seq_kv: int, device=None) -> str | None:
        """What is wrong with it for a call of these global sizes on ``device`` (the inputs'
        device; None: the CPU), or None."""
        return None

    def describe(self) -> str:
        raise NotImplementedError

    def agreement_text(self, batch: int, heads: int, seq_q: int, seq_kv: int, device=None) -> str:
        """What the ranks of a call of these global sizes compare."""
        return self.describe()

    def spec(self) -> dict:
        """The plain-data form the float64 oracle reads (reference.score_mods)."""
        raise NotImplementedError


@dataclass(frozen=True)
class SoftCap(ScoreMod):
    """``cap * tanh(score / cap)``: logits squashed into ``(-cap, cap)`` (Gemma 2: cap 50 on
    attention logits)."""

    cap: float

    def apply(self, score, b, h, q, kv):
        return torch.tanh(score / self.cap) * self.cap

    def derivative(self, score, b, h, q, kv):
        return 1 - torch.tanh(score / self.cap).square()

    def check(self, *, batch, heads, seq_q, seq_kv, device=None):
        if (
            isinstance(self.cap, bool)
            or not isinstance(self.cap, (int, float))
            or not (math.isfinite(self.cap) and self.cap > 0)
        ):
            return f"SoftCap.cap must be a finite number > 0, got {self.cap!r}"
        return None

    def describe(self) -> str:
        return f"softcap({struct.pack('<d', float(self.cap)).hex()})"

    def spec(self) -> dict:
        return {"kind": "softcap", "cap": float(self.cap)}


@dataclass(frozen=True, eq=False)
class Alibi(ScoreMod):
    """ALiBi: ``score + slopes[h] * (kv - q)`` on global positions (<= 0 for the keys a causal
    query sees, growing with the distance); ``symmetric``: ``score - slopes[h] * |q - kv|`` (for
    attention that sees both ways). ``slopes``: (heads,) float tensor, or an int ``n`` for
    :func:`alibi_slopes` ``(n)``. Slopes are constants (no gradient)."""

    slopes: torch.Tensor | int
    symmetric: bool = False

    def _slopes(self, device, dtype) -> torch.Tensor:
        s = alibi_slopes(self.slopes) if isinstance(self.slopes, int) else self.slopes
        return s.detach().to(device=device, dtype=dtype)

    def apply(self, score, b, h, q, kv):
        slope = self._slopes(score.device, score.dtype)[h]  # (1, H, 1, 1)
        dist = (kv - q).to(score.dtype)
        return score + slope * (-dist.abs() if self.symmetric else dist)

    def check(self, *, batch, heads, seq_q, seq_kv, device=None):
        if not isinstance(self.symmetric, bool):
            return f"Alibi.symmetric must be a bool, got {self.symmetric!r}"
        if isinstance(self.slopes, bool):
            return f"Alibi.slopes must be a (heads,) tensor or a head count, got {self.slopes!r}"
        if isinstance(self.slopes, int):
            if self.slopes != heads:
                return (
                    f"Alibi({self.slopes}) gives slopes for {self.slopes} heads but the call "
                    f"has {heads} "
                    f"query heads: pass Alibi({heads}) or a ({heads},) tensor of slopes"
                )
            return None
        s = self.slopes
        if not isinstance(s, torch.Tensor) or not s.is_floating_point():
            return (
                "Alibi.slopes must be a floating (heads,) tensor or a head count, got "
                f"{type(s).__name__}"
                + (f" of dtype {s.dtype}" if isinstance(s, torch.Tensor) else "")
            )
        if s.device.type == "meta":
            return (
                "Alibi.slopes are on the meta device, which holds no values: give them on the "
                "CPU or the inputs' device"
            )
        if tuple(s.shape) != (heads,):
            return (
                f"Alibi.slopes must have shape ({heads},), one slope per query head, got "
                f"{tuple(s.shape)}"
            )
        if not bool(torch.isfinite(s).all()):
            return "Alibi.slopes must be finite"
        return None

    def describe(self) -> str:
        data = f"n{self.slopes}" if isinstance(self.slopes, int) else _tensor_digest(self.slopes)
        return f"alibi({data},{'symmetric' if self.symmetric else 'signed'})"

    def spec(self) -> dict:
        s = alibi_slopes(self.slopes) if isinstance(self.slopes, int) else self.slopes
        return {
            "kind": "alibi",
            "slopes": s.detach().to(torch.float64).cpu().tolist(),
            "symmetric": self.symmetric,
        }


@dataclass(frozen=True, eq=False)
class PostScaleBias(ScoreMod):
    """``score + bias[b, h, q, kv]``: ``bias`` (1 or batch, 1 or heads, seq_q, seq_kv) on the
    global sequence, added after the scale (TransformerEngine's ``post_scale_bias``). Each block
    reads the rows and columns of its global positions. A constant (no gradient)."""

    bias: torch.Tensor

    def apply(self, score, b, h, q, kv):
        t = self.bias.detach().to(device=score.device, dtype=score.dtype)
        bi = b if t.shape[0] > 1 else torch.zeros_like(b)
        hi = h if t.shape[1] > 1 else torch.zeros_like(h)
        return score + t[bi, hi, q, kv]

    def check(self, *, batch, heads, seq_q, seq_kv, device=None):
        t = self.bias
        if not isinstance(t, torch.Tensor) or not t.is_floating_point():
            return f"PostScaleBias.bias must be a floating tensor, got {type(t).__name__}" + (
                f" of dtype {t.dtype}" if isinstance(t, torch.Tensor) else ""
            )
        if t.device.type == "meta":
            return (
                "PostScaleBias.bias is on the meta device, which holds no values: give it on the "
                "CPU or the inputs' device"
            )
        if (
            t.dim() != 4
            or t.shape[0] not in (1, batch)
            or t.shape[1] not in (1, heads)
            or tuple(t.shape[2:]) != (seq_q, seq_kv)
        ):
            return (
                f"PostScaleBias.bias must have shape (1 or {batch}, 1 or {heads}, {seq_q}, "
                f"{seq_kv}): the global "
                f"sequence (local length x world size), got {tuple(t.shape)}"
            )
        return None

    def describe(self) -> str:
        return f"bias({_tensor_digest(self.bias)})"

    def spec(self) -> dict:
        return {"kind": "bias", "bias": self.bias.detach().to(torch.float64).cpu()}


#: The probe scores a ScoreModFn is evaluated on for the cross-rank check (a grid of values
#: across the range attention logits take).
_PROBE_SCORES = (-30.0, -3.0, -0.5, 0.0, 0.25, 2.0, 7.0, 40.0)


@dataclass(frozen=True, eq=False)
class ScoreModFn(ScoreMod):
    """``fn(score, b, h, q_idx, kv_idx)`` in flex attention's convention, evaluated on
    broadcastable tensors (see the module docstring). Its derivative is taken by autograd of
    ``fn`` in the backward; tensors it closes over get no gradient."""

    fn: Callable

    def apply(self, score, b, h, q, kv):
        out = torch.as_tensor(self.fn(score, b, h, q, kv))
        return out.to(score.dtype).expand(score.shape)

    def derivative(self, score, b, h, q, kv):
        with torch.enable_grad():
            s = score.detach().requires_grad_(True)
            out = self.apply(s, b, h, q, kv)
            if not out.requires_grad:  # does not depend on the score
                return torch.zeros_like(score)
            (d,) = torch.autograd.grad(out, s, torch.ones_like(out), allow_unused=True)
        return torch.zeros_like(score) if d is None else d

    def check(self, *, batch, heads, seq_q, seq_kv, device=None):
        # Evaluated on the corners and a strided grid of the global positions, on the device the
        # call evaluates it on (a flex-style function reads its tables there): a function that
        # fails (an index out of range, a wrong shape) fails here on every rank alike.
        where = as_device(device)
        qs = torch.unique(
            torch.cat([torch.arange(0, seq_q, max(1, seq_q // 16)), torch.tensor([seq_q - 1])])
        ).to(where)
        ks = torch.unique(
            torch.cat([torch.arange(0, seq_kv, max(1, seq_kv // 16)), torch.tensor([seq_kv - 1])])
        ).to(where)
        b = torch.arange(batch, device=where).view(-1, 1, 1, 1)
        h = torch.arange(heads, device=where).view(1, -1, 1, 1)
        score = torch.zeros(batch, heads, qs.numel(), ks.numel(), dtype=torch.float64, device=where)
        try:
            out = torch.as_tensor(self.fn(score, b, h, qs.view(1, 1, -1, 1), ks.view(1, 1, 1, -1)))
        except Exception as exc:  # bad input, not a crash
            return (
                f"score_mod {self._name()} cannot be evaluated on the global positions "
                f"({type(exc).__name__}: {exc})"
            )
        if not out.is_floating_point():
            return (
                f"score_mod {self._name()} returned {out.dtype}, not a floating tensor of the "
                "scores' shape"
            )
        try:
            torch.broadcast_shapes(out.shape, score.shape)
        except RuntimeError:
            return (
                f"score_mod {self._name()} returned shape {tuple(out.shape)}, which does not "
                "broadcast to the "
                f"scores' {tuple(score.shape)}"
            )
        return None

    def _name(self) -> str:
        return getattr(self.fn, "__qualname__", type(self.fn).__name__)

    def describe(self) -> str:
        return f"score_mod({self._name()})"

    def agreement_text(self, batch, heads, seq_q, seq_kv, device=None) -> str:
        """Its name and its values on a probe grid: every (batch, head) up to 8 x 16, 16 query and
        16 key positions (the first and last included), each at the scores of _PROBE_SCORES, in
        float64 bits. A function that differs between ranks only elsewhere is not seen."""
        from .masks import probe_grid

        bs, hs, qs, ks = probe_grid(min(batch, 8), min(heads, 16), seq_q, seq_kv)
        qs = torch.unique(torch.cat([qs[:: max(1, qs.numel() // 16)], qs[-1:]]))
        ks = torch.unique(torch.cat([ks[:: max(1, ks.numel() // 16)], ks[-1:]]))
        # on the device the call evaluates it on (a flex-style function reads its tables there)
        where = as_device(device)
        bs, hs, qs, ks = (t.to(where) for t in (bs, hs, qs, ks))
        crc = 0
        try:
            for value in _PROBE_SCORES:
                score = torch.full(
                    (bs.numel(), hs.numel(), qs.numel(), ks.numel()),
                    value,
                    dtype=torch.float64,
                    device=where,
                )
                out = self.apply(
                    score,
                    bs.view(-1, 1, 1, 1),
                    hs.view(1, -1, 1, 1),
                    qs.view(1, 1, -1, 1),
                    ks.view(1, 1, 1, -1),
                )
                crc = zlib.crc32(out.detach().cpu().contiguous().numpy().tobytes(), crc)
        except Exception as exc:  # the call's own checks report it, on every rank
            return f"{self.describe()}:unprobed:{type(exc).__name__}"
        return f"{self.describe()}:{crc}"

    def spec(self) -> dict:
        return {"kind": "score_mod", "fn": self.fn}


def as_score_mod(score_mod) -> ScoreMod | None:
    """``score_mod=`` as a :class:`ScoreMod`: a ScoreMod as it is, a plain callable wrapped in
    :class:`ScoreModFn`, None as None; anything else as it is (the checks refuse it)."""
    if score_mod is None or isinstance(score_mod, ScoreMod):
        return score_mod
    if callable(score_mod):
        return ScoreModFn(score_mod)
    return score_mod


def score_mod_problem(
    score_mod,
    query,
    *,
    world_size: int,
    key=None,
    layout: str | None = "contiguous",
    op=None,
    strategy: str = "ring",
    exchange: str = "auto",
) -> str | None:
    """What is wrong with ``score_mod=`` for a call on local shards (query (batch, heads,
    seq_q_local, head_dim), key (batch, heads_kv, seq_kv_local, head_dim)), or None. Never
    raises. ``layout``: the ring's, whose positions the score_mod reads (checked against the
    lengths); None for a head-parallel strategy (not checked here)."""
    if score_mod is None:
        return None
    if not isinstance(score_mod, ScoreMod):
        return (
            "score_mod must be a callable score_mod(score, b, h, q_idx, kv_idx) or a "
            "ring_impl.score_mods "
            f"descriptor (SoftCap, Alibi, PostScaleBias), got {type(score_mod).__name__}"
        )
    if strategy not in ("ring", "ulysses", "hybrid"):
        return None  # the strategy checks report it
    if exchange == "halo":
        return (
            "exchange='halo' but the halo exchange takes no score_mod; pass exchange='auto' (a "
            "masked call with a score_mod runs on the ring)"
        )
    if exchange == "gather":
        return (
            "exchange='gather' but the sparse gather takes no score_mod; pass exchange='auto' "
            "(the ring runs it)"
        )
    if op is not None and not getattr(op.capabilities, "score_mod", False):
        return (
            f"attention op {getattr(op, 'name', op)!r} cannot apply a score_mod (it does not "
            "declare "
            "OpCapabilities.score_mod: a fused kernel computes no explicit scores); pass "
            "op='auto' or op='math'"
        )
    if not (
        isinstance(query, torch.Tensor)
        and query.dim() == 4
        and isinstance(key, torch.Tensor)
        and key.dim() == 4
    ):
        return None  # the input checks report it
    b, h, sq, _ = query.shape
    skv = key.shape[2]
    try:
        from .layout import layout_runs

        if layout is not None:  # the ring's positions: the layout's
            for n in {sq, skv}:
                layout_runs(layout, n * world_size, world_size, 0)
    except Exception as exc:
        return (
            f"score_mod reads global positions, but layout {layout!r} cannot place local length(s) "
            f"{sq}/{skv} over {world_size} ranks ({exc})"
        )
    try:
        return score_mod.check(
            batch=b, heads=h, seq_q=sq * world_size, seq_kv=skv * world_size, device=query.device
        )
    except Exception as exc:  # a descriptor that trips over its own data is bad input
        return (
            f"score_mod {type(score_mod).__name__} cannot be checked ({type(exc).__name__}: {exc})"
        )


def score_mod_code(score_mod, dims: tuple[int, int, int, int], device=None) -> str:
    """The text of ``score_mod`` the ranks compare (empty for none); ``dims`` the call's global
    (batch, heads, seq_q, seq_kv)."""
    if score_mod is None:
        return ""
    return score_mod.agreement_text(*dims, device)


@dataclass(frozen=True)
class BlockScores:
    """A score_mod bound to one kernel block: the global indices of its batch rows, query heads,
    query rows and key columns, broadcastable to the block's scores (B, H, rows, cols). What an
    op declaring ``OpCapabilities.score_mod`` receives as ``score_mod=``."""

    mod: ScoreMod
    b: torch.Tensor  # (B, 1, 1, 1) int64
    h: torch.Tensor  # (1, H, 1, 1) int64
    q: torch.Tensor  # (1, 1, rows, 1) int64
    kv: torch.Tensor  # (1, 1, 1, cols) int64

    def apply(self, score: torch.Tensor) -> torch.Tensor:
        """score (B, H, rows, cols) -> the modified scores."""
        return self.mod.apply(score, self.b, self.h, self.q, self.kv)

    def grad(self, score: torch.Tensor, grad_modified: torch.Tensor) -> torch.Tensor:
        """The gradient reaching the unmodified ``score`` (B, H, rows, cols) from the one
        reaching the modified scores."""
        d = self.mod.derivative(score, self.b, self.h, self.q, self.kv)
        return grad_modified if d is None else grad_modified * d


def _positions(runs, device) -> torch.Tensor:
    parts = [torch.arange(a, b, device=device) for a, b in runs]
    return parts[0] if len(parts) == 1 else torch.cat(parts)


def block_scores(
    mod: ScoreMod, *, batch: int, heads: tuple[int, int], q_pos, kv_pos, device: torch.device
) -> BlockScores:
    """``mod`` bound to a block of ``batch`` rows, query heads ``[heads[0], heads[1])`` of the
    call, at global query positions ``q_pos`` and key positions ``kv_pos`` (runs ``((start,
    stop), ...)`` in the block's row order)."""
    return BlockScores(
        mod,
        torch.arange(batch, device=device).view(-1, 1, 1, 1),
        torch.arange(heads[0], heads[1], device=device).view(1, -1, 1, 1),
        _positions(q_pos, device).view(1, 1, -1, 1),
        _positions(kv_pos, device).view(1, 1, 1, -1),
    )


def from_spec(spec) -> ScoreMod:
    """A score_mod from the plain data the oracle reads (reference.score_mods): ``{"kind":
    "softcap", "cap": c}``, ``{"kind": "alibi", "slopes": [...], "symmetric": bool}``, ``{"kind":
    "bias", "bias": tensor}``, ``{"kind": "score_mod", "fn": f}``."""
    kind = spec.get("kind")
    if kind == "softcap":
        return SoftCap(spec["cap"])
    if kind == "alibi":
        slopes = spec["slopes"]  # a tensor keeps its dtype; plain numbers become float64
        if not isinstance(slopes, torch.Tensor):
            slopes = torch.as_tensor(slopes, dtype=torch.float64)
        return Alibi(slopes, bool(spec.get("symmetric", False)))
    if kind == "bias":
        return PostScaleBias(torch.as_tensor(spec["bias"]))
    if kind == "score_mod":
        return ScoreModFn(spec["fn"])
    raise ValueError(f"unknown score_mod kind {kind!r}")
