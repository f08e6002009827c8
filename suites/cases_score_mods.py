"""Cases of the score_mod suite: a ring case with a score_mod (by name, on global positions),
optionally a mask (``is_causal`` or a named mask of the mask suite) and sinks; the rank function,
the judge and the diagnosis.

A score_mod's plain data (reference.score_mods) is built from its name on both sides: the
oracle reads the data, the implementation gets a callable in flex attention's convention (a
:class:`conformance.specs.ScoreModSpec` for the built-in kinds: the same data, callable:
conformance/implementation.py).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from conformance.implementation import load_implementation
from conformance.specs import MaskSpec, ScoreModSpec
from reference.budget import Verdict
from reference.layout import positions
from reference.masks import visibility
from suites.cases import RingCase, strategy_group
from suites.cases_masks import (
    _sinks,
    call_with_sinks,
    case_shard,
    mask_spec,
    optional_keywords,
    oracle_attention,
    sharded_inputs,
)
from suites.inputs import InputSpec, make_inputs
from suites.judge import judge_outputs, unshard_by_positions

__all__ = [
    "SCORE_MOD_NAMES",
    "ScoreModCase",
    "diagnose_scored",
    "judge_scored",
    "score_mod_spec",
    "scored_case",
]

SCORE_MOD_NAMES = ("softcap", "alibi", "alibi_symmetric", "bias", "callable")


def flex_style_mod(score, b, h, q_idx, kv_idx):
    """A flex-style score_mod reading the score, the head and both global positions: a per-head
    temperature, a term of the query's position and a clipped distance penalty."""
    dist = (q_idx - kv_idx).abs().clamp(max=16).to(score.dtype)
    return score * (1 + 0.2 * h) + 0.3 * torch.sin(0.37 * q_idx.to(score.dtype)) - 0.05 * dist


def _alibi_slopes(heads: int) -> list[float]:
    """The ALiBi paper's geometric slopes for a power-of-two head count, times 4 so that the
    distances of a short test sequence move the softmax (the slopes are data, any values do)."""
    return [4 * 2.0 ** (-8.0 * (i + 1) / heads) for i in range(heads)]


def score_mod_spec(name: str, spec: InputSpec) -> dict[str, Any]:
    """The plain-data score_mod (reference.score_mods) called ``name`` for the inputs ``spec``
    (global lengths, heads, batch)."""
    if name == "softcap":  # a cap near the logits' size: the cap changes every row
        return {"kind": "softcap", "cap": 0.8}
    if name in ("alibi", "alibi_symmetric"):
        return {
            "kind": "alibi",
            "slopes": _alibi_slopes(spec.heads),
            "symmetric": name == "alibi_symmetric",
        }
    if name == "bias":  # per head, shared by the batch rows
        gen = torch.Generator().manual_seed(spec.seed + 7)
        return {
            "kind": "bias",
            "bias": torch.randn(
                1, spec.heads, spec.seq_q, spec.seq_kv, generator=gen, dtype=torch.float64
            ),
        }
    if name == "callable":
        return {"kind": "score_mod", "fn": flex_style_mod}
    raise ValueError(f"unknown score_mod name {name!r}; expected one of {SCORE_MOD_NAMES}")


def implementation_score_mod(data: dict[str, Any], dtype: torch.dtype):
    """What the implementation gets for ``data``: a :class:`conformance.specs.ScoreModSpec` (the
    data, callable as a flex-style score_mod) for the built-in kinds, the function itself for
    ``score_mod``. Tensors in the input dtype's accumulation dtype (float64 for float64, else
    float32)."""
    acc = torch.float64 if dtype == torch.float64 else torch.float32
    kind = data["kind"]
    if kind == "softcap":
        return ScoreModSpec({"kind": "softcap", "cap": data["cap"]})
    if kind == "alibi":
        return ScoreModSpec(
            {
                "kind": "alibi",
                "slopes": torch.tensor(data["slopes"], dtype=acc),
                "symmetric": bool(data["symmetric"]),
            }
        )
    if kind == "bias":
        return ScoreModSpec({"kind": "bias", "bias": data["bias"].to(acc)})
    return data["fn"]


def oracle_data(data: dict[str, Any], dtype: torch.dtype) -> dict[str, Any]:
    """``data`` with its tensors rounded as the implementation gets them (its constants are
    inputs: the oracle takes them as given, as it takes the dtype-rounded query and key)."""
    acc = torch.float64 if dtype == torch.float64 else torch.float32
    if data["kind"] == "alibi":
        return {
            **data,
            "slopes": torch.tensor(data["slopes"], dtype=acc).to(torch.float64).tolist(),
        }
    if data["kind"] == "bias":
        return {**data, "bias": data["bias"].to(acc).to(torch.float64)}
    return data


@dataclass(frozen=True)
class ScoreModCase(RingCase):
    """``score_mod``: a name of :data:`SCORE_MOD_NAMES`; ``mask``: a named mask of the mask suite
    (suites.cases_masks.MASK_NAMES) or "" (``is_causal`` alone, or none); ``params``: drawn
    parameters over the named score_mod's (``("cap", c)``, ``("slopes", (s_0, ..., s_{H-1}))``,
    ``("bias_scale", x)``: the bias times x), () for the named ones."""

    score_mod: str = "softcap"
    mask: str = ""
    sinks: bool = False
    params: tuple[tuple[str, Any], ...] = ()

    def score_mod_data(self) -> dict[str, Any]:
        data = score_mod_spec(self.score_mod, self.inputs)
        for key, value in self.params:
            if key == "bias_scale":
                data["bias"] = data["bias"] * value
            else:
                data[key] = list(value) if isinstance(value, tuple) else value
        return data

    def mask_data(self) -> dict[str, Any] | None:
        if self.mask:
            return mask_spec(self.mask, self.inputs.seq_q)
        return {"kind": "causal"} if self.is_causal else None

    @property
    def label(self) -> str:
        mask = f", mask={self.mask}" if self.mask else ""
        return (
            RingCase.label.fget(self)[:-1]  # type: ignore[attr-defined]
            + f", score_mod={self.score_mod}{mask}, sinks={self.sinks}"
            + "".join(f", {k}={v}" for k, v in self.params)
            + ")"
        )


def scored_case(ctx, case: ScoreModCase) -> dict[str, Any]:
    """Run the case on this rank: local out, lse, dq, dk, dv (CPU) and this rank's dsinks."""
    # First: creating the hybrid's mesh is a collective.
    group = strategy_group(ctx, case.strategy, case.mesh_shape) if case.mesh_shape else ctx.group
    impl = load_implementation(case.impl)
    spec = case.inputs
    g = make_inputs(spec)
    q, k, v, dout, dlse, sinks = sharded_inputs(case, g, case_shard(case, ctx.rank), ctx.device)
    kwargs = case.call_keywords(
        group,
        return_lse=True,
        score_mod=implementation_score_mod(case.score_mod_data(), spec.torch_dtype),
    )
    if case.mask:
        kwargs["mask"] = MaskSpec(mask_spec(case.mask, spec.seq_q))
    kwargs.update(optional_keywords(case, sinks, ctx.device))
    return call_with_sinks(impl.obj.ring_attention, q, k, v, dout, sinks, kwargs, dlse=dlse)


def _visible(case: ScoreModCase) -> torch.Tensor | None:
    data = case.mask_data()
    if data is None:
        return None
    spec = case.inputs
    return visibility(data, spec.seq_q, spec.seq_kv, batch=spec.batch, heads=spec.heads)


def _rank_positions(case: ScoreModCase) -> list[torch.Tensor]:
    if case.mesh_shape is not None:
        from reference.strategies import positions as strategy_positions

        return [
            strategy_positions(case.strategy, case.layout, case.mesh_shape, r, case.inputs.seq_q)
            for r in range(case.world_size)
        ]
    return [
        positions(case.layout, case.world_size, r, case.inputs.seq_q)
        for r in range(case.world_size)
    ]


def judge_scored(
    case: ScoreModCase, results: list[dict[str, Any]], baseline_op: str | None = None
) -> list[Verdict]:
    """Verdicts for out, lse, dq, dk, dv (and dsinks) against the float64 oracle with the same
    score_mod (and mask, sinks)."""
    spec = case.inputs

    def on_lse_mismatch(differ: int) -> str:
        return diagnose_scored(case, results) or (
            f"{differ} rows are -inf where the oracle's are not, or the reverse (-inf: the row "
            "sees nothing)"
        )

    return judge_outputs(
        case,
        results,
        positions=_rank_positions(case),
        visible=_visible(case),
        sinks=_sinks(spec) if case.sinks else None,
        score_mod=oracle_data(case.score_mod_data(), spec.torch_dtype),
        baseline_op=baseline_op,
        on_lse_mismatch=on_lse_mismatch,
    )


def _at_local_positions(data: dict[str, Any], local: torch.Tensor) -> dict[str, Any]:
    """``data`` evaluated with every global position replaced by its row index within its rank's
    shard (``local``: global position -> local row)."""
    from reference.score_mods import apply_score_mod

    def fn(score, b, h, i, j):
        return apply_score_mod(
            data, score, q_positions=local[i.flatten()], k_positions=local[j.flatten()]
        )

    return {"kind": "score_mod", "fn": fn}


def _equals(
    case: ScoreModCase, got_out: torch.Tensor, got_lse: torch.Tensor, data: dict[str, Any] | None
) -> bool:
    """Whether the ranks' out and LSE are attention under ``data`` (None: no score_mod): within
    1% of the largest output, the LSE within 1% of its largest."""
    wrong = oracle_attention(case, make_inputs(case.inputs), _visible(case), score_mod=data)
    tol = 1e-2 * max(1.0, float(wrong.out.abs().max()))
    seen = torch.isfinite(wrong.lse)
    lse_err = (got_lse - wrong.lse).masked_fill(~seen, 0.0).abs().max()
    return float((got_out - wrong.out).abs().max()) <= tol and float(lse_err) <= 1e-2 * max(
        1.0, float(wrong.lse.masked_fill(~seen, 0.0).abs().max())
    )


def diagnose_scored(case: ScoreModCase, results: list[dict[str, Any]]) -> str:
    """Name the score_mod bug class the output points at, or ""."""
    spec = case.inputs
    pos = _rank_positions(case)
    out = unshard_by_positions([r["out"] for r in results], pos).to(torch.float64)
    lse = unshard_by_positions([r["lse"] for r in results], pos).to(torch.float64)
    data = oracle_data(case.score_mod_data(), spec.torch_dtype)
    if _equals(case, out, lse, None) or (data["kind"] == "softcap" and _out_without(case, out)):
        if data["kind"] != "softcap":
            return (
                "the score_mod was not applied: the output is attention without it; it must "
                "change each block's scores inside every ring step, before the merge"
            )
        return (
            "soft-cap applied after the merge (or not at all): the output is attention "
            "without the score_mod; a score_mod changes each block's scores before that "
            "block's softmax statistics, inside every ring step, so that the merge combines "
            "modified blocks (capping a merged LSE or output is not attention with capped "
            "logits)"
        )
    if case.world_size > 1 and case.mesh_shape is None:
        local = torch.empty(spec.seq_q, dtype=torch.int64)
        for p in pos:
            local[p] = torch.arange(p.numel())
        if _equals(case, out, lse, _at_local_positions(data, local)):
            return (
                f"{case.score_mod} on local instead of global positions: the output is "
                "attention with the score_mod evaluated at each rank's local row indices "
                "(0..seq_local-1 for queries and for the key/value block it holds); q_idx and "
                "kv_idx must be global token positions, the layout's, whatever the rank and "
                "the ring step"
            )
    return ""


def _out_without(case: ScoreModCase, out: torch.Tensor) -> bool:
    """Whether the output alone is attention without the score_mod (the LSE may have been
    changed after the merge)."""
    plain = oracle_attention(case, make_inputs(case.inputs), _visible(case)).out
    return float((out - plain).abs().max()) <= 1e-2 * max(1.0, float(plain.abs().max()))
