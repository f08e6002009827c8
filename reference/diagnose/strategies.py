"""Diagnoses of Ulysses and the hybrid: the strategies' known bugs replayed in float64, and the
output's heads matched against the reference's.

:func:`diagnose_strategy` replays each bug with :func:`reference.strategies.replay_head_parallel`
(one parameter changed: key/value heads tiled, the all-to-all on the sequence dim, the positions
of another layout) or with every rank attending to its own shard only, and names the one that
reproduces a failed result. :func:`heads_permutation` names an output whose every head is right
but in another head's place.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from reference.attention import attention
from reference.budget import abs_error, fmt_err
from reference.diagnose.findings import EXPLAINS_BY
from reference.strategies import _check, positions, replay_head_parallel, shard, unshard

__all__ = ["diagnose_strategy", "heads_permutation"]


def _local_only(query, key, value, *, strategy, layout, mesh_shape, is_causal, scale) -> Tensor:
    """Every rank attending to its own shard only (the kernel's top-left causal mask on it);
    arguments as :func:`reference.strategies.replay_head_parallel`."""
    n = mesh_shape[0] * mesh_shape[1]
    outs = [
        attention(
            *(
                shard(t.detach().to(torch.float64), strategy, layout, mesh_shape, m)
                for t in (query, key, value)
            ),
            is_causal=is_causal,
            scale=scale,
        ).out
        for m in range(n)
    ]
    return unshard(outs, strategy, layout, mesh_shape)


def _hypotheses(
    query, key, value, *, strategy, layout, mesh_shape, is_causal, scale
) -> list[tuple[str, Tensor]]:
    u_size, r_size = mesh_shape
    heads, heads_kv = query.shape[1], key.shape[1]
    common = dict(
        strategy=strategy, layout=layout, mesh_shape=mesh_shape, is_causal=is_causal, scale=scale
    )
    found: list[tuple[str, Tensor]] = [
        (
            "every rank attended only to its own sequence shard: local attention, context "
            "parallelism silently off",
            _local_only(query, key, value, **common),
        )
    ]
    e = u_size // math.gcd(heads_kv, u_size) if strategy != "ring" else 1
    if e > 1:
        g = heads // heads_kv
        g_rep = heads // (heads_kv * e)
        found.append(
            (
                f"key/value heads replicated in the wrong order for the Ulysses degree {u_size}: "
                f"each head copied {e} times as a block (repeat), so query head h read key/value "
                f"head (h // {g_rep}) % {heads_kv}, not h // {g} (repeat_interleave)",
                replay_head_parallel(query, key, value, kv_order="tile", **common),
            )
        )
    if strategy != "ring" and u_size > 1 and (query.shape[2] // (u_size * r_size)) % u_size == 0:
        found.append(
            (
                "the sequence-to-heads all-to-all split the sequence dim where it must split "
                "heads (heads and sequence swapped in the all-to-all)",
                replay_head_parallel(query, key, value, split="sequence", **common),
            )
        )
    if (
        is_causal
        and layout == "head_tail"
        and ((strategy == "hybrid" and r_size > 1) or (strategy == "ulysses" and u_size > 1))
    ):
        where = (
            "the hybrid's ring dimension ran the contiguous causal plan"
            if strategy == "hybrid"
            else "Ulysses attended the gathered chunks in rank order"
        )
        found.append(
            (
                f"{where} on head_tail shards: the head_tail reorder is missing",
                replay_head_parallel(query, key, value, assumed_layout="contiguous", **common),
            )
        )
    return found


def diagnose_strategy(
    query: Tensor,
    key: Tensor,
    value: Tensor,
    observed_out: Tensor,
    *,
    strategy: str,
    layout: str,
    mesh_shape: tuple[int, int],
    is_causal: bool,
    scale: float | None = None,
    tolerance: float | None = None,
) -> str:
    """A paragraph on a failed result of ``strategy``: where it is wrong (rows, head slices,
    mesh ranks) and the replayed bug that reproduces it, if one does.

    observed_out: the global output (unsharded with this layout); tolerance: the error above
    which an element counts as wrong (default: 1e-3 of the output's magnitude)."""
    u_size, r_size = _check(strategy, mesh_shape)
    ref = attention(
        query.detach().to(torch.float64),
        key.detach().to(torch.float64),
        value.detach().to(torch.float64),
        is_causal=is_causal,
        scale=scale,
    ).out
    err = abs_error(observed_out, ref)
    actual = float(err.max())
    tol = tolerance if tolerance is not None else 1e-3 * max(1.0, float(ref.abs().max()))
    seq = ref.shape[2]
    heads = ref.shape[1]
    wrong = []
    for m in range(u_size * r_size):
        pos = positions(strategy, layout, mesh_shape, m, seq)
        rank_err = err.index_select(2, pos).amax(dim=(0, 2, 3))  # per head
        slices = sorted({h * u_size // heads for h in (rank_err > tol).nonzero()[:, 0].tolist()})
        if slices:
            wrong.append((m, slices))
    if not wrong:
        where = f"no element is off by more than {fmt_err(tol)}"
    else:
        parts = [
            f"mesh rank {m} (ulysses {m % u_size}, ring {m // u_size}) on head slices {s}"
            for m, s in wrong[:6]
        ]
        where = (
            f"wrong (> {fmt_err(tol)}) at "
            + "; ".join(parts)
            + (f"; and {len(wrong) - 6} more ranks" if len(wrong) > 6 else "")
        )
    scored = []
    for what, predicted in _hypotheses(
        query,
        key,
        value,
        strategy=strategy,
        layout=layout,
        mesh_shape=mesh_shape,
        is_causal=is_causal,
        scale=scale,
    ):
        if float((predicted - ref).abs().max()) <= tol:
            continue  # this bug would not change the result here: it cannot explain a failure
        scored.append((float(abs_error(observed_out, predicted).max()), what))
    text = (
        f"{strategy} on a {u_size}x{r_size} (ulysses x ring) mesh: output max err "
        f"{fmt_err(actual)}, {where}"
    )
    if scored:
        residual, what = min(scored)
        if residual * EXPLAINS_BY <= actual:
            return f"{text}; explained (residual {fmt_err(residual)}) by: {what}"
    return (
        f"{text}; no replayed strategy bug (local attention only, key/value head order, "
        "all-to-all dim, head_tail reorder) explains it"
    )


def heads_permutation(observed: torch.Tensor, ref: torch.Tensor, tolerance: float) -> str | None:
    """In words, when every head of the global output ``observed`` (batch, heads, seq, d) equals
    (within ``tolerance``) the reference's attention of one other head, each head used once: the
    head slices went back in the wrong order (a head offset or reshape wrong after the output
    all-to-all); None when the heads are in place or no such permutation explains the output."""
    heads = ref.shape[1]
    x, r = observed.detach().double(), ref.detach().double()
    holds = []
    for i in range(heads):
        err = torch.stack(
            [(x[:, i] - r[:, j]).abs().nan_to_num(float("inf")).amax() for j in range(heads)]
        )
        j = int(err.argmin())
        if float(err[j]) > tolerance:
            return None
        holds.append(j)
    if sorted(holds) != list(range(heads)) or holds == list(range(heads)):
        return None
    moved = [f"{i} <- {j}" for i, j in enumerate(holds) if i != j]
    shown = ", ".join(moved[:8]) + (f" and {len(moved) - 8} more" if len(moved) > 8 else "")
    return (
        f"the output's heads are permuted: head i holds head j's attention (i <- j: {shown}); "
        "every head's result is right but in the wrong place: the head slices went back in the "
        "wrong order (or at the wrong head offset) after the output all-to-all"
    )
