"""``ring_attention`` and the process-wide default rotation method."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from typing import Any, NamedTuple, Protocol, TypedDict, cast

import torch

from .call import Call, exchange_of, kv_shards, replicated_problem
from .checks.inputs import (
    InputError,
    LocalCall,
    agree_across_ranks,
    local_problem,
    needs_backward,
    routed_error,
)
from .checks.remembered import CHECKED, Checked, for_this_call
from .exchanges.halo import HaloPath, halo_blocks, halo_reach, halo_refusal, halo_rows
from .exchanges.heads import plan_chunks
from .exchanges.kv_gather import gather_path, gather_refusal
from .exchanges.ring import Path, PathFunction, RingAttention, RingConfig, RingPath
from .group import RingGroup, resolve_group
from .layout import layout_divisor, layout_runs
from .masks import (
    AtQueryPositions,
    IdsCheck,
    Mask,
    StaleIds,
    fold_causal,
    mask_code,
    masking_problem,
    snapshot,
)
from .numerics.max_logit import max_logit_problem
from .ops import AttentionOp
from .planning.packed import (
    keep_documents,
    kept_documents,
    packed_documents,
    packed_problem,
    packed_result,
    packed_views,
    sequence_place,
)
from .planning.plan import plan_ahead
from .planning.uneven import (
    lengths_problem,
    uneven_call,
    uneven_problem,
    uneven_result,
    uneven_views,
)
from .score_mods import as_score_mod, score_mod_problem
from .sinks import with_sinks
from .transports import check_rotate_method

__all__ = ["Bound", "attend", "bind", "get_rotate_method", "ring_attention", "set_rotate_method"]

_DEFAULT_ROTATE = ["allgather"]


def set_rotate_method(rotate_method: str) -> None:
    """Set the default KV rotation: ``"allgather"`` (the default), ``"alltoall"`` or ``"p2p"``."""
    check_rotate_method(rotate_method)
    _DEFAULT_ROTATE[0] = rotate_method


def get_rotate_method() -> str:
    return _DEFAULT_ROTATE[0]


#: Why a call with return_max_logit=True leaves the compiled graph.
MAX_LOGIT_RUNS_EAGERLY = (
    "ring_attention(return_max_logit=True) runs eagerly inside torch.compile (a graph break): its "
    "max logit is a third output of the ring's forward and an all-reduce the compiled ring does "
    "not carry. Compile without fullgraph=True, or ask for the max logit outside the compiled "
    "region"
)

#: Why a call with a score_mod leaves the compiled graph.
SCORE_MODS_RUN_EAGERLY = (
    "ring_attention(score_mod=...) runs eagerly inside torch.compile (a graph break): its "
    "blocks run on the math op with the score_mod bound to each block's global positions, "
    "which the compiled ring does not carry. Compile without fullgraph=True, or call it outside "
    "the compiled region"
)

#: Why a masked call leaves the compiled graph (dynamo's message names it under fullgraph=True).
MASKS_RUN_EAGERLY = (
    "ring_attention(mask=...) runs eagerly inside torch.compile (a graph break) for a MaskMod "
    "whose bit table on the global grid would exceed "
    "ring_impl.planning.mask_table.MAX_TABLE_BITS, that "
    "does not return bool or whose function asserts or raises (in the graph its failure would "
    "raise on its own rank only), a Mask subclass (Python the compiled graph cannot carry), or "
    "mask values that are not plain ints/bools/tensors: its plan is data (the mask on global "
    "positions) that a graph could only bake in and serve stale. Built-in masks and MaskMods (as "
    "a table of bits), with any op, run in the graph, every strategy "
    "(ring_impl.compiled.masked_call). "
    "Compile without fullgraph=True, or call such masked attention outside the compiled region"
)


class Bound(NamedTuple):
    """What ``bind`` binds: a RingAttention variant, its head-parallel algorithms (None: the
    defaults) and the name compiled calls find both by (ring_impl.compiled.masked_call)."""

    impl: RingAttention
    algorithms: Mapping[str, Any] | None
    name: str


class RingAttentionFunction(Protocol):
    """What :func:`bind` returns: a ``ring_attention`` (its docstring gives the options and what
    it returns), with the :class:`Bound` it runs and the name compiled calls find it by."""

    bound: Bound
    impl_name: str

    def __call__(
        self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, **options: Any
    ) -> Any: ...


class _HaloWhere(TypedDict):
    """The call's sizes :func:`ring_impl.exchanges.halo.halo_reach` and ``halo_refusal`` take."""

    layout: str
    world_size: int
    seq_q: int
    seq_kv: int


def attend(bound: Bound, call: Call, query, key, value, ids: IdsCheck | None = None):
    """Run ``call`` on query, key and value: ``ring_attention``'s body (which inlines it), for the
    torch API routes that build their own Call (``problem``, ``routed_from``). ``ids``: the
    caller's unread compare of data its mask was made from (ring_impl.masks.IdsCheck); StaleIds
    reaches the caller, to make the mask again."""
    if torch.compiler.is_compiling():
        return _traced(bound, call, query, key, value)
    return _eager(bound, call, query, key, value, ids)


def _eager(bound: Bound, call: Call, query, key, value, given: IdsCheck | None = None):
    # Document ids on a device serve their last snapshot with the compare read later, together
    # with a read the call makes anyway (IdsCheck); ids found changed run the call again,
    # compared on the host (a compare the caller gave: the caller runs it again).
    ids = given if given is not None else IdsCheck() if call.mask is not None else None
    while True:
        try:
            path = call_path(bound.impl, bound.algorithms, call, query, key, value, ids)
            out, lse, *max_logit = PathFunction.apply(query, key, value, path, call.lse_needed)
            if ids is not None:
                ids.settle()
            break
        except StaleIds:
            if ids is None or given is not None:
                raise
            ids = None
    if call.sinks is not None:
        out, lse = with_sinks(out, lse, call.sinks)
    if call.return_lse or max_logit:  # (out, lse), (out, max_logit) or (out, lse, max_logit)
        return (out, *((lse,) if call.return_lse else ()), *max_logit)
    return out


def _traced(bound: Bound, call: Call, query, key, value):
    """A call inside torch.compile. Masked: custom ops in the graph (ring_impl.compiled.masked_call:
    the plan is made when the op runs, so a new mask is never served an old plan) or, for what those
    cannot carry, eagerly (MASKS_RUN_EAGERLY). Unmasked: traced, behind the cross-rank check as
    an op the graph keeps (ring_impl.compiled.checks). With a score_mod: eagerly
    (SCORE_MODS_RUN_EAGERLY)."""
    from .compiled.checks import checked_call
    from .compiled.masked_call import masked_ring_call

    if call.score_mod is not None:
        return _scored_eagerly(bound, call, query, key, value)
    if call.return_max_logit is not False:
        return _max_logit_eagerly(bound, call, query, key, value)

    # The custom ops' inputs carry no requires_grad: the ranks compare what the trace saw.
    call = call.with_(backward=needs_backward(query, key, value, call.sinks))
    if call.mask is not None:
        result = masked_ring_call(bound.name, query, key, value, call)
        return _masked_eagerly(bound, call, query, key, value) if result is None else result
    result = checked_call(_eager, call_path, bound, query, key, value, call)
    return _eager(bound, call, query, key, value) if result is None else result


def _packed(bound: Bound, call: Call, query, key, value, cu_seqlens, shard_lengths=None):
    """A packed (THD) call as the 4-D call with its documents as the mask
    (ring_impl.planning.packed); a problem with the packed arguments is raised on every rank by the
    call's checks. With ``shard_lengths`` the global packed sequence is their sum
    (ring_impl.planning.uneven). ``cu_seqlens`` on a device are read on the host once, and a
    repeat with lengths of the same kind serves the documents they made without a read, their
    compare left unread (ring_impl.planning.packed.kept_documents)."""
    place = sequence_place(call.strategy, call.group)
    world = None if place is None else place[0]
    problem = call.problem
    if problem is None and world is not None and shard_lengths is None:
        tokens, causal = query.shape[0] * world, bool(call.is_causal)
        ids = IdsCheck()
        documents = kept_documents(cu_seqlens, tokens, causal, ids)
        if (
            documents is not None
            and packed_problem(query, key, value, cu_seqlens, world, values=False) is None
        ):
            try:
                mask = documents if call.mask is None else documents & call.mask
                result = attend(
                    bound,
                    call.with_(mask=mask, is_causal=False),
                    *packed_views(query, key, value),
                    ids=ids,
                )
                return packed_result(result, call.return_lse, call.return_max_logit is True)
            except StaleIds:
                pass  # other lengths: read below
    if problem is None and world is not None and shard_lengths is not None:
        problem = lengths_problem(shard_lengths, world)
    total = None
    read = cu_seqlens  # (lengths on a device copied to the host once, for the checks and the plan)
    if isinstance(cu_seqlens, torch.Tensor) and not torch.compiler.is_compiling():
        try:
            read = cu_seqlens.cpu()
        except RuntimeError:  # (a tensor without data, meta: the checks refuse it, on every rank)
            pass
    if problem is None and world is not None:
        total = sum(shard_lengths) if shard_lengths is not None else None
        problem = packed_problem(query, key, value, read, world, total)
    if problem is not None or world is None:  # the checks refuse it (or the group) on every rank
        return attend(bound, call.with_(problem=problem), query, key, value)
    tokens = query.shape[0] * world if total is None else total
    documents = packed_documents(read, tokens, bool(call.is_causal))
    if shard_lengths is None:
        keep_documents(cu_seqlens, tokens, bool(call.is_causal), documents)
    mask = documents if call.mask is None else documents & call.mask
    call = call.with_(mask=mask, is_causal=False)
    q, k, v = packed_views(query, key, value)
    if shard_lengths is None:
        result = attend(bound, call, q, k, v)
    else:
        result = _uneven(bound, call, q, k, v, shard_lengths)
    return packed_result(result, call.return_lse, call.return_max_logit is True)


def _uneven(bound: Bound, call: Call, query, key, value, shard_lengths):
    """A call on shards of unequal lengths as the even call on shards padded to the longest, the
    padding hidden by the mask (ring_impl.planning.uneven); a problem with the lengths is raised on
    every rank by the call's checks."""
    place = sequence_place(call.strategy, call.group)
    if place is None or call.problem is not None:  # the checks refuse the group or the call
        return attend(bound, call, query, key, value)
    world, rank = place
    problem = lengths_problem(shard_lengths, world)
    lengths: tuple[int, ...] = ()
    if problem is None:
        raw = shard_lengths.tolist() if isinstance(shard_lengths, torch.Tensor) else shard_lengths
        lengths = tuple(int(n) for n in raw)
        problem = uneven_problem(
            query,
            key,
            value,
            lengths,
            rank,
            layout=call.layout,
            exchange=call.exchange,
            mask=call.mask,
            score_mod=call.score_mod,
        )
    if problem is not None:
        return attend(bound, call.with_(problem=problem), query, key, value)
    if len(set(lengths)) == 1 and sum(lengths) % layout_divisor(call.layout, world) == 0:
        return attend(bound, call, query, key, value)  # the layout's own even split: no padding
    q, k, v = uneven_views(query, key, value, max(lengths))
    result = attend(bound, uneven_call(call, lengths), q, k, v)
    return uneven_result(result, lengths[rank], call.return_lse, call.return_max_logit is True)


def call_path(
    impl: RingAttention, algorithms, call: Call, query, key, value, ids: IdsCheck | None = None
) -> Path:
    """The :class:`ring_impl.exchanges.ring.Path` serving ``call`` on these tensors (``ring_path``
    for the ring's exchanges, ``ring_impl.exchanges.head_parallel.strategy_path`` for Ulysses and
    the hybrid), checked on this rank and across the group (InputError on every rank for bad input).
    Its LSE is computed when ``return_lse`` or ``sinks`` (the sink term needs it).

    A ``mask`` holding tensors (``Documents``) is copied first (ring_impl.masks.snapshot): the
    path plans with that copy, so what the caller writes into its ids later cannot reach a plan
    or the plan cache's key. With ``ids``, ids on a device may serve their last snapshot
    unverified (ring_impl.masks.IdsCheck): the ring reads the compare with the cross-rank check
    or a one-rank forward's read, the other strategies here. A routed call's refusals name the
    function the user called (``call.routed_from``), compiled calls' too (it is part of the
    call's description)."""
    if call.mask is not None and not torch.compiler.is_compiling():
        call = call.with_(mask=snapshot(call.mask, ids))
    if call.replicated_kv is not False and call.problem is None:
        call = call.with_(problem=replicated_problem(call))
    try:
        if call.strategy == "ring":
            return ring_path(impl, call, query, key, value, ids)
        if ids is not None:
            ids.settle()  # (a local read, before any collective: a rank may run again alone)
        from .exchanges.head_parallel import strategy_path

        return strategy_path(impl, algorithms, call, query, key, value)
    except InputError as exc:  # (on every rank alike)
        if call.routed_from is None:
            raise
        raise routed_error(exc, call.routed_from) from None


def ring_path(
    impl: RingAttention,
    call: Call,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    ids: IdsCheck | None = None,
) -> Path:
    """The :class:`ring_impl.exchanges.ring.Path` (the ring, the halo exchange or the sparse gather)
    that serves ``call`` (an exchange of the ring's: "auto", "ring", "halo", "gather"), after
    checking it on this rank and across the group (InputError on every rank for bad input).
    ``ids``: the unread compare of the call's document ids, read with the cross-rank check's
    all-reduce (more ranks) or the forward's read (one rank)."""
    mask, sinks, layout, head_chunks = call.mask, call.sinks, call.layout, call.head_chunks
    try:
        pg = resolve_group(call.group)
    except (TypeError, ValueError):
        if call.problem is None:
            raise
        # The options' own problem (an unknown exchange beside a hybrid's 2-D mesh) is the cause:
        # every rank given the same options raises it here.
        raise InputError(f"ring_attention: {call.problem}") from None
    remembered = CHECKED.key(impl, call, pg, query, key, value)
    if remembered is not None and (hit := CHECKED.get(remembered)) is not None:
        return _checked_again(impl, hit, pg, query, key, value, ids)
    score_mod = as_score_mod(call.score_mod)
    local = LocalCall.of(call, query, key, value, score_mod=score_mod)
    effective_scale, op_obj = local.effective_scale, local.op
    # call.problem: the options' own (an unknown exchange) or a route's (the SDPA route's
    # attn_mask), raised through the same cross-rank agreement so every rank raises together.
    world = torch.distributed.get_world_size(pg)
    problem = (
        call.problem
        or local_problem(local, world_size=world)
        or masking_problem(
            query,
            key,
            mask,
            sinks,
            world_size=world,
            kv_world_size=kv_shards(call, world),
        )
        or score_mod_problem(
            score_mod,
            query,
            world_size=world,
            layout=layout,
            key=key,
            op=op_obj,
            exchange=call.exchange,
        )
        or max_logit_problem(call.return_max_logit, exchange=call.exchange)
    )
    max_logit = call.return_max_logit is True
    replicated = call.replicated_kv is True  # (a ring of one: ring_impl.call.replicated_problem)
    folded = fold_causal(mask, call.is_causal)
    if replicated and folded is not None and problem is None:
        # a ring of one plans rows 0..n-1: the mask reads them at their global positions
        folded = AtQueryPositions(folded, _query_positions(layout, query.shape[2], world, pg))
    reach = None
    gather = False  # the sparse gather (ring_impl.exchanges.kv_gather) serves the call
    if problem is None and not replicated:
        if call.exchange == "gather":
            problem = gather_refusal(
                mask, world_size=world, head_chunks=head_chunks, strategy="ring"
            )
            gather = problem is None and world > 1
        elif (
            call.exchange != "ring" and world > 1 and score_mod is None and not max_logit
        ):  # (the ring's only)
            where: _HaloWhere = {
                "layout": layout,
                "world_size": world,
                "seq_q": query.shape[2],
                "seq_kv": key.shape[2],
            }
            reach = halo_reach(folded, **where)
            if reach is None and call.exchange == "halo":
                problem = (
                    "exchange='halo' but the halo exchange cannot serve this call: "
                    f"{halo_refusal(folded, **where)}; pass exchange='auto' to fall back to the "
                    "ring"
                )
    cfg = ahead = None
    if problem is None:
        # local_problem passed: query 4-D, scale a number or None, op resolved (no op_error)
        assert effective_scale is not None and op_obj is not None
        cfg = RingConfig(
            group=(RingGroup.alone if replicated else RingGroup.of)(pg, query.device),
            is_causal=bool(call.is_causal),
            scale=effective_scale,
            layout="contiguous" if replicated else layout,  # (alone, positions are not read)
            rotate_method=call.rotate_method,
            op=op_obj,
            head_chunks=head_chunks,
            mask=folded,
            mask_dims=(query.shape[0], query.shape[1]),
            plan_memo={},
            verdicts={},
            score_mod=score_mod,
            max_logit=max_logit,
        )

        def make_ahead() -> None:
            nonlocal ahead
            ahead = _path(impl, cfg, query, key, gather, reach, plan=True)

        # A mask known only by evaluating it: the path is made and planned now, so a mask_mod
        # that fails on this rank's positions is a problem every rank raises (plan_ahead).
        problem = plan_ahead(make_ahead, folded)
    code = 0  # what the cross-rank check compares of the mask, sinks and score_mod
    if world > 1 and not torch.compiler.is_compiling():
        if problem is None:
            code = mask_code(
                mask,
                sinks,
                (
                    query.shape[0],
                    query.shape[1],
                    query.shape[2] * world,
                    key.shape[2] * kv_shards(call, world),
                ),
                query.device,
                score_mod=score_mod,
            )
        # Every rank's query, key and value finite, reported in the check's own all-reduce (no
        # read of its own), lets every path skip the NaN propagation of the inputs.
        group_finite = agree_across_ranks(
            problem,
            local,
            return_max_logit=max_logit if problem is None else False,
            group=pg,
            device=query.device if isinstance(query, torch.Tensor) else torch.device("cpu"),
            mask_code=code,
            exchange=_exchange_taken(gather, reach, replicated),
            finite=(query, key, value) if problem is None else (),
            ids=ids,
        )
        if cfg is not None:
            _keep_finite(cfg, group_finite)
    elif problem is not None:
        raise InputError(f"ring_attention: {problem}")
    assert cfg is not None
    if ids is not None and cfg.verdicts is not None:
        cfg.verdicts["ids"] = ids  # (taken by then with more ranks)
    if remembered is not None:
        held = (impl, pg, call.op)
        template = dataclasses.replace(cfg, plan_memo=None, verdicts=None)
        unbound = dataclasses.replace(local, query=None, key=None, value=None)
        CHECKED.keep(remembered, Checked(unbound, template, gather, reach, code, world, held))
    return ahead if ahead is not None else _path(impl, cfg, query, key, gather, reach, plan=False)


def _checked_again(
    impl: RingAttention, hit: Checked, pg, query, key, value, ids: IdsCheck | None
) -> Path:
    """The path of a call whose key was checked before (ring_impl.checks.remembered): that call's
    configuration with this call's own ``plan_memo`` and ``verdicts``, after the cross-rank check
    where there are other ranks (they may have changed what they pass; this rank's inputs may
    hold non-finite numbers now)."""
    cfg = for_this_call(hit.cfg)
    if hit.world > 1:
        local = dataclasses.replace(hit.local, query=query, key=key, value=value)
        group_finite = agree_across_ranks(
            None,
            local,
            return_max_logit=cfg.max_logit,
            group=pg,
            device=query.device,
            mask_code=hit.mask_code,
            exchange=_exchange_taken(hit.gather, hit.reach, hit.local.replicated_kv is True),
            finite=(query, key, value),
            ids=ids,
        )
        _keep_finite(cfg, group_finite)
    if ids is not None:
        cfg.verdicts["ids"] = ids
    return _path(impl, cfg, query, key, hit.gather, hit.reach, plan=False)


def _path(
    impl: RingAttention, cfg: RingConfig, query, key, gather: bool, reach, *, plan: bool
) -> Path:
    """The path serving a ring call: the sparse gather (planned when made), the halo exchange or
    the ring; ``plan``: make the halo's or the ring's plan now too (kept in cfg.plan_memo)."""
    if gather:
        return gather_path(query, key, cfg, impl)
    if reach is not None:
        if plan:
            g = cfg.group
            halo_blocks(cfg, query.shape[2], halo_rows(g.rank, g.world_size, *reach), query.device)
        return HaloPath(cfg, impl, reach)
    if plan:
        plan_chunks(impl, cfg, query.shape[1], key.shape[1], query.shape[2], key.shape[2])
    return RingPath(cfg, impl)


_masked_eagerly = torch._dynamo.disable(_eager, reason=MASKS_RUN_EAGERLY)
_scored_eagerly = torch._dynamo.disable(_eager, reason=SCORE_MODS_RUN_EAGERLY)
_max_logit_eagerly = torch._dynamo.disable(_eager, reason=MAX_LOGIT_RUNS_EAGERLY)


def _query_positions(layout: str, rows: int, world: int, pg) -> torch.Tensor:
    """(rows,) int64: the global position of each of this rank's query rows under ``layout``."""
    runs = layout_runs(layout, rows * world, world, torch.distributed.get_rank(pg))
    return torch.cat([torch.arange(a, b, dtype=torch.int64) for a, b in runs])


def _exchange_taken(gather: bool, reach, replicated: bool) -> str:
    """The exchange a ring call takes, as the cross-rank check compares it: ranks that would take
    different ones (one passed exchange="ring", another "gather"; one replicated_kv=True, another
    not) raise together, naming them."""
    if replicated:
        return "replicated_kv"
    return "gather" if gather else "halo" if reach is not None else "ring"


def _keep_finite(cfg: RingConfig, group_finite: bool | None) -> None:
    """Keep the cross-rank check's verdict that every rank's query, key and value are finite
    where the path reads it: a ring of more ranks per call, a ring of one (replicated key/value)
    in place of its forward's own read."""
    if group_finite is None or cfg.verdicts is None:
        return
    if cfg.group.world_size > 1:
        cfg.verdicts["group_finite"] = group_finite
    elif group_finite:
        cfg.verdicts["inputs_finite"] = True


def bind(impl: RingAttention, *, strategies=None) -> RingAttentionFunction:
    """A ``ring_attention`` with the same signature that runs ``impl`` (a RingAttention variant),
    and ``strategies`` ({"ulysses": ..., "hybrid": ...}: variants of ``ring_impl.exchanges``'
    algorithms) for the head-parallel strategies."""

    from .compiled.masked_call import register_impl

    bound = Bound(impl, strategies, register_impl(impl, strategies, call_path))

    def ring_attention(
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        *,
        group=None,
        is_causal: bool = False,
        scale: float | None = None,
        rotate_method: str | None = None,
        op: str | AttentionOp | None = None,
        layout: str = "contiguous",
        return_lse: bool = False,
        return_max_logit: bool = False,
        head_chunks: int = 1,
        mask: Mask | None = None,
        sinks: torch.Tensor | None = None,
        score_mod=None,
        exchange: str = "auto",
        cu_seqlens: torch.Tensor | Sequence[int] | None = None,
        shard_lengths: Sequence[int] | None = None,
        replicated_kv: bool = False,
        strategy: str | None = None,
        halo: bool | None = None,
        sparse_kv: bool | None = None,
    ):
        """Ring attention over a process group; differentiable in query, key and value.

        Args:
            query: this rank's shard (batch, heads, seq_q_local, head_dim), sharded on dim 2 in
                ``layout``.
            key, value: (batch, heads_kv, seq_kv_local, head_dim) and (..., head_dim_v); heads %
                heads_kv == 0 (GQA: only heads_kv heads travel). Non-causal attention may have
                seq_kv_local != seq_q_local. head_dim_v != head_dim (multi-head latent
                attention) runs on ops declaring OpCapabilities.value_head_dim ("auto" picks
                one; others are refused).
            group: a ProcessGroup or 1-D DeviceMesh (default: the default process group); for
                ``exchange="hybrid"`` a 2-D DeviceMesh with dims named "ulysses" and "ring", or a
                mapping {"ulysses": group, "ring": group}.
            is_causal: causal attention over the global sequence (top-left aligned); needs
                seq_q_local == seq_kv_local.
            scale: softmax scale (default 1/sqrt(head_dim)).
            rotate_method: how the ring moves key/value blocks: "allgather", "alltoall" or "p2p"
                (default: see set_rotate_method).
            op: "auto", a registered op name (ring_impl.available_ops()) or an AttentionOp.
            layout: "contiguous", "head_tail" (load balanced for causal attention) or any layout
                registered with ring_impl.register_layout.
            return_lse: also return the local LSE (batch, heads, seq_q_local), float32 (float64
                for float64 inputs); differentiable like the output (its gradient enters the
                backward's row term). NaN/inf in the inputs give NaN wherever they reach (see
                ring_impl.numerics.nonfinite).
            return_max_logit: also return the per-head maximum attention logit (what QK-clip
                optimisers such as MuonClip read; TransformerEngine's return_max_logit):
                (heads,), float32 (float64 for float64 inputs), the maximum over the batch,
                every query row on every rank and every key that row sees under causality and
                the mask of ``scale * q . k`` (before the softmax; sink logits are not logits
                of keys and are left out), equal on every rank (one all-reduce MAX at the end
                of the forward). -inf for a head that sees nothing; NaN where a NaN input
                reaches a logit some row sees. Detached: not differentiable. Computed per ring
                step from the step's query and key blocks (one extra block matmul per kernel
                call), nothing of it without the flag. The ring only (every rotation, layout,
                op, head_chunks, GQA, mask; "auto" takes the ring); exchanges "halo", "gather",
                "ulysses" and "hybrid" raise InputError on every rank. Under torch.compile it
                runs eagerly (MAX_LOGIT_RUNS_EAGERLY). Its all-reduce:
                collective_schedule(..., return_max_logit=True).
            head_chunks: run the ring this many times, each over a group of key/value heads
                (and their query heads), one after another (1 <= head_chunks <= heads_kv). The
                key/value blocks and dK/dV accumulators in flight and the kernel's per-step
                results shrink by that factor, so per-rank memory beyond inputs and outputs
                does; collectives multiply by it, bytes sent stay the same. See
                ring_impl.exchanges.heads.
            mask: a ring_impl.masks.Mask on *global* positions (Documents, SlidingWindow,
                ChunkedCausal, PrefixLM, KeyRanges, MaskMod, combined with & and |; with
                is_causal=True it is intersected with causal), equal on every rank (a MaskMod
                showing one range of keys per query: ring_impl.masks.tabulate once, the
                KeyRanges it gives to every call). Each ring step computes only
                the rows and columns some query sees (skipped when none: the block is still
                rotated). With an op taking row bounds (``cuda_flash_varlen``, what op="auto"
                picks for a masked call on CUDA) a step of a mask of key ranges (every built-in
                mask but a union) is one kernel call; otherwise it is cut into calls, unmasked
                where every row sees all, with the kernel's causal flag where causal-shaped,
                else with the block's mask (ops declaring ``masks``; others run those blocks
                with the math op). Rows that see nothing give out 0, LSE -inf and zero
                gradients. Under torch.compile the call runs in the graph as custom ops (a
                MaskMod evaluated into a table of bits on the global grid:
                ring_impl.planning.mask_table), or for what they cannot carry eagerly inside the
                compiled region (a graph break; see MASKS_RUN_EAGERLY).
            sinks: (heads,) per-head sink logits (a softmax term with no value),
                differentiable; each rank's gradient covers its own rows (reduce it over the
                group like any parameter's).
            score_mod: a change of each scaled logit s = scale * q.k before the mask and the
                softmax, on *global* positions, equal on every rank:
                ring_impl.score_mods.SoftCap(cap) (cap * tanh(s / cap)), Alibi(slopes or heads)
                (s + slope[h] * (kv - q)), PostScaleBias(bias) ((1|batch, 1|heads, seq_q,
                seq_kv) global), or a callable fn(score, b, h, q_idx, kv_idx) in flex
                attention's convention (q_idx/kv_idx global positions, h the global query head).
                Applied inside each ring step's block, before the merge; gradients flow to
                query, key and value through it (not to slopes, bias or tensors a function
                closes over). Its blocks run on an op declaring OpCapabilities.score_mod
                (op="auto": "math"; naming another op raises InputError). Exchanges "auto"
                (which then takes the ring), "ring", "ulysses", "hybrid"; "halo" and "gather"
                raise InputError. Under torch.compile it runs eagerly (a graph break,
                SCORE_MODS_RUN_EAGERLY).
            exchange: how key/value rows reach the queries that see them (ring_impl.call).
                "auto" (default): the halo exchange where it can serve the call, else the ring.
                "ring": key/value blocks go around the ring (``rotate_method``, any layout,
                op, head_chunks, mask). "halo": for a mask that reaches at most a shard's
                length back and forward (Mask.reach(): a SlidingWindow, alone or with & Causal
                / Documents; ChunkedCausal) under layout "contiguous" with equal local lengths,
                each rank receives only the last ``left`` key/value rows of rank - 1 and the
                first ``right`` of rank + 1 and sends their dK/dV home in the backward
                (ring_impl.exchanges.halo); InputError on every rank saying why when it cannot (W=1
                runs the ring: there is nothing to exchange). "gather", with a mask: each rank
                receives in one all-to-all only the key/value rows its queries see and sends
                their dK/dV home in one all-to-all (ring_impl.exchanges.kv_gather): the fewest bytes
                of any exchange, not overlapped with compute; any layout, head_chunks 1.
                "ulysses": an all-to-all turns sequence shards into head shards, each rank
                attends heads / U heads over the whole sequence, and an all-to-all turns the
                output back (heads divisible by the group size; key/value heads fewer than it
                are replicated). "hybrid": Ulysses inside each row of a 2-D mesh and the ring
                across rows. Ulysses' and the hybrid's shards follow their layouts
                (ring_impl.exchanges.shard). The collectives of each:
                collective_schedule(..., exchange=).
            cu_seqlens: packed (THD) inputs, as FlashAttention's varlen functions take them:
                query, key and value are (tokens_local, heads, head_dim), this rank's shard
                (``ring_impl.shard(t, W, rank, layout=..., dim=0)``) of the global packed
                sequence, and cu_seqlens (n_documents + 1,) the global cumulative document
                lengths [0, l0, l0 + l1, ...], equal on every rank. Each token attends its own
                document (causally with is_causal), intersected with ``mask`` if given; tokens
                past cu_seqlens[-1] are padding. Returns (tokens_local, heads, head_dim) and the
                LSE as (heads, tokens_local). See ring_impl.planning.packed.
            shard_lengths: uneven shards: rank r holds shard_lengths[r] tokens (query, key and
                value alike; >= 0, one per rank of the sequence, equal on every rank) of a
                global sequence of sum(shard_lengths) tokens: any split for layout
                "contiguous", the layout's own split of the sum for another
                (ring_impl.shard_lengths; ring_impl.shard(..., lengths=) cuts them). Runs padded
                to the longest shard with the padding hidden by the mask, on exchanges "auto",
                "ring", "gather" and "ulysses" (not "halo" or "hybrid"); with cu_seqlens, the
                packed tokens per rank. Returns this rank's rows only. See
                ring_impl.planning.uneven.
            replicated_kv: key and value are the whole key/value sequence, equal on every rank
                (cross-attention over tokens every rank holds: a text encoder's output, an
                image's patches), (batch, heads_kv, seq_kv, head_dim) with any seq_kv; query is
                sharded as usual. Each rank attends its own query rows to all of it: no
                key/value moves, only the cross-rank input check runs
                (collective_schedule(..., replicated_kv=True)). Each rank's key/value gradient is
                its own rows' contribution; their sum over the group is the gradient of the
                replicated tensors (reduce it like a parameter's, as for sinks). Any layout,
                op, GQA, head_chunks and sinks; a mask is read at (the query's global position,
                the key's index 0..seq_kv-1): a key padding MaskMod, or cross-attention
                Documents(q_ids, kv_doc_ids=kv_ids). is_causal, score_mod, return_max_logit,
                exchanges other than "auto"/"ring", cu_seqlens and shard_lengths raise InputError
                on every rank (the keys have no positions on the query's sequence to compare).
                Passing such key/value without the flag is attention over W copies of it.
            strategy, halo, sparse_kv: deprecated aliases of ``exchange`` (strategy="ulysses"
                -> "ulysses", halo=True -> "halo", halo=False -> "ring", sparse_kv=True ->
                "gather"); a DeprecationWarning, and InputError when they contradict.

        Returns:
            The local output (batch, heads, seq_q_local, head_dim_v) in the input dtype, then the
            LSE when ``return_lse``, then the max logit (heads,) when ``return_max_logit``:
            ``out``, ``(out, lse)``, ``(out, max_logit)`` or ``(out, lse, max_logit)``.

        Raises:
            InputError (a ValueError) on every rank, before any ring collective, for bad input
            on any rank, and when the ranks disagree on any shape or option (saying which rank
            has what). The backward is first-order: gradients taken with create_graph=True
            carry no graph, and differentiating them again raises on every rank.
        """
        exchange, problem = exchange_of(exchange, strategy, halo, sparse_kv)
        call = Call(
            group=group,
            is_causal=is_causal,
            scale=scale,
            op=op,
            layout=layout,
            return_lse=return_lse,
            return_max_logit=return_max_logit,
            rotate_method=get_rotate_method() if rotate_method is None else rotate_method,
            head_chunks=head_chunks,
            mask=mask,
            sinks=sinks,
            score_mod=score_mod,
            exchange=exchange,
            replicated_kv=replicated_kv,
            problem=problem,
        )
        if replicated_kv is not False and (cu_seqlens is not None or shard_lengths is not None):
            form = "cu_seqlens" if cu_seqlens is not None else "shard_lengths"
            return attend(
                bound,
                call.with_(
                    problem=problem
                    or f"replicated_kv=True takes no {form}=: only the query is sharded; pass the "
                    "query's rows as a 4-D shard"
                ),
                query,
                key,
                value,
            )
        if cu_seqlens is not None:
            return _packed(bound, call, query, key, value, cu_seqlens, shard_lengths)
        if shard_lengths is not None:
            return _uneven(bound, call, query, key, value, shard_lengths)
        if torch.compiler.is_compiling():  # attend(), inlined: one frame fewer to the kernel
            return _traced(bound, call, query, key, value)
        return _eager(bound, call, query, key, value)

    # The function itself (what torch.compile inlines), given the protocol's two attributes here.
    bound_fn = cast(RingAttentionFunction, ring_attention)
    bound_fn.impl_name = bound.name  # how compiled calls name it (ring_impl.compiled.masked_call)
    bound_fn.bound = bound
    return bound_fn


_DEFAULT_IMPL = RingAttention()
ring_attention = bind(_DEFAULT_IMPL)
