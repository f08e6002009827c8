"""ring_impl.planning.tiling: one step's visibility cut into kernel calls.

The property every cut must have, for any mask: the calls' rectangles are disjoint, and for
every batch and head the pairs they show (a full call: its rectangle; causal: its top-left
triangle; masked: its own visibility) are exactly the visible pairs. Then what the cuts are for:
structured masks get their exact pieces, and the computed area stays near the visible area.
"""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from ring_impl.masks import (
    Causal,
    ChunkedCausal,
    Documents,
    MaskMod,
    PrefixLM,
    SlidingWindow,
    visibility,
)
from ring_impl.planning.plan import masked_plan
from ring_impl.planning.tiling import CALL_COST, split_visibility


def _shown(calls, batch: int, heads: int, rows: int, cols: int) -> torch.Tensor:
    """How many calls show each (batch, head, row, col) pair."""
    count = torch.zeros(batch, heads, rows, cols, dtype=torch.int64)
    for kind, (r0, r1), (c0, c1), box in calls:
        assert 0 <= r0 < r1 <= rows and 0 <= c0 < c1 <= cols, (
            f"{kind} call {(r0, r1)} x {(c0, c1)} out of bounds"
        )
        if kind == "full":
            assert box is None
            count[..., r0:r1, c0:c1] += 1
        elif kind == "causal":
            assert box is None
            count[..., r0:r1, c0:c1] += torch.ones(r1 - r0, c1 - c0, dtype=torch.int64).tril()
        else:
            assert kind == "masked" and box is not None and box.shape[-2:] == (r1 - r0, c1 - c0)
            assert bool(box.any()), "a masked call that shows nothing"
            count[..., r0:r1, c0:c1] += box.to(torch.int64)
    return count


def _check_exact(vis: torch.Tensor, calls) -> None:
    b, h, rows, cols = vis.shape
    boxes = torch.zeros(rows, cols, dtype=torch.int64)
    for _, (r0, r1), (c0, c1), _ in calls:
        boxes[r0:r1, c0:c1] += 1
    assert int(boxes.max()) <= 1, "two calls overlap"
    shown = _shown(calls, b, h, rows, cols)
    assert torch.equal(shown.to(torch.bool), vis), (
        "the calls show a pair the mask hides, or miss a visible one"
    )


def _area(calls) -> int:
    total = 0
    for kind, (r0, r1), (c0, c1), _ in calls:
        r, c = r1 - r0, c1 - c0
        k = min(r, c)
        total += k * (k + 1) // 2 + (r - k) * c if kind == "causal" else r * c
    return total


def _documents(lengths: list[int], causal: bool = True) -> Documents:
    ids = torch.cat([torch.full((n,), d) for d, n in enumerate(lengths)])
    return Documents(ids, causal)


_MASKS = {
    "causal": lambda s: Causal(),
    "documents": lambda s: _documents([s // 2, 3, 1, s // 4, s - s // 2 - 4 - s // 4]),
    "documents_full": lambda s: _documents([s // 3, s - s // 3], causal=False),
    "window": lambda s: SlidingWindow(7),
    "window_both": lambda s: SlidingWindow(5, 3),
    "chunked": lambda s: ChunkedCausal(10),
    "prefix": lambda s: PrefixLM(9),
    "docs_window": lambda s: _documents([s // 2, s - s // 2]) & SlidingWindow(6),
    "sink_and_window": lambda s: MaskMod(
        lambda b, h, q, kv: (kv <= q) & ((kv < 4) | (kv >= q - 6))
    ),
    "per_head": lambda s: MaskMod(lambda b, h, q, kv: (kv <= q) & ((h == 0) | (kv >= q - 5))),
    "checkerboard": lambda s: MaskMod(lambda b, h, q, kv: (q + kv) % 3 == 0),
}


@pytest.mark.parametrize("name", sorted(_MASKS))
@pytest.mark.parametrize("call_cost", [1, 64, CALL_COST])
def test_calls_show_exactly_the_visible_pairs(name: str, call_cost: int) -> None:
    s = 96
    pos = torch.arange(s)
    vis = visibility(_MASKS[name](s), pos, pos, batch=1, heads=2)
    _check_exact(vis, split_visibility(vis, call_cost=call_cost))


@settings(max_examples=150, deadline=None)
@given(
    rows=st.integers(1, 40),
    cols=st.integers(1, 40),
    heads=st.sampled_from([1, 2]),
    density=st.floats(0.0, 1.0),
    seed=st.integers(0, 2**31 - 1),
    call_cost=st.sampled_from([1, 100, CALL_COST]),
    kind=st.sampled_from(["random", "intervals", "bands"]),
)
def test_any_visibility_is_cut_exactly(rows, cols, heads, density, seed, call_cost, kind) -> None:
    gen = torch.Generator().manual_seed(seed)
    if kind == "random":
        vis = torch.rand(1, heads, rows, cols, generator=gen) < density
    else:  # one interval per row, moving by random steps: the segments' edge cases
        lo = torch.randint(0, cols, (rows,), generator=gen)
        if kind == "bands":
            lo = (torch.arange(rows) // max(1, int(density * 4)) + int(lo[0])).clamp(max=cols - 1)
        width = torch.randint(0, cols + 1, (rows,), generator=gen)
        c = torch.arange(cols)
        vis = ((c >= lo[:, None]) & (c < lo[:, None] + width[:, None])).expand(1, heads, rows, cols)
    _check_exact(vis, split_visibility(vis, call_cost=call_cost))


def test_structured_masks_get_their_exact_pieces() -> None:
    s = 512
    pos = torch.arange(s)
    # Causal over one block: one causal call, as the kernel's own flag.
    assert [c[0] for c in split_visibility(visibility(Causal(), pos, pos))] == ["causal"]
    # Causal documents: per document a full part and a causal diagonal (none for the first piece),
    # nothing between documents.
    docs = _documents([200, 150, 162])
    calls = split_visibility(visibility(docs, pos, pos))
    assert [(c[0], c[1], c[2]) for c in calls] == [
        ("causal", (0, 200), (0, 200)),
        ("causal", (200, 350), (200, 350)),
        ("causal", (350, 512), (350, 512)),
    ]
    # Packed non-causal documents: one full call each.
    calls = split_visibility(visibility(_documents([300, 212], causal=False), pos, pos))
    assert [(c[0], c[1], c[2]) for c in calls] == [
        ("full", (0, 300), (0, 300)),
        ("full", (300, 512), (300, 512)),
    ]


@pytest.mark.parametrize("window", [64, 256])
def test_a_band_is_tiled_near_its_area(window: int) -> None:
    """A sliding window computes about (window + sqrt(call_cost)) entries per row, not the
    whole block: the band is cut into tiles of ~sqrt(call_cost) rows."""
    s = 2048
    pos = torch.arange(s)
    vis = visibility(SlidingWindow(window), pos, pos)
    calls = split_visibility(vis)
    tile = round(math.sqrt(CALL_COST))
    assert _area(calls) <= s * (window + 1 + tile), (_area(calls), s * (window + 1 + tile))
    assert len(calls) <= s // tile + 4


def test_short_documents_merge_into_one_call() -> None:
    """Documents of a few tokens each would cost a call apiece: below the call cost they are
    merged into masked calls, which still show only their own pairs."""
    s = 256
    pos = torch.arange(s)
    vis = visibility(_documents([4] * 64), pos, pos)
    calls = split_visibility(vis, call_cost=CALL_COST)
    assert len(calls) < 16, len(calls)
    _check_exact(vis, calls)
    # With calls free, each document is its own causal call.
    assert len(split_visibility(vis, call_cost=0)) == 64


def _what(plans) -> list:
    """A plan as comparable data, the masked blocks' visibility included."""
    return [
        (b.step, b.kind, b.q_rows, b.kv_rows, None if b.visible is None else b.visible.tolist())
        for p in plans
        for b in p.blocks
    ]


def test_masked_plan_is_cached_for_exact_masks_only() -> None:
    docs = _documents([30, 34])
    a = masked_plan(0, 2, layout="contiguous", mask=docs, seq_q=32, seq_kv=32, batch=1, heads=1)
    b = masked_plan(
        0, 2, layout="contiguous", mask=_documents([30, 34]), seq_q=32, seq_kv=32, batch=1, heads=1
    )
    assert all(x is y for x, y in zip(a, b)), "an equal built-in mask replans"
    other = masked_plan(
        0, 2, layout="contiguous", mask=_documents([20, 44]), seq_q=32, seq_kv=32, batch=1, heads=1
    )
    assert _what(other) != _what(a), "different documents share a plan"
    # A MaskMod's description only probes it: a closure over other data must replan.
    table = {"cut": 30}
    mod = MaskMod(lambda b, h, q, kv: (kv <= q) & ((q < table["cut"]) == (kv < table["cut"])))
    first = masked_plan(0, 2, layout="contiguous", mask=mod, seq_q=32, seq_kv=32, batch=1, heads=1)
    table["cut"] = 20
    second = masked_plan(0, 2, layout="contiguous", mask=mod, seq_q=32, seq_kv=32, batch=1, heads=1)
    assert _what(first) != _what(second), "a MaskMod's plan was reused after its data changed"


def test_plans_holding_much_visibility_are_not_kept(monkeypatch) -> None:
    """The cache keeps plans of built-in masks only while the visibility they hold is small: an
    irregular mask on long shards would otherwise pin its masked blocks' booleans."""
    from ring_impl.planning import plan as plan_module

    docs = _documents([30, 34]) | ChunkedCausal(5)  # irregular rows: masked blocks
    monkeypatch.setattr(plan_module, "_PLAN_ENTRY_BYTES", 0)
    a = masked_plan(0, 2, layout="contiguous", mask=docs, seq_q=32, seq_kv=32, batch=1, heads=1)
    b = masked_plan(0, 2, layout="contiguous", mask=docs, seq_q=32, seq_kv=32, batch=1, heads=1)
    assert any(blk.visible is not None for p in a for blk in p.blocks), (
        "the case needs a masked block"
    )
    assert not any(x is y for x, y in zip(a, b)), "a plan over the size limit was kept"
    assert _what(a) == _what(b)


def test_a_subclass_with_its_parents_description_gets_its_own_plan() -> None:
    """A subclass may change visible() and keep the parent's describe(): sharing the parent's
    cached plan would compute the parent's mask."""

    class WiderWindow(SlidingWindow):
        def visible(self, b, h, q, kv):
            return (kv <= q) & (kv >= q - 2 * self.left)

    plain = masked_plan(
        0, 1, layout="contiguous", mask=SlidingWindow(3), seq_q=16, seq_kv=16, batch=1, heads=1
    )
    wider = masked_plan(
        0, 1, layout="contiguous", mask=WiderWindow(3), seq_q=16, seq_kv=16, batch=1, heads=1
    )
    assert _what(plain) != _what(wider)
    assert SlidingWindow(3).exact_digest and (SlidingWindow(3) & Causal()).exact_digest
    assert not WiderWindow(3).exact_digest and not (WiderWindow(3) & Causal()).exact_digest
