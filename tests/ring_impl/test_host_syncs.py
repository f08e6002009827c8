"""Host syncs of a call as on a GPU: a device-to-host read (``aten._local_scalar_dense``:
``.item()``, ``bool(t)``, ``int(t)``) stalls the host until the device has caught up, so the
ring may not make one per block.

The ring skips the NaN propagation for blocks whose inputs are finite, a check that reads a
flag: free on CPU, where it is made per ring step; a sync on a GPU, where a call makes it once at
most. A one-rank forward reads one flag of its query, key and value; a multi-rank forward learns
the group's verdict from the cross-rank check's all-reduce (the one read it makes, of the table
that check reads anyway: with gloo that table is host memory, so it does not show here). A
backward whose query, key and value are known finite reads one flag of its gradients (one sync
per backward): the alternative, its blocks run on the gradients' finite parts with NaN put where
those reach (``GradientFlags``), needs per-feature range counts over every row, 2.5x the
kernel's own backward at 64k tokens on an H200. That path runs only when the read finds a
non-finite gradient. Otherwise the blocks go through the whole propagation, without a read. A
one-rank call makes each read right before its kernel's launch, so what the host does after the
launch overlaps the kernel; a multi-rank backward reads after its first step's kernels (the next
hop already in flight), before anything they computed leaves the rank.
Here reads are made to count as on a GPU (``RingAttention.reads_are_free``), and they are
counted in one warm call, forward and backward, at W=1 and W=2 with the CUDA kernels' CPU
emulations. Counts are exact, not timings.
"""

from __future__ import annotations

import pytest
import torch

from benchmarks.host_work import VIEWS

from .counting import AtenOps

SEQ = 2048


def _syncs(ctx, case: str) -> int:
    import ring_impl
    from ring_impl import masks
    from ring_impl.exchanges.ring import RingAttention
    from ring_impl.masks import Documents, SlidingWindow

    options = {
        "causal": dict(is_causal=True, op="cpu_efficient_layout"),
        "window": dict(mask=SlidingWindow(256, 0), op="cpu_efficient_layout"),
        "window_varlen": dict(mask=SlidingWindow(256, 0), op="cpu_flash_varlen_layout"),
        # (a ring of one inside the group: the check's verdict serves its forward)
        "replicated_kv": dict(replicated_kv=True, op="cpu_efficient_layout"),
        # (the ids live on the CPU: the checks that read them read host memory)
        "documents": dict(
            mask=Documents.from_cu_seqlens([0, 100, 400, 401, 900, 1500, 2000], SEQ),
            op="cpu_flash_varlen_layout",
        ),
        # (the ids live on the device: comparing them with their snapshot on the host is a read)
        "documents_on_device": dict(
            mask=Documents(Documents.from_cu_seqlens([0, 100, 400, 900, 2000], SEQ).doc_ids),
            op="cpu_flash_varlen_layout",
        ),
    }[case]
    on_device = case == "documents_on_device"
    gen = torch.Generator().manual_seed(0)
    q, k, v, do = (torch.randn(1, 4, SEQ // ctx.world_size, 32, generator=gen) for _ in range(4))
    shortcut, free = RingAttention.reads_are_free, masks.reads_are_free
    RingAttention.reads_are_free = lambda self, tensors: False  # as on a GPU
    if on_device:
        masks.reads_are_free = lambda t: False
    try:
        for _ in range(2):  # the second call is counted: plans are cached by then
            leaves = [t.clone().requires_grad_() for t in (q, k, v)]
            with AtenOps(traced=READS) as reads:
                ring_impl.ring_attention(*leaves, group=ctx.group, **options).backward(do)
    finally:
        RingAttention.reads_are_free, masks.reads_are_free = shortcut, free
    made = [w for packet in READS[: 2 if on_device else 1] for w in reads.where[packet]]
    return len(made), made


#: The aten ops that read device memory on the host: a scalar read, and (where the ids live on
#: the device) the compare of the ids with their host snapshot.
READS = ("aten._local_scalar_dense", "aten.equal")


#: case -> device-to-host reads of one call at W=1: the forward's non-finite decision and the
#: backward's (of its gradients)
LIMITS = {
    "causal": 2,
    "window": 2,
    "window_varlen": 2,
    "documents": 2,
    "documents_on_device": 2,
    "replicated_kv": 2,
}


@pytest.mark.parametrize("world", [1, 2])
@pytest.mark.parametrize("case", sorted(LIMITS))
def test_no_host_sync_per_block(ring, case: str, world: int) -> None:
    syncs, made = zip(*ring.rank_pool(world).run(_syncs, case))
    # W=2: the forward's verdict comes with the cross-rank check's own read; the backward reads
    # one flag of its gradients
    limit = LIMITS[case] if world == 1 else LIMITS[case] - 1
    assert max(syncs) <= limit, (
        f"{case}: {list(syncs)} host syncs per rank in one call at W={world}, at most {limit} "
        f"allowed; made at (per rank): {list(made)}"
    )


def _propagations(ctx, exchange: str, nan_in: str | None) -> dict[str, tuple[int, int]]:
    """Per direction, (blocks that went through the whole NaN propagation, blocks) of one call at
    W=2 over ``exchange`` ("ring", "halo", "gather") with reads as on a GPU, and
    ``"gradients"``: (backward blocks that went through the gradients' propagation, backward
    blocks); ``nan_in``: rank 1's tensor holding a NaN, "key" or "grad_out" (None: all
    finite)."""
    import ring_impl
    from ring_impl.exchanges.ring import RingAttention
    from ring_impl.masks import Documents, SlidingWindow

    seq = SEQ // 8
    options = {
        "ring": dict(is_causal=True, layout="head_tail"),
        "halo": dict(mask=SlidingWindow(16, 0), exchange="halo"),
        "gather": dict(
            mask=Documents.from_cu_seqlens([0, 100, seq + 20, 2 * seq], 2 * seq),
            exchange="gather",
        ),
    }[exchange]

    gen = torch.Generator().manual_seed(1)
    q, k, v, do = (torch.randn(1, 4, seq, 32, generator=gen) for _ in range(4))
    if ctx.rank == 1 and nan_in == "key":
        k[0, 1, 3, 5] = float("nan")
    if ctx.rank == 1 and nan_in == "grad_out":
        do[0, 2, 7, 1] = float("nan")
    patched = {
        "nonfinite_forward": "forward",
        "block_forward": "forward_blocks",
        "nonfinite_backward": "backward",
        "nonfinite_gradients": "gradients",
        "block_backward": "backward_blocks",
    }
    counts = dict.fromkeys(patched.values(), 0)
    originals = {name: getattr(RingAttention, name) for name in (*patched, "reads_are_free")}

    def counted(name: str):
        def method(self, *args, **kwargs):
            counts[patched[name]] += 1
            return originals[name](self, *args, **kwargs)

        return method

    RingAttention.reads_are_free = lambda self, tensors: False  # as on a GPU
    for name in patched:
        setattr(RingAttention, name, counted(name))
    try:
        leaves = [t.clone().requires_grad_() for t in (q, k, v)]
        out = ring_impl.ring_attention(*leaves, group=ctx.group, **options)
        out.backward(do)
    finally:
        for name, method in originals.items():
            setattr(RingAttention, name, method)
    return {
        "forward": (counts["forward"], counts["forward_blocks"]),
        "backward": (counts["backward"], counts["backward_blocks"]),
        "gradients": (counts["gradients"], counts["backward_blocks"]),
    }


@pytest.mark.parametrize("exchange", ["ring", "halo", "gather"])
def test_a_multi_rank_call_skips_the_propagation_on_the_groups_verdict(ring, exchange) -> None:
    """As on a GPU, on every exchange: with every rank's query, key and value finite (reported in
    the cross-rank check's all-reduce) no block goes through the whole NaN propagation, forward
    or backward, whatever the gradients hold. The backward reads one flag of its gradients,
    after launching its first step's kernels as if they were finite: a rank whose gradients are
    finite propagates nothing and runs each block once, and the rank holding a NaN in its
    grad_out puts every one of its backward blocks through the gradients' propagation (its first
    step's blocks run twice, the speculated results dropped). A NaN in one rank's key puts every
    block of every rank through the whole propagation (the verdict is the group's)."""
    pool = ring.rank_pool(2)
    blocks = []  # per rank, the backward's blocks of a finite call
    for nan_in in (None, "grad_out"):
        for rank, calls in enumerate(pool.run(_propagations, exchange, nan_in)):
            (pf, bf), (pb, bb), (pg, _) = calls["forward"], calls["backward"], calls["gradients"]
            holds_nan = nan_in == "grad_out" and rank == 1
            assert pf == 0 and bf > 0 and pb == 0 and bb > 0, (nan_in, rank, calls)
            if nan_in is None:
                blocks.append(bb)
            assert pg == (blocks[rank] if holds_nan else 0), (nan_in, rank, calls)
            assert (bb > blocks[rank]) if holds_nan else (bb == blocks[rank]), (nan_in, rank, calls)
    for rank, calls in enumerate(pool.run(_propagations, exchange, "key")):
        (pf, bf), (pb, bb), (pg, _) = calls["forward"], calls["backward"], calls["gradients"]
        assert pf == bf > 0 and pb == bb > 0 and pg == 0, (rank, calls)


def _order(ctx, case: str) -> dict[str, list[str]]:
    """Per direction, the kernel calls and device reads of one warm one-rank call in the order
    they happen, reads as on a GPU."""
    from torch.utils._python_dispatch import TorchDispatchMode

    import ring_impl
    from ring_impl.exchanges.ring import RingAttention

    options = {
        "causal": dict(is_causal=True, op="cpu_efficient_layout"),
        "documents": dict(
            mask=ring_impl.masks.Documents.from_cu_seqlens(
                [0, 100, 400, 2000 * ctx.world_size], SEQ * ctx.world_size
            ),
            op="cpu_flash_varlen_layout",
        ),
    }[case]
    events: list[str] = []

    class Reads(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if func is torch.ops.aten._local_scalar_dense.default:
                events.append("read")
            return func(*args, **(kwargs or {}))

    originals = {n: getattr(RingAttention, n) for n in ("block_forward", "block_backward")}

    def kernel(name):
        def method(self, *args, **kwargs):
            events.append("kernel")
            return originals[name](self, *args, **kwargs)

        return method

    gen = torch.Generator().manual_seed(0)
    q, k, v, do = (torch.randn(1, 4, SEQ, 32, generator=gen) for _ in range(4))
    shortcut = RingAttention.reads_are_free
    RingAttention.reads_are_free = lambda self, tensors: False  # as on a GPU
    for name in originals:
        setattr(RingAttention, name, kernel(name))
    try:
        for _ in range(2):  # the second call is recorded: plans are cached by then
            events.clear()
            leaves = [t.clone().requires_grad_() for t in (q, k, v)]
            with Reads():
                out = ring_impl.ring_attention(*leaves, group=ctx.group, **options)
            forward = list(events)
            events.clear()
            with Reads():
                out.backward(do)
    finally:
        RingAttention.reads_are_free = shortcut
        for name, method in originals.items():
            setattr(RingAttention, name, method)
    return {"forward": forward, "backward": list(events)}


@pytest.mark.parametrize("case", ["causal", "documents"])
def test_a_one_rank_call_reads_right_before_its_kernel(ring, case: str) -> None:
    """Where a read is a device sync, a one-rank call of one block reads whether its inputs
    (forward) or gradients (backward) are finite and then launches its kernel, so that what the
    host does after the launch (the output's return, autograd, the backward's preparation)
    overlaps the kernel: one read and one kernel call per direction, in that order. (Read after
    the launch, the read waits for the kernel and all of that follows it: docs/benchmarks.md,
    "Where each read goes".)"""
    (events,) = ring.rank_pool(1).run(_order, case)
    assert events == {"forward": ["read", "kernel"], "backward": ["read", "kernel"]}, events


@pytest.mark.parametrize("case", ["causal", "documents"])
def test_a_multi_rank_backward_reads_after_its_first_kernels(ring, case: str) -> None:
    """At W=2, as on a GPU: the forward reads nothing (the group's verdict comes with the
    cross-rank check), and the backward reads its gradients' flag once, after its first kernel
    is launched."""
    for rank, events in enumerate(ring.rank_pool(2).run(_order, case)):
        forward, backward = events["forward"], events["backward"]
        assert forward and set(forward) == {"kernel"}, (rank, events)
        assert backward[0] == "kernel" and backward.count("read") == 1, (rank, events)


#: aten ops that make no kernel launch on a GPU: views and metadata (the benchmark's list), the
#: read (counted by the test above) and the mask snapshot's compare of the document ids, which
#: live in host memory
_NO_LAUNCH = VIEWS | {"aten._local_scalar_dense", "aten.equal"}

#: the varlen kernel's emulation, one custom op as the CUDA kernel is one launch
_KERNELS = frozenset({"ring_impl.emulated_varlen_forward", "ring_impl.emulated_varlen_backward"})


class _RingOps(AtenOps):
    """:class:`AtenOps` of the ring's own work: nothing while ``kernel[0]`` (inside the method of
    an op that emulates one CUDA kernel call)."""

    def __init__(self, kernel: list[bool]):
        super().__init__()
        self.kernel = kernel

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if self.kernel[0]:
            return func(*args, **(kwargs or {}))
        return super().__torch_dispatch__(func, types, args, kwargs)


def _launches(ctx, case: str) -> dict[str, dict[str, int]]:
    import ring_impl
    from ring_impl.exchanges.ring import RingAttention
    from ring_impl.masks import Documents, SlidingWindow
    from ring_impl.ops.cpu import CpuEfficientLayoutOp

    options = {
        # (cpu_efficient_layout's methods emulate one call of CUDA's memory-efficient kernel)
        "causal": dict(is_causal=True, op="cpu_efficient_layout"),
        # (every row in a document: one block, nothing to merge)
        "documents": dict(
            mask=Documents.from_cu_seqlens([0, 100, 400, 401, 900, 1500, SEQ], SEQ),
            op="cpu_flash_varlen_layout",
        ),
        "window": dict(mask=SlidingWindow(256, 0), op="cpu_flash_varlen_layout"),
    }[case]
    gen = torch.Generator().manual_seed(0)
    q, k, v, do = (torch.randn(1, 4, SEQ, 32, generator=gen) for _ in range(4))
    kernel = [False]
    methods = {name: getattr(CpuEfficientLayoutOp, name) for name in ("forward", "backward")}

    def one_kernel(method):
        def run(*args, **kwargs):
            kernel[0] = True
            try:
                return method(*args, **kwargs)
            finally:
                kernel[0] = False

        return run

    shortcut = RingAttention.reads_are_free
    RingAttention.reads_are_free = lambda self, tensors: False  # as on a GPU
    for name, method in methods.items():
        setattr(CpuEfficientLayoutOp, name, one_kernel(method))
    try:
        for _ in range(2):  # the second call is counted: plans are cached by then
            leaves = [t.clone().requires_grad_() for t in (q, k, v)]
            with _RingOps(kernel) as forward:
                out = ring_impl.ring_attention(*leaves, group=ctx.group, **options)
            with _RingOps(kernel) as backward:  # (grad, not backward: no copies into .grad)
                torch.autograd.grad(out, leaves, do)
    finally:
        RingAttention.reads_are_free = shortcut
        for name, method in methods.items():
            setattr(CpuEfficientLayoutOp, name, method)
    return {
        direction: {
            op: n for op, n in ops.ops.items() if op not in _NO_LAUNCH and op not in _KERNELS
        }
        for direction, ops in (("forward", forward), ("backward", backward))
    }


#: direction -> kernels a one-rank call launches beside its attention kernel: the sums of its
#: one read (forward: query, key and value, three sums added twice; backward: grad_out and the
#: LSE, its -inf lifted by one clamp, two sums added once)
LAUNCHES = {"forward": 5, "backward": 4}


@pytest.mark.parametrize("case", ["causal", "documents", "window"])
def test_a_one_rank_call_launches_little_beside_its_kernel(ring, case: str) -> None:
    """On a GPU a one-rank call is host-bound below tens of thousands of tokens: every launch
    beside the kernel costs the host more than the device. Counted with the kernels' CPU
    emulations, reads as on a GPU, in a warm call (counts are exact)."""
    (launches,) = ring.rank_pool(1).run(_launches, case)
    for direction, limit in LAUNCHES.items():
        n = sum(launches[direction].values())
        assert n <= limit, f"{case}: {direction} launches {launches[direction]}, at most {limit}"


def test_the_read_judges_the_sums_on_the_host() -> None:
    """What a read finds: 16-bit tensors summed past their own range still count as finite (the
    sums are float32); NaN and inf anywhere do not; an LSE of -inf (a row that sees nothing) is
    finite to the backward's decision, NaN and +inf in it are not."""
    from ring_impl.exchanges.ring import RingAttention, _gradient_inputs

    impl = RingAttention()
    for dtype in (torch.float16, torch.bfloat16):
        ones = torch.ones(4, 70_000, dtype=dtype)  # a sum of 280,000: past float16's 65,504
        assert impl.all_finite(ones, once=True)
        for bad in (float("nan"), float("inf"), float("-inf")):
            spoiled = ones.clone()
            spoiled[3, 5] = bad
            assert not impl.all_finite(ones, spoiled, once=True), (dtype, bad)
            assert not bool(impl.finite_flag(ones, spoiled)), (dtype, bad)
    grad_out = torch.zeros(1, 2, 3, 4)
    lse = torch.tensor([[[float("-inf"), 1.5, -2.0]] * 2])
    assert impl.all_finite(*_gradient_inputs(grad_out, lse), once=True)
    for bad in (float("nan"), float("inf")):
        spoiled = lse.clone()
        spoiled[0, 1, 2] = bad
        assert not impl.all_finite(*_gradient_inputs(grad_out, spoiled), once=True), bad


def _kept_and_anew(ctx, form: str) -> dict[str, tuple[int, ...]]:
    """Per way of passing the documents ("kept": one object every call, as a model's layers
    share one; "anew": an equal one built for every call, as a data loader hands each step new
    tensors), the counts of the second call, the first having warmed the caches: (copies of the
    ids or lengths to the host, reads of anything computed from them, device syncs, aten ops,
    varlen kernel calls),
    forward and backward, reads counted as on a GPU. ``form``: "documents"
    (``mask=Documents(ids)``, ids on the device) or "cu_seqlens" (a packed call's lengths on
    the device)."""
    import ring_impl
    from ring_impl import masks
    from ring_impl.exchanges.ring import RingAttention
    from ring_impl.masks import Documents

    from .counting import DeviceReads, varlen_kernel_calls

    world = ctx.world_size
    cuts = [0, 100, 400, 401, 900, 1500, 2000]
    gen = torch.Generator().manual_seed(0)
    q, k, v, do = (torch.randn(1, 4, SEQ // world, 32, generator=gen) for _ in range(4))
    ids = Documents.from_cu_seqlens(cuts, SEQ).doc_ids.to(torch.int32)
    lengths = torch.tensor(cuts, dtype=torch.int32)

    def call(documents):
        leaves = [t.clone().requires_grad_() for t in (q, k, v)]
        if form == "documents":
            out = ring_impl.ring_attention(
                *leaves, group=ctx.group, mask=documents, op="cpu_flash_varlen_layout"
            )
            out.backward(do)
            return
        thd = [t[0].transpose(0, 1) for t in leaves]  # (tokens_local, heads, head_dim)
        out = ring_impl.ring_attention(
            *thd,
            group=ctx.group,
            cu_seqlens=documents,
            is_causal=True,
            op="cpu_flash_varlen_layout",
        )
        out.backward(do[0].transpose(0, 1))

    def built(source: torch.Tensor):
        return Documents(source) if form == "documents" else source

    counts = {}
    shortcut, free = RingAttention.reads_are_free, masks.reads_are_free
    RingAttention.reads_are_free = lambda self, tensors: False  # as on a GPU
    masks.reads_are_free = lambda t: False
    try:
        for way in ("kept", "anew"):
            source = (ids if form == "documents" else lengths).clone()
            kept = built(source)
            for _ in range(2):  # the second call is counted
                if way == "anew":
                    source = source.clone()
                with (
                    DeviceReads(source) as reads,
                    AtenOps(traced=("aten._local_scalar_dense",)) as ops,
                    varlen_kernel_calls() as kernels,
                ):
                    call(kept if way == "kept" else built(source))
            counts[way] = (
                reads.direct,
                reads.reads,
                ops.ops["aten._local_scalar_dense"],
                sum(ops.ops.values()),
                kernels["forward"] + kernels["backward"],
            )
    finally:
        RingAttention.reads_are_free, masks.reads_are_free = shortcut, free
    return counts


@pytest.mark.parametrize("world", [1, 2])
@pytest.mark.parametrize("form", ["documents", "cu_seqlens"])
def test_documents_built_anew_each_call_take_the_kept_path(ring, form: str, world: int) -> None:
    """Documents whose ids (or packed lengths) arrive as a new tensor each call, equal to the
    last, take the path a kept object takes: the same reads of anything computed from them (the
    compare with the kept copy, read with the call's own sync), the same device syncs and kernel
    calls, and the same host work. A path chosen by the object's identity (a cache keyed by
    ``id()``, a padding test by ``is``) would read, re-plan or take a slower kernel path for
    every new object: correct outputs, a host sync per call."""
    for rank, counts in enumerate(ring.rank_pool(world).run(_kept_and_anew, form)):
        assert counts["anew"] == counts["kept"], (
            f"{form} at W={world}, rank {rank}: (copies of the ids to the host, reads of what is "
            f"computed from them, device syncs, aten ops, kernel calls) of one call are "
            f"{counts['anew']} for an equal new object, {counts['kept']} for a kept one"
        )
