"""Deliberately broken context-parallel APIs: one per way an API leaves context parallelism
quietly off or misapplied (or fails where it should work).

Each is ring_impl's API (``context_parallel``, ``context_parallel_unshard``,
``ContextParallel``) with exactly one bug, put together from ring_impl's own parts with one part
replaced the way a real implementation got it wrong. Each is registered as a module
``meta_tests.broken_api.<name>`` and wrapped as an implementation under test whose
``api_module`` names it (its ring attention is ring_impl's, correct), so
``pytest suites/test_context_parallel.py --impl meta_tests.broken_api:<name>`` runs the API suite
against it; the suite must fail with a message matching ``expect``.
"""

from __future__ import annotations

import contextlib
import sys
import types
from collections.abc import Iterator

import torch.nn.functional as F

import ring_impl
from conformance.adapters.ring_impl import RingImplAdapter
from meta_tests.broken import Broken, by_name
from ring_impl.torch_api import context_parallel as _cp
from ring_impl.torch_api import sdpa_route
from ring_impl.torch_api.context_parallel import (
    ShardedBuffers,
    context_parallel_unshard,
    sharded_and_routed,
)
from ring_impl.torch_api.parallel_style import ContextParallel

__all__ = ["BROKEN_API"]


# ------------------------------------------------------------------------ torch.compile


class _OpaqueAttentionForward(sdpa_route.RouteMode):
    """F.multi_head_attention_forward called as it is, also when compiled: dynamo keeps it as
    one opaque node of its graph, which looks SDPA up only when it runs or is traced."""

    def attention_forward(self, *args, **kwargs):
        return F.multi_head_attention_forward(*args, **kwargs)


@contextlib.contextmanager
def _routing_in_the_trace(route: sdpa_route.Route, *, mode_type=None) -> Iterator[None]:
    """The routing as plain state changes that dynamo traces through without a graph break."""
    previous = F.scaled_dot_product_attention
    F.scaled_dot_product_attention = sdpa_route.routed_sdpa
    sdpa_route._ROUTES.append(route)
    try:
        with (mode_type or _OpaqueAttentionForward)():
            yield
    finally:
        sdpa_route._ROUTES.pop()
        F.scaled_dot_product_attention = previous


class RoutingInvisibleToCompile(ContextParallel):
    """The routing is done in hooks that dynamo traces, around an opaque attention node: dynamo
    replays the hooks' effect on SDPA inside its trace only, and the node computes after the
    routing was undone, attending to the local shard."""

    route_ctx = staticmethod(_routing_in_the_trace)

    def _apply(self, module, device_mesh):
        enter, leave = self.routing_hooks(device_mesh)
        module.register_forward_pre_hook(enter)
        module.register_forward_hook(leave, always_call=True)
        return module


class _CallableRoute:
    """SDPA replaced by a callable object (not a function): dynamo cannot inline it."""

    def __call__(self, *args, **kwargs):
        return sdpa_route.routed_sdpa(*args, **kwargs)


@contextlib.contextmanager
def _routing_through_an_object(route: sdpa_route.Route) -> Iterator[None]:
    previous = F.scaled_dot_product_attention
    F.scaled_dot_product_attention = _CallableRoute()
    sdpa_route._ROUTES.append(route)
    try:
        with sdpa_route.RouteMode():
            yield
    finally:
        sdpa_route._ROUTES.pop()
        F.scaled_dot_product_attention = previous


# ------------------------------------------------------------------------ MultiheadAttention


class _WeightsPathAllowed(sdpa_route.RouteMode):
    """need_weights=True goes through: F.multi_head_attention_forward's bmm + softmax over the
    local shard, silently."""

    def check_attention_weights(self, route, args, kwargs) -> None:
        return None


def _routing_allowing_weights(route: sdpa_route.Route):
    return sdpa_route.routing(route, mode_type=_WeightsPathAllowed)


# ------------------------------------------------------------------------ buffers


class _ShardedPerListing(ShardedBuffers):
    """Each listing of a buffer is sharded: ``buffers=[x, x, x]`` shards x three times."""

    @staticmethod
    def _listed_before(entries, b):
        return None


class _NestingShardsAgain(ShardedBuffers):
    """A buffer an enclosing context already sharded is sharded again."""

    @staticmethod
    def _sharded_by_enclosing(b) -> bool:
        return False


class _GradLeftShardShaped(ShardedBuffers):
    """On exit the data comes back but ``.grad`` stays as backward left it: shard-shaped."""

    def restore(self, *, normal_exit: bool) -> None:
        for i in reversed(range(len(self.entries))):
            b, _, restore = self.entries[i]
            _cp._SHARDED.pop(id(b), None)
            if restore:
                _cp._set_data(b, self.originals[i])


# ------------------------------------------------------------------------ assembly


def _api(
    name: str, *, sharding=ShardedBuffers, route_ctx=sdpa_route.routing, style=ContextParallel
):
    """A module offering the context-parallel API with the given parts."""

    def context_parallel(mesh, **options):
        return sharded_and_routed(sharding, route_ctx, mesh, **options)

    if route_ctx is not sdpa_route.routing:
        style = type(
            f"{style.__name__}With{name.title().replace('_', '')}",
            (style,),
            {"route_ctx": staticmethod(route_ctx)},
        )
    module = types.ModuleType(
        f"{__name__}.{name}", f"ring_impl's context-parallel API with one bug: {name}"
    )
    module.context_parallel = context_parallel  # type: ignore[attr-defined]
    module.context_parallel_unshard = context_parallel_unshard  # type: ignore[attr-defined]
    module.ContextParallel = style  # type: ignore[attr-defined]
    module.shard, module.unshard = ring_impl.shard, ring_impl.unshard  # type: ignore[attr-defined]
    sys.modules[module.__name__] = module
    return module


def _implementation(name: str, api: types.ModuleType) -> RingImplAdapter:
    adapter = RingImplAdapter(name=name)
    adapter.api_module = api.__name__  # type: ignore[attr-defined]
    return adapter


def _broken(name: str, bug_class: str, expect: str, **parts) -> Broken:
    return Broken(
        name,
        bug_class,
        expect,
        _implementation(name, _api(name, **parts)),
        suites="suites/test_context_parallel.py",
    )


BROKEN_API: dict[str, Broken] = by_name(
    _broken(
        "routing_lost_under_compile",
        "silent fallback: a parallelised module compiled with torch.compile attends to the "
        "local shard",
        r"compiled parallelized module: ContextParallel then torch\.compile",
        style=RoutingInvisibleToCompile,
    ),
    _broken(
        "compiled_sdpa_fails",
        "torch.compile: SDPA compiled inside context_parallel fails (the route is not a function)",
        r"function calling SDPA inside context_parallel failed",
        route_ctx=_routing_through_an_object,
    ),
    _broken(
        "mha_weights_path_local",
        "silent fallback: nn.MultiheadAttention's default need_weights=True path attends to "
        "the local shard",
        r"MultiheadAttention with need_weights=True \(its default\)",
        route_ctx=_routing_allowing_weights,
    ),
    _broken(
        "buffers_sharded_per_listing",
        "buffers: a tensor listed more than once is sharded once per listing",
        r"sharded once per listing",
        sharding=_ShardedPerListing,
    ),
    _broken(
        "nesting_shards_again",
        "buffers: nested context_parallel shards a buffer again",
        r"nested context_parallel over a buffer the outer one already sharded sharded it again",
        sharding=_NestingShardsAgain,
    ),
    _broken(
        "grad_left_shard_shaped",
        "buffers: a Parameter buffer keeps a shard-shaped .grad after the context",
        r"shard-shaped \.grad left behind",
        sharding=_GradLeftShardShaped,
    ),
)

# Module attributes, so each is loadable as --impl meta_tests.broken_api:<name>.
globals().update({name: b.impl for name, b in BROKEN_API.items()})
