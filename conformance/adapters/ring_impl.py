"""This project's ring attention as an implementation under test (the suites' default)."""

from __future__ import annotations

import functools

import ring_impl
from conformance.implementation import Capabilities
from reference.masks import MASK_KINDS
from ring_impl import debug
from ring_impl.balance import BALANCERS, register_balanced_layout

ALL_DTYPES = frozenset({"float64", "float32", "bfloat16", "float16"})

CAPABILITIES = Capabilities(
    layouts=frozenset(ring_impl.LAYOUTS),
    rotate_methods=frozenset(ring_impl.ROTATE_METHODS),
    dtypes=ALL_DTYPES,
    devices=frozenset({"cpu", "cuda"}),
    ops=frozenset({"*"}),
    backward=True,
    lse=True,
    gqa=True,
    cross_attention=True,
    value_head_dim=True,
    compile=True,
    input_errors=True,
    context_parallel=True,
    collective_schedule=True,
    record_steps=True,
    strategies=frozenset(ring_impl.STRATEGIES),
    masks=frozenset(MASK_KINDS),
    sinks=True,
    score_mod=True,
    balancers=frozenset(BALANCERS),
    uneven_shards=True,
    packed=True,
    multi_mask_layouts=True,
)


def _protocol(ring_attention):
    """``ring_attention`` taking the protocol's ``strategy=`` ("ring", "ulysses", "hybrid"): the
    head-parallel strategies are ``ring_impl``'s ``exchange=`` values, and ``"ring"`` its default
    (the ring, or the halo exchange where it serves the call). Anything else is passed on as
    ``strategy=``, which ``ring_impl`` refuses on every rank."""

    @functools.wraps(ring_attention)
    def call(query, key, value, *, strategy=None, **options):
        if strategy in ("ulysses", "hybrid"):
            options["exchange"] = strategy
        elif strategy is not None and strategy != "ring":
            options["strategy"] = strategy
        return ring_attention(query, key, value, **options)

    return call


class RingImplAdapter:
    """Wraps a :class:`ring_impl.RingAttention` (or a variant of it) for the suites."""

    def __init__(self, impl: ring_impl.RingAttention | None = None, name: str = "ring_impl"):
        self.name = name
        self.capabilities = CAPABILITIES
        self.ring_attention = _protocol(
            ring_impl.ring_attention if impl is None else ring_impl.bind(impl)
        )
        self.baseline_op = "auto"
        # The package whose context_parallel /
        # context_parallel_unshard / ContextParallel are tested.
        self.api_module = "ring_impl"

    @staticmethod
    def collective_schedule(world_size, rotate_method, **kwargs):
        return ring_impl.collective_schedule(world_size, rotate_method, **kwargs)

    @staticmethod
    def record_steps():
        return debug.record_steps()

    @staticmethod
    def balanced_layout(balancer, mask, seq_len, world_size):
        return register_balanced_layout(balancer, mask, seq_len, world_size)


IMPLEMENTATION = RingImplAdapter()
