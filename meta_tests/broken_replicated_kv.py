"""Deliberately broken replicated key/value (``ring_attention(..., replicated_kv=True)``: key and
value the whole sequence on every rank, a cross-attention's text tokens), each caught by the
replicated key/value suite (``suites/test_replicated_kv.py``) with a failure that names the bug:

- ``replicated_kv_as_sequence_shards``: ring_impl given the call without ``replicated_kv``, so
  that every rank's whole key/value is taken for that rank's sequence shard: Ulysses' all-to-all
  (the bug class's own words: a context-parallel hook that treats the text tokens as
  sequence-sharded) where the heads divide over the group, else the ring's rotation. Every query
  attends W copies: the output is unchanged without sinks; the LSE is off by ``log W``, the
  output with sinks moves, and the collectives are an exchange the call does not have.
- ``replicated_kv_grads_reduced``: the forward right, but dK/dV all-reduced (summed) over the
  group on every rank, so that their sum over ranks (what the caller's reduction makes of them)
  is W times the gradient.

Each is wrapped as an implementation under test
(``--impl meta_tests.broken_replicated_kv:<NAME>``); ``meta_tests/test_suite_catches_bugs.py``
runs the suite against each and requires every failure to match its ``expect`` pattern and no
other broken ring's. The second wraps ring_impl's own
``replicated_kv=True`` where ring_impl has it, else math_ring's (meta_tests/correct), with that
ring's capabilities.
"""

from __future__ import annotations

import inspect
import re

import torch
import torch.distributed as dist

import ring_impl
from conformance.adapters.ring_impl import RingImplAdapter
from meta_tests.broken import Broken, by_name, function_adapter
from meta_tests.correct.math_ring import math_ring
from suites.cases_replicated_kv import DUPLICATED, EXCHANGED, GRADS_REDUCED

__all__ = ["BROKEN_REPLICATED_KV"]

#: Whether ring_impl.ring_attention takes replicated_kv= (else the correct forward is math_ring's).
RING_IMPL_REPLICATES = "replicated_kv" in inspect.signature(ring_impl.ring_attention).parameters


def _as_sequence_shards(query, key, value, *, replicated_kv=False, strategy=None, **options):
    """ring_impl's call with ``replicated_kv`` dropped, so that each rank's whole key/value is
    taken for that rank's sequence shard: on Ulysses, whose all-to-all hands every rank its heads
    of W copies (the bug class as context-parallel hooks built on Ulysses ship it), where the
    query heads divide over the group; on the ring, which rotates the W copies, elsewhere."""
    if strategy not in (None, "ring"):  # Ulysses and the hybrid: ring_impl's own
        return RingImplAdapter().ring_attention(query, key, value, strategy=strategy, **options)
    group = options.get("group")
    world = dist.get_world_size(_process_group(group))
    if replicated_kv and query.shape[1] % world == 0:
        options.pop("rotate_method", None)
        return ring_impl.ring_attention(query, key, value, exchange="ulysses", **options)
    return ring_impl.ring_attention(query, key, value, **options)


class _SummedOverGroup(torch.autograd.Function):
    """The identity forward; backward all-reduces (sums) the gradient over ``group``."""

    @staticmethod
    def forward(ctx, t, group):
        ctx.group = group
        return t.view_as(t)

    @staticmethod
    def backward(ctx, grad):
        grad = grad.contiguous().clone()
        dist.all_reduce(grad, group=ctx.group)
        return grad, None


def _process_group(group):
    """The process group of ``group`` (a group, a 1-D DeviceMesh or None)."""
    return group.get_group() if hasattr(group, "get_group") else group


def _grads_reduced(ring_attention):
    """``ring_attention`` whose replicated key and value get dK/dV summed over the group on every
    rank (each rank's contribution all-reduced), the forward untouched."""

    def call(query, key, value, *, replicated_kv=False, group=None, **options):
        if replicated_kv:
            pg = _process_group(group)
            key, value = (_SummedOverGroup.apply(t, pg) for t in (key, value))
            options["replicated_kv"] = True
        return ring_attention(query, key, value, group=group, **options)

    return call


class _OnMathRing:
    """math_ring as an implementation under test with its ``ring_attention`` replaced."""

    def __init__(self, name: str, ring_attention) -> None:
        self.name = name
        self.capabilities = math_ring.capabilities
        self.baseline_op = math_ring.baseline_op
        self.ring_attention = ring_attention
        self.collective_schedule = math_ring.collective_schedule
        self.record_steps = math_ring.record_steps


def _grads_reduced_impl(name: str):
    if RING_IMPL_REPLICATES:
        adapter = RingImplAdapter(name=name)
        adapter.ring_attention = _grads_reduced(adapter.ring_attention)
        return adapter
    return _OnMathRing(name, _grads_reduced(math_ring.ring_attention))


_SUITE = "suites/test_replicated_kv.py"

BROKEN_REPLICATED_KV: dict[str, Broken] = by_name(
    Broken(
        "replicated_kv_as_sequence_shards",
        "replicated key/value: duplicated W-fold by an exchange that treats it as sequence-sharded",
        f"{re.escape(DUPLICATED)}|{re.escape(EXCHANGED)}",
        function_adapter("replicated_kv_as_sequence_shards", _as_sequence_shards),
        suites=_SUITE,
        # on the contiguous layout (head_tail's even chunks would refuse an odd key/value length
        # as a shard first): the copies show in the LSE and with sinks; where neither is there,
        # in the collectives (the all-to-all or rotation of the copies)
        select=("-k", "test_replicated_kv_matches_reference and contiguous"),
        min_failures=9,  # (every one of the quick tier's 11: Ulysses at W 2 and 4, the ring at 3)
    ),
    Broken(
        "replicated_kv_grads_reduced",
        "replicated key/value: dK/dV all-reduced over the group on every rank",
        re.escape(GRADS_REDUCED),
        _grads_reduced_impl("replicated_kv_grads_reduced"),
        suites=_SUITE,
        select=("-k", "test_replicated_kv_matches_reference and not nobw"),
        min_failures=3,
    ),
)

# Module attributes, so each is loadable as --impl meta_tests.broken_replicated_kv:<name>.
globals().update({name: b.impl for name, b in BROKEN_REPLICATED_KV.items()})
