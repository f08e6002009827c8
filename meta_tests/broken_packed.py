"""Deliberately broken rings for packed (THD) inputs and multi-mask layouts, each caught by the
packed suite (``suites/test_packed.py``) or the multi-mask layout suite
(``suites/test_multi_mask_layouts.py``).

- ``packed_cu_seqlens_local``: ``cu_seqlens`` taken as offsets into the local shard: each token's
  document is the one its *local* index falls in, on every rank.
- ``packed_padding_attended``: the tokens past ``cu_seqlens[-1]`` taken as one more document
  (the padding tokens see each other).
- ``packed_lse_bhs``: the packed LSE returned as ``(1, heads, tokens_local)`` (the 4-D call's
  layout) instead of ``(heads, tokens_local)``.
- ``balanced_for_first_mask_only``: a balancer that, given several weighted masks, balances the
  first one's work and ignores the rest (a correct layout: every check of the layout rules and
  of the outputs passes; the weighted work is what is off).

Each is ring_impl with one part replaced, wrapped as an implementation under test
(``--impl meta_tests.broken_packed:<NAME>``); ``meta_tests/test_suite_catches_bugs.py`` runs the
suite against each and requires a failure matching its ``expect`` pattern and no other's.
"""

from __future__ import annotations

import torch

import ring_impl
from conformance.adapters.ring_impl import RingImplAdapter, ring_impl_masks
from meta_tests.broken import Broken, by_name, function_adapter, ring_adapter
from meta_tests.broken_masks import DocumentsAtLocalPositions
from ring_impl.group import resolve_group
from ring_impl.planning.balance import weighted_masks

__all__ = ["BROKEN_PACKED"]


def _global_world(group) -> tuple[int, int]:
    pg = resolve_group(group)
    return torch.distributed.get_world_size(pg), torch.distributed.get_rank(pg)


def _padding_attended(query, key, value, *, cu_seqlens=None, **kwargs):
    """The padding past cu_seqlens[-1] passed on as one more document."""
    if cu_seqlens is not None:
        world, _ = _global_world(kwargs.get("group"))
        cu = [int(x) for x in torch.as_tensor(cu_seqlens).tolist()]
        tokens = query.shape[0] * world
        if cu[-1] < tokens:
            cu.append(tokens)
        cu_seqlens = cu
    return ring_impl.ring_attention(query, key, value, cu_seqlens=cu_seqlens, **kwargs)


def _lse_bhs(query, key, value, *, cu_seqlens=None, **kwargs):
    """The packed LSE returned with the 4-D call's leading batch dim: (1, heads, tokens)."""
    result = ring_impl.ring_attention(query, key, value, cu_seqlens=cu_seqlens, **kwargs)
    if cu_seqlens is not None and kwargs.get("return_lse"):
        out, lse = result
        return out, lse.unsqueeze(0)
    return result


class BalancedForFirstMaskOnly(RingImplAdapter):
    def balanced_layout(self, balancer, mask, seq_len, world_size):
        first = weighted_masks(ring_impl_masks(mask))[0][0]
        return super().balanced_layout(balancer, first, seq_len, world_size)


BROKEN_PACKED: dict[str, Broken] = by_name(
    Broken(
        "packed_cu_seqlens_local",
        "packed: cu_seqlens taken as offsets into the local shard",
        r"cu_seqlens read as offsets into the local shard",
        # ring_impl runs a packed call as a 4-D call under the documents of cu_seqlens: with
        # those documents read at each token's local index, cu_seqlens cut the local shard.
        ring_adapter("packed_cu_seqlens_local", DocumentsAtLocalPositions()),
        suites="suites/test_packed.py",
    ),
    Broken(
        "packed_padding_attended",
        "packed: the padding past cu_seqlens[-1] attended as one more document",
        r"padding past cu_seqlens\[-1\] attended",
        function_adapter("packed_padding_attended", _padding_attended),
        suites="suites/test_packed.py",
    ),
    Broken(
        "packed_lse_bhs",
        "packed: the LSE returned in the 4-D call's (1, heads, tokens) layout",
        r"the packed LSE in the layout \(1, heads, tokens_local\) instead of \(heads, "
        r"tokens_local\)",
        function_adapter("packed_lse_bhs", _lse_bhs),
        suites="suites/test_packed.py",
    ),
    Broken(
        "balanced_for_first_mask_only",
        "balance: a layout for several weighted masks balanced for the first mask only",
        r"balances the first mask's work only",
        BalancedForFirstMaskOnly(name="balanced_for_first_mask_only"),
        suites="suites/test_multi_mask_layouts.py",
    ),
)

# Module attributes, so each is loadable as --impl meta_tests.broken_packed:<name>.
globals().update({name: b.impl for name, b in BROKEN_PACKED.items()})
