"""Rank-side cases of the strategy suite: Ulysses and the hybrid on a ``(ulysses, ring)`` mesh.

A case names its strategy and mesh shape ``(U, R)``; the pool has ``U * R`` ranks. The hybrid's
group is the pool's 2-D mesh ``(R, U)`` with dims ``("ring", "ulysses")`` (created once per pool
and shape, :meth:`harness.RankContext.device_mesh`), so a Ulysses row is ``U`` consecutive ranks
and a rank's mesh rank (``r * U + u``) is its pool rank. Ulysses runs on the pool's group. Inputs
are the global tensors of :mod:`suites.inputs`, sharded with the oracle's layout code
(:mod:`reference.strategies`), never the implementation's.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field, replace
from typing import Any

import torch

from conformance.implementation import load_implementation, load_op
from reference.strategies import shard
from suites.inputs import InputSpec, in_memory, make_inputs

__all__ = [
    "BAD_INPUTS",
    "MESH_DIMS",
    "StrategyCase",
    "strategy_bad_input_case",
    "strategy_case",
    "strategy_group",
]

#: The pool mesh's dim names, outer (ring) first: Ulysses rows are consecutive ranks.
MESH_DIMS = ("ring", "ulysses")


@dataclass(frozen=True)
class StrategyCase:
    """One call of ``ring_attention(..., strategy=...)`` (and its backward) on every rank."""

    inputs: InputSpec
    strategy: str
    mesh_shape: tuple[int, int]  # (ulysses degree U, ring degree R)
    is_causal: bool = False
    layout: str = "contiguous"
    rotate_method: str = "allgather"  # the hybrid's ring dimension
    op: str | None = None
    impl: str | None = None
    return_lse: bool = True
    backward: bool = True
    compile: str | None = None
    account: bool = False
    extras: tuple[tuple[str, Any], ...] = field(default=())

    @property
    def world_size(self) -> int:
        return self.mesh_shape[0] * self.mesh_shape[1]

    @property
    def mesh(self) -> str:
        return f"{self.mesh_shape[0]}x{self.mesh_shape[1]}"

    def with_(self, **changes: Any) -> StrategyCase:
        return replace(self, **changes)

    @property
    def label(self) -> str:
        ring = (
            f", rotate={self.rotate_method}"
            if self.strategy == "hybrid" and self.mesh_shape[1] > 1
            else ""
        )
        s = self.inputs
        return (
            f"ring_attention(strategy={self.strategy}, mesh {self.mesh} (ulysses x ring), "
            f"{s.dtype}, causal={self.is_causal}, layout={self.layout}{ring}, heads "
            f"{s.heads}/{s.heads_kv}, "
            f"op={self.op or 'default'}{', compile=' + self.compile if self.compile else ''})"
        )


def strategy_group(ctx, strategy: str, mesh_shape: tuple[int, int]):
    """The ``group=`` of a strategy on this pool."""
    u, r = mesh_shape
    if u * r != ctx.world_size:
        raise ValueError(f"a {u}x{r} mesh needs {u * r} ranks but the pool has {ctx.world_size}")
    if strategy == "hybrid":
        return ctx.device_mesh((r, u), MESH_DIMS)
    return ctx.group


def _local(t: torch.Tensor, case: StrategyCase, rank: int, device) -> torch.Tensor:
    local = shard(t, case.strategy, case.layout, case.mesh_shape, rank).contiguous().to(device)
    return in_memory(local, case.inputs) if local.dim() == 4 else local


def strategy_case(ctx, case: StrategyCase) -> dict[str, Any]:
    """Run the case on this rank; local results as CPU tensors (keys as
    ``suites.cases.ring_case``)."""
    group = strategy_group(
        ctx, case.strategy, case.mesh_shape
    )  # first: creating a mesh is a collective
    impl = load_implementation(case.impl)
    g = make_inputs(case.inputs)
    q, k, v = (
        _local(t, case, ctx.rank, ctx.device).requires_grad_() for t in (g.query, g.key, g.value)
    )
    grad_out = _local(g.grad_out, case, ctx.rank, ctx.device)
    grad_lse = (
        None
        if g.grad_lse is None
        else _local(g.grad_lse.unsqueeze(-1), case, ctx.rank, ctx.device).squeeze(-1)
    )
    kwargs: dict[str, Any] = dict(
        group=group,
        strategy=case.strategy,
        is_causal=case.is_causal,
        scale=case.inputs.scale,
        rotate_method=case.rotate_method,
        layout=case.layout,
        return_lse=case.return_lse,
    )
    if case.op is not None:
        kwargs["op"] = load_op(case.op)
    kwargs.update(case.extras)
    fn = impl.obj.ring_attention
    if case.compile:
        torch._dynamo.reset()  # ranks live across cases: see suites.cases.ring_case
        fn = torch.compile(fn, backend=case.compile, fullgraph=True)
    log = None
    with contextlib.ExitStack() as stack:
        phase = lambda name: contextlib.nullcontext()  # noqa: E731
        if case.account:
            from harness.accounting import CollectiveLog

            log = stack.enter_context(CollectiveLog())
            phase = log.phase
        with phase("forward"):
            res = fn(q, k, v, **kwargs)
        out, lse = res if case.return_lse else (res, None)
        if case.backward:
            with phase("backward"):
                # An LSE of the wrong shape takes no gradient (autograd would raise on the ranks):
                # the judge reports its layout from the returned tensor.
                if grad_lse is not None and lse is not None and lse.shape == grad_lse.shape:
                    torch.autograd.backward([out, lse], [grad_out, grad_lse])
                else:
                    out.backward(grad_out)

    def cpu(t):
        return None if t is None else t.detach().cpu()

    return {
        "out": cpu(out),
        "lse": cpu(lse),
        "dq": cpu(q.grad),
        "dk": cpu(k.grad),
        "dv": cpu(v.grad),
        "collectives": log.summary() if log is not None else None,
    }


# ---------------------------------------------------------------------- bad input

#: kind -> (what every rank's error must mention (regex, case-insensitive),
#: strategies it applies to)
BAD_INPUTS: dict[str, tuple[str, tuple[str, ...]]] = {
    "heads_not_divisible_by_degree": (
        r"not divisible by the Ulysses degree",
        ("ulysses", "hybrid"),
    ),
    "heads_differ_on_one_rank": (r"heads", ("ulysses", "hybrid")),
    "length_differs_on_one_rank": (r"seq_q|length", ("ulysses", "hybrid")),
    "causal_differs_on_one_rank": (r"is_causal", ("ulysses", "hybrid")),
    "return_lse_differs_on_one_rank": (r"return_lse", ("ulysses", "hybrid")),
    # the last rank calls the ring on the same flat group: both checks must exchange one table size
    "strategy_differs_on_one_rank": (r"strategy", ("ulysses",)),
    "head_tail_odd_rows": (r"head_tail", ("ulysses", "hybrid")),
    "head_chunks_for_ulysses": (r"head_chunks", ("ulysses",)),
    "hybrid_on_a_flat_group": (r"2-D DeviceMesh", ("hybrid",)),
    "unknown_strategy": (r"unknown strategy", ("ulysses", "hybrid")),
}


def strategy_bad_input_case(
    ctx, impl_spec: str | None, strategy: str, mesh_shape: tuple[int, int], kind: str
) -> str:
    """Call the implementation with the bad input ``kind``; "no error" if nothing raised."""
    group = strategy_group(ctx, strategy, mesh_shape)
    impl = load_implementation(impl_spec)
    u = mesh_shape[0]
    last = ctx.rank == ctx.world_size - 1
    heads, heads_kv, seq = 4 * u, 2, 4 * u
    kw: dict[str, Any] = dict(
        group=group,
        strategy=strategy,
        is_causal=False,
        layout="contiguous",
        rotate_method="alltoall",
    )
    if kind == "heads_not_divisible_by_degree":
        heads, heads_kv = 4 * u + 1, 1
    elif kind == "heads_differ_on_one_rank" and last:
        heads = 8 * u
    elif kind == "length_differs_on_one_rank" and last:
        seq += 2 * u
    elif kind == "causal_differs_on_one_rank":
        kw["is_causal"] = last
    elif kind == "return_lse_differs_on_one_rank":
        kw["return_lse"] = last
    elif kind == "strategy_differs_on_one_rank" and last:
        kw["strategy"] = "ring"
    elif kind == "head_tail_odd_rows":
        kw["layout"], kw["is_causal"] = "head_tail", True
        seq = 1 if strategy == "hybrid" and u % 2 else 2 * u + 1
    elif kind == "head_chunks_for_ulysses":
        kw["head_chunks"] = 2
    elif kind == "hybrid_on_a_flat_group":
        kw["group"] = ctx.group
    elif kind == "unknown_strategy":
        kw["strategy"] = "ulysess"
    q = torch.randn(2, heads, seq, 8, device=ctx.device)
    k = torch.randn(2, heads_kv, seq, 8, device=ctx.device)
    impl.obj.ring_attention(q, k, torch.randn_like(k), **kw)
    return "no error"
