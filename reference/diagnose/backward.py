"""Diagnosis of wrong gradients: the backward replayed in float64 with its known bugs.

A forward that matches while the gradients do not is replayed against backward bugs (each step
using the rank's own key/value block; the ``dO . O`` row term taken from a step's own partial;
dK/dV left a hop short of their owner).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence

import torch
from torch import Tensor

from reference import layout as layouts
from reference.attention import attention_grads, expand_kv_heads
from reference.budget import abs_error
from reference.diagnose.findings import Finding, _atol
from reference.simulate import RingSimulation, StepRecord


def _block_grads(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    visible: Tensor,
    out: Tensor,
    lse: Tensor,
    dout: Tensor,
    scale: float,
    dlse: Tensor | None = None,
) -> tuple[Tensor, Tensor, Tensor]:
    """float64 (dq, dk, dv) contribution of one (query shard, key/value block) pair to the
    gradient of the whole attention, given the final out and lse of the query rows.

    q, out, dout (batch, heads, sq, d); k, v (batch, heads_kv, sk, d); lse and dlse (the loss's
    gradient in the LSE, or None) (batch, heads, sq); visible (sq, sk). dk, dv come back with
    heads_kv heads (query groups summed).
    """
    heads, heads_kv = q.shape[1], k.shape[1]
    ke, ve = expand_kv_heads(k, heads), expand_kv_heads(v, heads)
    scores = (q @ ke.transpose(-2, -1) * scale).masked_fill(~visible, -math.inf)
    seen = torch.isfinite(lse).unsqueeze(-1)
    p = torch.where(seen, torch.exp(scores - torch.where(seen, lse.unsqueeze(-1), 0.0)), 0.0)
    dp = dout @ ve.transpose(-2, -1)
    row = (dout * out).sum(-1, keepdim=True)  # D; an LSE gradient g adds P * g to dS: D - g
    ds = p * (dp - (row if dlse is None else row - dlse.unsqueeze(-1)))
    dq = ds @ ke * scale
    dk, dv = ds.transpose(-2, -1) @ q * scale, p.transpose(-2, -1) @ dout
    b, _, sk, _ = dk.shape

    def fold(t: Tensor) -> Tensor:
        return t.reshape(b, heads_kv, heads // heads_kv, sk, t.shape[-1]).sum(2)

    return dq, fold(dk), fold(dv)


def _replay_backward(
    sim: RingSimulation,
    grad_out: Tensor,
    kv_source: Callable[[StepRecord], int],
    *,
    step_output: bool = False,
    grad_lse: Tensor | None = None,
) -> dict[str, list[Tensor]]:
    """Per-rank dq, dk, dv of a ring whose backward computes step ``rec`` with the key/value block
    of rank ``kv_source(rec)`` (the contribution still goes to block ``rec.kv_rank``). With
    ``step_output`` its ``dO . O`` row term takes the step's own partial output instead of the
    merged one (the LSE stays the merged one). ``grad_lse`` (batch, heads, seq_q): the loss's
    gradient in the LSE, when the loss used it."""
    w = sim.world_size
    grads: dict[str, list[Tensor]] = {
        "dq": [torch.zeros_like(sim.query_shard(r)) for r in range(w)],
        "dk": [torch.zeros_like(sim.key_shard(r)) for r in range(w)],
        "dv": [torch.zeros_like(sim.value_shard(r)) for r in range(w)],
    }
    dout64 = grad_out.to(torch.float64).to(sim.query.device)
    for rank in range(w):
        out, lse = sim.local_merge(rank)
        dout = layouts.shard(dout64, sim.layout, w, rank)
        dlse = None
        if grad_lse is not None:
            lse64 = grad_lse.to(torch.float64).to(sim.query.device).unsqueeze(-1)
            dlse = layouts.shard(lse64, sim.layout, w, rank).squeeze(-1)
        q = sim.query_shard(rank)
        for rec in sim.rank_steps(rank):
            if rec.kind == "skip":
                continue
            src = kv_source(rec)
            row_out = rec.partial_out.to(q.device) if step_output else out
            dq, dk, dv = _block_grads(
                q,
                sim.key_shard(src),
                sim.value_shard(src),
                rec.visible.to(q.device),
                row_out,
                lse,
                dout,
                sim.scale,
                dlse,
            )
            grads["dq"][rank] += dq
            grads["dk"][rec.kv_rank] += dk
            grads["dv"][rec.kv_rank] += dv
    return grads


def _backward_findings(
    sim: RingSimulation,
    grads_by_rank: Mapping[str, Sequence[Tensor]],
    grad_out: Tensor,
    grad_errs: dict[str, dict[int, tuple[float, float]]],
    grad_bad: dict[str, tuple[int, ...]],
    forward_ok: bool,
    earlier: list[Finding],
    grad_lse: Tensor | None = None,
) -> list[Finding]:
    """Explain wrong gradients by a replayed backward bug; say the backward is at fault when the
    forward matched and nothing explains them. ``grad_lse``: the loss's gradient in the LSE,
    when the loss used it (every replay takes it)."""
    if any(
        "every value of the" in f.what and f.what.startswith(("dq", "dk", "dv")) for f in earlier
    ):
        return []  # already explained by the dtype the gradients went through
    w = sim.world_size

    def matches(observed: Mapping[str, Sequence[Tensor]], names: Sequence[str]) -> bool:
        for name in names:
            for r in range(w):
                tol = grad_errs[name][r][1]
                got = grads_by_rank[name][r]
                if (
                    float(abs_error(got.to(observed[name][r].device), observed[name][r]).max())
                    > tol
                ):
                    return False
        return True

    names = [n for n in ("dq", "dk", "dv") if n in grads_by_rank]
    if w > 1 and forward_ok:
        own = _replay_backward(sim, grad_out, lambda rec: rec.rank, grad_lse=grad_lse)
        if matches(own, names):
            return [
                Finding(
                    0,
                    None,
                    "the backward used each rank's own key/value block at every ring step "
                    "(the step-0 block reused): dq, dk and dv equal that replay",
                )
            ]
        if matches(
            _replay_backward(
                sim, grad_out, lambda rec: rec.kv_rank, step_output=True, grad_lse=grad_lse
            ),
            names,
        ):
            return [
                Finding(
                    0,
                    None,
                    "the backward took the dO.O row term from each ring step's own partial output "
                    "instead of the merged output of all steps: dq, dk and dv equal that replay",
                )
            ]
        if "dq" in grads_by_rank and not grad_bad.get("dq") and {"dk", "dv"} & set(grads_by_rank):
            truth = _replay_backward(sim, grad_out, lambda rec: rec.kv_rank, grad_lse=grad_lse)
            kv_names = [n for n in ("dk", "dv") if n in grads_by_rank]
            for t in range(1, w):
                shifted = {n: [truth[n][(r + t) % w] for r in range(w)] for n in kv_names}
                if matches(shifted, kv_names):
                    return [
                        Finding(
                            0,
                            None,
                            (
                                "dq matches on every rank, but rank r holds the dk/dv of rank "
                                f"r+{t}'s block: the dK/dV accumulators stopped {t} hop(s) short "
                                "of their owners (the return hop is missing)"
                            ),
                        )
                    ]
            return [
                Finding(
                    0,
                    None,
                    (
                        "dq matches on every rank, but dk/dv do not: the dK/dV accumulators did "
                        "not reach their owners complete (a missing, extra or misrouted hop of "
                        "the gradient ring)"
                    ),
                )
            ]
    if forward_ok:
        wrong = ", ".join(n for n in names if grad_bad.get(n))
        return [
            Finding(
                0,
                None,
                f"the forward matches the simulation on every rank but {wrong} do not: "
                "the backward is at fault (its blocks, masks or the routing of dK/dV)",
            )
        ]
    return []


def _grad_errors(
    sim: RingSimulation,
    grads_by_rank: Mapping[str, Sequence[Tensor]],
    grad_out: Tensor | None,
    step_rel: float,
    grad_lse: Tensor | None = None,
) -> dict[str, dict[int, tuple[float, float]]]:
    """name -> rank -> (max error of that rank's shard, tolerance), against float64 autograd of
    the loss (with the LSE's term when ``grad_lse`` is given)."""
    if grad_out is None:
        raise ValueError(
            "diagnose(grads_by_rank=...) needs grad_out, the global upstream gradient of the "
            "run, to compute the reference gradients"
        )
    ref = attention_grads(
        sim.query,
        sim.key,
        sim.value,
        grad_out,
        is_causal=sim.is_causal,
        scale=sim.scale,
        grad_lse=grad_lse,
    )._asdict()
    result: dict[str, dict[int, tuple[float, float]]] = {}
    for name, shards in grads_by_rank.items():
        if name not in ("dq", "dk", "dv"):
            raise ValueError(f"grads_by_rank keys must be dq, dk or dv; got {name!r}")
        tol = _atol(ref[name], step_rel)
        result[name] = {}
        for r in range(sim.world_size):
            want = layouts.shard(ref[name], sim.layout, sim.world_size, r)
            result[name][r] = (float(abs_error(shards[r].to(want.device), want).max()), tol)
    return result
