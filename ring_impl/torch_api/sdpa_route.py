"""Routing ``scaled_dot_product_attention`` to ring attention while a context is active.

Used by ``context_parallel`` and the ``ContextParallel`` parallel style. While a route is
active:

- ``torch.nn.functional.scaled_dot_product_attention`` is :func:`routed_sdpa`, one plain
  function for the whole process. Callers that look the name up at call time are routed:
  ``nn.MultiheadAttention`` (through ``F.multi_head_attention_forward``, which reads the
  module global), custom attention modules calling ``F.scaled_dot_product_attention``, and
  code compiled with ``torch.compile`` (dynamo inlines the function; its identity is stable,
  so the compiled code is guarded on it and not recompiled per call).
- a ``TorchFunctionMode`` (:class:`RouteMode`) catches callers that hold the SDPA builtin
  itself, and rejects ``F.multi_head_attention_forward(..., need_weights=True)``: that path
  computes attention weights with bmm + softmax and never calls SDPA, so under context
  parallel it would attend to the local shard only. The mode also makes ``has_torch_function``
  true, which keeps ``nn.MultiheadAttention``'s fused inference fast path (that never calls
  SDPA either) out of the way.

The function and the mode are both needed: the SDPA call inside
``F.multi_head_attention_forward`` runs nested in that function's own torch-function dispatch,
where the mode is switched off.

Under ``torch.compile`` (with the route entered outside the compiled region, as
``context_parallel`` and ``ContextParallel`` do) the ring becomes part of dynamo's graph: dynamo
traces the mode and inlines :func:`routed_sdpa`. ``F.multi_head_attention_forward`` is an
exception dynamo would keep as one opaque node, whose SDPA call the backend resolves later,
outside dynamo's guards and with a cache keyed by dynamo's graph alone (so by neither the route
nor the rank's causal plan); the mode therefore calls a copy of it that dynamo inlines. Compiled
code is guarded on the route (:func:`_pin`), so it is recompiled for another route, not per
call.

Flex attention is routed the same way (``ring_impl.torch_api.flex_route``): ``flex_attention(q, k,
v, block_mask=...)`` with a block mask built on the global sequence runs as ring attention with
that mask.

Routes nest: the innermost active route decides (group, layout, rotation, op, head chunks).
"""

from __future__ import annotations

import contextlib
import functools
import inspect
from collections.abc import Iterator
from dataclasses import dataclass, field, replace
from types import FunctionType

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

from .. import api
from ..call import Call
from ..checks.inputs import InputError, routed_error
from ..group import resolve_group
from ..layout import check_layout
from ..masks import MaskMod
from ..ops import AttentionOp, default_scale, get_op
from . import flex_route

__all__ = [
    "NEED_WEIGHTS_PROBLEM",
    "Route",
    "RouteMode",
    "active_route",
    "routed_sdpa",
    "routing",
    "sdpa_routed_to_ring",
]

_BUILTIN_SDPA = torch._C._nn.scaled_dot_product_attention
_MHA_FORWARD = F.multi_head_attention_forward
_MHA_PARAMS = inspect.signature(_MHA_FORWARD).parameters
_NEED_WEIGHTS_POS = list(_MHA_PARAMS).index("need_weights")
_NEED_WEIGHTS_DEFAULT = _MHA_PARAMS["need_weights"].default
# The same function as a separate object. Dynamo keeps F.multi_head_attention_forward itself
# as one opaque node of its graph (the backend traces into it later, outside dynamo's view and
# guards, and caches the result keyed by that graph alone), but inlines this copy like any
# Python function: the routed SDPA call inside, and so the ring, become part of dynamo's graph.
_MHA_FORWARD_INLINED = FunctionType(
    _MHA_FORWARD.__code__,
    _MHA_FORWARD.__globals__,
    _MHA_FORWARD.__name__,
    _MHA_FORWARD.__defaults__,
    _MHA_FORWARD.__closure__,
)
_MHA_FORWARD_INLINED.__kwdefaults__ = _MHA_FORWARD.__kwdefaults__

NEED_WEIGHTS_PROBLEM = (
    "nn.MultiheadAttention / F.multi_head_attention_forward with need_weights=True (its default) "
    "computes the attention weights with bmm + softmax instead of scaled_dot_product_attention, "
    "so under context parallel it would attend to this rank's shard only; call it with "
    "need_weights=False (the weights of a sharded sequence are not available)"
)


@dataclass(frozen=True)
class Route:
    """Where and how routed SDPA calls run.

    ``kernel_ops``: ``((device type, (op name, ...)), ...)``, the ops an ``op=None`` route may
    run on each device type in SDPA's order of preference, from the
    ``torch.nn.attention.sdpa_kernel`` choice active when the route was entered; a call runs the
    first that takes its dtype, head size, scale and causality, as SDPA itself picks (filled in by
    :func:`routing`; reading those flags inside a compiled region would break the graph). ``key``:
    the route as plain values (group name, layout, rotation, op name or the op object's identity,
    head chunks, strategy, replicated key/value, kernel ops); compiled code is guarded on it
    (see :func:`_pin`).
    """

    group: dist.ProcessGroup
    layout: str
    rotate_method: str | None
    op: str | AttentionOp | None
    head_chunks: int = 1
    strategy: str = "ring"
    #: the routed calls' key/value are whole on every rank (``ring_attention(replicated_kv=True)``:
    #: a cross-attention module's, under ``ContextParallel(replicated_kv=True)``)
    replicated_kv: bool = False
    #: the 2-D DeviceMesh routed calls take (strategy "hybrid";
    #: ``group`` is then the mesh flattened)
    mesh: object = field(default=None, compare=False, repr=False)
    kernel_ops: tuple[tuple[str, tuple[str, ...]], ...] = ()
    key: tuple = field(init=False, repr=False, compare=False)

    def call(self, *, problem: str | None, routed_from: str, **options) -> Call:
        """A routed call of ``routed_from`` as a ring_attention :class:`~ring_impl.call.Call` on
        this route's group, layout, rotation, head chunks and strategy; ``problem``: the route's
        own refusal of the call (raised on every rank by the call's cross-rank check)."""
        return Call(
            group=self.mesh if self.mesh is not None else self.group,
            layout=self.layout,
            rotate_method=api.get_rotate_method()
            if self.rotate_method is None
            else self.rotate_method,
            head_chunks=self.head_chunks,
            exchange="auto" if self.strategy == "ring" else self.strategy,
            replicated_kv=self.replicated_kv,
            problem=problem,
            routed_from=routed_from,
            **options,
        )

    def __post_init__(self) -> None:
        op_key = (
            self.op
            if self.op is None or isinstance(self.op, str)
            else f"{type(self.op).__qualname__}@{id(self.op):x}"
        )
        object.__setattr__(
            self,
            "key",
            (
                self.group.group_name,
                self.layout,
                self.rotate_method,
                op_key,
                self.head_chunks,
                self.strategy,
                self.replicated_kv,
                *self.kernel_ops,
            ),
        )

    def op_for(
        self,
        query: torch.Tensor,
        scale: float | None,
        is_causal: bool,
        value: torch.Tensor | None = None,
    ) -> str | AttentionOp:
        """The op a routed call on ``query`` runs: the route's own, else the first enabled SDPA
        backend's op that takes the call (float64 on CUDA goes to ``math`` as SDPA sends it; a
        ``value`` whose head dim differs from query's to a backend that takes it), else the
        first one, whose input check then says why it cannot."""
        if self.op is not None:
            return self.op
        names = next((names for kind, names in self.kernel_ops if kind == query.device.type), ())
        effective = (
            default_scale(query.shape[-1])
            if scale is None
            else (
                float(scale)
                if isinstance(scale, (int, float)) and not isinstance(scale, bool)
                else None
            )
        )
        for name in names:
            why = get_op(name).capabilities.unsupported(
                query.device,
                query.dtype,
                query.shape[-1],
                scale=effective,
                is_causal=bool(is_causal),
                head_dim_v=value.shape[-1]
                if isinstance(value, torch.Tensor) and value.dim() >= 1
                else None,
            )
            if why is None:
                return name
        return names[0] if names else "auto"


#: Active routes, innermost last. Module state on purpose: dynamo reads it (and guards on it)
#: when it inlines routed_sdpa, so compiled code follows the route of the call.
_ROUTES: list[Route] = []
#: What F.scaled_dot_product_attention was before the outermost route.
_SAVED_SDPA: list = []


def active_route() -> Route | None:
    return _ROUTES[-1] if _ROUTES else None


def _ops_from_sdpa_kernel(device_type: str) -> tuple[str, ...]:
    """The ops of the SDPA backends an active ``torch.nn.attention.sdpa_kernel`` choice enables,
    in the order the ring prefers them; ``math`` last where SDPA's math backend is enabled."""
    backends = torch.backends.cuda
    math = ("math",) if backends.math_sdp_enabled() else ()
    if device_type == "cpu":
        fused = (
            backends.flash_sdp_enabled()
            or backends.mem_efficient_sdp_enabled()
            or backends.cudnn_sdp_enabled()
        )
        return ("cpu_flash", *math) if fused or not math else math
    names = (
        tuple(
            name
            for enabled, name in (
                (backends.flash_sdp_enabled(), "cuda_flash"),
                (backends.cudnn_sdp_enabled(), "cudnn"),
                (backends.mem_efficient_sdp_enabled(), "cuda_efficient"),
            )
            if enabled
        )
        + math
    )
    return names or ("math",)


def routed_sdpa(
    query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False
):
    """``scaled_dot_product_attention`` as ring attention over the active route's group.

    query (batch, heads, seq_local, head_dim) or unbatched (heads, seq_local, head_dim); key and
    value likewise with heads_kv heads. Returns the local output in query's shape. Outside any
    route it is the builtin SDPA.
    """
    route = active_route()
    if route is None:
        return _BUILTIN_SDPA(
            query,
            key,
            value,
            attn_mask=attn_mask,
            dropout_p=dropout_p,
            is_causal=is_causal,
            scale=scale,
            enable_gqa=enable_gqa,
        )
    problem, mask = None, None
    if attn_mask is not None:
        mask = (
            key_padding_mask(attn_mask, key)
            if route.replicated_kv is True and isinstance(key, torch.Tensor)
            else None
        )
        if mask is None:
            problem = (
                "attn_mask is not supported under context parallel (a mask over the global "
                "sequence cannot be applied per shard); use is_causal=True or no mask. Under "
                "ContextParallel(replicated_kv=True) a boolean attn_mask equal for every query "
                "(shape (batch or 1, heads or 1, 1, seq_kv): a key padding mask) is taken"
            )
    if problem is None and dropout_p:
        problem = (
            f"dropout_p={dropout_p} is not supported under context parallel; set attention "
            "dropout to 0"
        )
    elif (
        problem is None
        and isinstance(query, torch.Tensor)
        and isinstance(key, torch.Tensor)
        and query.dim() == key.dim()
        and query.dim() >= 3
    ):
        if query.shape[-3] != key.shape[-3] and not enable_gqa:
            problem = (
                f"query has {query.shape[-3]} heads but key/value have {key.shape[-3]}; "
                "pass enable_gqa=True for grouped-query attention"
            )
    squeeze = isinstance(query, torch.Tensor) and query.dim() == 3
    if squeeze:  # (heads, seq, dim): the unbatched form SDPA accepts
        query, key, value = query.unsqueeze(0), key.unsqueeze(0), value.unsqueeze(0)
    op = (
        route.op_for(query, scale, is_causal, value)
        if isinstance(query, torch.Tensor)
        else route.op
    )
    # Refusals name the function called, compiled too (routed_from).
    call = route.call(
        is_causal=is_causal,
        scale=scale,
        op=op,
        problem=problem,
        routed_from="scaled_dot_product_attention",
        mask=mask,
    )
    out = api.attend(api.ring_attention.bound, call, query, key, value)
    return out.squeeze(0) if squeeze else out


def key_padding_mask(attn_mask, key: torch.Tensor) -> MaskMod | None:
    """SDPA's ``attn_mask`` as a mask of a replicated key/value call, where it is one: a boolean
    tensor equal for every query, broadcastable to ``(batch, heads, 1, seq_kv)`` (True: the key
    is attended), key padding of the text every rank holds; None for any other (the route
    refuses it). Its rows are the same on every rank, so the ranks agree on it."""
    if not isinstance(attn_mask, torch.Tensor) or attn_mask.dtype != torch.bool:
        return None
    if not 1 <= attn_mask.dim() <= 4 or attn_mask.shape[-1] != key.shape[-2]:
        return None
    table = attn_mask.reshape((1,) * (4 - attn_mask.dim()) + tuple(attn_mask.shape))
    if table.shape[2] != 1:
        return None  # rows of this rank's queries: not the same on every rank
    # (a function of the module with the table bound, not a closure: compiled, the route runs
    # inside the traced code, which can bind a graph tensor but not close over one)
    return MaskMod(functools.partial(_key_padding, table[:, :, 0]))


def _key_padding(table: torch.Tensor, b, h, q_idx, kv_idx):
    """``table`` (batch or 1, heads or 1, seq_kv) bool at the keys ``kv_idx``, for every query."""
    rows = b if table.shape[0] > 1 else torch.zeros_like(b)
    heads = h if table.shape[1] > 1 else torch.zeros_like(h)
    return table.to(kv_idx.device)[rows, heads, kv_idx]


def _reject_on_every_rank(route: Route, problem: str, anchor) -> None:
    """Raise ``problem`` on every rank of the route's group, through the same cross-rank
    agreement as a ring call, so a rank whose call did reach SDPA raises too instead of
    waiting in the ring."""
    if torch.compiler.is_compiling():
        # A call that could not be described for the refusing op (RouteMode.__torch_function__
        # gives a described one the op): this rank raises alone, while tracing.
        raise routed_error(InputError(f"ring_attention: {problem}"), "multi_head_attention_forward")
    anchor = anchor if isinstance(anchor, torch.Tensor) else torch.empty(0)
    call = route.call(problem=problem, routed_from="multi_head_attention_forward")
    api.attend(api.ring_attention.bound, call, anchor, anchor, anchor)
    raise AssertionError("unreachable: a ring call with a problem raises")  # pragma: no cover


def _mha_arg(args: tuple, kwargs: dict, name: str):
    """``F.multi_head_attention_forward``'s argument
    ``name`` as the call gave it (or its default)."""
    if name in kwargs:
        return kwargs[name]
    position = list(_MHA_PARAMS).index(name)
    return args[position] if len(args) > position else _MHA_PARAMS[name].default


def _weights_refused_in_graph(route: Route, args: tuple, kwargs: dict):
    """A traced ``F.multi_head_attention_forward(..., need_weights=True)`` under a route, as the
    refusing op of ring_impl.compiled.checks: (attn_output, attn_weights) of the shapes the call
    would give, made by ``ring_impl::refuse``, which runs the call's checks with the weights
    problem when the graph runs, so that every rank raises (the ranks that reached SDPA run the
    same agreement in their ``ring_impl::agree`` op). The module returns the op's results, so no
    compiler drops it. None when the call cannot be described (this rank raises alone then,
    while tracing)."""
    from ..compiled import checks as compiled_checks  # noqa: F401  (registers ring_impl::refuse)
    from ..compiled.masked_call import describe_call

    query, key = _mha_arg(args, kwargs, "query"), _mha_arg(args, kwargs, "key")
    if not (
        isinstance(query, torch.Tensor) and isinstance(key, torch.Tensor) and query.dim() in (2, 3)
    ):
        return None
    call = route.call(problem=NEED_WEIGHTS_PROBLEM, routed_from="multi_head_attention_forward")
    described = describe_call(api.ring_attention.impl_name, query, query, call)
    if described is None:
        return None
    heads = int(_mha_arg(args, kwargs, "num_heads"))
    lengths = [int(query.shape[0]), int(key.shape[0])]  # (L, S)
    batch = [int(query.shape[1])] if query.dim() == 3 else []
    per_head = [] if _mha_arg(args, kwargs, "average_attn_weights") else [heads]
    out, weights = torch.ops.ring_impl.refuse(
        query,
        query,
        query,
        None,
        described[0],
        [int(n) for n in query.shape],
        [*batch, *per_head, *lengths],
    )
    return out, weights.to(query.dtype)


def _needs_weights(args: tuple, kwargs: dict) -> bool:
    if "need_weights" in kwargs:
        return bool(kwargs["need_weights"])
    if len(args) > _NEED_WEIGHTS_POS:
        return bool(args[_NEED_WEIGHTS_POS])
    return bool(_NEED_WEIGHTS_DEFAULT)


_NEVER = object()


def _pin(route: Route) -> None:
    """Use every part of the route's key, so that dynamo guards the compiled code on it.

    Dynamo traces :class:`RouteMode` for each torch call of a compiled region and guards on the
    values the traced code uses (a value only read is not guarded). :func:`routed_sdpa` uses
    the route too; this covers compiled code under a route whose SDPA call dynamo does not see
    itself (a function kept as an opaque node, into which the backend traces later): without a
    guard, code compiled under one route would run under another.
    """
    for part in route.key:
        if part is _NEVER:
            raise AssertionError("unreachable")


class RouteMode(TorchFunctionMode):
    """Routes direct calls of the SDPA builtin and rejects MultiheadAttention's weights path."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        route = active_route()
        if route is not None:
            _pin(route)
        if func is _BUILTIN_SDPA:
            return routed_sdpa(*args, **kwargs)
        if func is _MHA_FORWARD and route is not None:
            if torch.compiler.is_compiling() and _needs_weights(args, kwargs):
                refused = _weights_refused_in_graph(route, args, kwargs)
                if refused is not None:
                    return refused
            self.check_attention_weights(route, args, kwargs)
            return self.attention_forward(*args, **kwargs)
        return func(*args, **kwargs)

    def attention_forward(self, *args, **kwargs):
        """``F.multi_head_attention_forward``; compiled, the copy dynamo inlines (see the module
        docstring)."""
        if torch.compiler.is_compiling():
            return _MHA_FORWARD_INLINED(*args, **kwargs)
        return _MHA_FORWARD(*args, **kwargs)

    def check_attention_weights(self, route: Route, args: tuple, kwargs: dict) -> None:
        """Reject ``F.multi_head_attention_forward(..., need_weights=True)`` on every rank."""
        if _needs_weights(args, kwargs):
            _reject_on_every_rank(
                route, NEED_WEIGHTS_PROBLEM, args[0] if args else kwargs.get("query")
            )


@contextlib.contextmanager
def sdpa_routed_to_ring(
    group,
    *,
    layout: str = "head_tail",
    rotate_method: str | None = None,
    op: str | AttentionOp | None = None,
    head_chunks: int = 1,
    strategy: str = "ring",
) -> Iterator[None]:
    """While active, SDPA calls run as ring (or Ulysses)
    attention over ``group`` (no buffer sharding)."""
    check_layout(layout)
    route = Route(resolve_group(group), layout, rotate_method, op, head_chunks, strategy)
    with routing(route):
        yield


@contextlib.contextmanager
def routing(route: Route, *, mode_type: type[TorchFunctionMode] | None = None) -> Iterator[None]:
    """Activate ``route`` (innermost wins); the previous state comes back on exit.

    ``mode_type``: the torch-function mode entered with it (default :class:`RouteMode`).
    """
    if not _ROUTES:
        _SAVED_SDPA.append(F.scaled_dot_product_attention)
        F.scaled_dot_product_attention = routed_sdpa
        flex_route.install(active_route)
    _ROUTES.append(
        replace(
            route, kernel_ops=tuple((kind, _ops_from_sdpa_kernel(kind)) for kind in ("cpu", "cuda"))
        )
    )
    try:
        with (mode_type or RouteMode)():
            yield
    finally:
        _ROUTES.pop()
        if not _ROUTES:
            F.scaled_dot_product_attention = _SAVED_SDPA.pop()
            flex_route.uninstall()
