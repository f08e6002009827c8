"""Balance as a property: each rank's work (score area) under a mask, from the plan the ring
runs, and a work-aware layout that balances packed documents where head_tail cannot; the ring
stays right on it."""

from __future__ import annotations

import random

import pytest
import torch

from conformance.implementation import DEFAULT_IMPL_SPEC
from reference import attention_grads
from reference.budget import assert_close, error_scales
from reference.masks import visibility


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
    from ring_impl.balance import rank_work, work_balanced_layout
    from ring_impl.masks import Documents

    seq, world = 2048, 4
    mask = Documents(_lognormal_doc_ids(seq, seed))
    name = register_layout(work_balanced_layout(f"test_docs_{seed}", mask, seq, world, chunks_per_rank=16), replace=True).name
    balanced, head_tail = _imbalance(rank_work(name, mask, seq, world)), _imbalance(rank_work("head_tail", mask, seq, world))
    print(f"seed {seed}: max/mean work, work-aware {balanced:.3f}, head_tail {head_tail:.3f}")
    assert balanced <= 1.05, f"work-aware layout: max/mean work {balanced:.3f} (head_tail {head_tail:.3f})"
    assert balanced <= head_tail


def test_work_is_the_visible_area() -> None:
    """Per-rank work sums to the mask's visible area: nothing invisible computed, nothing lost."""
    from ring_impl.balance import rank_work
    from ring_impl.masks import Causal, Documents, SlidingWindow

    seq, world = 96, 3
    pos = torch.arange(seq)
    for mask in (Causal(), SlidingWindow(5), Documents(_lognormal_doc_ids(seq, 3))):
        area = int(mask.visible(None, None, pos.view(-1, 1), pos.view(1, -1)).sum())
        for layout in ("contiguous", "head_tail"):
            assert sum(rank_work(layout, mask, seq, world)) == area, (mask, layout)


def _run(ctx, doc_ids: torch.Tensor, seq: int, rotate: str):
    import ring_impl
    from ring_impl.balance import work_balanced_layout
    from ring_impl.masks import Documents

    mask = Documents(doc_ids)
    layout = ring_impl.register_layout(work_balanced_layout("test_docs_ring", mask, seq, ctx.world_size, chunks_per_rank=4),
                                       replace=True).name
    gen = torch.Generator().manual_seed(5)
    q, k, v, dout = (torch.randn(1, 2, seq, 8, generator=gen, dtype=torch.float64) for _ in range(4))
    q, k, v, dout = (ring_impl.shard(t, ctx.world_size, ctx.rank, layout=layout) for t in (q, k, v, dout))
    q, k, v = (t.requires_grad_(True) for t in (q, k, v))
    out = ring_impl.ring_attention(q, k, v, group=ctx.group, mask=mask, layout=layout, rotate_method=rotate, op="math")
    out.backward(dout)
    return {"out": out.detach(), "dq": q.grad, "dk": k.grad, "dv": v.grad}


@pytest.mark.parametrize("rotate", ["alltoall", "p2p"])
def test_ring_is_right_on_the_work_aware_layout(ring, rotate: str) -> None:
    if ring.impl.spec != DEFAULT_IMPL_SPEC:
        pytest.skip(f"work_balanced_layout is ring_impl's API; the implementation under test is {ring.impl.spec}")
    import ring_impl
    from ring_impl.balance import work_balanced_layout
    from ring_impl.masks import Documents

    seq, world = 96, 3
    doc_ids = _lognormal_doc_ids(seq, 7)
    layout = ring_impl.register_layout(work_balanced_layout("test_docs_ring", Documents(doc_ids), seq, world, chunks_per_rank=4),
                                       replace=True).name
    results = ring.rank_pool(world).run(_run, doc_ids, seq, rotate, timeout=120.0)
    gen = torch.Generator().manual_seed(5)
    q, k, v, dout = (torch.randn(1, 2, seq, 8, generator=gen, dtype=torch.float64) for _ in range(4))
    vis = visibility({"kind": "document", "doc_ids": doc_ids.tolist(), "causal": True}, seq, seq)
    ref = attention_grads(q, k, v, dout, visible=vis)
    scales = error_scales(q, k, v, dout, visible=vis)
    for name in ("out", "dq", "dk", "dv"):
        got = ring_impl.unshard([r[name] for r in results], layout=layout)
        want = getattr(ref, name)
        assert_close(f"{name} [work-aware layout, {rotate}]", got, want, want, world_size=world, scales=scales[name])
