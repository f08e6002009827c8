"""Calls checked before: a repeated call skips what its shapes, options and mask decided.

A model calls ring attention with the same shapes, options and mask in every layer and every
step. What :func:`ring_impl.api.ring_path` derives from those alone (the op and scale resolved,
the local checks and the mask's passed, the exchange chosen, the
:class:`ring_impl.exchanges.ring.RingConfig` built) comes out the same each time, and on a GPU
that host work sits in front of the first kernel with nothing on the device to hide it. So a
call that passed is kept here, under a key made of everything that work reads, and the next
call with the same key takes its result. Nothing a call reads of its tensors' values is kept:
the cross-rank check (with the group's finite verdict) runs on every call of more than one rank,
and every path decides its non-finite handling per call.

The key holds, each option with its type (``head_chunks=True`` is not ``head_chunks=1``): query,
key and value's shape, strides, dtype, device and ``requires_grad`` (plain tensors only: a
subclass such as DTensor is checked every time); grad mode; the resolved group; the
implementation; every option of the :class:`ring_impl.call.Call`; the mask's description where it
determines the mask and its problems (``settled``: built-in masks and snapshots of documents,
whose ids are this library's own copy, so ids refilled in place give another description); and
the generations of the op and layout registries (a name registered again may mean something
else). A call with sinks, a score_mod, a mask its description does not determine (a MaskMod) or
an option that cannot be hashed is never kept: it is checked in full every time.
"""

from __future__ import annotations

import collections
from typing import Any, NamedTuple

import torch

from ..layout import layout_generation
from ..masks import settled
from ..ops.registry import registry_generation

__all__ = ["CHECKED", "Checked", "CheckedCalls", "for_this_call"]


class Checked(NamedTuple):
    """What a checked call decided, for the next call with its key: ``local`` its
    :class:`ring_impl.checks.inputs.LocalCall` without the tensors, ``cfg`` its RingConfig
    without the per-call ``plan_memo`` and ``verdicts``, ``gather``/``reach`` the exchange it
    takes, ``mask_code`` what it sends to the cross-rank check, ``world`` the group's size.
    ``held``: the objects the key names by identity (the implementation, the group, an op
    object), kept alive with the entry so that no other object can take their ids."""

    local: Any
    cfg: Any
    gather: bool
    reach: Any
    mask_code: int
    world: int
    held: tuple


class CheckedCalls:
    """The last ``size`` checked calls, least recently used dropped first. A model repeats a few
    calls (one per attention shape); an entry holds its mask (documents: their ids, and the copies
    made of them on the inputs' device), so few are kept."""

    def __init__(self, size: int = 16):
        self.size = size
        self._kept: collections.OrderedDict[tuple, Checked] = collections.OrderedDict()

    def key(self, impl, call, group, query, key, value) -> tuple | None:
        """The key of ``call`` on these tensors over ``group`` (resolved), or None for a call that
        is never kept (see the module docstring)."""
        mask = call.mask
        if (
            call.problem is not None
            or call.sinks is not None
            or call.score_mod is not None
            or (mask is not None and not settled(mask))
            or type(query) is not torch.Tensor  # (subclasses, DTensor: checked every time)
            or type(key) is not torch.Tensor
            or type(value) is not torch.Tensor
            or torch.compiler.is_compiling()
        ):
            return None
        op = call.op
        c = call
        return (
            id(impl),
            id(group),
            *(type(v) for v in (c.is_causal, c.scale, c.return_lse, c.return_max_logit)),
            *(type(v) for v in (c.head_chunks, c.layout, c.rotate_method, c.exchange, op)),
            type(c.replicated_kv),
            c.replicated_kv,
            c.is_causal,
            c.scale,
            c.return_lse,
            c.return_max_logit,
            c.head_chunks,
            c.layout,
            c.rotate_method,
            c.exchange,
            op if op is None or isinstance(op, str) else id(op),
            c.routed_from,
            None if mask is None else mask.describe(),
            *(t.shape for t in (query, key, value)),
            *(t.stride() for t in (query, key, value)),
            *(t.dtype for t in (query, key, value)),
            *(t.device for t in (query, key, value)),
            query.requires_grad,
            key.requires_grad,
            value.requires_grad,
            torch.is_grad_enabled(),
            registry_generation(),
            layout_generation(),
        )

    def get(self, key: tuple) -> Checked | None:
        """The kept result for ``key``, or None (also for a key holding an option that cannot be
        hashed: such a call is checked in full, every time)."""
        try:
            hit = self._kept.get(key)
            if hit is not None:
                self._kept.move_to_end(key)
        except TypeError:
            return None
        except KeyError:  # (another thread's call dropped it meanwhile: it was found all the same)
            pass
        return hit

    def keep(self, key: tuple, checked: Checked) -> None:
        try:
            self._kept[key] = checked
        except TypeError:  # an option that cannot be hashed: not kept
            return
        self._kept.move_to_end(key)
        while len(self._kept) > self.size:
            self._kept.popitem(last=False)

    def clear(self) -> None:
        self._kept.clear()

    def __len__(self) -> int:
        return len(self._kept)


def for_this_call(cfg):
    """A copy of the kept RingConfig ``cfg`` with this call's own (empty) ``plan_memo`` and
    ``verdicts``, its fields written directly: ``dataclasses.replace`` re-runs the constructor
    over every field, several times the cost, on the path this module exists to shorten."""
    fresh = object.__new__(type(cfg))
    fresh.__dict__.update(cfg.__dict__, plan_memo={}, verdicts={})
    return fresh


#: The calls ``ring_impl.api.ring_path`` has checked.
CHECKED = CheckedCalls()
