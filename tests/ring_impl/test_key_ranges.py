"""``KeyRanges`` (one range of keys per query) and ``tabulate`` (a mask evaluated once into that
form): the ring over every exchange against the float64 oracle, a tabulated ``MaskMod`` never
evaluated again by the calls that take it, one kernel call per block on an op taking row
bounds, plans shared between calls, and bad bounds refused on every rank."""

from __future__ import annotations

import itertools

import pytest
import torch

from tests.ring_impl.oracle import assert_ring_matches_oracle
from tests.ring_impl.outcomes import assert_input_error_on_every_rank

SEQ_LOCAL, HEADS, HEADS_KV, DIM = 24, 4, 2, 16
WINDOW = 9


def _document_ids(seq: int) -> torch.Tensor:
    """Packed documents over ``seq`` tokens, the last 6 padding (-1): rows that see nothing."""
    cuts = [0, 5, 17, 18, seq - 6]
    ids = torch.full((seq,), -1, dtype=torch.int64)
    for d, (a, b) in enumerate(itertools.pairwise(cuts)):
        ids[a:b] = d
    return ids


def _expected_visibility(ids: torch.Tensor) -> torch.Tensor:
    """Causal documents within a window of WINDOW + 1 keys, written out on global positions."""
    pos = torch.arange(ids.numel())
    q, kv = pos[:, None], pos[None, :]
    same = (ids[:, None] == ids[None, :]) & (ids[:, None] >= 0)
    return same & (kv <= q) & (kv >= q - WINDOW)


def _inputs(seq: int) -> tuple[torch.Tensor, ...]:
    """Global float64 (query, key, value, grad_out), GQA: HEADS query heads on HEADS_KV."""
    gen = torch.Generator().manual_seed(7)
    q = torch.randn(1, HEADS, seq, DIM, generator=gen, dtype=torch.float64)
    k, v = (torch.randn(1, HEADS_KV, seq, DIM, generator=gen, dtype=torch.float64) for _ in "kv")
    do = torch.randn(1, HEADS, seq, DIM, generator=gen, dtype=torch.float64)
    return q, k, v, do


def _run(ctx, exchange: str, layout: str) -> dict:
    import ring_impl
    from ring_impl.masks import KeyRanges, MaskMod, tabulate
    from ring_impl.planning.mesh_layout import local_shard

    seq = SEQ_LOCAL * ctx.world_size
    ids = _document_ids(seq)
    evaluations = [0]

    def windowed_documents(b, h, q, kv):
        evaluations[0] += 1
        return (ids[q] == ids[kv]) & (ids[q] >= 0) & (kv <= q) & (kv >= q - WINDOW)

    mask = tabulate(MaskMod(windowed_documents), seq)
    assert type(mask) is KeyRanges
    evaluations[0] = 0
    q, k, v, do = _inputs(seq)
    strategy = "ulysses" if exchange == "ulysses" else "ring"
    leaves = [
        local_shard(t, ctx.group, strategy=strategy, layout=layout).requires_grad_(True)
        for t in (q, k, v)
    ]
    out, lse = ring_impl.ring_attention(
        *leaves, group=ctx.group, mask=mask, layout=layout, exchange=exchange, return_lse=True
    )
    out.backward(local_shard(do, ctx.group, strategy=strategy, layout=layout))
    return {
        "out": out.detach(),
        "lse": lse.detach(),
        "dq": leaves[0].grad,
        "dk": leaves[1].grad,
        "dv": leaves[2].grad,
        "evaluations": evaluations[0],
    }


@pytest.mark.parametrize(
    "world,exchange,layout",
    [
        (1, "ring", "contiguous"),
        (2, "ring", "head_tail"),
        (2, "halo", "contiguous"),
        (2, "gather", "contiguous"),
        (2, "ulysses", "contiguous"),
    ],
)
def test_a_tabulated_mask_mod_matches_the_oracle_without_being_evaluated(
    ring, world, exchange, layout
) -> None:
    """A MaskMod of one key range per query (causal documents in a window, padding at the end),
    tabulated once, runs on every exchange as the float64 oracle says its mask should, and the
    call never calls its function."""
    results = ring.rank_pool(world).run(_run, exchange, layout)
    assert [r.pop("evaluations") for r in results] == [0] * world
    seq = SEQ_LOCAL * world
    assert_ring_matches_oracle(
        f"KeyRanges {exchange} {layout} W={world}",
        results,
        _inputs(seq),
        _expected_visibility(_document_ids(seq)),
        layout=layout,
        world_size=world,
        dtype=torch.float64,
    )


def _kernel_calls(ctx) -> dict:
    """Forward kernel calls, plans built and (out, grads) of two calls with one KeyRanges and one
    with the Documents it equals, on the varlen emulation (an op taking row bounds)."""
    import ring_impl
    from ring_impl.exchanges.ring import RingAttention
    from ring_impl.masks import Documents, tabulate
    from ring_impl.planning import plan

    seq = SEQ_LOCAL * 4 * ctx.world_size
    cuts = [0, 5, 40, 41, seq - 20, seq - 7]
    documents = Documents.from_cu_seqlens(cuts, seq)
    ranges = tabulate(documents, seq)
    calls, built = [0], [0]
    kernel, masked_plan = RingAttention.block_forward, plan._masked_plan

    def counted(self, *args, **kwargs):
        calls[0] += 1
        return kernel(self, *args, **kwargs)

    def counted_plan(*args, **kwargs):
        built[0] += 1
        return masked_plan(*args, **kwargs)

    gen = torch.Generator().manual_seed(3)
    q, k, v, do = (
        ring_impl.shard(torch.randn(1, 4, seq, 16, generator=gen), ctx.world_size, ctx.rank)
        for _ in range(4)
    )
    runs = []
    RingAttention.block_forward, plan._masked_plan = counted, counted_plan
    try:
        for mask in (ranges, ranges, documents):
            calls[0] = built[0] = 0
            leaves = [t.clone().requires_grad_(True) for t in (q, k, v)]
            out = ring_impl.ring_attention(
                *leaves, group=ctx.group, mask=mask, op="cpu_flash_varlen_layout"
            )
            out.backward(do)
            runs.append((calls[0], built[0], [out.detach(), *(t.grad for t in leaves)]))
    finally:
        RingAttention.block_forward, plan._masked_plan = kernel, masked_plan
    (first, first_built, r_first), (second, second_built, _), (doc, _, r_doc) = runs
    return {
        "calls": (first, second, doc),
        "built": (first_built, second_built),
        "diff": max(float((a - b).abs().max()) for a, b in zip(r_first, r_doc)),
    }


@pytest.mark.parametrize("world", [1, 2])
def test_key_ranges_run_as_documents_with_one_kernel_call_and_one_plan(ring, world) -> None:
    """On an op taking row bounds, KeyRanges make the kernel calls Documents make (one per block:
    one per step here), give their results bit for bit, and a second call with an equal
    KeyRanges builds no plan (cached by its description)."""
    for rank, run in enumerate(ring.rank_pool(world).run(_kernel_calls)):
        first, second, doc = run["calls"]
        assert first == second == doc <= world, (rank, run["calls"])
        assert run["built"][0] >= 1 and run["built"][1] == 0, (rank, run["built"])
        assert run["diff"] == 0.0, (rank, run["diff"])


def test_key_ranges_own_their_bounds_and_check_them() -> None:
    from ring_impl.masks import KeyRanges

    start, end = torch.tensor([0, 0, 2], dtype=torch.int32), torch.tensor([1, 2, 3])
    mask = KeyRanges(start, end)
    before = mask.describe()
    start.fill_(1)  # a write to the tensor given never reaches the mask
    assert mask.describe() == before and mask.start.tolist() == [0, 0, 2]
    assert mask.check(3, 3) is None
    assert mask.reach() == (1, 0)  # query 1 sees key 0
    assert "3 tokens" in KeyRanges([0, 0], [1, 2]).check(3, 3)
    assert "[0, 3]" in KeyRanges([0, 0, 0], [1, 2, 4]).check(3, 3)
    assert "integer tensor" in KeyRanges(torch.zeros(3), end).check(3, 3)
    assert KeyRanges([0, 0, 0], [0, 0, 0]).reach() == (0, 0)  # nothing visible
    assert KeyRanges([0, 0, 0], [3, 3, 3]).reach() == (2, 2)


def test_tabulate_refuses_a_mask_without_the_form() -> None:
    from ring_impl.masks import Documents, MaskMod, SlidingWindow, tabulate, visibility

    with pytest.raises(ValueError, match="not one contiguous range"):
        tabulate(MaskMod(lambda b, h, q, kv: (kv == 0) | (kv == q)), 16)
    with pytest.raises(ValueError, match="differ between batch entries or heads"):
        tabulate(MaskMod(lambda b, h, q, kv: kv <= q - h), 16, heads=2)
    with pytest.raises(ValueError, match=r"tabulate: Documents\.doc_ids"):
        tabulate(Documents(torch.zeros(8, dtype=torch.int64)), 16)
    # a band of rows at a time: the same ranges as the whole grid at once
    pos = torch.arange(40)
    window = SlidingWindow(5, 2)
    import ring_impl.masks as masks

    whole = tabulate(window, 40)
    kept, masks._TABULATE_ENTRIES = masks._TABULATE_ENTRIES, 3 * 40
    try:
        banded = tabulate(window, 40)
    finally:
        masks._TABULATE_ENTRIES = kept
    assert banded.describe() == whole.describe()
    assert torch.equal(visibility(whole, pos, pos), visibility(window, pos, pos))


def _bad_bounds(ctx):
    import ring_impl
    from ring_impl.masks import KeyRanges

    seq = 8 * ctx.world_size
    end = torch.arange(1, seq + 1)
    if ctx.rank == 1:
        end[-1] = seq + 5  # past the keys, on one rank only
    q = torch.randn(1, 2, 8, 8)
    ring_impl.ring_attention(
        q, q, q, group=ctx.group, mask=KeyRanges(torch.zeros(seq, dtype=torch.int64), end)
    )


def test_bad_bounds_raise_on_every_rank(ring) -> None:
    outcomes = ring.rank_pool(2).run_outcomes(_bad_bounds, timeout=60.0)
    assert_input_error_on_every_rank(outcomes, "KeyRanges.end must lie in [0, 16]")
