"""Cases of the uneven-shard suite: ``ring_attention(..., shard_lengths=[n_0, ..., n_{W-1}])``,
rank ``r`` holding ``n_r`` tokens (query, key and value alike) of a global sequence of ``S =
sum(shard_lengths)``; the rank function, the judge against the float64 oracle and the diagnosis.

The suite owns the global tensors and cuts every rank's shard itself with
:func:`reference.layout.split_positions` (written apart from the implementation): ``contiguous``
any split, ``head_tail`` its own split of ``S`` (:func:`reference.layout.split_lengths`). The
judge holds the contract (out ``(batch, heads, n_r, head_dim_v)``, LSE ``(batch, heads, n_r)``,
gradients of the rank's own rows) and then every quantity to the numerics policy
(reference.budget), the baseline being the same kernel on the whole sequence on one device.

Failures name the bug classes the output points at (:func:`diagnose_uneven`): padding keys
attended (a shard padded to the longest one and the padding not hidden), global positions taken
from an even split (rank ``r``'s first token at ``r * max(shard_lengths)`` instead of after the
tokens of ranks ``0 .. r-1``), padding rows not trimmed from the output or the LSE.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from conformance.implementation import load_implementation
from conformance.specs import MaskSpec
from reference.budget import Verdict
from reference.layout import split_lengths, split_positions
from reference.masks import visibility
from suites.cases import RingCase, backpropagate, local_results, resolve_case_op
from suites.cases_masks import mask_spec
from suites.inputs import make_inputs
from suites.judge import judge_outputs, produced, unshard_by_positions

__all__ = [
    "MASKS",
    "MASK_KINDS",
    "SPLITS",
    "UnevenCase",
    "diagnose_uneven",
    "judge_uneven",
    "split_for",
    "uneven_case",
]

#: Masks of the cases: none, ``is_causal``, a window that looks one key ahead (so padding after a
#: row is within reach of a window evaluated on the padded sequence), documents crossing the
#: shard borders with padding (-1) at the end, a head-dependent flex-style mask_mod.
MASKS = ("", "causal", "window", "documents", "mask_mod")
#: The mask kinds (reference.masks.MASK_KINDS) each mask needs the implementation to claim.
MASK_KINDS = {"window": ("sliding_window",), "documents": ("document",), "mask_mod": ("mask_mod",)}
#: How the sequence is split: a long rank 0 and short others, a rank with one token, a rank with
#: none, the layout's own split of a length its chunks do not divide.
SPLITS = ("skewed", "one_token", "empty_rank", "layout")


def split_for(split: str, world_size: int, layout: str) -> tuple[int, ...]:
    """Tokens per rank, rank 0 first, of the split called ``split`` over ``world_size`` ranks
    (``head_tail`` has its own split only: ``"layout"``)."""
    w = world_size
    if split == "layout":  # 7W - 1 tokens: no multiple of W (W >= 2) nor of 2W
        return split_lengths(layout, w, 7 * w - 1)
    if layout != "contiguous":
        raise ValueError(f"split {split!r} is for the contiguous layout; {layout!r} has 'layout'")
    if split == "skewed":
        return (3 * w + 1, *(2 + r % 2 for r in range(1, w)))
    if split == "one_token":
        return tuple(1 if r == 1 else 5 + r % 3 for r in range(w))
    if split == "empty_rank":  # rank 0 for W=2, a middle rank beyond
        empty = (w - 1) // 2
        return tuple(0 if r == empty else 4 + (3 * r) % 5 for r in range(w))
    raise ValueError(f"unknown split {split!r}; expected one of {SPLITS}")


@dataclass(frozen=True)
class UnevenCase(RingCase):
    """A ring case on uneven shards: ``lengths`` the tokens of every rank (``shard_lengths``;
    ``inputs.seq_q == inputs.seq_kv == sum(lengths)``), ``split`` its name (:data:`SPLITS`),
    ``mask`` a name of :data:`MASKS` ("causal" is ``is_causal=True``, no mask)."""

    lengths: tuple[int, ...] = ()
    split: str = "layout"
    mask: str = ""

    def mask_data(self) -> dict[str, Any] | None:
        """The plain-data mask (reference.masks) on the global sequence; None for none."""
        seq = sum(self.lengths)
        if self.mask == "":
            return None
        if self.mask == "causal":
            return {"kind": "causal"}
        if self.mask == "window":
            return {"kind": "sliding_window", "left": 3, "right": 1}
        return mask_spec(self.mask, seq)

    @property
    def label(self) -> str:
        return (
            RingCase.label.fget(self)[:-1]  # type: ignore[attr-defined]
            + f", shard_lengths={list(self.lengths)} ({self.split}), mask={self.mask or 'none'}, "
            f"return_lse={self.return_lse}, backward={self.backward})"
        )


def rank_positions(case: UnevenCase) -> list[torch.Tensor]:
    """Per rank, the global positions of its rows (the suite's own split, not the impl's)."""
    return [split_positions(case.layout, case.lengths, r) for r in range(case.world_size)]


def uneven_case(ctx, case: UnevenCase) -> dict[str, Any]:
    """Run the case on this rank: local out, lse, dq, dk, dv (CPU; None where not asked)."""
    impl = load_implementation(case.impl)
    spec = case.inputs
    g = make_inputs(spec)
    rows = split_positions(case.layout, case.lengths, ctx.rank)
    q, k, v = (t[:, :, rows].to(ctx.device).requires_grad_() for t in (g.query, g.key, g.value))
    kwargs = case.call_keywords(
        ctx.group, is_causal=case.mask == "causal", shard_lengths=list(case.lengths)
    )
    data = case.mask_data()
    if data is not None and case.mask != "causal":
        kwargs["mask"] = MaskSpec(data)
    if case.op is not None:
        kwargs["op"] = resolve_case_op(case, ctx.device)
    res = impl.obj.ring_attention(q, k, v, **kwargs)
    out, lse = res if case.return_lse else (res, None)
    if case.backward:
        dlse = None if g.grad_lse is None else g.grad_lse[:, :, rows].to(ctx.device)
        backpropagate(out, lse, g.grad_out[:, :, rows].to(ctx.device), dlse)
    return local_results(out, lse, q, k, v, lse_requires_grad=lse is not None and lse.requires_grad)


def _visible(case: UnevenCase) -> torch.Tensor | None:
    data = case.mask_data()
    if data is None:
        return None
    spec = case.inputs
    return visibility(data, spec.seq_q, spec.seq_kv, batch=spec.batch, heads=spec.heads)


def _contract(case: UnevenCase, results: list[dict[str, Any]]) -> None:
    """Shapes of what every rank returned: its own ``n_r`` rows, never the padding's."""
    __tracebackhide__ = True
    spec = case.inputs
    b, h, hkv, d, dv = spec.batch, spec.heads, spec.heads_kv, spec.head_dim, spec.value_head_dim
    longest = max(case.lengths)
    for rank, (res, n) in enumerate(zip(results, case.lengths)):
        want = {
            "out": (b, h, n, dv),
            "lse": (b, h, n) if case.return_lse else None,
            "dq": (b, h, n, d) if case.backward else None,
            "dk": (b, hkv, n, d) if case.backward else None,
            "dv": (b, hkv, n, dv) if case.backward else None,
        }
        for name, shape in want.items():
            if shape is None:
                continue
            got = res.get(name)
            if got is None:
                raise AssertionError(
                    f"{name}: rank {rank} returned none (ring_attention(shard_lengths=...) returns "
                    f"out{', lse' if case.return_lse else ''} and gradients of query, key and "
                    f"value) [{case.label}]"
                )
            if tuple(got.shape) == shape:
                continue
            why = ""
            if got.dim() >= 3 and got.shape[2] == longest != n:
                why = (
                    f" It holds {longest} rows, max(shard_lengths): padding rows not trimmed "
                    f"(the rows a shard is padded with to the longest shard must be cut off before "
                    f"the {name} is returned)."
                )
            raise AssertionError(
                f"contract: {name} on rank {rank}, which holds shard_lengths[{rank}] = {n} "
                f"tokens, must have shape {shape}, got {tuple(got.shape)}.{why} [{case.label}]"
            )


def judge_uneven(
    case: UnevenCase, results: list[dict[str, Any]], baseline_op: str | None = None
) -> list[Verdict]:
    """The contract (AssertionError naming what is wrong), then verdicts for out, lse, dq, dk, dv
    against the float64 oracle on the global sequence."""
    __tracebackhide__ = True
    _contract(case, results)

    def on_lse_mismatch(differ: int) -> str:
        return (
            f"{differ} rows are -inf where the oracle's are not, or the reverse (-inf: the row "
            f"sees nothing). {diagnose_uneven(case, results)}"
        )

    return judge_outputs(
        case,
        results,
        positions=rank_positions(case),
        names=produced(case),
        visible=_visible(case),
        # the kernel's causal path for is_causal, the mask otherwise
        causal_kernel=case.mask == "causal",
        baseline_op=baseline_op,
        on_lse_mismatch=on_lse_mismatch,
    )


# ----------------------------------------------------------------------------------- diagnosis


def _padded_data(case: UnevenCase, total: int) -> dict[str, Any] | None:
    """The case's mask on a sequence padded from ``S`` to ``total`` positions, as an
    implementation that pads without hiding the padding evaluates it: documents' ids extended
    with padding (-1), a mask_mod's positions clamped into ``[0, S)``, the rest as they are."""
    data = case.mask_data()
    seq = sum(case.lengths)
    if data is None or data["kind"] in ("causal", "sliding_window"):
        return data
    if data["kind"] == "document":
        return {**data, "doc_ids": list(data["doc_ids"]) + [-1] * (total - seq)}
    fn = data["fn"]

    def clamped(b, h, q_idx, kv_idx):
        return fn(b, h, q_idx.clamp(max=seq - 1), kv_idx.clamp(max=seq - 1))

    return {**data, "fn": clamped}


def _matches(case: UnevenCase, out: torch.Tensor, k, v, visible) -> bool:
    """Whether ``out`` (the ranks' output, global order) is float64 attention of the case's
    queries over keys ``k`` and values ``v`` under ``visible``, within 1% of its largest value."""
    from reference import attention

    g = make_inputs(case.inputs)
    want = attention(g.query, k, v, visible=visible, scale=case.inputs.scale).out
    return float((out - want).abs().max()) <= 1e-2 * max(1.0, float(want.abs().max()))


def diagnose_uneven(case: UnevenCase, results: list[dict[str, Any]]) -> str:
    """Name the uneven-shard bug class the output points at, or ""."""
    spec, w = case.inputs, case.world_size
    seq, longest = sum(case.lengths), max(case.lengths)
    total = w * longest
    pos = rank_positions(case)
    try:
        out = unshard_by_positions([r["out"] for r in results], pos).to(torch.float64)
    except Exception:  # a broken contract: the judge names it
        return ""
    g = make_inputs(spec)
    bh = dict(batch=spec.batch, heads=spec.heads)
    padded = _padded_data(case, total)
    if total > seq:
        # Padding attended: every real row also sees the padding keys (zero keys and values at
        # positions S .. W*max - 1) wherever the mask on the padded sequence lets it.
        pad = lambda t: torch.nn.functional.pad(t, (0, 0, 0, total - seq))  # noqa: E731
        vis = visibility(padded, total, total, **bh)[:, :, :seq]
        if _matches(case, out, pad(g.key), pad(g.value), vis) and not _matches(
            case, out, g.key, g.value, _visible(case)
        ):
            return (
                "The padding keys were attended: the output is attention that also sees the "
                f"{total - seq} zero padding keys (shards padded to the longest, {longest} "
                "rows); the padding must be hidden from every query (seen by nothing), whatever "
                "the mask and causality."
            )
    if case.layout == "contiguous" and w > 1 and len(set(case.lengths)) > 1:
        # Positions from an even split: rank r's row i taken for global position r * max + i.
        even = torch.cat([torch.arange(n) + r * longest for r, n in enumerate(case.lengths)])
        vis = visibility(padded, seq, seq, q_positions=even, k_positions=even, **bh)
        real = visibility(case.mask_data(), seq, seq, **bh)
        if not torch.equal(vis, real) and _matches(case, out, g.key, g.value, vis):
            return (
                "Global positions from an even split: the output is attention with rank r's "
                f"tokens at positions r * {longest} + i (every rank taken to hold "
                "max(shard_lengths) tokens); rank r's first token is at sum(shard_lengths[:r]), "
                "which masks, windows and documents must see."
            )
    return ""
