"""Rank-side case functions: what every rank of a pool runs for one conformance case.

A case of the ring runs on the pool's group, its inputs sharded by the oracle's layout
(:mod:`reference.layout`); a strategy case (``strategy`` "ulysses" / "hybrid" on a
``mesh_shape`` ``(U, R)``) on :func:`strategy_group`: the hybrid's group is the pool's 2-D mesh
``(R, U)`` with dims ``("ring", "ulysses")`` (created once per pool and shape,
:meth:`harness.RankContext.device_mesh`), so a Ulysses row is ``U`` consecutive ranks and a rank's
mesh rank (``r * U + u``) is its pool rank; Ulysses runs on the pool's group. Its inputs are
sharded by :mod:`reference.strategies`' layouts, never the implementation's.

Functions here are pickled by reference to the ranks, so they live in this plain module (cheap
to import on a rank) rather than in the test modules. Each takes the rank's
:class:`harness.RankContext` first and returns plain data (CPU tensors, dicts) to the pytest
process, which owns every verdict.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any

import torch

from conformance.implementation import load_implementation, load_op
from reference.strategies import shard as strategy_shard
from suites.inputs import Inputs, InputSpec, in_memory, local_inputs, make_inputs

__all__ = [
    "MESH_DIMS",
    "CountingOp",
    "RingCase",
    "backpropagate",
    "collective_phases",
    "local_results",
    "lse_shard",
    "resolve_case_op",
    "ring_case",
    "ring_case_twice",
    "strategy_group",
    "strategy_inputs",
]


@dataclass(frozen=True)
class RingCase:
    """One call of an implementation's ``ring_attention`` (and its backward) on every rank.

    ``strategy``: "ring" (the default: the sequence over ``world_size`` ranks in ``layout``), or
    "ulysses" / "hybrid" on a ``mesh_shape`` ``(U, R)`` (Ulysses degree x ring degree) of
    ``world_size = U * R`` ranks: the group is :func:`suites.cases_strategies.strategy_group`'s and
    the shards follow :mod:`reference.strategies`' layouts; ``rotate_method`` is then the hybrid's
    ring dimension's."""

    inputs: InputSpec
    world_size: int
    is_causal: bool = False
    layout: str = "contiguous"
    rotate_method: str = "allgather"
    op: str | None = (
        None  # a registered op name or "package.module:object"; None: the impl's choice
    )
    impl: str | None = None  # implementation spec; None: RING_IMPL or the default
    return_lse: bool = True
    backward: bool = True
    compile: str | None = None  # torch.compile backend, fullgraph=True
    account: bool = False  # record collectives per phase
    record: bool = False  # record per-step partials (diagnosis)
    count_work: bool = False  # count attention score entries per rank (load balance)
    extras: tuple[tuple[str, Any], ...] = field(
        default=()
    )  # extra keyword arguments for ring_attention
    strategy: str = "ring"
    mesh_shape: tuple[int, int] | None = None  # (U, R) for "ulysses" / "hybrid"

    def __post_init__(self) -> None:
        if self.mesh_shape is not None and self.mesh_shape[0] * self.mesh_shape[1] != (
            self.world_size
        ):
            raise ValueError(
                f"a {self.mesh} mesh has {self.mesh_shape[0] * self.mesh_shape[1]} ranks, not "
                f"world_size {self.world_size}"
            )

    def with_(self, **changes: Any) -> RingCase:
        return replace(self, **changes)

    def call_keywords(self, group: Any, **more: Any) -> dict[str, Any]:
        """The keywords of this case's ``ring_attention`` call on ``group`` (a process group, or a
        strategy's mesh): causality, scale, rotation, layout and ``return_lse`` as the case has
        them; ``more`` adds the call's other keywords or overrides these."""
        return {
            "group": group,
            "is_causal": self.is_causal,
            "scale": self.inputs.scale,
            "rotate_method": self.rotate_method,
            "layout": self.layout,
            "return_lse": self.return_lse,
            **more,
        }

    def declared_schedule(
        self, collective_schedule: Callable[..., Any], **keywords: Any
    ) -> dict[str, dict[str, dict[str, int]]]:
        """What ``collective_schedule`` (the implementation's, in the protocol's signature)
        declares for this case's call: ``{phase: {kind: {"calls", "bytes"}}}``, asked with the
        world size, the rotation and each rank's key/value block (``seq_kv`` local, the input
        dtype), uncompiled unless ``keywords`` say ``compiled=``; ``keywords`` add what the call
        adds (``head_dim_v=``, ``heads=``, ``return_max_logit=``, a strategy's ``mesh_shape=``)."""
        spec = self.inputs
        return collective_schedule(
            self.world_size,
            self.rotate_method,
            batch=spec.batch,
            heads_kv=spec.heads_kv,
            seq_kv=spec.seq_kv // self.world_size,
            head_dim=spec.head_dim,
            dtype=spec.torch_dtype,
            **{"compiled": False, **keywords},
        )

    @property
    def mesh(self) -> str:
        """``"UxR"`` of a strategy case ("" for the ring)."""
        return "" if self.mesh_shape is None else f"{self.mesh_shape[0]}x{self.mesh_shape[1]}"

    @property
    def rotates(self) -> bool:
        """Whether the case has a ring dimension, so that its rotation method matters."""
        return self.mesh_shape is None or (self.strategy == "hybrid" and self.mesh_shape[1] > 1)

    @property
    def label(self) -> str:
        s = self.inputs
        dims = "" if s.head_dim_v is None else f", head_dim={s.head_dim}, head_dim_v={s.head_dim_v}"
        where = (
            f"W={self.world_size}"
            if self.mesh_shape is None
            else f"strategy={self.strategy}, mesh {self.mesh} (ulysses x ring)"
        )
        heads = "" if s.heads == s.heads_kv else f", heads {s.heads}/{s.heads_kv}"
        rotate = f", rotate={self.rotate_method}" if self.rotates else ""
        compiled = f", compile={self.compile}" if self.compile else ""
        loss = ", loss with the LSE" if s.lse_grad else ""
        return (
            f"ring_attention({where}, {s.dtype}, causal={self.is_causal}{rotate}, "
            f"layout={self.layout}, op={self.op or 'default'}{dims}{heads}{compiled}{loss})"
        )


class CountingOp:
    """An attention op that counts the score entries it computes, then delegates.

    Work of one call, per (batch, head): ``seq_q * seq_k`` entries, ``seq_q * (seq_q + 1) / 2``
    for a causal block, or for a masked block (``attn_mask``, the (batch or 1, heads or 1,
    seq_q, seq_k) bool a masked kernel receives, True where a query sees a key) the entries some
    batch and head sees: what load balancing is about. Only forward calls count.

    Masked blocks reach an op only when it declares ``masks`` (the ring runs them with the math
    op otherwise, past this wrapper): count masked work with an op that declares it.
    """

    def __init__(self, inner):
        self.inner = inner
        self.name = f"counting[{getattr(inner, 'name', inner)}]"
        self.capabilities = inner.capabilities
        self.work = 0
        self.calls = 0

    @staticmethod
    def call_work(query, key, *, is_causal: bool, attn_mask=None) -> int:
        sq, sk = query.shape[2], key.shape[2]
        if attn_mask is not None:
            seen = (
                attn_mask if attn_mask.dtype == torch.bool else attn_mask > float("-inf")
            )  # additive: -inf hides
            seen = seen if seen.dim() == 2 else seen.reshape(-1, *seen.shape[-2:]).any(0)
            if is_causal:
                seen = seen & torch.ones(sq, sk, dtype=torch.bool, device=seen.device).tril()
            return int(seen.expand(sq, sk).sum())
        return sq * (sq + 1) // 2 if is_causal else sq * sk

    def forward(self, query, key, value, *, is_causal, scale, attn_mask=None):
        self.work += self.call_work(query, key, is_causal=is_causal, attn_mask=attn_mask)
        self.calls += 1
        extra = {} if attn_mask is None else {"attn_mask": attn_mask}
        return self.inner.forward(query, key, value, is_causal=is_causal, scale=scale, **extra)

    def backward(self, grad_out, query, key, value, out, lse, *, is_causal, scale, **kwargs):
        # kwargs: attn_mask for a masked block, grad_lse for ops that declare lse_grad
        return self.inner.backward(
            grad_out, query, key, value, out, lse, is_causal=is_causal, scale=scale, **kwargs
        )


#: The pool mesh's dim names, outer (ring) first: Ulysses rows are consecutive ranks.
MESH_DIMS = ("ring", "ulysses")


def strategy_group(ctx, strategy: str, mesh_shape: tuple[int, int]):
    """The ``group=`` of a strategy on this pool."""
    u, r = mesh_shape
    if u * r != ctx.world_size:
        raise ValueError(f"a {u}x{r} mesh needs {u * r} ranks but the pool has {ctx.world_size}")
    if strategy == "hybrid":
        return ctx.device_mesh((r, u), MESH_DIMS)
    return ctx.group


def strategy_inputs(case: RingCase, rank: int, device) -> Inputs:
    """This rank's shards of a strategy case's global inputs (reference.strategies' layouts, in
    the case's memory layout); query, key and value are leaves that require grad."""
    assert case.mesh_shape is not None, "a ring case has no strategy shards"
    spec, mesh = case.inputs, case.mesh_shape

    def local(t: torch.Tensor) -> torch.Tensor:
        part = strategy_shard(t, case.strategy, case.layout, mesh, rank).contiguous().to(device)
        return in_memory(part, spec) if part.dim() == 4 else part

    g = make_inputs(spec)
    q, k, v = (local(t).requires_grad_() for t in (g.query, g.key, g.value))
    grad_lse = None if g.grad_lse is None else local(g.grad_lse.unsqueeze(-1)).squeeze(-1)
    return Inputs(q, k, v, local(g.grad_out), grad_lse)


def resolve_case_op(case: RingCase, device: torch.device):
    """The op object a case runs with (the registered
    default for the device when ``op`` is None)."""
    from conformance.kernels import default_op

    if case.op is None:
        return default_op(
            device, case.inputs.torch_dtype, case.inputs.head_dim, case.inputs.value_head_dim
        )
    return load_op(case.op)


def local_results(out, lse, query, key, value, **more: Any) -> dict[str, Any]:
    """What a rank function hands back: ``out``, ``lse`` and the gradients ``dq``, ``dk``, ``dv``
    of query, key and value, detached on the CPU (None where there is none), then ``more``."""

    def cpu(t):
        return None if t is None else t.detach().cpu()

    return {
        "out": cpu(out),
        "lse": cpu(lse),
        "dq": cpu(query.grad),
        "dk": cpu(key.grad),
        "dv": cpu(value.grad),
        **more,
    }


def ring_case(ctx, case: RingCase) -> dict[str, Any]:
    """Run the case on this rank; return the local results as CPU tensors.

    Keys: ``out`` (b, h, sq_local, dv), ``lse`` (b, h, sq_local) or None, ``dq``/``dk``/``dv``
    (None without backward), ``collectives`` ({phase: {kind: {calls, bytes}}}) or None,
    ``records`` (per-step partials) or None, ``work`` (int) or None, ``input_strides``,
    ``lse_requires_grad`` (whether the returned LSE carries a gradient).
    """
    if case.world_size != ctx.world_size:
        raise ValueError(f"case is for {case.world_size} ranks but the pool has {ctx.world_size}")
    group = ctx.group
    if case.mesh_shape is None:
        inp = local_inputs(case.inputs, case.layout, ctx.world_size, ctx.rank, ctx.device)
    else:
        group = strategy_group(ctx, case.strategy, case.mesh_shape)  # first: a mesh is collective
        inp = strategy_inputs(case, ctx.rank, ctx.device)
    impl = load_implementation(case.impl)
    caps = impl.capabilities
    kwargs = case.call_keywords(group)
    if case.mesh_shape is not None:
        kwargs["strategy"] = case.strategy
    kwargs.update(case.extras)
    op = None
    if case.op is not None or case.count_work:
        op = resolve_case_op(case, ctx.device)
        if case.count_work:
            op = CountingOp(op)
    if op is not None:
        if not caps.claims("ops", "*"):
            raise ValueError(
                f"{impl.name} does not accept op objects (it {caps.lacking('ops', '*')})"
            )
        kwargs["op"] = op

    fn = impl.obj.ring_attention
    if case.compile:
        # Ranks live across cases: without a reset, every new configuration is a recompile of
        # the same code object, and dynamo gives up after its recompile limit (8).
        torch._dynamo.reset()
        fn = torch.compile(fn, backend=case.compile, fullgraph=True)

    with contextlib.ExitStack() as stack:
        log, phase = collective_phases(stack, case.account)
        recorder = stack.enter_context(impl.obj.record_steps()) if case.record else None
        with phase("forward"):
            res = fn(inp.query, inp.key, inp.value, **kwargs)
        out, lse = res if case.return_lse else (res, None)
        lse_requires_grad = lse is not None and lse.requires_grad
        if case.backward:
            with phase("backward"):
                backpropagate(out, lse, inp.grad_out, inp.grad_lse)

    return local_results(
        out,
        lse,
        inp.query,
        inp.key,
        inp.value,
        collectives=log.summary() if log is not None else None,
        records=list(recorder.records) if recorder is not None else None,
        work=op.work if isinstance(op, CountingOp) else None,
        input_strides=[tuple(t.stride()) for t in (inp.query, inp.key, inp.value)],
        lse_requires_grad=lse_requires_grad,
    )


def backpropagate(
    out: torch.Tensor,
    lse: torch.Tensor | None,
    grad_out: torch.Tensor,
    grad_lse: torch.Tensor | None,
) -> None:
    """The backward of a case's loss ``(out * grad_out).sum()``, plus ``(lse * grad_lse).sum()``
    when ``grad_lse`` is given (the loss uses the LSE too: ``InputSpec.lse_grad``). An LSE that
    does not require grad, or of another shape than ``grad_lse``, takes no gradient (autograd
    would raise on the ranks): the judge names it, from the returned tensor and its
    ``lse_requires_grad``."""
    if (
        grad_lse is not None
        and lse is not None
        and lse.requires_grad
        and lse.shape == grad_lse.shape
    ):
        torch.autograd.backward([out, lse], [grad_out, grad_lse])
    else:
        out.backward(grad_out)


def lse_shard(grad_lse: torch.Tensor | None, shard, device) -> torch.Tensor | None:
    """This rank's rows of the global LSE gradient (b, h, seq_q), or None: ``shard`` cuts a
    (b, h, seq, d) tensor's rows as the case cuts the query's."""
    if grad_lse is None:
        return None
    return shard(grad_lse.unsqueeze(-1)).squeeze(-1).to(device)


def collective_phases(stack: contextlib.ExitStack, account: bool):
    """``(log, phase)``: with ``account``, a :class:`harness.accounting.CollectiveLog` entered on
    ``stack`` and its ``phase(name)`` context manager, which books the collectives issued inside
    to that phase; without, None and a ``phase`` that books nothing."""
    if not account:
        return None, lambda name: contextlib.nullcontext()
    from harness.accounting import CollectiveLog

    log = stack.enter_context(CollectiveLog())
    return log, log.phase


def ring_case_twice(ctx, case: RingCase) -> list[dict[str, Any]]:
    """The same case twice in a row on the same ranks (determinism)."""
    return [ring_case(ctx, case), ring_case(ctx, case)]
