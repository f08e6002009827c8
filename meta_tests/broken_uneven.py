"""Deliberately broken uneven shards (``ring_attention(shard_lengths=...)``), each caught by the
uneven-shard suite (``suites/test_uneven.py``) with a failure that names the bug:

- ``uneven_padding_attended``: every shard padded at its end to the longest one (the padding at
  global positions ``S ..``, as ring_impl.planning.uneven does), but the mask that hides the padding
  dropped: the padding keys (zeros) are seen wherever causality and the call's mask let them be.
- ``uneven_positions_from_even_split``: every shard padded to the longest, ``L`` rows, and run as
  an even contiguous call with the padding hidden: rank ``r``'s tokens sit at global positions
  ``r * L + i`` instead of after the tokens of ranks ``0 .. r-1`` (causality alone cannot tell,
  a window, documents or a mask_mod can).
- ``uneven_lse_untrimmed``: the padded call done right, the output cut to the rank's rows but the
  LSE returned with the padding rows.

Each is ring_impl's even call around a padding of its own (a vendor building uneven shards on an
even ring), wrapped as an implementation under test (``--impl
meta_tests.broken_uneven:<NAME>``); ``meta_tests/test_suite_catches_bugs.py`` runs the suite
against each and requires every failure to match its ``expect`` pattern and no other broken
ring's.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

import ring_impl
from conformance.adapters.ring_impl import RingImplAdapter
from meta_tests.broken import Broken, by_name, function_adapter
from ring_impl.masks import Documents, snapshot
from ring_impl.planning.uneven import extended_mask, padded_layout, real_tokens, uneven_views

__all__ = ["BROKEN_UNEVEN"]


def _padded(
    query,
    key,
    value,
    *,
    shard_lengths=None,
    layout="contiguous",
    is_causal=False,
    mask=None,
    return_lse=False,
    group=None,
    bug: str,
    **options,
):
    """ring_attention(shard_lengths=) as an even call on shards padded to the longest, with
    ``bug`` in it; without ``shard_lengths`` the even call itself."""
    if shard_lengths is None:
        return ring_impl.ring_attention(
            query,
            key,
            value,
            layout=layout,
            is_causal=is_causal,
            mask=mask,
            return_lse=return_lse,
            group=group,
            **options,
        )
    lengths = tuple(int(n) for n in shard_lengths)
    world, rank = len(lengths), dist.get_rank(group)
    seq, rows = sum(lengths), max(lengths)
    total = world * rows
    q, k, v = uneven_views(query, key, value, rows)
    real = None if mask is None else extended_mask(snapshot(mask), seq, total)
    if bug == "positions_from_even_split" and layout == "contiguous":
        # rank r's rows at r * rows .. r * rows + rows - 1, its padding (id -1) hidden
        ids = torch.tensor([0 if i % rows < lengths[i // rows] else -1 for i in range(total)])
        hide = Documents(ids, is_causal)
        layout, is_causal, mask = "contiguous", False, hide if real is None else hide & real
    elif bug == "padding_attended":  # the padded layout, but nothing hides the padding
        layout, mask = padded_layout(layout, lengths), real
    else:  # the padding hidden as it must be
        hide = real_tokens(seq, total, bool(is_causal))
        layout, is_causal = padded_layout(layout, lengths), False
        mask = hide if real is None else hide & real
    res = ring_impl.ring_attention(
        q,
        k,
        v,
        layout=layout,
        is_causal=is_causal,
        mask=mask,
        return_lse=return_lse,
        group=group,
        **options,
    )
    n = lengths[rank]
    if not isinstance(res, tuple):
        return res[:, :, :n]
    out, *rest = res
    if return_lse and bug != "lse_untrimmed":
        rest[0] = rest[0][:, :, :n]
    return (out[:, :, :n], *rest)


def _adapter(bug: str) -> RingImplAdapter:
    def ring_attention(query, key, value, *, strategy=None, **options):
        if strategy not in (None, "ring"):  # Ulysses and the hybrid: ring_impl's own
            return RingImplAdapter().ring_attention(query, key, value, strategy=strategy, **options)
        return _padded(query, key, value, bug=bug, **options)

    return function_adapter(f"uneven_{bug}", ring_attention)


#: Case selections of suites/test_uneven.py: non-causal cases without a mask (the padding is
#: in every row's reach), contiguous cases with a window, documents or a mask_mod (positions
#: matter beyond their order), cases that return the LSE.
_UNMASKED = (
    "test_uneven_shards_match_reference and full and not window and not documents and not mask_mod"
)
_POSITIONAL = (
    "test_uneven_shards_match_reference and contiguous and (window or documents or mask_mod)"
)
_WITH_LSE = "test_uneven_shards_match_reference and not nolse"

BROKEN_UNEVEN: dict[str, Broken] = by_name(
    Broken(
        "uneven_padding_attended",
        "uneven shards: the padding keys are attended",
        r"padding keys were attended",
        _adapter("padding_attended"),
        suites="suites/test_uneven.py",
        select=("-k", _UNMASKED),
        min_failures=3,
    ),
    Broken(
        "uneven_positions_from_even_split",
        "uneven shards: global positions from an even split",
        r"global positions from an even split",
        _adapter("positions_from_even_split"),
        suites="suites/test_uneven.py",
        select=("-k", _POSITIONAL),
        min_failures=3,
    ),
    Broken(
        "uneven_lse_untrimmed",
        "uneven shards: the LSE keeps the padding rows",
        r"padding rows not trimmed",
        _adapter("lse_untrimmed"),
        suites="suites/test_uneven.py",
        select=("-k", _WITH_LSE),
        min_failures=5,
    ),
)

globals().update({name: b.impl for name, b in BROKEN_UNEVEN.items()})
