"""Ring attention (context-parallel attention) for PyTorch.

Public API::

    ring_attention(query, key, value, *, group=None, is_causal=False, scale=None,
                   rotate_method=None, op=None, layout="contiguous", return_lse=False,
                   head_chunks=1, mask=None, sinks=None,  # masks on global positions; sink logits
                   score_mod=None,                   # soft-cap, ALiBi, bias, fn: ring_impl.score_mods
                   exchange="auto", cu_seqlens=None, # "ring", "halo", "gather", "ulysses", "hybrid"; THD
                   shard_lengths=None)               # uneven shards: tokens per rank (ring_impl.planning.uneven)
    set_rotate_method(name)            # "allgather" (default), "alltoall", "p2p" (ring_impl.transports)
    shard / unshard / shard_lengths    # layouts "contiguous", "head_tail", registered ones
    register_layout / Layout / layouts # a layout is the global positions each rank holds (ring_impl.layout)
    context_parallel / context_parallel_unshard / ContextParallel
    flex_attention                     # flex attention; ring attention with its block mask under a route
    register_op / available_ops / AttentionOp / OpCapabilities
    collective_schedule                # the collectives a call issues, per phase
    exchanges.local_shard / shard / unshard  # sharding for exchange="ulysses" / "hybrid"

Rooms: exchanges/ (ring, halo, kv_gather, ulysses, hybrid), planning/, schedule/, numerics/,
checks/, compiled/, torch_api/, ops/, transports/ (docs/architecture.md).
"""  # noqa: E501

from __future__ import annotations

from . import exchanges, masks, moved, score_mods
from .api import bind, get_rotate_method, ring_attention, set_rotate_method
from .checks.inputs import InputError
from .exchanges.ring import RingAttention
from .layout import LAYOUTS, Layout, layouts, register_layout, shard, shard_lengths, unshard
from .ops import AttentionOp, OpCapabilities, available_ops, get_op, register_op
from .planning.mesh_layout import STRATEGIES
from .schedule import collective_schedule
from .torch_api.context_parallel import (
    ContextParallelError,
    context_parallel,
    context_parallel_unshard,
)
from .torch_api.flex_route import flex_attention
from .torch_api.parallel_style import ContextParallel
from .transports import ROTATE_METHODS, Transport, get_transport, register_transport, rotate_methods

moved.install()


def __getattr__(name: str):
    """An old flat module path as an attribute (``ring_impl.plan``): :mod:`ring_impl.moved`."""
    return moved.module_getattr(name)


__all__ = [
    "LAYOUTS",
    "ROTATE_METHODS",
    "STRATEGIES",
    "AttentionOp",
    "ContextParallel",
    "ContextParallelError",
    "InputError",
    "Layout",
    "OpCapabilities",
    "RingAttention",
    "Transport",
    "available_ops",
    "bind",
    "collective_schedule",
    "context_parallel",
    "context_parallel_unshard",
    "exchanges",
    "flex_attention",
    "get_op",
    "get_rotate_method",
    "get_transport",
    "layouts",
    "masks",
    "register_layout",
    "register_op",
    "register_transport",
    "ring_attention",
    "rotate_methods",
    "score_mods",
    "set_rotate_method",
    "shard",
    "shard_lengths",
    "unshard",
]
