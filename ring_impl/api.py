"""``ring_attention`` and the process-wide default rotation method."""

from __future__ import annotations

import zlib
from collections.abc import Callable

import torch

from .group import RingGroup, resolve_group
from .halo import HaloPath, halo_blocks, halo_reach, halo_refusal, halo_rows
from .heads import plan_chunks
from .kv_gather import gather_path, gather_refusal
from .masks import fold_causal, mask_code, masking_problem, snapshot
from .ops import AttentionOp, resolve_scale_and_op
from .plan import plan_ahead
from .ring import Path, PathFunction, RingAttention, RingConfig, RingPath
from .sinks import with_sinks
from .transports import check_rotate_method
from .validate import InputError, agree_across_ranks, local_problem, routed_error

__all__ = ["bind", "get_rotate_method", "ring_attention", "set_rotate_method"]

_DEFAULT_ROTATE = ["allgather"]


def set_rotate_method(rotate_method: str) -> None:
    """Set the default KV rotation: ``"allgather"`` (the default), ``"alltoall"`` or ``"p2p"``."""
    check_rotate_method(rotate_method)
    _DEFAULT_ROTATE[0] = rotate_method


def get_rotate_method() -> str:
    return _DEFAULT_ROTATE[0]


#: Why a masked call leaves the compiled graph (dynamo's message names it under fullgraph=True).
MASKS_RUN_EAGERLY = (
    "ring_attention(mask=...) runs eagerly inside torch.compile (a graph break) for a MaskMod whose bit table "
    "on the global grid would exceed ring_impl.mask_table.MAX_TABLE_BITS, that does not return bool or whose function "
    "asserts or raises (in the graph its failure would raise on its own rank only), a Mask subclass "
    "(Python the compiled graph cannot carry), or mask values that are not plain ints/bools/tensors: "
    "its plan is data (the mask on global positions) that a graph could only bake in and serve stale. Built-in "
    "masks and MaskMods (as a table of bits), with any op, run in the graph, every strategy "
    "(ring_impl.compiled_masks). Compile without fullgraph=True, or call such masked attention outside the "
    "compiled region"
)


def _ring_attention(impl: RingAttention, query, key, value, *, impl_name: str | None = None, **kwargs):
    """``ring_attention``'s body. A masked call under torch.compile runs as custom ops in the
    graph (ring_impl.compiled_masks: the plan is made when the op runs, so a new mask is never
    served an old plan) or, for what those cannot carry, eagerly (MASKS_RUN_EAGERLY)."""
    if kwargs.get("mask") is not None and torch.compiler.is_compiling():
        if impl_name is not None:
            from .compiled_masks import masked_ring_call

            result = masked_ring_call(impl_name, query, key, value, **kwargs)
            if result is not None:
                return result
        return _masked_eagerly(impl, query, key, value, **kwargs)
    if torch.compiler.is_compiling() and impl_name is not None:
        # The cross-rank check as an op the graph keeps (ring_impl.compiled_checks).
        from .compiled_checks import checked_call

        result = checked_call(_attend, call_path, impl, impl_name, query, key, value, **kwargs)
        if result is not None:
            return result
    return _attend(impl, query, key, value, **kwargs)


def _attend(impl: RingAttention, query, key, value, *, return_lse: bool = False, sinks=None, **kwargs):
    path = call_path(impl, query, key, value, return_lse=return_lse, sinks=sinks, **kwargs)
    out, lse = PathFunction.apply(query, key, value, path, bool(return_lse) or sinks is not None)
    if sinks is not None:
        out, lse = with_sinks(out, lse, sinks)
    return (out, lse) if return_lse else out


def call_path(impl: RingAttention, query, key, value, *, strategy: str = "ring", algorithms=None,
              routed_from: str | None = None, **kwargs) -> Path:
    """The :class:`ring_impl.ring.Path` serving a ``ring_attention`` call with these arguments
    (``ring_path`` for ``strategy="ring"``, ``ring_impl.strategies.strategy_path`` otherwise),
    checked on this rank and across the group. Its LSE is computed when ``return_lse`` or
    ``sinks`` (the sink term needs it).

    A ``mask`` holding tensors (``Documents``) is copied first (ring_impl.masks.snapshot): the
    path plans with that copy, so what the caller writes into its ids later cannot reach a plan
    or the plan cache's key.

    ``routed_from``: the function the user called when a context-parallel route runs it as ring
    attention (``"scaled_dot_product_attention"``, ``"flex_attention"``); refusals then name it
    (:func:`ring_impl.validate.routed_error`). It is part of the call, so compiled calls, whose
    checks raise from an op when the graph runs, word their refusals the same."""
    if kwargs.get("mask") is not None and not torch.compiler.is_compiling():
        kwargs["mask"] = snapshot(kwargs["mask"])
    if routed_from is None:
        return _call_path(impl, query, key, value, strategy=strategy, algorithms=algorithms, **kwargs)
    try:
        return _call_path(impl, query, key, value, strategy=strategy, algorithms=algorithms, **kwargs)
    except InputError as exc:  # (on every rank alike)
        raise routed_error(exc, routed_from) from None


def _call_path(impl: RingAttention, query, key, value, *, strategy: str, algorithms, **kwargs) -> Path:
    if strategy == "ring":
        return ring_path(impl, query, key, value, **kwargs)
    from .strategies import strategy_path

    extra_problem, halo, sparse_kv = kwargs.pop("extra_problem", None), kwargs.pop("halo", None), kwargs.pop("sparse_kv", False)
    if halo is not None and halo is not False:
        extra_problem = extra_problem or f"halo={halo!r} runs with strategy='ring' only; pass halo=None"
    if sparse_kv is not False:
        extra_problem = extra_problem or f"sparse_kv={sparse_kv!r} runs with strategy='ring' only; pass sparse_kv=False"
    kwargs["rotate_method"] = get_rotate_method() if kwargs.get("rotate_method") is None else kwargs["rotate_method"]
    return strategy_path(impl, algorithms, strategy, query, key, value, extra_problem=extra_problem, **kwargs)


def ring_path(
    impl: RingAttention,
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
    head_chunks: int = 1,
    extra_problem: str | None = None,
    mask=None,
    sinks=None,
    halo: bool | None = None,
    sparse_kv: bool = False,
) -> Path:
    """The :class:`ring_impl.ring.Path` (the ring, the halo exchange or the sparse gather) that
    serves a ``strategy="ring"`` call of ``ring_attention`` with these arguments, after checking
    them on this rank and across the group (InputError on every rank for bad input)."""
    rotate_method = get_rotate_method() if rotate_method is None else rotate_method
    pg = resolve_group(group)
    effective_scale, op_obj, op_error = resolve_scale_and_op(query, scale, op, is_causal, masked=mask is not None,
                                                             value=value)
    # extra_problem: a caller's own rejection (the SDPA route's attn_mask, dropout), raised
    # through the same cross-rank agreement so every rank raises together.
    world = torch.distributed.get_world_size(pg)
    problem = extra_problem or local_problem(
        query, key, value, is_causal=is_causal, scale=scale, layout=layout, rotate_method=rotate_method,
        op=op_obj, op_error=op_error, head_chunks=head_chunks, return_lse=return_lse, world_size=world,
    ) or masking_problem(query, key, mask, sinks, world_size=world)
    folded = fold_causal(mask, is_causal)
    reach = None
    gather = False  # the sparse gather (ring_impl.kv_gather) serves the call
    if problem is None:
        if halo is not None and not isinstance(halo, bool):
            problem = f"halo must be None (automatic), True or False, got {halo!r}"
        elif not isinstance(sparse_kv, bool):
            problem = f"sparse_kv must be True or False, got {sparse_kv!r}"
        elif sparse_kv:
            problem = ("halo=True and sparse_kv=True ask for two different exchanges; pass one of them" if halo
                       else gather_refusal(mask, world_size=world, head_chunks=head_chunks, strategy="ring"))
            gather = problem is None and world > 1
        elif halo is not False and world > 1:
            where = {"layout": layout, "world_size": world, "seq_q": query.shape[2], "seq_kv": key.shape[2]}
            reach = halo_reach(folded, **where)
            if reach is None and halo:
                problem = (f"halo=True but the halo exchange cannot serve this call: {halo_refusal(folded, **where)}; "
                           "pass halo=None to fall back to the ring")
    cfg = ahead = None
    if problem is None:
        cfg = RingConfig(
            group=RingGroup.of(pg, query.device), is_causal=bool(is_causal), scale=effective_scale, layout=layout,
            rotate_method=rotate_method, op=op_obj, head_chunks=head_chunks, mask=folded,
            mask_dims=(query.shape[0], query.shape[1]), plan_memo={},
        )

        def make_ahead() -> None:
            nonlocal ahead
            ahead = _path(impl, cfg, query, key, gather, reach, plan=True)

        # A mask known only by evaluating it: the path is made and planned now, so a mask_mod
        # that fails on this rank's positions is a problem every rank raises (plan_ahead).
        problem = plan_ahead(make_ahead, folded)
    if world > 1 and not torch.compiler.is_compiling():
        agree_across_ranks(
            problem, query, key, is_causal=is_causal, scale=effective_scale, layout=layout,
            rotate_method=rotate_method, op=op_obj, head_chunks=head_chunks, return_lse=return_lse, group=pg, value=value,
            device=query.device if isinstance(query, torch.Tensor) else torch.device("cpu"),
            mask_code=_path_code(mask_code(mask, sinks, (query.shape[0], query.shape[1], query.shape[2] * world,
                                                         key.shape[2] * world), query.device),
                                 "gather" if gather else "halo" if reach is not None else "ring")
            if problem is None else 0,
        )
    elif problem is not None:
        raise InputError(f"ring_attention: {problem}")
    assert cfg is not None
    return ahead if ahead is not None else _path(impl, cfg, query, key, gather, reach, plan=False)


def _path(impl: RingAttention, cfg: RingConfig, query, key, gather: bool, reach, *, plan: bool) -> Path:
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


_masked_eagerly = torch._dynamo.disable(_attend, reason=MASKS_RUN_EAGERLY)


def _path_code(code: int, path: str) -> int:
    """The mask digest the ranks compare, marked with the path the call takes ("ring", "halo",
    "gather"): ranks that would take different paths (one passed halo=False, or sparse_kv=True)
    disagree on it and raise together."""
    return code if path == "ring" else zlib.crc32(f"{code}|{path}".encode()) & 0x7FFFFFFF


def bind(impl: RingAttention, *, strategies=None) -> Callable[..., torch.Tensor]:
    """A ``ring_attention`` with the same signature that runs ``impl`` (a RingAttention variant),
    and ``strategies`` ({"ulysses": ..., "hybrid": ...}: variants of ``ring_impl.strategies``'
    algorithms) for the head-parallel strategies."""

    from .compiled_masks import register_impl

    impl_name = register_impl(impl, strategies, call_path)

    def ring_attention(query, key, value, **kwargs):
        return _ring_attention(impl, query, key, value, algorithms=strategies, impl_name=impl_name, **kwargs)

    ring_attention.__doc__ = _ring_attention_doc
    ring_attention.impl_name = impl_name  # how compiled calls name it (ring_impl.compiled_masks)
    return ring_attention


_ring_attention_doc = """Ring attention over a process group; differentiable in query, key and value.

Args:
    query: this rank's shard (batch, heads, seq_q_local, head_dim), sharded on dim 2 in ``layout``.
    key, value: (batch, heads_kv, seq_kv_local, head_dim) and (..., head_dim_v); heads %
        heads_kv == 0 (GQA: only heads_kv heads travel). Non-causal attention may have
        seq_kv_local != seq_q_local. head_dim_v != head_dim (multi-head latent attention) runs on
        ops declaring OpCapabilities.value_head_dim ("auto" picks one; others are refused).
    group: a ProcessGroup or 1-D DeviceMesh (default: the default process group); for
        ``strategy="hybrid"`` a 2-D DeviceMesh with dims named "ulysses" and "ring", or a
        mapping {"ulysses": group, "ring": group}.
    is_causal: causal attention over the global sequence (top-left aligned); needs
        seq_q_local == seq_kv_local.
    scale: softmax scale (default 1/sqrt(head_dim)).
    rotate_method: "allgather", "alltoall" or "p2p" (default: see set_rotate_method).
    op: "auto", a registered op name (ring_impl.available_ops()) or an AttentionOp object.
    layout: "contiguous", "head_tail" (load balanced for causal attention) or any layout registered
        with ring_impl.register_layout.
    return_lse: also return the local LSE (batch, heads, seq_q_local), float32 (float64 for
        float64 inputs); differentiable like the output (its gradient enters the backward's
        row term). NaN/inf in the inputs give NaN wherever they reach (see ring_impl.nonfinite).
    head_chunks: run the ring this many times, each over a group of key/value heads (and
        their query heads), one after another (1 <= head_chunks <= heads_kv). The key/value
        blocks and dK/dV accumulators in flight and the kernel's per-step results shrink by
        that factor, so per-rank memory beyond inputs and outputs does; collectives multiply
        by it, bytes sent stay the same. See ring_impl.heads.
    strategy: "ring" (default); "ulysses": an all-to-all turns sequence shards into head shards,
        each rank attends heads / U heads over the whole sequence with the local kernel, and an
        all-to-all turns the output back (heads must be divisible by the group size; key/value
        heads fewer than it are replicated); "hybrid": Ulysses inside each row of a 2-D mesh and
        the ring (every rotation, layout, op, head_chunks) across rows. Shards follow the
        strategy's layout (ring_impl.strategies.shard). See ring_impl.strategies.
    mask: a ring_impl.masks.Mask on *global* positions (Documents, SlidingWindow, ChunkedCausal,
        PrefixLM, MaskMod, combined with & and |; with is_causal=True it is intersected with
        causal), equal on every rank. Each ring step computes only the rows and columns some
        query sees (skipped when none: the block is still rotated). With an op taking row
        bounds (``cuda_flash_varlen``, what op="auto" picks for a masked call on CUDA) a step
        of a mask of key ranges (every built-in mask but a union) is one kernel call; otherwise
        it is cut into calls, unmasked where every row sees all, with the kernel's causal flag
        where causal-shaped, else with the block's mask (ops declaring ``masks``; others run
        those blocks with the math op). Rows that see nothing
        give out 0, LSE -inf and zero gradients. Any head_chunks. Under torch.compile the
        call runs in the graph as custom ops (a MaskMod evaluated into a table of bits on the
        global grid: ring_impl.mask_table), or for what they cannot carry eagerly inside the
        compiled region (a graph break; see MASKS_RUN_EAGERLY).
    halo: None (default): a mask that reaches at most a shard's length back and forward
        (Mask.reach(): a SlidingWindow, alone or with & Causal / Documents; ChunkedCausal),
        with layout "contiguous", equal local lengths and W >= 2, runs as a halo exchange
        (ring_impl.halo): each rank receives only the last ``left`` key/value rows of rank - 1
        and the first ``right`` of rank + 1, runs the kernel on the band's tiles, and sends
        those rows' dK/dV home in the backward; no block goes around the ring. Anything else runs on the
        ring. False: always the ring (rotate_method applies). True: the halo exchange, or
        InputError on every rank saying why it cannot serve the call (at W=1, the ring: there
        is nothing to exchange). rotate_method and head_chunks do not apply to the halo exchange; its
        collectives: collective_schedule(..., mask=, rank=).
    sparse_kv: False (default): the ring (or the halo exchange, see halo). True, with a mask:
        each rank receives in one all-to-all only the key/value rows its queries see, runs the
        kernel on its own and those rows (exact calls, as a ring step's), and sends their dK/dV
        home in one all-to-all in the backward (ring_impl.kv_gather). Bytes are the minimum of
        any exchange: for packed documents under a balanced layout a fraction of the ring's,
        whose transfers it does not overlap with compute. Any layout; W = 1 runs the ring;
        rotate_method and head_chunks (must be 1) do not apply; its collectives:
        collective_schedule(..., mask=, rank=, sparse_kv=True).
    sinks: (heads,) per-head sink logits (a softmax term with no value), differentiable; each
        rank's gradient covers its own rows (reduce it over the group like any parameter's).

Returns:
    The local output (batch, heads, seq_q_local, head_dim_v) in the input dtype, and the LSE
    when ``return_lse``.

Raises:
    InputError (a ValueError) on every rank, before any ring collective, for bad input on
    any rank, and when the ranks disagree on any shape or option (saying which rank has what).
    The backward is first-order: gradients taken with create_graph=True carry no graph, and
    differentiating them again raises on every rank.
"""

_DEFAULT_IMPL = RingAttention()
ring_attention = bind(_DEFAULT_IMPL)
ring_attention.__name__ = "ring_attention"
