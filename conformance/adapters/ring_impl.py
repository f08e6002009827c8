"""This project's ring attention as an implementation under test (the suites' default)."""

from __future__ import annotations

import functools
import weakref
from collections.abc import Mapping

import torch

import ring_impl
from conformance.implementation import Capabilities
from conformance.specs import MaskSpec, ScoreModSpec
from reference.masks import MASK_KINDS
from ring_impl import debug, masks, score_mods
from ring_impl.planning.balance import BALANCERS, register_balanced_layout

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
    replicated_kv=True,
)


#: MaskSpec -> the ring_impl mask built from it: one object per spec, so a spec used again (by
#: every layer of a model, or after its document ids are refilled in place) reaches ring_impl as
#: the same mask, whose own snapshot decides what changed.
_MASKS: weakref.WeakKeyDictionary[MaskSpec, masks.Mask] = weakref.WeakKeyDictionary()


def ring_impl_mask(mask):
    """``mask`` as ``ring_impl`` takes it: a :class:`~conformance.specs.MaskSpec` (or any mapping
    of :mod:`reference.masks`' data) built into a :class:`ring_impl.masks.Mask` (the caller's
    id tensors held, not copied); a ring_impl mask or None passed on."""
    if not isinstance(mask, Mapping):
        return mask
    if isinstance(mask, MaskSpec) and not torch.compiler.is_compiling():
        built = _MASKS.get(mask)
        if built is None:
            built = _MASKS[mask] = masks.from_spec(mask)
        return built
    return masks.from_spec(mask)


def ring_impl_masks(mask_or_pairs):
    """:func:`ring_impl_mask` of one mask, or of each mask of a sequence (of masks or of
    ``(mask, weight)`` pairs, for a multi-mask layout)."""
    if isinstance(mask_or_pairs, (list, tuple)):
        return [
            (ring_impl_mask(e[0]), *e[1:]) if isinstance(e, tuple) else ring_impl_mask(e)
            for e in mask_or_pairs
        ]
    return ring_impl_mask(mask_or_pairs)


def ring_impl_score_mod(score_mod):
    """``score_mod`` as ``ring_impl`` takes it: a :class:`~conformance.specs.ScoreModSpec`
    built into its ``ring_impl.score_mods`` descriptor (SoftCap, Alibi, PostScaleBias: kernels
    that know the kind take it without probing a callable); any other callable passed on."""
    if isinstance(score_mod, ScoreModSpec):
        return score_mods.from_spec(score_mod)
    return score_mod


def speaking_specs(ring_attention):
    """``ring_attention`` (ring_impl's, or a variant's) taking the suites' plain-data ``mask=``
    and ``score_mod=`` (:mod:`conformance.specs`)."""

    @functools.wraps(ring_attention)
    def call(query, key, value, *, mask=None, score_mod=None, **options):
        if mask is not None:
            options["mask"] = ring_impl_mask(mask)
        if score_mod is not None:
            options["score_mod"] = ring_impl_score_mod(score_mod)
        return ring_attention(query, key, value, **options)

    return call


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
    """Wraps a :class:`ring_impl.RingAttention` (or a variant of it) for the suites.

    Whatever ``ring_attention`` it is given (a variant's own function too) takes the suites'
    plain-data masks and score_mods (:func:`speaking_specs`)."""

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

    @property
    def ring_attention(self):
        return self._ring_attention

    @ring_attention.setter
    def ring_attention(self, fn) -> None:
        self._ring_attention = speaking_specs(fn)

    @staticmethod
    def collective_schedule(world_size, rotate_method, *, mask=None, **kwargs):
        """ring_impl's schedule; ``mask`` (plain data) as :func:`ring_impl_mask` builds it."""
        mask = ring_impl_mask(mask)
        return ring_impl.collective_schedule(world_size, rotate_method, mask=mask, **kwargs)

    @staticmethod
    def record_steps():
        return debug.record_steps()

    @staticmethod
    def balanced_layout(balancer, mask, seq_len, world_size):
        return register_balanced_layout(balancer, ring_impl_masks(mask), seq_len, world_size)


IMPLEMENTATION = RingImplAdapter()
