"""Cases of the max-logit suite: ``ring_attention(..., return_max_logit=True)`` on every rank,
causal or not, with a mask or without, and the judge against the float64 oracle
(:func:`reference.attention.max_logit`).

The contract (conformance/implementation.py, capability ``max_logit``): the call returns ``(out,
max_logit)`` (``(out, lse, max_logit)`` with ``return_lse``), ``max_logit`` of shape (heads,) in
float32 (float64 for float64 inputs), not requiring grad, equal on every rank: per head the
largest ``scale * q . k`` over the batch, every query row of every rank and every key the row
sees. The judge holds it to the numerics policy (reference.budget): the single-device baseline
is the same logits formed in the kernels' compute dtype on one device, the floor the dot
product's rounding bound (:func:`reference.budget.max_logit_scale`).
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Any

import torch

from conformance.implementation import load_implementation
from conformance.specs import MaskSpec
from reference.attention import max_logit as oracle_max_logit
from reference.budget import Verdict, check, compute_dtype, fmt_err, max_logit_scale
from reference.layout import positions, shard
from reference.masks import visibility
from suites.cases import RingCase
from suites.cases_masks import _sinks, mask_spec
from suites.inputs import make_inputs

__all__ = ["MaxLogitCase", "diagnose_max_logit", "judge_max_logit", "max_logit_case"]


@dataclass(frozen=True)
class MaxLogitCase(RingCase):
    """A ring case that asks for the max logit; ``mask``: a name of
    :data:`suites.cases_masks.MASK_NAMES` on the global sequence (None: none; ``is_causal``
    then says causal), ``sinks``: per-head sink logits too (no part of the max logit)."""

    mask: str | None = None
    sinks: bool = False

    @property
    def label(self) -> str:
        base = RingCase.label.fget(self)[:-1]  # type: ignore[attr-defined]
        return base + f", mask={self.mask}, sinks={self.sinks}, return_max_logit=True)"


def max_logit_case(ctx, case: MaxLogitCase) -> dict[str, Any]:
    """Run the case on this rank: the returned max logit (CPU), what the call returned, and with
    ``case.account`` the collectives per phase."""
    impl = load_implementation(case.impl)
    spec = case.inputs
    g = make_inputs(spec)
    w, r = ctx.world_size, ctx.rank
    q, k, v = (
        shard(t, case.layout, w, r, dim=2).to(ctx.device).requires_grad_()
        for t in (g.query, g.key, g.value)
    )
    kwargs = case.call_keywords(ctx.group, return_max_logit=True)
    if case.mask is not None:
        kwargs["mask"] = MaskSpec(mask_spec(case.mask, spec.seq_q))
    if case.sinks:
        kwargs["sinks"] = _sinks(spec).to(ctx.device).requires_grad_()
    log = None
    with contextlib.ExitStack() as stack:
        if case.account:
            from harness.accounting import CollectiveLog

            log = stack.enter_context(CollectiveLog())
        with log.phase("forward") if log is not None else contextlib.nullcontext():
            res = impl.obj.ring_attention(q, k, v, **kwargs)
        returned = len(res) if isinstance(res, tuple) else 1
        ml = res[-1] if isinstance(res, tuple) else None
        if case.backward and isinstance(res, tuple):
            # the output stays differentiable beside the max logit
            with log.phase("backward") if log is not None else contextlib.nullcontext():
                res[0].backward(shard(g.grad_out, case.layout, w, r, dim=2).to(ctx.device))
    ok = isinstance(ml, torch.Tensor)
    return {
        "returned": returned,
        "max_logit": ml.detach().cpu() if ok else None,
        "requires_grad": bool(ml.requires_grad) if ok else None,
        "dq": q.grad is not None if case.backward and ok else None,
        "collectives": log.summary() if log is not None else None,
    }


def _visible(case: MaxLogitCase) -> torch.Tensor | None:
    """(batch or 1, heads or 1, seq_q, seq_kv) bool of the case's mask or causality; None: all."""
    spec = case.inputs
    if case.mask is not None:
        return visibility(
            mask_spec(case.mask, spec.seq_q),
            spec.seq_q,
            spec.seq_kv,
            batch=spec.batch,
            heads=spec.heads,
        )
    if case.is_causal:
        return torch.ones(spec.seq_q, spec.seq_kv, dtype=torch.bool).tril()
    return None


def judge_max_logit(case: MaxLogitCase, results: list[dict[str, Any]]) -> list[Verdict]:
    """The contract (what is returned, its shape, dtype and gradient, equal on every rank; an
    AssertionError that says what is wrong) and the policy's verdict on the value."""
    __tracebackhide__ = True
    spec = case.inputs
    want = 3 if case.return_lse else 2
    acc = compute_dtype(spec.torch_dtype)
    for rank, res in enumerate(results):
        assert res["returned"] == want and res["max_logit"] is not None, (
            f"contract: with return_max_logit=True (return_lse={case.return_lse}) ring_attention "
            f"must return {want} tensors, the max logit last; rank {rank} returned "
            f"{res['returned']} [{case.label}]"
        )
        ml = res["max_logit"]
        assert tuple(ml.shape) == (spec.heads,), (
            f"contract: max_logit must have shape (heads,) = ({spec.heads},), rank {rank} returned "
            f"{tuple(ml.shape)} [{case.label}]"
        )
        assert ml.dtype == acc, (
            f"contract: max_logit must be {str(acc).removeprefix('torch.')} for {spec.dtype} "
            f"inputs, rank {rank} returned {str(ml.dtype).removeprefix('torch.')} [{case.label}]"
        )
        assert not res["requires_grad"], (
            f"contract: max_logit is a statistic, not differentiable (requires_grad False); "
            f"rank {rank} returned one that requires grad [{case.label}]"
        )
        assert res["dq"] is not False, (
            f"the output's backward gave no dq on rank {rank} beside return_max_logit=True "
            f"[{case.label}]"
        )
    first = results[0]["max_logit"]
    differ = [r for r, res in enumerate(results) if not _same(res["max_logit"], first)]
    assert not differ, (
        f"max_logit differs between ranks (rank 0 {first.tolist()}, "
        + ", ".join(f"rank {r} {results[r]['max_logit'].tolist()}" for r in differ)
        + "): every rank must return the group's maximum. "
        + f"{diagnose_unreduced(case, results)} [{case.label}]"
    )
    g = make_inputs(spec)
    vis = _visible(case)
    ref = oracle_max_logit(g.query, g.key, scale=spec.scale, visible=vis)
    base = oracle_max_logit(g.query, g.key, scale=spec.scale, visible=vis, dtype=acc)
    scales = max_logit_scale(g.query, g.key, scale=spec.scale, visible=vis)
    return [
        check(
            "max_logit",
            first,
            ref,
            base,
            dtype=spec.torch_dtype,
            result_dtype=acc,
            scales=scales,
            roundings=spec.head_dim + 1,
            context=f"[{case.label}]",
        )
    ]


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.shape == b.shape and bool(((a == b) | (torch.isnan(a) & torch.isnan(b))).all())


def _rank_max(case: MaxLogitCase, rank: int, kv_ranks: list[int]) -> torch.Tensor:
    """The float64 max logit over rank ``rank``'s query rows and the keys of ``kv_ranks``."""
    spec, w = case.inputs, case.world_size
    g = make_inputs(spec)
    vis = _visible(case)
    vis = torch.ones(spec.seq_q, spec.seq_kv, dtype=torch.bool) if vis is None else vis
    rows = positions(case.layout, w, rank, spec.seq_q)
    cols = torch.cat([positions(case.layout, w, r, spec.seq_kv) for r in kv_ranks])
    part = vis.expand(*vis.shape[:-2], spec.seq_q, spec.seq_kv)[..., rows, :][..., cols]
    return oracle_max_logit(g.query[:, :, rows], g.key[:, :, cols], scale=spec.scale, visible=part)


def _close(x: torch.Tensor, want: torch.Tensor) -> bool:
    x64 = x.to(torch.float64)
    both_inf = torch.isinf(x64) & (x64 == want)
    return bool((both_inf | ((x64 - want).abs() <= 1e-3 * (1 + want.abs()))).all())


def diagnose_unreduced(case: MaxLogitCase, results: list[dict[str, Any]]) -> str:
    """Whether each rank returned the maximum of its own query rows: not reduced over the group."""
    w = case.world_size
    own = [_rank_max(case, r, list(range(w))) for r in range(w)]
    if all(_close(res["max_logit"], own[r]) for r, res in enumerate(results)):
        return (
            "Each rank returned the maximum over its own query rows only: the per-rank maxima "
            "were not reduced over the group (one all-reduce MAX is missing)."
        )
    return ""


def diagnose_max_logit(case: MaxLogitCase, results: list[dict[str, Any]]) -> str:
    """A failed value pinned where it can be: the maximum of the last ring step's blocks only
    (at step s rank r holds the key/value shard of rank (r - s) mod W)."""
    w = case.world_size
    got = results[0]["max_logit"]
    if w > 1:
        last = torch.stack([_rank_max(case, r, [(r + 1) % w]) for r in range(w)]).amax(0)
        if _close(got, last):
            return (
                "the max logit equals the maximum over the last ring step's blocks only (rank "
                "r's queries and the keys of rank r + 1): the running maximum across ring steps "
                "was not kept"
            )
    spec = case.inputs
    g = make_inputs(spec)
    unmasked = oracle_max_logit(g.query, g.key, scale=spec.scale)
    if _visible(case) is not None and _close(got, unmasked):
        return (
            "the max logit equals the maximum over every key, masked or not: masked-out (or "
            "causally hidden) entries were not excluded"
        )
    return f"no known pattern (returned {[fmt_err(float(x)) for x in got]})"
