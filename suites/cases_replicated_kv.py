"""Cases of the replicated key/value suite: ``ring_attention(..., replicated_kv=True)``, the query
sharded in ``layout`` as usual and key/value the *whole* sequence, equal on every rank (the text
tokens of a cross-attention every rank holds); the rank function, the judge against the float64
oracle and the diagnosis.

The suite owns the global tensors: every rank gets its query rows (:func:`reference.layout.
positions` of the layout, written apart from the implementation) and fresh leaves of the whole
key and value. The judge holds the contract (out ``(batch, heads, n, head_dim_v)``, LSE
``(batch, heads, n)``, dQ of the rank's rows, dK/dV of key's and value's whole shapes on every
rank), then every quantity to the numerics policy (reference.budget) through
:func:`suites.judge.judge_outputs`: out, LSE and dQ unsharded by the query positions, dK and dV
(each rank its rows' contribution) and the sinks' gradient summed over the ranks, the baseline
being the same kernel on the whole query on one device.

Failures name the bug classes the results point at (:func:`diagnose_replicated_kv`): the
key/value duplicated W-fold (taken for sequence shards and rotated or all-to-all'ed, so every
query attends W copies: the output is unchanged without sinks, the LSE is off by ``log W``, the
output with sinks moves; the dK/dV sum over ranks stays right without sinks), and dK/dV reduced
over the group on every rank (their sum over ranks is W times the gradient).
"""

from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass
from typing import Any

import torch

from conformance.implementation import load_implementation
from conformance.specs import MaskSpec
from reference.attention import attention, attention_grads
from reference.budget import Verdict, compute_dtype
from reference.layout import positions
from reference.masks import visibility
from suites.cases import (
    RingCase,
    backpropagate,
    collective_phases,
    local_results,
    resolve_case_op,
)
from suites.cases_masks import _sinks
from suites.inputs import make_inputs
from suites.judge import judge_outputs, produced, unshard_by_positions

__all__ = [
    "DUPLICATED",
    "EXCHANGED",
    "GRADS_REDUCED",
    "MASKS",
    "ReplicatedKVCase",
    "diagnose_replicated_kv",
    "judge_replicated_kv",
    "rank_positions",
    "replicated_kv_case",
    "replicated_kv_mask",
]

#: The bug classes' names as the diagnosis states them (the meta-tests' expected patterns).
DUPLICATED = "key/value duplicated W-fold (treated as sequence shards: LSE off by log W)"
#: What a collectives failure of the suite says first: a replicated key/value needs no exchange,
#: so collectives beyond the declared input check mean one (an output that hides it: no LSE
#: returned, no sinks, equal keys keeping the softmax).
EXCHANGED = "replicated key/value exchanged between ranks"
GRADS_REDUCED = (
    "dK/dV reduced over the group on every rank (their sum over ranks is W times the gradient)"
)


#: The masks a replicated key/value case may carry (:func:`replicated_kv_mask`).
MASKS = ("key_padding", "cross_documents")


def replicated_kv_mask(name: str, batch: int, seq_q: int, seq_kv: int) -> dict[str, Any]:
    """The plain-data mask ``name`` of a replicated key/value call, on (the query's global
    position, the key's index): ``key_padding``, each batch row's keys after its own length
    padding (a caption's padding: row ``b`` keeps ``seq_kv - 1 - b`` keys, at least one);
    ``cross_documents``, query documents each seeing the keys of their own document (ids per
    query position and per key, cut at other places; the last query rows padding, seeing
    nothing)."""
    if name == "key_padding":
        kept = torch.tensor([max(1, seq_kv - 1 - b) for b in range(batch)])

        def key_padding_mod(b, h, q_idx, kv_idx):
            return kv_idx < kept[b]

        return {"kind": "mask_mod", "fn": key_padding_mod}
    q_ids = torch.arange(seq_q) * 3 // seq_q
    q_ids[-max(1, seq_q // 8) :] = -1
    kv_ids = torch.arange(seq_kv) * 3 // max(seq_kv, 1)

    def cross_documents_mod(b, h, q_idx, kv_idx):
        dq = q_ids.to(q_idx.device)[q_idx]
        return (dq == kv_ids.to(kv_idx.device)[kv_idx]) & (dq >= 0)

    return {"kind": "mask_mod", "fn": cross_documents_mod}


@dataclass(frozen=True)
class ReplicatedKVCase(RingCase):
    """A call with ``replicated_kv=True``: ``inputs.seq_q`` the global query (sharded in
    ``layout``), ``inputs.seq_kv`` the whole key/value every rank holds; non-causal; ``mask``: a
    name of :data:`MASKS` or None; ``sinks``: per-head sink logits (each rank's own leaf, their
    gradients summed)."""

    sinks: bool = False
    mask: str | None = None

    def mask_data(self) -> dict[str, Any] | None:
        spec = self.inputs
        if self.mask is None:
            return None
        return replicated_kv_mask(self.mask, spec.batch, spec.seq_q, spec.seq_kv)

    def visible(self) -> torch.Tensor | None:
        """The mask's visibility (batch, heads, seq_q, seq_kv) on the global query and the whole
        key/value, or None."""
        spec = self.inputs
        data = self.mask_data()
        if data is None:
            return None
        return visibility(data, spec.seq_q, spec.seq_kv, batch=spec.batch, heads=spec.heads)

    @property
    def rotates(self) -> bool:
        """Nothing rotates: no rotation method is asked of the implementation or passed."""
        return False

    @property
    def label(self) -> str:
        return (
            RingCase.label.fget(self)[:-1]  # type: ignore[attr-defined]
            + f", replicated_kv=True, seq_kv={self.inputs.seq_kv} on every rank, "
            f"mask={self.mask}, sinks={self.sinks}, return_lse={self.return_lse}, "
            f"backward={self.backward})"
        )


def rank_positions(case: ReplicatedKVCase) -> list[torch.Tensor]:
    """Per rank, the global positions of its query rows (the oracle's layout, not the impl's)."""
    w, seq = case.world_size, case.inputs.seq_q
    return [positions(case.layout, w, r, seq) for r in range(w)]


def replicated_kv_case(ctx, case: ReplicatedKVCase) -> dict[str, Any]:
    """Run the case on this rank: local out, lse, dq, this rank's dk, dv (of the whole key and
    value) and dsinks (CPU; None where not asked)."""
    impl = load_implementation(case.impl)
    spec = case.inputs
    g = make_inputs(spec)
    rows = positions(case.layout, ctx.world_size, ctx.rank, spec.seq_q)
    q = g.query[:, :, rows].to(ctx.device).requires_grad_()
    # the whole key and value, fresh leaves on every rank
    k, v = (t.to(ctx.device).detach().clone().requires_grad_() for t in (g.key, g.value))
    sinks = _sinks(spec).to(ctx.device).requires_grad_() if case.sinks else None
    kwargs = case.call_keywords(ctx.group, replicated_kv=True)
    del kwargs["rotate_method"]  # nothing rotates; the protocol leaves it out
    if sinks is not None:
        kwargs["sinks"] = sinks
    if case.mask is not None:
        kwargs["mask"] = MaskSpec(case.mask_data())
    if case.op is not None:
        kwargs["op"] = resolve_case_op(case, ctx.device)
    with contextlib.ExitStack() as stack:
        log, phase = collective_phases(stack, case.account)
        with phase("forward"):
            res = impl.obj.ring_attention(q, k, v, **kwargs)
        out, lse = res if case.return_lse else (res, None)
        if case.backward:
            with phase("backward"):
                dlse = None if g.grad_lse is None else g.grad_lse[:, :, rows].to(ctx.device)
                backpropagate(out, lse, g.grad_out[:, :, rows].to(ctx.device), dlse)

    return local_results(
        out,
        lse,
        q,
        k,
        v,
        dsinks=None if sinks is None or sinks.grad is None else sinks.grad.detach().cpu(),
        collectives=None if log is None else log.summary(),
        lse_requires_grad=lse is not None and lse.requires_grad,
    )


def _contract(case: ReplicatedKVCase, results: list[dict[str, Any]]) -> None:
    """Shapes and dtypes of what every rank returned: its own query rows for out, LSE and dQ;
    the gradient of the whole key and value it was given for dK and dV."""
    __tracebackhide__ = True
    spec = case.inputs
    b, h, hkv, d, dv = spec.batch, spec.heads, spec.heads_kv, spec.head_dim, spec.value_head_dim
    skv, in_dtype = spec.seq_kv, spec.torch_dtype
    n = spec.seq_q // case.world_size
    want: dict[str, tuple[tuple[int, ...], torch.dtype] | None] = {
        "out": ((b, h, n, dv), in_dtype),
        "lse": ((b, h, n), compute_dtype(in_dtype)) if case.return_lse else None,
        "dq": ((b, h, n, d), in_dtype) if case.backward else None,
        "dk": ((b, hkv, skv, d), in_dtype) if case.backward else None,
        "dv": ((b, hkv, skv, dv), in_dtype) if case.backward else None,
    }
    for rank, res in enumerate(results):
        for name, expected in want.items():
            if expected is None:
                continue
            shape, dtype = expected
            got = res.get(name)
            if got is None:
                raise AssertionError(
                    f"{name}: rank {rank} returned none (ring_attention(replicated_kv=True) "
                    f"returns out{', lse' if case.return_lse else ''} and gradients of query, key "
                    f"and value) [{case.label}]"
                )
            if tuple(got.shape) != shape:
                whole = (
                    f" dK/dV on every rank are the gradient of the whole key/value that rank was "
                    f"given ({skv} tokens): its query rows' contribution, summed over the ranks "
                    "by the caller."
                    if name in ("dk", "dv")
                    else ""
                )
                raise AssertionError(
                    f"contract: {name} on rank {rank} must have shape {shape}, got "
                    f"{tuple(got.shape)}.{whole} [{case.label}]"
                )
            if got.dtype != dtype:
                raise AssertionError(
                    f"contract: {name} on rank {rank} must be {str(dtype).removeprefix('torch.')}"
                    f", got {str(got.dtype).removeprefix('torch.')} [{case.label}]"
                )


def judge_replicated_kv(
    case: ReplicatedKVCase, results: list[dict[str, Any]], baseline_op: str | None = None
) -> list[Verdict]:
    """The contract (AssertionError naming what is wrong), then verdicts for out, lse, dq (by the
    query positions) and dk, dv, dsinks (summed over the ranks) against the float64 oracle."""
    __tracebackhide__ = True
    _contract(case, results)

    def on_lse_mismatch(differ: int) -> str:
        return (
            f"{differ} rows are -inf where the oracle's are not, or the reverse (every row sees "
            f"the replicated keys its mask shows, all {case.inputs.seq_kv} without one). "
            f"{diagnose_replicated_kv(case, results)}"
        )

    return judge_outputs(
        case,
        results,
        positions=rank_positions(case),
        names=produced(case),
        visible=case.visible(),
        sinks=_sinks(case.inputs) if case.sinks else None,
        baseline_op=baseline_op,
        on_lse_mismatch=on_lse_mismatch,
        replicated_kv=True,
    )


# ----------------------------------------------------------------------------------- diagnosis


def _points_at(got: list[torch.Tensor], bug: list[torch.Tensor], right: list[torch.Tensor]) -> bool:
    """Whether the results ``got`` are the bug's ``bug`` rather than the ``right`` ones (float64
    tensors, taken together): within a fifth of the largest distance between the two from the
    bug's, and at least four fifths of it from the right ones. Far looser than any verdict, far
    tighter than the factors (W, log W) the bugs are off by; no evidence where the two agree."""
    sep = max(float((b - r).abs().max()) for b, r in zip(bug, right))
    if not sep > 0:
        return False
    to_bug = max(float((x.to(torch.float64) - b).abs().max()) for x, b in zip(got, bug))
    to_right = max(float((x.to(torch.float64) - r).abs().max()) for x, r in zip(got, right))
    return to_bug <= 0.2 * sep and to_right >= 0.8 * sep


def diagnose_replicated_kv(case: ReplicatedKVCase, results: list[dict[str, Any]]) -> str:
    """Name the replicated key/value bug class the results point at, or ""."""
    spec, w = case.inputs, case.world_size
    if w < 2:
        return ""
    pos = rank_positions(case)
    try:
        got = {
            name: unshard_by_positions([r[name] for r in results], pos).to(torch.float64)
            if all(r.get(name) is not None for r in results)
            else None
            for name in ("out", "lse")
        }
        sums = {
            name: torch.stack([r[name].to(torch.float64) for r in results]).sum(0)
            if all(r.get(name) is not None for r in results)
            else None
            for name in ("dk", "dv")
        }
    except Exception:  # a broken contract: the judge names it
        return ""
    g = make_inputs(spec)
    sinks = _sinks(spec) if case.sinks else None
    vis = case.visible()
    right = attention(g.query, g.key, g.value, visible=vis, scale=spec.scale, sinks=sinks)
    lines = []
    # W copies of every key/value (each under the mask's columns): what a ring or all-to-all
    # that takes each rank's whole copy for its sequence shard computes
    copies = attention(
        g.query,
        g.key.repeat(1, 1, w, 1),
        g.value.repeat(1, 1, w, 1),
        visible=None if vis is None else vis.repeat(1, 1, 1, w),
        scale=spec.scale,
        sinks=sinks,
    )
    lse, out = got["lse"], got["out"]
    if lse is not None and _points_at([lse], [copies.lse], [right.lse]):
        shift = float((lse - right.lse).mean())
        lines.append(
            f"{DUPLICATED}: the LSE is that of every query attending {w} copies of the "
            f"replicated key/value, off by {shift:.4g} on average (log {w} = {math.log(w):.4g}"
            f"{', less with sinks' if sinks is not None else ''}): the whole key/value every "
            "rank holds was taken for a sequence shard and rotated or all-to-all'ed; with "
            "replicated_kv=True each rank attends its rows to the key/value it holds, once."
        )
    elif sinks is not None and out is not None and _points_at([out], [copies.out], [right.out]):
        lines.append(
            f"{DUPLICATED}: the output is that of every query attending {w} copies of the "
            "replicated key/value, which the sinks weigh against W times the keys' mass (the "
            "LSE would be off by up to log W): the whole key/value every rank holds was taken "
            "for a sequence shard; with replicated_kv=True each rank attends its rows to the "
            "key/value it holds, once."
        )
    if sums["dk"] is not None and sums["dv"] is not None:
        ref = attention_grads(
            g.query, g.key, g.value, g.grad_out, visible=vis, scale=spec.scale, sinks=sinks
        )
        grads = [sums["dk"], sums["dv"]]
        if _points_at(grads, [w * ref.dk, w * ref.dv], [ref.dk, ref.dv]):
            lines.append(
                f"{GRADS_REDUCED}: summed over the {w} ranks, dK/dV are {w} times the gradient "
                "of the replicated key/value; each rank must return its own query rows' "
                "contribution (the caller reduces them over the group, as a parameter's), not "
                "their all-reduced sum."
            )
    return " ".join(lines)
