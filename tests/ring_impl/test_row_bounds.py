"""Masks as one key range per query row (ring_impl.planning.row_bounds) and the one-block steps the
ring plans from them (ring_impl.planning.plan.range_blocks): exact against the dense visibility for
every built-in mask on any increasing key positions, refused (None) where a row's keys are no
range."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from ring_impl.masks import (
    Causal,
    ChunkedCausal,
    Documents,
    Full,
    MaskMod,
    PrefixLM,
    SlidingWindow,
    visibility,
)
from ring_impl.planning.plan import masked_plan, range_blocks
from ring_impl.planning.row_bounds import column_bounds


def _dense(bounds: tuple[torch.Tensor, torch.Tensor], cols: int) -> torch.Tensor:
    lo, hi = bounds
    c = torch.arange(cols)
    return (c >= lo.view(-1, 1)) & (c < hi.view(-1, 1))


def _ids(data, n: int, label: str, padding: bool) -> torch.Tensor:
    """Non-decreasing document ids over ``n`` positions; with ``padding``, -1 runs between (and,
    when drawn, inside) documents."""
    lengths = data.draw(
        st.lists(st.integers(1, max(1, n // 2)), min_size=1, max_size=6), label=f"{label} lengths"
    )
    ids = torch.cat([torch.full((length,), d) for d, length in enumerate(lengths)])[:n]
    ids = torch.cat([ids, torch.full((n - ids.numel(),), -1)]) if ids.numel() < n else ids
    if padding:
        for at in data.draw(st.lists(st.integers(0, n - 1), max_size=3), label=f"{label} padding"):
            ids[at] = -1
    return ids


def _mask(data, n_q: int, n_kv: int, depth: int = 0):
    kind = data.draw(
        st.sampled_from(
            ["full", "causal", "window", "chunked", "prefix", "documents", "and"]
            if depth == 0
            else ["full", "causal", "window", "chunked", "prefix", "documents"]
        ),
        label="mask",
    )
    side = st.one_of(st.none(), st.integers(0, 12))
    if kind == "full":
        return Full()
    if kind == "causal":
        return Causal()
    if kind == "window":
        return SlidingWindow(data.draw(side, label="left"), data.draw(side, label="right"))
    if kind == "chunked":
        return ChunkedCausal(data.draw(st.integers(1, 9), label="chunk"))
    if kind == "prefix":
        return PrefixLM(data.draw(st.integers(0, n_kv), label="prefix"))
    if kind == "documents":
        padding = data.draw(st.booleans(), label="padding")
        ids = _ids(data, n_q, "query", padding)
        kv_ids = (
            _ids(data, n_kv, "key", padding)
            if n_q != n_kv or data.draw(st.booleans(), label="cross")
            else None
        )
        return Documents(ids, causal=data.draw(st.booleans(), label="causal"), kv_doc_ids=kv_ids)
    return _mask(data, n_q, n_kv, 1) & _mask(data, n_q, n_kv, 1)


@settings(max_examples=300, deadline=None, derandomize=True, database=None)
@given(data=st.data())
def test_column_bounds_are_the_dense_visibility(data) -> None:
    """Wherever bounds are given they show exactly the pairs the mask shows, for query positions
    in any order and increasing key positions with gaps (a shard of any layout); documents are
    refused only when padding sits inside one of them."""
    n_q, n_kv = (
        data.draw(st.integers(1, 40), label="seq_q"),
        data.draw(st.integers(1, 40), label="seq_kv"),
    )
    mask = _mask(data, n_q, n_kv)
    q_pos = torch.tensor(
        data.draw(st.lists(st.integers(0, n_q - 1), min_size=1, max_size=20), label="q_pos")
    )
    kv_pos = torch.tensor(
        sorted(
            data.draw(st.sets(st.integers(0, n_kv - 1), min_size=1, max_size=20), label="kv_pos")
        )
    )
    bounds = column_bounds(mask, q_pos, kv_pos)
    want = visibility(mask, q_pos, kv_pos)[0, 0]
    if bounds is None:
        # the only refusal: a row whose visible keys are no range of columns
        rows = [r.nonzero().flatten() for r in want]
        assert (
            any(int(r.numel()) > 0 and int(r[-1] - r[0] + 1) != r.numel() for r in rows)
            or "documents" in mask.describe()
        ), f"{mask.describe()}: refused although every row's keys are a range"
        return
    assert torch.equal(_dense(bounds, kv_pos.numel()), want), mask.describe()


def test_what_has_no_range_form_is_refused() -> None:
    pos = torch.arange(16)
    padded = torch.tensor([0] * 5 + [-1] + [0] * 4 + [1] * 6)  # padding inside document 0
    assert column_bounds(Documents(padded), pos, pos) is None
    assert column_bounds(MaskMod(lambda b, h, q, kv: kv <= q), pos, pos) is None
    assert column_bounds(Causal() | SlidingWindow(2), pos, pos) is None

    class Shifted(Causal):  # a subclass may change visible: never trusted with its parent's rule
        def visible(self, b, h, q, kv):
            return kv < q

    assert column_bounds(Shifted(), pos, pos) is None
    assert column_bounds(Causal(), pos, torch.tensor([3, 1, 2])) is None  # keys not increasing


def test_a_step_is_one_block_trimmed_to_what_its_rows_see() -> None:
    pos = torch.arange(64)
    ids = torch.repeat_interleave(torch.arange(4), torch.tensor([10, 20, 30, 4]))
    (block,) = range_blocks(Documents(ids), pos, pos, 0, 0)
    assert block.kind == "ranges" and block.q_rows == (0, 64) and block.kv_rows == (0, 64)
    assert torch.equal(_dense(block.bounds, 64), visibility(Documents(ids), pos, pos)[0, 0])
    assert block.work == int(visibility(Documents(ids), pos, pos).sum())
    (causal,) = range_blocks(Causal(), pos, pos, 0, 0)
    assert causal.kind == "causal" and causal.bounds is None
    (full,) = range_blocks(Causal(), pos + 64, pos, 1, 0)
    assert full.kind == "full"
    assert range_blocks(Causal(), pos, pos + 64, 1, 1) == ()  # nothing seen: the step is skipped
    # a window from the previous shard: trimmed to the rows and keys it reaches
    (tail,) = range_blocks(SlidingWindow(8), pos + 64, pos, 1, 0)
    assert tail.q_rows == (0, 8) and tail.kv_rows == (56, 64)  # query 64 sees keys 56 .. 63


@pytest.mark.parametrize("layout", ["contiguous", "head_tail"])
@pytest.mark.parametrize("world", [1, 2, 3, 4])
def test_ranges_plans_cover_what_tiled_plans_cover(layout: str, world: int) -> None:
    """Every rank's steps under a range plan show exactly the pairs of the tiled plan (the
    plan without row bounds), one block per step."""
    seq = 48 * world
    ids = torch.repeat_interleave(torch.arange(5), torch.tensor([7, 1, 30, 2, seq - 40]))
    for mask in (
        Documents(ids),
        SlidingWindow(9),
        Documents(ids) & SlidingWindow(5),
        PrefixLM(13),
        ChunkedCausal(11),
    ):
        for rank in range(world):
            args = dict(
                layout=layout, mask=mask, seq_q=seq // world, seq_kv=seq // world, batch=1, heads=1
            )
            for ranged, tiled in zip(
                masked_plan(rank, world, ranges=True, **args), masked_plan(rank, world, **args)
            ):
                assert len(ranged.blocks) <= 1
                assert _shown(ranged.blocks, seq // world) == _shown(tiled.blocks, seq // world), (
                    mask.describe(),
                    rank,
                    ranged.step,
                )


def _shown(blocks, n: int) -> list[list[bool]]:
    shown = torch.zeros(n, n, dtype=torch.bool)
    for b in blocks:
        (r0, r1), (c0, c1) = b.q_rows, b.kv_rows
        if b.kind == "full":
            part = torch.ones(r1 - r0, c1 - c0, dtype=torch.bool)
        elif b.kind == "causal":
            part = torch.ones(r1 - r0, c1 - c0, dtype=torch.bool).tril()
        elif b.kind == "ranges":
            part = _dense(b.bounds, c1 - c0)
        else:
            part = b.visible.any(0).any(0)
        shown[r0:r1, c0:c1] |= part
    return shown.tolist()
