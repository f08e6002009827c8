"""A call plans with the mask's data as it is when the call starts, whatever the caller writes
into its ids afterwards or wrote before without torch seeing it.

Document ids held in any integer dtype, in a ``torch.from_numpy`` buffer refilled through
numpy, written through ``.data``, or a view of a larger buffer: the second call on the same
``Documents`` runs the new documents, and a brand-new ``Documents`` of the new ids afterwards
gets the new plan too (the plan cache is keyed by exactly the data its plans were built from).
Judged against the float64 oracle (reference.masks, written apart from ring_impl.masks).
"""

from __future__ import annotations

import contextlib

import numpy as np
import pytest
import torch

from reference.attention import attention
from reference.masks import visibility

SEQ = 48  # global
OLD = [0] * 10 + [1] * 14 + [2] * 20 + [-1] * 4
NEW = [0] * 20 + [1] * 6 + [2] * 18 + [-1] * 4


def _ids_for(dtype: str) -> tuple[list[int], list[int]]:
    """(old, new) ids an array of ``dtype`` holds: an unsigned one has no -1,
    so its padding is one more document."""
    if dtype.startswith("uint"):
        return [3 if i < 0 else i for i in OLD], [3 if i < 0 else i for i in NEW]
    return OLD, NEW


def _inputs():
    gen = torch.Generator().manual_seed(5)
    return [torch.randn(1, 2, SEQ, 8, generator=gen, dtype=torch.float64) for _ in range(3)]


def _oracle(ids: list[int]) -> torch.Tensor:
    q, k, v = _inputs()
    vis = visibility({"kind": "document", "doc_ids": ids, "causal": True}, SEQ, SEQ)
    return attention(q, k, v, visible=vis).out


WRITES = ("numpy_refill", "data_copy", "view_of_larger_buffer", "copy_")


def _holder(dtype: str, write: str):
    """(ids tensor holding the old ids, a function writing
    the new ones into it in the way named by ``write``)."""
    old, new = _ids_for(dtype)
    if write == "numpy_refill":
        buffer = np.asarray(old, dtype=dtype)
        ids = torch.from_numpy(buffer)

        def refill():
            buffer[:] = np.asarray(new, dtype=dtype)
    elif write == "view_of_larger_buffer":
        buffer = np.zeros(2 * SEQ, dtype=dtype)
        buffer[SEQ:] = np.asarray(old, dtype=dtype)
        ids = torch.from_numpy(buffer)[SEQ:]

        def refill():
            buffer[SEQ:] = np.asarray(new, dtype=dtype)
    else:
        ids = torch.tensor(old, dtype=getattr(torch, dtype))

        def refill():
            target = ids.data if write == "data_copy" else ids
            target.copy_(torch.tensor(new, dtype=ids.dtype))

    return ids, refill


def _calls(ctx, dtype: str, write: str) -> list[float]:
    import ring_impl
    from reference.layout import shard
    from ring_impl.masks import Documents

    q, k, v = (shard(t, "contiguous", ctx.world_size, ctx.rank, dim=2) for t in _inputs())
    ids, refill = _holder(dtype, write)
    mask = Documents(ids)
    outs = [ring_impl.ring_attention(q, k, v, group=ctx.group, mask=mask)]
    refill()
    outs.append(ring_impl.ring_attention(q, k, v, group=ctx.group, mask=mask))
    outs.append(
        ring_impl.ring_attention(
            q, k, v, group=ctx.group, mask=Documents(torch.tensor(_ids_for(dtype)[1]))
        )
    )
    return outs


DTYPES = ("int8", "int16", "int32", "int64", "uint8")


@pytest.mark.parametrize("write", WRITES)
@pytest.mark.parametrize("dtype", DTYPES)
def test_ids_written_between_calls_are_the_ids_the_next_call_runs(
    ring, dtype: str, write: str
) -> None:
    from reference.layout import unshard

    runs = ring.rank_pool(2).run(_calls, dtype, write)
    got = [unshard([r[i] for r in runs], "contiguous", dim=2) for i in range(3)]
    old, new = (_oracle(ids) for ids in _ids_for(dtype))
    assert float((got[0] - old).abs().max()) < 1e-12, (
        "the first call does not run the documents its ids hold"
    )
    stale = float((got[1] - old).abs().max()) < 1e-12
    assert float((got[1] - new).abs().max()) < 1e-12, (
        f"{dtype} ids written by {write}: the second call on the same mask "
        + (
            "ran the old documents (stale ids or plan)"
            if stale
            else "matches neither the old nor the new documents"
        )
    )
    assert float((got[2] - new).abs().max()) < 1e-12, (
        f"{dtype} ids written by {write}: a new Documents of the new ids got another plan (the "
        "plan cache was poisoned by the call after the write)"
    )


def test_a_snapshot_is_the_data_at_call_time() -> None:
    from ring_impl.masks import Documents, SlidingWindow, snapshot

    buffer = np.asarray(OLD, dtype=np.int32)
    mask = Documents(torch.from_numpy(buffer)) & SlidingWindow(4)
    frozen = snapshot(mask)
    described = frozen.describe()
    buffer[:] = np.asarray(NEW, dtype=np.int32)
    assert frozen.describe() == described != mask.describe()
    assert frozen.a.doc_ids.dtype == torch.int64 and frozen.a.doc_ids.tolist() == OLD
    assert (
        snapshot(frozen) is frozen and frozen.b is mask.b
    )  # plain-valued masks are their own snapshot
    q = torch.arange(SEQ)
    assert torch.equal(
        frozen.visible(None, None, q.view(-1, 1), q.view(1, -1)),
        visibility(
            {
                "kind": "and",
                "masks": [
                    {"kind": "document", "doc_ids": OLD, "causal": True},
                    {"kind": "sliding_window", "left": 4, "right": 0},
                ],
            },
            SEQ,
            SEQ,
        )[0, 0],
    )


@pytest.mark.parametrize("dtype", ["int32", "int64"])
def test_unchanged_ids_reuse_their_snapshot_and_changed_ones_never_do(dtype: str) -> None:
    """Calls on ids that did not change share one snapshot (its ids, checks and description made
    once); a write of any kind (in place, through numpy) gets a new snapshot of the new values."""
    from ring_impl.masks import Documents, snapshot

    buffer = np.asarray(OLD, dtype=dtype)
    mask = Documents(torch.from_numpy(buffer))
    first = snapshot(mask)
    assert snapshot(mask) is first, "unchanged ids made a second snapshot"
    buffer[:] = np.asarray(NEW, dtype=dtype)  # unseen by torch's version counter
    second = snapshot(mask)
    assert second is not first and second.doc_ids.tolist() == NEW and first.doc_ids.tolist() == OLD
    assert second.describe() != first.describe()
    mask.doc_ids[0] = 1  # in place, through torch
    third = snapshot(mask)
    assert third is not second and third.doc_ids.tolist() == [1, *NEW[1:]]
    buffer[:] = np.asarray(
        NEW, dtype=dtype
    )  # back to the values of the second: equal values, equal plans
    assert snapshot(mask).doc_ids.tolist() == NEW


def test_a_problem_found_once_belongs_to_its_mask_alone() -> None:
    """Problems are kept by description for masks it determines; float ids with the values of
    accepted int ids describe alike and must still be refused."""
    from ring_impl.masks import Documents, SlidingWindow, mask_problem, snapshot

    sizes = dict(seq_q=SEQ, seq_kv=SEQ, batch=1, heads=1)
    good = snapshot(Documents(torch.tensor(OLD)) & SlidingWindow(4))
    assert mask_problem(good, **sizes) is None
    assert mask_problem(good, **sizes) is None  # (kept)
    bad = snapshot(Documents(torch.tensor(OLD, dtype=torch.float32)) & SlidingWindow(4))
    assert "integer" in (mask_problem(bad, **sizes) or "")
    assert "entries" in (mask_problem(good, **{**sizes, "seq_q": SEQ * 2}) or "")


def test_packed_calls_share_the_documents_of_equal_cu_seqlens() -> None:
    """THD calls with equal cu_seqlens (a model's layers) share one snapshot of their documents."""
    from ring_impl.planning.packed import packed_documents

    cu = [0, 10, 24, 44]
    a = packed_documents(cu, SEQ, True)
    b = packed_documents(torch.tensor(cu, dtype=torch.int32), SEQ, True)
    c = packed_documents([0, 10, 25, 44], SEQ, True)
    assert a is b and c is not a
    assert a.doc_ids.tolist() == [0] * 10 + [1] * 14 + [2] * 20 + [-1] * 4


@pytest.mark.parametrize(
    ("make", "message"),
    [
        (
            lambda: __import__("ring_impl.masks", fromlist=["x"]).Documents.from_cu_seqlens(
                [0, 10.7, 40.2], SEQ
            ),
            r"cu_seqlens must be integers .*10\.7",
        ),
        (
            lambda: __import__("ring_impl.masks", fromlist=["x"]).Documents.from_cu_seqlens(
                torch.tensor([0.0, 10.5]), SEQ
            ),
            r"cu_seqlens must be integers",
        ),
    ],
)
def test_non_integer_lengths_are_refused_never_truncated(make, message) -> None:
    with pytest.raises(ValueError, match=message):
        make()


def test_integral_lengths_of_any_kind_are_taken() -> None:
    from ring_impl.masks import ChunkedCausal, Documents, PrefixLM, SlidingWindow

    expected = Documents.from_cu_seqlens([0, 10, 40], SEQ).doc_ids
    for cu in (
        np.array([0, 10, 40], dtype=np.int32),
        np.array([0.0, 10.0, 40.0]),
        torch.tensor([0, 10, 40], dtype=torch.int16),
    ):
        assert torch.equal(Documents.from_cu_seqlens(cu, SEQ).doc_ids, expected)
    for mask in (
        SlidingWindow(np.int64(4), np.int32(0)),
        ChunkedCausal(np.int16(3)),
        PrefixLM(torch.tensor(2)),
    ):
        assert mask.check(SEQ, SEQ) is None, mask
        assert all(type(v) is int for v in vars(mask).values()), vars(mask)
    assert (
        SlidingWindow(np.int64(4)) == SlidingWindow(4)
        and SlidingWindow(np.int64(4)).describe() == "window(4,0)"
    )
    assert "must be an int" in SlidingWindow(4.0).check(SEQ, SEQ)
    assert "must be an int" in SlidingWindow(True).check(SEQ, SEQ)


def test_unsigned_ids_are_checked_as_their_values() -> None:
    from ring_impl.masks import Documents

    assert (
        Documents(torch.tensor(OLD[:-4] + [0] * 4, dtype=torch.uint8)).check(SEQ, SEQ) is not None
    )  # decreasing
    assert (
        Documents(torch.tensor(sorted(OLD[:-4]) + [2] * 4, dtype=torch.uint8)).check(SEQ, SEQ)
        is None
    )
    assert "meta device" in Documents(torch.zeros(SEQ, dtype=torch.int64, device="meta")).check(
        SEQ, SEQ
    )


MOD_OLD = [0] * 10 + [1] * 14 + [2] * 24
MOD_NEW = [0] * 20 + [1] * 6 + [2] * 22


def _mod_of(ids: torch.Tensor):
    def same_document_causal(b, h, q, kv):
        return (ids[q] == ids[kv]) & (q >= kv)

    return same_document_causal


def _maskmod_calls(ctx) -> dict:
    import ring_impl
    import ring_impl.planning.tiling as tiling
    from reference.layout import shard
    from ring_impl.masks import MaskMod

    q, k, v = (shard(t, "contiguous", ctx.world_size, ctx.rank, dim=2) for t in _inputs())
    cuts = []
    split = tiling.split_visibility

    def counted(*args, **kwargs):
        cuts.append(1)
        return split(*args, **kwargs)

    tiling.split_visibility = counted
    try:
        ids = torch.tensor(MOD_OLD)
        mask = MaskMod(_mod_of(ids))
        outs, splits = [], []
        for write in (None, None, MOD_NEW):
            if write is not None:
                ids.copy_(torch.tensor(write))
            before = len(cuts)
            outs.append(ring_impl.ring_attention(q, k, v, group=ctx.group, mask=mask))
            splits.append(len(cuts) - before)
    finally:
        tiling.split_visibility = split
    return {"outs": outs, "splits": splits}


def test_a_mask_mod_is_cut_once_per_visibility_and_never_runs_stale(ring) -> None:
    """A MaskMod's function may read data the caller rewrites (here document ids, refilled in
    place between calls): every call evaluates it, the second call on unchanged data cuts no
    block (its blocks are kept by a hash of every bit of each step's visibility), and the call
    after the write runs the new documents."""
    from reference.layout import unshard

    runs = ring.rank_pool(2).run(_maskmod_calls)
    got = [unshard([r["outs"][i] for r in runs], "contiguous", dim=2) for i in range(3)]
    pos = torch.arange(SEQ)
    q, k, v = _inputs()

    def oracle(ids: list[int]) -> torch.Tensor:
        seen = _mod_of(torch.tensor(ids))(None, None, pos.view(-1, 1), pos.view(1, -1))
        return attention(q, k, v, visible=seen).out

    old, new = oracle(MOD_OLD), oracle(MOD_NEW)
    assert float((got[0] - old).abs().max()) < 1e-12
    assert float((got[1] - old).abs().max()) < 1e-12
    assert float((got[2] - new).abs().max()) < 1e-12, (
        "the call after the ids were refilled did not run the new documents (a stale plan)"
    )
    for rank, run in enumerate(runs):
        first, again, rewritten = run["splits"]
        assert first > 0 and rewritten > 0, (rank, run["splits"])
        assert again == 0, (
            f"rank {rank}: the second call on unchanged data cut its visibility into blocks "
            f"again ({again} cuts): the MaskMod's blocks are not kept"
        )


@contextlib.contextmanager
def _as_on_a_gpu(counts: dict[str, int]):
    """Inside it, reads of ids and lengths cost a sync as on a GPU (``masks.reads_are_free`` is
    False for every tensor), and ``counts`` counts compares left on the device (``"compares"``:
    ``IdsCheck.compare``) and StaleIds raised (``"stale"``)."""
    from ring_impl import masks
    from ring_impl.masks import IdsCheck, StaleIds

    compare, stale_init, free = IdsCheck.compare, StaleIds.__init__, masks.reads_are_free

    def counted_compare(self, *args):
        counts["compares"] = counts.get("compares", 0) + 1
        return compare(self, *args)

    def counted_stale(self, *args):
        counts["stale"] = counts.get("stale", 0) + 1
        stale_init(self, *args)

    IdsCheck.compare, StaleIds.__init__ = counted_compare, counted_stale  # type: ignore[method-assign]
    masks.reads_are_free = lambda t: False
    try:
        yield
    finally:
        IdsCheck.compare, StaleIds.__init__ = compare, stale_init  # type: ignore[method-assign]
        masks.reads_are_free = free


def _device_ids_calls(ctx, refilling: tuple[int, ...]) -> list[dict]:
    """Four calls with the masks' reads as on a GPU (``ring_impl.masks.reads_are_free``):
    the first snapshots int32 ids, the second repeats it, the ranks in ``refilling`` then refill
    the ids in place before the third, and the fourth and fifth pass each a new Documents of
    the new ids.
    Per call: the output (or the InputError's message), host compares of ids (``aten.equal``),
    compares left on the device (``IdsCheck.compare``) and StaleIds raised."""
    import ring_impl
    from reference.layout import shard
    from ring_impl.masks import Documents

    from .counting import AtenOps

    q, k, v = (shard(t, "contiguous", ctx.world_size, ctx.rank, dim=2) for t in _inputs())
    ids = torch.tensor(OLD, dtype=torch.int32)
    mask = Documents(ids)
    counts = {"compares": 0, "stale": 0}

    def call(m) -> dict:
        before = dict(counts)
        with AtenOps() as ops:
            try:
                out = ring_impl.ring_attention(q, k, v, group=ctx.group, mask=m)
            except ring_impl.InputError as exc:
                out = str(exc)
        return {
            "out": out,
            "equal": ops.ops["aten.equal"],
            **{name: counts[name] - before[name] for name in counts},
        }

    with _as_on_a_gpu(counts):
        rows = [call(mask), call(mask)]
        if ctx.rank in refilling:
            ids.copy_(torch.tensor(NEW, dtype=ids.dtype))
        rows.append(call(mask))
        rows.append(call(Documents(torch.tensor(NEW, dtype=torch.int32))))
        rows.append(call(Documents(torch.tensor(NEW, dtype=torch.int32))))
    return rows


@pytest.mark.parametrize("world", [1, 2])
def test_ids_on_a_device_are_compared_with_a_read_the_call_makes_anyway(ring, world: int) -> None:
    """Ids on a GPU are not compared on the host (a device sync per call): a repeat serves the
    last snapshot with the compare left on the device, read with the one-rank forward's read or
    the cross-rank check's all-reduce. Ids refilled in place are found by that read, and the
    call runs again from a snapshot of the new ids: the new documents, every rank. A new object
    is served the last snapshot of ids of its kind the same way, whether it holds those ids
    (the fifth call) or others (the fourth: found stale, run again)."""
    from reference.layout import unshard

    runs = ring.rank_pool(world).run(_device_ids_calls, tuple(range(world)))
    old, new = _oracle(OLD), _oracle(NEW)
    for i, want in enumerate((old, old, new, new, new)):
        got = unshard([r[i]["out"] for r in runs], "contiguous", dim=2)
        assert float((got - want).abs().max()) < 1e-12, (
            f"call {i + 1} at W={world} ran other documents than its ids held"
            + (" (a stale snapshot served the refilled ids)" if i == 2 else "")
        )
    for rank, rows in enumerate(runs):
        seen = [{k: row[k] for k in ("equal", "compares", "stale")} for row in rows]
        assert seen[1] == {"equal": 0, "compares": 1, "stale": 0}, (
            f"rank {rank}: the repeat with unchanged ids compared them on the host or found them "
            f"stale: {seen}"
        )
        assert seen[2]["compares"] == 1 and seen[2]["stale"] == 1, (
            f"rank {rank}: the refilled ids were not compared on the device and found stale "
            f"once: {seen}"
        )
        # A new object holding the ids the last snapshot of their kind holds is served it, the
        # compare left on the device as for the same object: the object's identity decides
        # nothing.
        assert seen[4] == {"equal": 0, "compares": 1, "stale": 0}, (
            f"rank {rank}: a new Documents of the ids the last call ran was not served their "
            f"snapshot through the device compare: {seen}"
        )


def test_a_rank_whose_ids_alone_changed_makes_every_rank_run_again(ring) -> None:
    """One rank refills its ids: every rank learns it in the cross-rank check's all-reduce and
    runs the call again (no rank raises on the stale rank's old description, none is left
    waiting); the second run finds the ranks' masks differ, and every rank raises that."""
    runs = ring.rank_pool(2).run(_device_ids_calls, (1,))
    for rank, rows in enumerate(runs):
        third = rows[2]
        assert third["stale"] == 1, f"rank {rank} did not run the call again: {third}"
        assert isinstance(third["out"], str) and "disagree" in third["out"], (
            f"rank {rank}: ranks passing different documents did not raise the disagreement: "
            f"{third['out']!r}"
        )


def _unread_compare_calls(ctx) -> list[torch.Tensor]:
    """Two one-rank calls, with ids refilled between them, of a ring whose forward reads its
    inputs' finiteness without the ids' compare (``all_finite`` without ``ids``)."""
    import ring_impl
    from ring_impl.exchanges.ring import RingAttention
    from ring_impl.masks import Documents

    class UnreadCompare(RingAttention):
        def all_finite(self, *tensors, once=False, ids=None):
            return super().all_finite(*tensors, once=once)

    attend = ring_impl.bind(UnreadCompare())
    q, k, v = _inputs()
    ids = torch.tensor(OLD, dtype=torch.int32)
    mask = Documents(ids)
    with _as_on_a_gpu({}):
        outs = [attend(q, k, v, group=ctx.group, mask=mask)]
        ids.copy_(torch.tensor(NEW, dtype=ids.dtype))
        outs.append(attend(q, k, v, group=ctx.group, mask=mask))
    return outs


def test_a_compare_nobody_read_is_read_before_the_call_returns(ring) -> None:
    """A path that leaves the ids' compare unread (a variant's forward) still never returns what
    a stale snapshot computed: the call reads the compare at its end and runs again."""
    old, new = ring.rank_pool(1).run(_unread_compare_calls)[0]
    assert float((old - _oracle(OLD)).abs().max()) < 1e-12
    assert float((new - _oracle(NEW)).abs().max()) < 1e-12, (
        "the call after the refill returned the stale snapshot's documents"
    )


OLD_CU, NEW_CU = [0, 10, 24, 44], [0, 20, 26, 44]  # the documents of OLD and NEW


def _thd_calls(ctx) -> list[dict]:
    """Three packed calls with ``cu_seqlens`` as on a GPU (``ring_impl.masks.reads_are_free``):
    the first reads them, the second repeats it, the third follows a refill in place. Per call:
    the output, the host reads of ``cu_seqlens`` (``tolist``, ``cpu``), the compares left on
    the device and the StaleIds raised."""
    import ring_impl
    from reference.layout import shard

    q, k, v = (
        shard(t[0].transpose(0, 1), "contiguous", ctx.world_size, ctx.rank, dim=0)
        for t in _inputs()
    )
    cu = torch.tensor(OLD_CU, dtype=torch.int32)
    counts = {"reads": 0, "compares": 0, "stale": 0}
    originals = {"tolist": torch.Tensor.tolist, "cpu": torch.Tensor.cpu}

    def reading(name):
        def method(self, *args, **kwargs):
            counts["reads"] += self is cu
            got = originals[name](self, *args, **kwargs)
            # (a copy to the host is a new tensor, as from a device)
            return got.clone() if name == "cpu" and got is cu else got

        return method

    def call() -> dict:
        before = dict(counts)
        out = ring_impl.ring_attention(q, k, v, group=ctx.group, cu_seqlens=cu, is_causal=True)
        return {"out": out, **{name: counts[name] - before[name] for name in counts}}

    torch.Tensor.tolist, torch.Tensor.cpu = reading("tolist"), reading("cpu")  # type: ignore[method-assign]
    try:
        with _as_on_a_gpu(counts):
            rows = [call(), call()]
            cu.copy_(torch.tensor(NEW_CU, dtype=cu.dtype))
            rows.append(call())
    finally:
        torch.Tensor.tolist, torch.Tensor.cpu = originals["tolist"], originals["cpu"]  # type: ignore[method-assign]
    return rows


@pytest.mark.parametrize("world", [1, 2])
def test_packed_lengths_on_a_device_are_read_once_and_then_compared_there(ring, world: int) -> None:
    """``cu_seqlens`` on a GPU: the first packed call reads them on the host once (checks and
    plan from that one copy); a repeat reads nothing, its documents served with the lengths'
    compare left on the device; lengths refilled in place are found by that compare and the call
    runs the new documents."""
    from reference.layout import unshard

    runs = ring.rank_pool(world).run(_thd_calls)
    old, new = (_oracle(ids)[0].transpose(0, 1) for ids in (OLD, NEW))
    for i, want in enumerate((old, old, new)):
        got = unshard([r[i]["out"] for r in runs], "contiguous", dim=0)
        assert float((got - want).abs().max()) < 1e-12, (
            f"packed call {i + 1} at W={world} ran other documents than its cu_seqlens held"
        )
    for rank, rows in enumerate(runs):
        seen = [{k: row[k] for k in ("reads", "compares", "stale")} for row in rows]
        assert seen[0]["reads"] == 1, f"rank {rank}: the first call read cu_seqlens: {seen}"
        assert seen[1] == {"reads": 0, "compares": 1, "stale": 0}, (
            f"rank {rank}: the repeat read cu_seqlens on the host or found them stale: {seen}"
        )
        assert seen[2]["stale"] == 1 and seen[2]["reads"] == 1, (
            f"rank {rank}: the refilled lengths were not found stale and read once: {seen}"
        )
