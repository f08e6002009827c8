"""A mask known only by evaluating it (a ``MaskMod``, alone or combined) is evaluated, before the
cross-rank check, on every position the rank will attend (``ring_impl.planning.plan.plan_ahead``).

The check itself probes a strided grid of positions. A ``mask_mod`` failing elsewhere (one
corrupt table entry) used to fail while one rank planned its first ring step, after its first
collective: that rank raised a raw IndexError and the others waited for ever. Now every rank raises
InputError, on every path (ring and its head chunks, halo exchange, sparse gather, Ulysses,
hybrid), and the next call runs. The plans made ahead are the call's own: the forward uses them,
and the backward evaluates nothing again.
"""

from __future__ import annotations

import pytest
import torch

SEQ_LOCAL = 16
#: the one position whose table entry is corrupt: off the check's grid (0, 2, 4, ... at 32 tokens,
#: 0, 4, 8, ... at 64), held by rank 0 under the contiguous layout
BAD = 5


def _call(ctx, how: str, corrupt: bool, counter: list | None = None):
    import ring_impl
    from ring_impl.masks import MaskMod, SlidingWindow

    seq = SEQ_LOCAL * ctx.world_size
    table = torch.arange(seq)
    if corrupt:
        table[BAD] = 10**6  # out of range for `seen`: an IndexError at query BAD only

    seen = torch.ones(seq, dtype=torch.bool)

    def fn(b, h, q_idx, kv_idx):
        if counter is not None:
            counter.append(int(q_idx.numel()))
        return (kv_idx <= q_idx) & seen[table[q_idx]] & ((q_idx - kv_idx) % (2 + h) != 1)

    mask = MaskMod(fn)
    kwargs = {"group": ctx.group, "mask": mask, "layout": "contiguous", "rotate_method": "alltoall"}
    if how == "head_chunks":
        kwargs["head_chunks"] = 2
    elif how == "halo":
        kwargs.update(mask=mask & SlidingWindow(3), halo=True)
    elif how == "sparse_kv":
        kwargs["sparse_kv"] = True
    elif how == "ulysses":
        kwargs["strategy"] = "ulysses"
    elif how == "hybrid":
        from torch.distributed.device_mesh import init_device_mesh

        kwargs.update(
            strategy="hybrid",
            group=init_device_mesh("cpu", (2, 2), mesh_dim_names=("ulysses", "ring")),
        )
    gen = torch.Generator().manual_seed(ctx.rank)
    q, k, v = (
        torch.randn(1, 4, SEQ_LOCAL, 8, generator=gen).requires_grad_(True) for _ in range(3)
    )
    out = ring_impl.ring_attention(q, k, v, **kwargs)
    forward_evaluations = None if counter is None else sum(counter)
    out.sum().backward()
    return {
        "forward": forward_evaluations,
        "all": None if counter is None else sum(counter),
        "finite": bool(torch.isfinite(q.grad).all()),
    }


def _off_grid_failure_then_a_good_call(ctx, how: str):
    from ring_impl import InputError

    try:
        _call(ctx, how, corrupt=True)
        refused = "no error"
    except InputError as exc:
        refused = str(exc)
    except Exception as exc:  # a raw error: the bug this file guards
        refused = f"RAW {type(exc).__name__}: {exc}"
    return {"refused": refused, "good": _call(ctx, how, corrupt=False)}


@pytest.mark.parametrize(
    "how,world",
    [
        ("ring", 2),
        ("ring", 3),
        ("head_chunks", 2),
        ("halo", 2),
        ("sparse_kv", 2),
        ("ulysses", 2),
        ("hybrid", 4),
    ],
)
def test_a_mask_mod_failing_off_the_probe_grid_raises_on_every_rank(ring, how, world) -> None:
    runs = ring.rank_pool(world).run(_off_grid_failure_then_a_good_call, how, timeout=120.0)
    for rank, r in enumerate(runs):
        msg = r["refused"]
        assert (
            "cannot be evaluated on the positions this rank attends (IndexError" in msg
            or "rejected their input" in msg
        ), f"{how}, rank {rank}: {msg}"
        assert r["good"]["finite"], f"{how}, rank {rank}: the good call after the refusal"
    # The rank holding the corrupt position names it (the hybrid and Ulysses: every rank holding
    # it after the all-to-all).
    assert "cannot be evaluated" in runs[0]["refused"], runs[0]["refused"]


def _evaluations(ctx, how: str):
    return _call(ctx, how, corrupt=False, counter=[])


@pytest.mark.parametrize("how", ["ring", "head_chunks", "ulysses"])
def test_the_backward_evaluates_no_mask_again(ring, how) -> None:
    """The plans made before the check serve the forward and the backward: the mask_mod's
    evaluations all happen before the first collective's results are used, none in the backward."""
    for rank, r in enumerate(ring.rank_pool(2).run(_evaluations, how, timeout=120.0)):
        assert r["forward"] > 0 and r["all"] == r["forward"], f"{how}, rank {rank}: {r}"


# --- compiled: the MaskMod's table is evaluated in the graph -------------------------------------


def _compiled_call(ctx, backend: str, failure: str, corrupt_ranks: tuple[int, ...]):
    """A good compiled call, the same graph with data that fails on ``corrupt_ranks`` (an index
    out of range, or an integer divided by zero, at query BAD only), then a good call again."""
    import ring_impl
    from ring_impl import InputError
    from ring_impl.masks import MaskMod

    seq = SEQ_LOCAL * ctx.world_size
    seen = torch.ones(seq, dtype=torch.bool)

    def mask_for(corrupt: bool) -> MaskMod:
        table, divisor = torch.arange(seq), torch.ones(seq, dtype=torch.int64)
        if corrupt and failure == "index":
            table[BAD] = 10**6
        if corrupt and failure == "division":
            divisor[BAD] = 0

        def fn(b, h, q_idx, kv_idx):  # a new closure per mask, over its own tensors (graph inputs)
            return (kv_idx <= q_idx) & seen[table[q_idx]] & ((q_idx // divisor[q_idx] + h) % 3 != 2)

        return MaskMod(fn)

    step = torch.compile(
        lambda q, k, v, mask: ring_impl.ring_attention(q, k, v, group=ctx.group, mask=mask),
        backend=backend,
        fullgraph=True,
    )
    gen = torch.Generator().manual_seed(ctx.rank)

    def run(corrupt: bool) -> bool:
        q, k, v = (
            torch.randn(1, 4, SEQ_LOCAL, 8, generator=gen).requires_grad_(True) for _ in range(3)
        )
        step(q, k, v, mask_for(corrupt)).sum().backward()
        return bool(torch.isfinite(q.grad).all())

    first = run(False)
    try:
        run(ctx.rank in corrupt_ranks)
        refused = "no error"
    except InputError as exc:
        refused = str(exc)
    except Exception as exc:  # a raw error: the failure raised in the graph
        refused = f"RAW {type(exc).__name__}: {exc}"
    return {"first": first, "refused": refused, "after": run(False)}


@pytest.mark.parametrize("backend", ["aot_eager", "inductor"])
@pytest.mark.parametrize("failure", ["index", "division"])
@pytest.mark.parametrize("corrupt_ranks", [(1,), (0, 1)], ids=["one_rank", "every_rank"])
def test_a_compiled_mask_mod_failing_on_some_ranks_data_raises_on_every_rank(
    ring, backend, failure, corrupt_ranks
) -> None:
    """Compiled, the table is evaluated in the graph, where a failure raised on one rank's data
    left the others waiting in the op's cross-rank check. Evaluated under
    ring_impl.planning.mask_table.EvaluationGuard, it is refused with InputError on every rank, and
    the same graph then runs good data."""
    runs = ring.rank_pool(2).run(_compiled_call, backend, failure, corrupt_ranks, timeout=240.0)
    for rank, r in enumerate(runs):
        assert r["first"] and r["after"], f"rank {rank}: the good calls: {r}"
        assert "rejected their input" in r["refused"] or "cannot be evaluated" in r["refused"], (
            f"rank {rank}: {r}"
        )
    for rank in corrupt_ranks:
        assert "an index out of range or an integer divided by zero" in runs[rank]["refused"], runs[
            rank
        ]


def _calls_and_results(ctx, layout: str) -> dict:
    """Kernel calls of the forward and (out, dq, dk, dv) of one call per mask: packed causal
    documents as ``Documents`` and as a mask_mod that spells them, on the varlen emulation."""
    import ring_impl
    from ring_impl.exchanges.ring import RingAttention
    from ring_impl.masks import Documents, MaskMod
    from ring_impl.planning.mesh_layout import local_shard

    seq = SEQ_LOCAL * 8 * ctx.world_size
    cuts = [0, 5, 40, 41, 90, seq - 7, seq]
    ids = torch.repeat_interleave(torch.arange(len(cuts) - 1), torch.diff(torch.tensor(cuts)))

    def same_document(b, h, q, kv):
        return (ids[q] == ids[kv]) & (kv <= q)

    calls = [0]
    kernel = RingAttention.block_forward

    def counted(self, *args, **kwargs):
        calls[0] += 1
        return kernel(self, *args, **kwargs)

    gen = torch.Generator().manual_seed(3)
    full = [torch.randn(1, 4, seq, 16, generator=gen, dtype=torch.float64) for _ in range(4)]
    q, k, v, do = (local_shard(t, ctx.group, strategy="ring", layout=layout) for t in full)
    results = {}
    RingAttention.block_forward = counted
    try:
        for name, mask in (
            ("documents", Documents.from_cu_seqlens(cuts, seq)),
            ("mask_mod", MaskMod(same_document)),
        ):
            calls[0] = 0
            leaves = [t.clone().requires_grad_(True) for t in (q, k, v)]
            out = ring_impl.ring_attention(
                *leaves, group=ctx.group, mask=mask, layout=layout, op="cpu_flash_varlen_layout"
            )
            out.backward(do)
            results[name] = (calls[0], [out.detach(), *(t.grad for t in leaves)])
    finally:
        RingAttention.block_forward = kernel
    (c_doc, r_doc), (c_mod, r_mod) = results["documents"], results["mask_mod"]
    return {
        "calls": (c_doc, c_mod),
        "diff": max(float((a - b).abs().max()) for a, b in zip(r_doc, r_mod)),
    }


@pytest.mark.parametrize("world,layout", [(1, "contiguous"), (2, "contiguous"), (2, "head_tail")])
def test_a_mask_mod_of_one_key_range_per_row_runs_as_the_built_in_mask(ring, world, layout) -> None:
    """A mask_mod whose rows each see one range of keys (packed causal documents spelled as a
    function) reaches an op taking row bounds as one call per block, as ``Documents`` does
    (evaluated on every call, its ranges read from what it shows), with the same results."""
    for rank, got in enumerate(ring.rank_pool(world).run(_calls_and_results, layout)):
        c_doc, c_mod = got["calls"]
        assert c_mod == c_doc > 0, f"rank {rank}: kernel calls {got['calls']} (Documents, MaskMod)"
        assert got["diff"] < 1e-12, f"rank {rank}: max |MaskMod - Documents| {got['diff']:.2e}"


def test_visible_ranges_are_read_only_from_one_range_per_row() -> None:
    """Each row's range, rows seeing nothing as empty ranges; None where a row sees two ranges
    or the visibility differs between heads."""
    from ring_impl.planning.plan import visible_ranges

    i, j = torch.arange(6).view(-1, 1), torch.arange(8).view(1, -1)
    window = (j <= i + 2) & (j >= i)
    window[3] = False  # a row that sees nothing
    lo, hi = visible_ranges(window.view(1, 1, 6, 8).expand(2, 3, 6, 8))
    assert lo.tolist() == [0, 1, 2, 0, 4, 5] and hi.tolist() == [3, 4, 5, 0, 7, 8]
    two = window.clone()
    two[1, 7] = True  # row 1 sees 1..3 and 7
    assert visible_ranges(two.view(1, 1, 6, 8)) is None
    per_head = torch.stack([window, j <= i]).view(1, 2, 6, 8)
    assert visible_ranges(per_head) is None


# --- a MaskMod of key ranges: evaluated on every call, cut once per distinct result ------------


def _ranges_reuse(ctx) -> dict:
    """Builds of the ring's blocks (``bounds_blocks``) and of the varlen kernel's plans
    (``bounds_varlen_plan``) per call of a mask_mod spelling packed causal documents over a
    table it closes over: a first call, a repeat, a new closure over the same table (a model's
    next layer), and a call after the table is refilled in place; with each call's largest
    error against the float64 oracle of the documents the table held."""
    import ring_impl
    from ring_impl.masks import MaskMod
    from ring_impl.ops import varlen
    from ring_impl.planning import plan
    from ring_impl.planning.mesh_layout import local_shard

    seq = SEQ_LOCAL * 8 * ctx.world_size
    old = [0, 5, 40, 41, 90, seq - 7, seq]
    new = [0, 30, 31, 70, seq]

    def ids_of(cuts):
        return torch.repeat_interleave(torch.arange(len(cuts) - 1), torch.diff(torch.tensor(cuts)))

    table = ids_of(old)

    def mask_mod():
        def same_document(b, h, q, kv):  # a new closure per call of mask_mod (per layer)
            return (table[q] == table[kv]) & (kv <= q)

        return MaskMod(same_document)

    builds = {"blocks": 0, "plans": 0}
    blocks, plans = plan.bounds_blocks, varlen.bounds_varlen_plan

    def counted(name, fn):
        def call(*args, **kwargs):
            builds[name] += 1
            return fn(*args, **kwargs)

        return call

    plan._PLAN_CACHE.clear()  # (the pool's earlier calls may have cut these ranges already)
    gen = torch.Generator().manual_seed(7)
    full = [torch.randn(1, 2, seq, 8, generator=gen, dtype=torch.float64) for _ in range(3)]
    q, k, v = (local_shard(t, ctx.group, strategy="ring", layout="contiguous") for t in full)
    runs = []
    plan.bounds_blocks = counted("blocks", blocks)
    varlen.bounds_varlen_plan = counted("plans", plans)
    try:
        for what, mask in (
            ("first", mask_mod()),
            ("repeat", None),
            ("next layer", mask_mod()),
            ("refilled", "refill"),
        ):
            if mask == "refill":
                table.copy_(ids_of(new))
                mask = runs[-1]["mask"]
            mask = runs[-1]["mask"] if mask is None else mask
            before = dict(builds)
            out = ring_impl.ring_attention(
                q, k, v, group=ctx.group, mask=mask, op="cpu_flash_varlen_layout"
            )
            expected = local_shard(
                _documents_oracle(full, table), ctx.group, strategy="ring", layout="contiguous"
            )
            runs.append(
                {
                    "what": what,
                    "mask": mask,
                    "blocks": builds["blocks"] - before["blocks"],
                    "plans": builds["plans"] - before["plans"],
                    "error": float((out - expected).abs().max()),
                }
            )
    finally:
        plan.bounds_blocks, varlen.bounds_varlen_plan = blocks, plans
    return {r["what"]: {k: r[k] for k in ("blocks", "plans", "error")} for r in runs}


def _documents_oracle(full: list[torch.Tensor], ids: torch.Tensor) -> torch.Tensor:
    from reference.attention import attention
    from reference.masks import visibility

    seq = ids.numel()
    vis = visibility({"kind": "document", "doc_ids": ids.tolist(), "causal": True}, seq, seq)
    return attention(*full, visible=vis).out


@pytest.mark.parametrize("world", [1, 2])
def test_a_mask_mod_of_key_ranges_is_cut_once_per_distinct_result(ring, world) -> None:
    """A mask_mod is evaluated on every call (its function may read data that changed), but the
    blocks cut from the ranges it shows, and the kernel's plans of them, are built once per
    distinct ranges: a repeated call and another layer's mask_mod over the same table build
    nothing, a table refilled in place builds anew, and every call matches the oracle of the
    documents the table held."""
    for rank, runs in enumerate(ring.rank_pool(world).run(_ranges_reuse)):
        # (a block whose rows all see the same keys is full or causal: no plan of its bounds)
        assert runs["first"]["blocks"] > 0 and runs["first"]["plans"] > 0, f"rank {rank}: {runs}"
        for again in ("repeat", "next layer"):
            assert runs[again]["blocks"] == runs[again]["plans"] == 0, f"rank {rank}: {runs}"
        assert runs["refilled"]["blocks"] > 0, f"rank {rank}: {runs}"
        worst = max(r["error"] for r in runs.values())
        assert worst < 1e-12, f"rank {rank}: {runs}"


def test_a_mask_mod_step_reads_the_device_once() -> None:
    """Cutting a step of a mask_mod evaluated on the device (its table and the positions there)
    reads back one thing, its rows' ranges and whether each row is one range (on a GPU, one
    device sync; cut again, the same ranges are its cached block); a visibility with several batch
    entries or heads reads whether they agree first."""
    from ring_impl.masks import MaskMod, visible_ranges
    from ring_impl.planning import plan

    from .counting import DeviceReads

    table = torch.tensor([0] * 9 + [1] * 20 + [2] * 3)
    q_pos, kv_pos = torch.arange(16, 32), torch.arange(0, 32)

    def same_document(b, h, q, kv):
        return (table[q] == table[kv]) & (kv <= q)

    plan._PLAN_CACHE.clear()
    for cut in ("first", "again"):
        with DeviceReads(table, q_pos, kv_pos) as counted:
            (block,) = plan.mask_blocks(
                MaskMod(same_document),
                q_pos,
                kv_pos,
                0,
                0,
                batch=1,
                heads=1,
                head_span=None,
                device=None,
                ranges=True,
            )
        assert block.kind == "ranges" and counted.reads == 1, (cut, block, counted.reads)
    i, j = torch.arange(6).view(-1, 1), torch.arange(8).view(1, -1)
    window = (j <= i + 2) & (j >= i)
    two = window.clone()
    two[1, 7] = True  # row 1 sees two ranges
    for vis, reads, ranges in (
        (window.view(1, 1, 6, 8), 1, True),
        (two.view(1, 1, 6, 8), 1, False),
        (window.view(1, 1, 6, 8).expand(2, 3, 6, 8), 2, True),
    ):
        with DeviceReads(vis) as counted:
            got = visible_ranges(vis)
        assert (got is not None) == ranges and counted.reads == reads, (tuple(vis.shape), got)
