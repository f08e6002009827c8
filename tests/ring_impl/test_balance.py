"""Balance as a property: each rank's work (score area) under a mask, from the plan the ring
runs; a work-aware layout and head_tail per document that balance packed documents where
head_tail cannot; the ring stays right on them."""

from __future__ import annotations

import random

import pytest
import torch

from reference import attention_grads
from reference.budget import assert_close, error_scales
from reference.masks import visibility
from tests.ring_impl.oracle import assert_float64_results_match_oracle


def _lognormal_doc_ids(seq: int, seed: int) -> torch.Tensor:
    """Packed documents with lognormal lengths (one long, many short), filled to ``seq``."""
    rng = random.Random(seed)
    ids, d = [], 0
    while len(ids) < seq:
        n = max(1, int(rng.lognormvariate(4.0, 1.2)))
        ids += [d] * n
        d += 1
    return torch.tensor(ids[:seq])


def _imbalance(work: list[int]) -> float:
    return max(work) / (sum(work) / len(work))


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_work_aware_layout_balances_packed_documents(seed: int) -> None:
    from ring_impl import register_layout
    from ring_impl.masks import Documents
    from ring_impl.planning.balance import rank_work, work_balanced_layout

    seq, world = 2048, 4
    mask = Documents(_lognormal_doc_ids(seq, seed))
    name = register_layout(
        work_balanced_layout(f"test_docs_{seed}", mask, seq, world, chunks_per_rank=16),
        replace=True,
    ).name
    balanced, head_tail = (
        _imbalance(rank_work(name, mask, seq, world)),
        _imbalance(rank_work("head_tail", mask, seq, world)),
    )
    print(f"seed {seed}: max/mean work, work-aware {balanced:.3f}, head_tail {head_tail:.3f}")
    assert balanced <= 1.05, (
        f"work-aware layout: max/mean work {balanced:.3f} (head_tail {head_tail:.3f})"
    )
    assert balanced <= head_tail


@pytest.mark.parametrize("world", [32, 64])
def test_work_aware_layout_balances_a_long_document_at_large_worlds(world: int) -> None:
    """The balance suite's packed documents at W=32, 64 (128 tokens per rank, lognormal lengths
    around one document of a third of the sequence): the long document's tail makes heavy
    chunks, few per rank, where the greedy deal alone leaves the heaviest rank 3-6% above the
    mean; with the swaps after it the layout keeps the balancer's promise (1.05). Work is
    counted from the mask's visible pairs per row on the layout's global positions."""
    from ring_impl.masks import Documents
    from ring_impl.planning.balance import work_balanced_layout

    seq = 128 * world
    rng = random.Random(1000 * world + seq)  # the suite's seed (suites/cases_balance.py)
    lengths: list[int] = []
    while sum(lengths) < seq - seq // 3:
        lengths.append(max(1, int(rng.lognormvariate(3.0, 1.0))))
    lengths[-1] -= sum(lengths) - (seq - seq // 3)
    lengths = [n for n in lengths if n > 0]
    lengths.insert(rng.randrange(len(lengths) + 1), seq // 3)
    ids = torch.tensor([d for d, n in enumerate(lengths) for _ in range(n)])
    layout = work_balanced_layout(f"test_long_doc_{world}", Documents(ids), seq, world)
    pos = torch.arange(seq)
    # causal within documents: row i sees the keys of its document up to i
    keys = ((ids[:, None] == ids[None, :]) & (pos[None, :] <= pos[:, None])).sum(1)
    work = []
    for rank in range(world):
        rows = torch.cat([pos[a:b] for a, b in layout.runs(seq, world, rank)])
        assert len(rows) == seq // world
        work.append(int(keys[rows].sum()))
    assert sum(work) == int(keys.sum())
    assert _imbalance(work) <= 1.05, (world, _imbalance(work), work)


@pytest.mark.parametrize("seed", range(6))
def test_swaps_after_the_deal_never_raise_the_heaviest_rank(seed: int) -> None:
    """The swap pass keeps every chunk once and each rank's chunk count, and its heaviest rank
    is never heavier than the greedy deal's."""
    from ring_impl.planning.balance import _refine_by_swaps

    rng = random.Random(seed)
    world, k = rng.choice([(2, 3), (4, 8), (7, 5), (16, 8)])
    weight = [rng.lognormvariate(0.0, 2.0) for _ in range(world * k)]
    held = [list(range(r * k, (r + 1) * k)) for r in range(world)]
    if seed % 2:  # an uneven deal: the first ranks hold one chunk more
        held[0].append(world * k)
        weight.append(rng.random())
    before = max(sum(weight[c] for c in h) for h in held)
    counts = [len(h) for h in held]
    _refine_by_swaps(held, weight)
    assert sorted(c for h in held for c in h) == list(range(len(weight)))
    assert [len(h) for h in held] == counts
    assert max(sum(weight[c] for c in h) for h in held) <= before + 1e-9


def test_work_is_the_visible_area() -> None:
    """Per-rank work sums to the mask's visible area: nothing invisible computed, nothing lost."""
    from ring_impl.masks import Causal, Documents, SlidingWindow
    from ring_impl.planning.balance import rank_work, register_balanced_layout

    seq, world = 96, 3
    pos = torch.arange(seq)
    for mask in (Causal(), SlidingWindow(5), Documents(_lognormal_doc_ids(seq, 3))):
        area = int(mask.visible(None, None, pos.view(-1, 1), pos.view(1, -1)).sum())
        balanced = [
            register_balanced_layout(b, mask, seq, world)[0]
            for b in ("document_head_tail", "work_aware")
        ]
        for layout in ("contiguous", "head_tail", *balanced):
            assert sum(rank_work(layout, mask, seq, world)) == area, (mask, layout)


def _ids(lengths: list[int]) -> torch.Tensor:
    return torch.tensor([d for d, n in enumerate(lengths) for _ in range(n)])


def _registered(layout) -> str:
    from ring_impl import register_layout

    return register_layout(layout, replace=True).name


@pytest.mark.parametrize("world", [1, 2, 3, 4])
def test_document_head_tail_gives_each_rank_a_head_and_a_tail_of_every_document(world: int) -> None:
    from ring_impl.layout import layout_runs
    from ring_impl.planning.balance import document_head_tail_layout

    lengths = [4 * world, 6 * world, 2 * world]  # multiples of 2W: no leftovers
    seq = sum(lengths)
    name = _registered(document_head_tail_layout("test_dht_even", _ids(lengths), seq, world))
    starts = [sum(lengths[:d]) for d in range(len(lengths))]
    for r in range(world):
        want = []
        for a, n in zip(starts, lengths):
            m = n // (2 * world)
            want += [
                (a + r * m, a + (r + 1) * m),
                (a + (2 * world - 1 - r) * m, a + (2 * world - r) * m),
            ]
        held = torch.cat([torch.arange(a, b) for a, b in layout_runs(name, seq, world, r)])
        assert held.tolist() == torch.cat([torch.arange(a, b) for a, b in want]).tolist(), r


@pytest.mark.parametrize(
    "lengths", [[1, 2, 3, 5, 7, 11, 1, 18], [3] * 8, [1] * 24, [50, 1, 1, 20], [23, 1]]
)
@pytest.mark.parametrize("world", [2, 3, 4])
def test_document_head_tail_keeps_the_layout_rules_for_any_lengths(
    lengths: list[int], world: int
) -> None:
    """Leftovers and documents shorter than 2W: every rank S/W tokens, each once, in increasing
    order (layout_runs checks them), and each rank holds at most two runs per document."""
    from ring_impl.layout import layout_runs
    from ring_impl.planning.balance import document_head_tail_layout, document_spans

    seq = -(-sum(lengths) // world) * world
    ids = torch.cat(
        [_ids(lengths), torch.full((seq - sum(lengths),), -1)]
    )  # padding: one more document
    name = _registered(document_head_tail_layout("test_dht_any", ids, seq, world))
    runs = [layout_runs(name, seq, world, r) for r in range(world)]  # raises if a rule is broken
    assert sorted(p for rr in runs for a, b in rr for p in range(a, b)) == list(range(seq))
    for a, b in document_spans(ids, seq):
        for r in range(world):
            inside = [(max(a, x), min(b, y)) for x, y in runs[r] if x < b and y > a]
            assert len(inside) <= 2, (a, b, r, inside)
            assert sum(y - x for x, y in inside) <= -(-(b - a) // world) + 1


def test_balancers_split_a_length_the_ranks_do_not_divide() -> None:
    """10 tokens over 4 ranks: an uneven layout (ring_attention(shard_lengths=)) whose counts
    are as close as the balancer deals them, every position held once; shorter than the ranks
    is refused."""
    from ring_impl.layout import layout_runs, shard_lengths
    from ring_impl.masks import Causal
    from ring_impl.planning.balance import document_head_tail_layout, work_balanced_layout

    for layout, spread in (
        (document_head_tail_layout("test_dht_uneven", _ids([5, 5]), 10, 4), 1),
        (work_balanced_layout("test_wa_uneven", Causal(), 10, 4, chunks_per_rank=2), 2),
    ):
        name = _registered(layout)
        lengths = shard_lengths(10, 4, name)
        assert sum(lengths) == 10 and max(lengths) - min(lengths) <= spread, lengths
        runs = [layout_runs(name, 10, 4, r) for r in range(4)]
        assert sorted(p for rr in runs for a, b in rr for p in range(a, b)) == list(range(10))
    with pytest.raises(ValueError, match="shorter than world_size 4"):
        document_head_tail_layout("x", _ids([2, 1]), 3, 4)
    with pytest.raises(ValueError, match="shorter than its 8 chunks"):
        work_balanced_layout("x", Causal(), 7, 4, chunks_per_rank=2)


def test_document_head_tail_is_head_tail_without_documents() -> None:
    from ring_impl.layout import permutation
    from ring_impl.masks import Causal, SlidingWindow
    from ring_impl.planning.balance import register_balanced_layout

    for mask in (Causal(), SlidingWindow(5)):
        name, _ = register_balanced_layout("document_head_tail", mask, 48, 3)
        assert torch.equal(permutation(name, 48, 3), permutation("head_tail", 48, 3))


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_work_of_head_tail_per_document_against_head_tail_and_work_aware(seed: int) -> None:
    """Packed documents: head_tail per document and the work-aware layout balance (<= 1.05),
    head_tail does not; causal without documents: head_tail per document is head_tail (1.0)."""
    from ring_impl.masks import Causal, Documents
    from ring_impl.planning.balance import imbalance, rank_work, register_balanced_layout

    seq, world = 2048, 4
    mask = Documents(_lognormal_doc_ids(seq, seed))
    figures = {}
    for layout in ("head_tail", "document_head_tail", "work_aware"):
        name = (
            layout
            if layout == "head_tail"
            else register_balanced_layout(layout, mask, seq, world)[0]
        )
        figures[layout] = imbalance(rank_work(name, mask, seq, world))
    print(f"seed {seed}: max/mean work {figures}")
    assert figures["document_head_tail"] <= 1.05 and figures["work_aware"] <= 1.05, figures
    assert (
        figures["document_head_tail"] < figures["head_tail"]
        and figures["work_aware"] < figures["head_tail"]
    ), figures
    name, _ = register_balanced_layout("document_head_tail", Causal(), seq, world)
    assert rank_work(name, Causal(), seq, world) == rank_work("head_tail", Causal(), seq, world)
    assert imbalance(rank_work(name, Causal(), seq, world)) == 1.0


def test_balanced_layout_names_are_equal_for_equal_arguments() -> None:
    from ring_impl.masks import Documents
    from ring_impl.planning.balance import register_balanced_layout

    mask = Documents(_lognormal_doc_ids(256, 4))
    first, second = (register_balanced_layout("work_aware", mask, 256, 4) for _ in range(2))
    assert first == second
    other = register_balanced_layout("work_aware", Documents(_lognormal_doc_ids(256, 5)), 256, 4)
    assert other[0] != first[0]
    with pytest.raises(ValueError, match="unknown balancer 'zigzag'"):
        register_balanced_layout("zigzag", mask, 256, 4)


def _balanced(balancer: str, doc_ids: torch.Tensor, seq: int, world: int) -> str:
    import ring_impl
    from ring_impl.masks import Documents
    from ring_impl.planning.balance import document_head_tail_layout, work_balanced_layout

    if balancer == "work_aware":
        layout = work_balanced_layout(
            "test_docs_ring", Documents(doc_ids), seq, world, chunks_per_rank=4
        )
    else:
        layout = document_head_tail_layout("test_docs_ring", Documents(doc_ids), seq, world)
    return ring_impl.register_layout(layout, replace=True).name


def _run(ctx, balancer: str, doc_ids: torch.Tensor, seq: int, rotate: str):
    import ring_impl
    from ring_impl.masks import Documents

    mask = Documents(doc_ids)
    layout = _balanced(balancer, doc_ids, seq, ctx.world_size)
    gen = torch.Generator().manual_seed(5)
    q, k, v, dout = (
        torch.randn(1, 2, seq, 8, generator=gen, dtype=torch.float64) for _ in range(4)
    )
    q, k, v, dout = (
        ring_impl.shard(t, ctx.world_size, ctx.rank, layout=layout) for t in (q, k, v, dout)
    )
    q, k, v = (t.requires_grad_(True) for t in (q, k, v))
    out = ring_impl.ring_attention(
        q, k, v, group=ctx.group, mask=mask, layout=layout, rotate_method=rotate, op="math"
    )
    out.backward(dout)
    return {"out": out.detach(), "dq": q.grad, "dk": k.grad, "dv": v.grad}


@pytest.mark.parametrize("balancer", ["work_aware", "document_head_tail"])
@pytest.mark.parametrize("rotate", ["alltoall", "p2p"])
def test_ring_is_right_on_the_balanced_layouts(ring, rotate: str, balancer: str) -> None:
    import ring_impl

    seq, world = 96, 3
    doc_ids = _lognormal_doc_ids(seq, 7)
    layout = _balanced(balancer, doc_ids, seq, world)
    results = ring.rank_pool(world).run(_run, balancer, doc_ids, seq, rotate, timeout=120.0)
    gen = torch.Generator().manual_seed(5)
    q, k, v, dout = (
        torch.randn(1, 2, seq, 8, generator=gen, dtype=torch.float64) for _ in range(4)
    )
    vis = visibility({"kind": "document", "doc_ids": doc_ids.tolist(), "causal": True}, seq, seq)
    ref = attention_grads(q, k, v, dout, visible=vis)
    scales = error_scales(q, k, v, dout, visible=vis)
    got = {
        n: ring_impl.unshard([r[n] for r in results], layout=layout)
        for n in ("out", "dq", "dk", "dv")
    }
    assert_float64_results_match_oracle(
        f"{balancer} layout, {rotate}", got, ref, scales, world_size=world
    )


def _model_masks(seq: int):
    """A model's masks: packed documents in every layer, 3 of 4 layers a 64-token window too."""
    from ring_impl.masks import Documents, SlidingWindow

    first, second = seq * 600 // 1024, seq * 300 // 1024
    docs = Documents(torch.tensor([0] * first + [1] * second + [2] * (seq - first - second)))
    return docs, docs & SlidingWindow(64, 0)


def test_one_layout_balances_a_model_of_several_masks() -> None:
    """The layout balanced for the model (every layer's mask, weighted by its layers) gives the
    model's work less imbalance than a layout balanced for any one of its masks, and the
    built-in layouts."""
    import ring_impl
    from ring_impl.planning.balance import imbalance, rank_work, work_balanced_layout

    seq, world = 1024, 4
    docs, window = _model_masks(seq)
    model = [(docs, 1), (window, 3)]
    layouts = {
        what: ring_impl.register_layout(
            work_balanced_layout(f"test_model_{what}", masks, seq, world), replace=True
        ).name
        for what, masks in (("docs", docs), ("window", window), ("model", model))
    }
    model_imbalance = {
        what: imbalance(rank_work(name, model, seq, world)) for what, name in layouts.items()
    }
    for builtin in ("contiguous", "head_tail"):
        model_imbalance[builtin] = imbalance(rank_work(builtin, model, seq, world))
    assert model_imbalance["model"] <= 1.01, model_imbalance
    assert all(model_imbalance["model"] < v for k, v in model_imbalance.items() if k != "model"), (
        model_imbalance
    )
    # The weighted work is the sum of each mask's work times its layers.
    name = layouts["model"]
    assert rank_work(name, model, seq, world) == [
        a + 3 * b
        for a, b in zip(
            rank_work(name, docs, seq, world), rank_work(name, window, seq, world), strict=True
        )
    ]


def test_several_masks_are_named_by_all_of_them_and_checked() -> None:
    from ring_impl.masks import Causal, Documents, SlidingWindow
    from ring_impl.planning.balance import register_balanced_layout, weighted_masks

    docs, window = _model_masks(256)
    assert weighted_masks(docs) == [(docs, 1.0)]
    assert weighted_masks([docs, (window, 3)]) == [(docs, 1.0), (window, 3.0)]
    one, _ = register_balanced_layout("work_aware", [docs, (window, 3)], 256, 4)
    other, _ = register_balanced_layout("work_aware", [docs, (window, 2)], 256, 4)
    again, _ = register_balanced_layout("work_aware", [docs, (window, 3)], 256, 4)
    assert one == again and one != other  # the weights are part of the layout's name
    for bad, message in (
        ([], "non-empty sequence"),
        ([(docs, 0)], "positive number"),
        (["causal"], "is not a"),
        ([(docs, float("nan"))], "positive number"),
    ):
        with pytest.raises(ValueError, match=message):
            weighted_masks(bad)
    # document_head_tail balances documents: the masks must agree on them.
    _, runs = register_balanced_layout("document_head_tail", [docs, (window, 3)], 256, 4)
    _, alone = register_balanced_layout("document_head_tail", docs, 256, 4)
    assert runs == alone
    with pytest.raises(ValueError, match="different document ids"):
        register_balanced_layout(
            "document_head_tail", [docs, Documents(torch.arange(256) // 64)], 256, 4
        )
    _, plain = register_balanced_layout("document_head_tail", [Causal(), SlidingWindow(8)], 256, 4)
    assert plain == [
        ((0, 32), (224, 256)),
        ((32, 64), (192, 224)),
        ((64, 96), (160, 192)),
        ((96, 160),),
    ]


def _model_run(ctx, seq: int, layout_masks):
    import ring_impl
    from ring_impl.planning.balance import register_balanced_layout

    layout, _ = register_balanced_layout("work_aware", layout_masks, seq, ctx.world_size)
    docs, window = _model_masks(seq)
    gen = torch.Generator().manual_seed(9)
    q, k, v, dout = (
        torch.randn(1, 2, seq, 8, generator=gen, dtype=torch.float64) for _ in range(4)
    )
    q, k, v, dout = (
        ring_impl.shard(t, ctx.world_size, ctx.rank, layout=layout) for t in (q, k, v, dout)
    )
    results = {}
    for what, mask in (("docs", docs), ("window", window)):  # two layers, one sharding
        leaves = [t.clone().requires_grad_(True) for t in (q, k, v)]
        out = ring_impl.ring_attention(
            *leaves, group=ctx.group, mask=mask, layout=layout, op="math"
        )
        out.backward(dout)
        results[what] = {
            "out": out.detach(),
            "dq": leaves[0].grad,
            "dk": leaves[1].grad,
            "dv": leaves[2].grad,
        }
    return layout, results


def test_every_mask_of_the_model_is_right_on_its_one_layout(ring) -> None:
    import ring_impl
    from ring_impl.planning.balance import register_balanced_layout

    seq, world = 256, 2
    docs, window = _model_masks(seq)
    runs = ring.rank_pool(world).run(_model_run, seq, [docs, (window, 3)], timeout=120.0)
    layout, _ = register_balanced_layout("work_aware", [docs, (window, 3)], seq, world)
    assert all(name == layout for name, _ in runs)
    gen = torch.Generator().manual_seed(9)
    q, k, v, dout = (
        torch.randn(1, 2, seq, 8, generator=gen, dtype=torch.float64) for _ in range(4)
    )
    ids = docs.doc_ids.tolist()
    specs = {
        "docs": {"kind": "document", "doc_ids": ids, "causal": True},
        "window": {
            "kind": "and",
            "masks": [
                {"kind": "document", "doc_ids": ids, "causal": True},
                {"kind": "sliding_window", "left": 64, "right": 0},
            ],
        },
    }
    for what, spec in specs.items():
        vis = visibility(spec, seq, seq)
        ref = attention_grads(q, k, v, dout, visible=vis)
        scales = error_scales(q, k, v, dout, visible=vis)
        for name in ("out", "dq", "dk", "dv"):
            got = ring_impl.unshard([r[what][name] for _, r in runs], layout=layout)
            assert_close(
                f"{name} [{what} on the model's layout]",
                got,
                getattr(ref, name),
                getattr(ref, name),
                world_size=world,
                scales=scales[name],
            )
