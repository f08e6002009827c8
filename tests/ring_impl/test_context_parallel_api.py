"""ring_impl's context-parallel API: argument checks, its documented choices, what it costs.

The behaviours every implementation must have (compiled modules, MultiheadAttention's weights
path, repeated and nested buffers, Parameter buffers' gradients) are in
suites/test_context_parallel.py; here are ring_impl's own contracts: which error, raised where
(at construction, on entry, on every rank before anything is sharded), the gradient a buffer
keeps when the context is left by an exception, the collectives the context adds, that
compiled routed code is not recompiled per call, and the helpers' checks (shard, unshard,
collective_schedule), the tutorial script without torchrun and the benchmark's help.
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

import pytest
import torch

import ring_impl
from harness.procs import run_tree
from ring_impl.torch_api.context_parallel import ContextParallelError
from tests.ring_impl.outcomes import assert_every_rank_raised

ROOT = Path(__file__).resolve().parents[2]


# ---------------------------------------------------------------------- helpers' checks


@pytest.mark.parametrize("layout", ["contiguous", "head_tail"])
@pytest.mark.parametrize("rank", [2, 5, -1])
def test_shard_rejects_a_rank_outside_the_world(layout: str, rank: int) -> None:
    with pytest.raises(ValueError, match=r"rank must be an int in \[0, 2\)"):
        ring_impl.shard(torch.zeros(1, 1, 8, 1), 2, rank, layout=layout)


@pytest.mark.parametrize("world", [0, -1, True, 2.0])
def test_shard_rejects_a_world_size_below_one(world) -> None:
    with pytest.raises(ValueError, match="world_size must be an int >= 1"):
        ring_impl.shard(torch.zeros(1, 1, 8, 1), world, 0)


def test_shard_rejects_a_dim_out_of_range() -> None:
    with pytest.raises(ValueError, match="dim 4 is out of range"):
        ring_impl.shard(torch.zeros(1, 1, 8, 1), 2, 0, dim=4)


def test_unshard_takes_the_layouts_split_and_rejects_others() -> None:
    """Shards of unequal lengths: any split for contiguous, the layout's own split for head_tail
    (6 tokens over 2: 3 and 3, from uneven chunks), another split or another shape refused."""
    x = torch.arange(10.0).reshape(1, 1, 10, 1)
    assert torch.equal(ring_impl.unshard([x[:, :, :4], x[:, :, 4:]], layout="contiguous"), x)
    with pytest.raises(ValueError, match=r"splits 10 tokens over 2 ranks as \[5, 5\]"):
        ring_impl.unshard([x[:, :, :4], x[:, :, 4:]], layout="head_tail")
    six = x[:, :, :6]
    parts = [ring_impl.shard(six, 2, r, layout="head_tail") for r in range(2)]
    assert [p.shape[2] for p in parts] == [3, 3]
    assert torch.equal(ring_impl.unshard(parts, layout="head_tail"), six)
    with pytest.raises(ValueError, match="different shapes"):
        ring_impl.unshard([torch.zeros(1, 1, 4, 1), torch.zeros(1, 2, 4, 1)], layout="contiguous")
    with pytest.raises(ValueError, match="no shards"):
        ring_impl.unshard([], layout="contiguous")


def test_unshard_inverts_shard() -> None:
    x = torch.arange(24.0).reshape(1, 1, 24, 1)
    for layout in ring_impl.LAYOUTS:
        for world in (1, 2, 3):
            parts = [ring_impl.shard(x, world, r, layout=layout) for r in range(world)]
            assert torch.equal(ring_impl.unshard(parts, layout=layout), x), (layout, world)


_SIZES = dict(batch=1, heads_kv=2, seq_kv=8, head_dim=4, dtype=torch.float32)


@pytest.mark.parametrize(
    "override,pattern",
    [
        ({"world_size": 0}, "world_size must be an int >= 1"),
        ({"world_size": -2}, "world_size must be an int >= 1"),
        ({"world_size": True}, "world_size must be an int >= 1"),
        ({"batch": 0}, "batch must be an int >= 1"),
        ({"seq_kv": -8}, "seq_kv must be an int >= 1"),
        ({"head_dim": 4.0}, "head_dim must be an int >= 1"),
        ({"heads_kv": -1}, "heads_kv must be an int >= 1"),
        ({"dtype": torch.int32}, "floating-point torch.dtype"),
        ({"dtype": "float32"}, "floating-point torch.dtype"),
        ({"compiled": "yes"}, "compiled must be a bool"),
        ({"rotate_method": "nope"}, "unknown rotate_method"),
    ],
)
def test_collective_schedule_rejects_nonsense(override: dict, pattern: str) -> None:
    kwargs = {"world_size": 2, "rotate_method": "alltoall", **_SIZES, **override}
    world, method = kwargs.pop("world_size"), kwargs.pop("rotate_method")
    with pytest.raises(ValueError, match=pattern):
        ring_impl.collective_schedule(world, method, **kwargs)


def test_collective_schedule_of_one_rank_is_empty() -> None:
    assert ring_impl.collective_schedule(1, "p2p", **_SIZES) == {"forward": {}, "backward": {}}


@pytest.mark.parametrize(
    "kwargs,pattern",
    [
        ({"rotate_method": "nope"}, "unknown rotate_method 'nope'"),
        ({"layout": "zigzag"}, "unknown layout 'zigzag'"),
        ({"op": "no_such_op"}, "unknown attention op 'no_such_op'"),
        ({"op": object()}, "lacks"),
        ({"head_chunks": 0}, "head_chunks must be a positive int"),
        ({"head_chunks": "2"}, "head_chunks must be a positive int"),
        ({"strategy": "ulysses", "head_chunks": 2}, "head_chunks=2 applies to the ring"),
    ],
)
def test_context_parallel_style_checks_its_arguments_at_construction(
    kwargs: dict, pattern: str
) -> None:
    with pytest.raises(ContextParallelError, match=f"ContextParallel: .*{pattern}"):
        ring_impl.ContextParallel(**kwargs)


def test_context_parallel_style_accepts_every_valid_option() -> None:
    for layout in ring_impl.LAYOUTS:
        for method in (None, *ring_impl.ROTATE_METHODS):
            for op in (None, "auto", "math", ring_impl.get_op("cpu_flash")):
                ring_impl.ContextParallel(layout=layout, rotate_method=method, op=op, head_chunks=2)


# ---------------------------------------------------------------------- entry checks on every rank


def _bad_entry(ctx, kind: str) -> dict:
    """context_parallel with one bad argument (on every rank, or on the last rank only)."""
    last = ctx.rank == ctx.world_size - 1
    x = torch.arange(8.0 * ctx.world_size).reshape(1, 1, -1, 1)
    y = torch.zeros(1, 1, 8 * ctx.world_size, 1)
    original = x.clone()
    kw: dict = {"buffers": [x], "buffer_seq_dims": [2]}
    if kind == "rotate_method":
        kw["rotate_method"] = "nope"
    elif kind == "rotate_method_on_one_rank":
        kw["rotate_method"] = "nope" if last else "alltoall"
    elif kind == "layout":
        kw["layout"] = "zigzag"
    elif kind == "op":
        kw["op"] = "no_such_op"
    elif kind == "head_chunks":
        kw["head_chunks"] = 0
    elif kind == "ulysses_head_chunks":
        kw["strategy"], kw["head_chunks"] = "ulysses", 2
    elif kind == "dims_count":
        kw["buffer_seq_dims"] = [2, 2]
    elif kind == "dim_out_of_range_on_one_rank":
        kw["buffer_seq_dims"] = [7 if last else 2]
    elif kind == "not_a_tensor":
        kw["buffers"] = [x, "q"]
        kw["buffer_seq_dims"] = [2, 2]
    elif kind == "two_dims":
        kw["buffers"] = [x, x]
        kw["buffer_seq_dims"] = [2, 0]
    elif kind == "length":
        kw["buffers"] = [torch.zeros(1, 1, 3, 1)]
    elif kind == "no_restore_not_in_buffers":
        kw["no_restore_buffers"] = [y]
    try:
        with ring_impl.context_parallel(ctx.group, **kw):
            return {"entered": True}
    finally:
        if not torch.equal(x, original):
            raise AssertionError(f"a buffer was sharded before the error (shape {tuple(x.shape)})")


@pytest.mark.parametrize(
    "kind,pattern",
    [
        ("rotate_method", "unknown rotate_method 'nope'"),
        ("rotate_method_on_one_rank", "unknown rotate_method 'nope'"),
        ("layout", "unknown layout 'zigzag'"),
        ("op", "unknown attention op 'no_such_op'"),
        ("head_chunks", "head_chunks must be a positive int"),
        ("ulysses_head_chunks", "head_chunks=2 applies to the ring"),
        ("dims_count", "1 buffers but 2 buffer_seq_dims"),
        ("dim_out_of_range_on_one_rank", r"buffer_seq_dims\[0\]=7 is out of range"),
        ("not_a_tensor", r"buffers\[1\] is a str, not a tensor"),
        ("two_dims", "same tensor as an earlier buffer but with sequence dim 0"),
        ("length", "not a multiple of"),
        ("no_restore_not_in_buffers", "no_restore_buffers must also be in buffers"),
    ],
)
def test_context_parallel_rejects_bad_arguments_on_every_rank_before_sharding(
    ring, kind: str, pattern: str
) -> None:
    outcomes = ring.rank_pool(2).run_outcomes(_bad_entry, kind, timeout=30.0)
    summary = assert_every_rank_raised(outcomes, "ContextParallelError")
    assert any(re.search(pattern, o.exc_message) for o in outcomes), summary
    assert all("sharded before the error" not in o.exc_message for o in outcomes), summary


# ---------------------------------------------------------------------- ring_impl's choices


def _grad_on_exit(ctx, layout: str) -> dict:
    """A Parameter buffer holding a gradient on entry; backward inside; exit normally or by an
    exception; what .grad is and which collectives the exits issued. Also a no_restore one."""
    from harness.accounting import CollectiveLog

    w = ctx.world_size
    gen = torch.Generator().manual_seed(4)
    init, entry, weight = (
        torch.randn(1, 8 * w, 4, generator=gen, dtype=torch.float64) for _ in range(3)
    )
    out: dict = {"entry": entry, "weight": weight}
    for how in ("normal", "exception", "kept"):
        p = torch.nn.Parameter(init.clone())
        p.grad = entry.clone()
        wbuf = weight.clone()
        log = CollectiveLog()
        with log:
            try:
                with ring_impl.context_parallel(
                    ctx.group,
                    buffers=[p, wbuf],
                    buffer_seq_dims=[1, 1],
                    layout=layout,
                    no_restore_buffers=[p] if how == "kept" else None,
                ):
                    (p * wbuf).sum().backward()  # d/dp = this rank's shard of weight
                    if how == "exception":
                        raise KeyError("leave by exception")
            except KeyError:
                pass
        out[how] = {
            "grad": p.grad.detach().clone(),
            "shape": tuple(p.shape),
            "collectives": log.summary(),
        }
    return out


@pytest.mark.parametrize("layout", ["contiguous", "head_tail"])
def test_parameter_buffer_grad_on_every_exit(ring, layout: str) -> None:
    """Normal exit: entry gradient + unshard(shard gradients), one all_reduce (which buffers
    have a gradient) and one all_gather. Exception: no collective, the entry gradient as it
    was. no_restore: data and gradient stay this rank's shard."""
    for rank, r in enumerate(ring.rank_pool(2).run(_grad_on_exit, layout, timeout=60.0)):
        entry, weight = r["entry"], r["weight"]
        assert torch.equal(r["normal"]["grad"], entry + weight), f"rank {rank}: normal exit"
        calls = {k: v["calls"] for k, v in r["normal"]["collectives"]["default"].items()}
        # the entry agreement and the exit's "which buffers have a gradient" (all_reduce), one
        # all_gather for the one Parameter buffer
        assert calls == {"all_reduce": 2, "all_gather": 1}, (
            f"rank {rank}: {r['normal']['collectives']}"
        )
        assert torch.equal(r["exception"]["grad"], entry), (
            f"rank {rank}: exception exit must leave the entry gradient"
        )
        assert r["exception"]["collectives"] == {
            "default": {"all_reduce": {"calls": 1, "bytes": 16}}
        }, (
            f"rank {rank}: only the entry agreement may run, the exception exit issued "
            f"{r['exception']['collectives']}"
        )
        kept = ring_impl.shard(entry + weight, 2, rank, layout=layout, dim=1)
        assert r["kept"]["shape"] == tuple(kept.shape) and torch.equal(r["kept"]["grad"], kept), (
            f"rank {rank}: kept"
        )


def _mha_weights_on_one_rank(ctx) -> str:
    mha = torch.nn.MultiheadAttention(8, 2, batch_first=True)
    x = torch.randn(1, 8 * ctx.world_size, 8)
    with ring_impl.context_parallel(ctx.group, buffers=[x], buffer_seq_dims=[1]):
        mha(x, x, x, need_weights=ctx.rank == 0)
    return "no error"


def test_multihead_attention_weights_on_one_rank_raise_everywhere(ring) -> None:
    """need_weights=True on rank 0 only: rank 0 rejects before SDPA, rank 1 reaches the ring's
    agreement, and both raise (no hang)."""
    outcomes = ring.rank_pool(2).run_outcomes(_mha_weights_on_one_rank, timeout=30.0)
    summary = assert_every_rank_raised(outcomes)
    assert "need_weights=False" in outcomes[0].exc_message, summary
    assert "rank 0 rejected their input" in outcomes[1].exc_message, summary
    # Each names the function its rank called: rank 1's call reached SDPA.
    assert outcomes[0].exc_message.startswith(
        "multi_head_attention_forward under context parallel"
    ), summary
    assert outcomes[1].exc_message.startswith(
        "scaled_dot_product_attention under context parallel"
    ), summary


def _sdpa_attn_mask_on_one_rank(ctx) -> str:
    x = torch.randn(1, 2, 8 * ctx.world_size, 8)
    mask = torch.ones(8, 8, dtype=torch.bool) if ctx.rank == 0 else None
    with ring_impl.context_parallel(ctx.group, buffers=[x], buffer_seq_dims=[2]):
        torch.nn.functional.scaled_dot_product_attention(x, x, x, attn_mask=mask)
    return "no error"


def test_sdpa_refusal_names_the_function_called(ring) -> None:
    """An SDPA call that context parallel cannot run is refused on every rank, in words about
    scaled_dot_product_attention (the function the user called), not only ring_attention."""
    outcomes = ring.rank_pool(2).run_outcomes(_sdpa_attn_mask_on_one_rank, timeout=30.0)
    summary = assert_every_rank_raised(outcomes, "InputError")
    assert all(
        o.exc_message.startswith("scaled_dot_product_attention under context parallel")
        for o in outcomes
    ), summary
    assert "attn_mask is not supported" in outcomes[0].exc_message, summary
    assert "rank 0 rejected their input" in outcomes[1].exc_message, summary


class _Attention(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.proj = torch.nn.Linear(16, 48, dtype=torch.float64)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, _ = x.shape
        q, k, v = self.proj(x).view(b, s, 3, 2, 8).permute(2, 0, 3, 1, 4)
        return torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)


def _compiled_routes(ctx) -> dict:
    """A custom attention module (calls F.scaled_dot_product_attention) with ContextParallel,
    compiled with aot_eager, called three times per layout; and the dynamo frame counters."""
    from torch._dynamo.utils import counters
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.tensor.parallel import parallelize_module

    mesh = DeviceMesh.from_group(ctx.group, "cpu")
    torch.manual_seed(2)
    x = torch.randn(2, 8 * ctx.world_size, 16, dtype=torch.float64)
    out: dict = {"errors": {}, "compiled_frames": {}}
    torch._dynamo.reset()
    counters.clear()
    for layout in ("contiguous", "head_tail"):
        module = _Attention()
        reference = module(x).detach()
        parallelize_module(module, mesh, ring_impl.ContextParallel(layout=layout))
        compiled = torch.compile(module, backend="aot_eager")
        local = ring_impl.shard(x, ctx.world_size, ctx.rank, layout=layout, dim=1)
        expected = ring_impl.shard(reference, ctx.world_size, ctx.rank, layout=layout, dim=2)
        out["errors"][layout], out["compiled_frames"][layout] = [], []
        for _ in range(3):
            out["errors"][layout].append(float((compiled(local).detach() - expected).abs().max()))
            out["compiled_frames"][layout].append(counters["frames"]["ok"])
    return out


def test_compiled_custom_attention_follows_the_route_without_recompiling_per_call(ring) -> None:
    for rank, r in enumerate(ring.rank_pool(2).run(_compiled_routes, timeout=180.0)):
        for layout, errors in r["errors"].items():
            assert max(errors) < 1e-12, f"rank {rank} {layout}: errors {errors}"
            frames = r["compiled_frames"][layout]
            assert frames[0] > 0 and frames[0] == frames[-1], (
                f"rank {rank} {layout}: frames compiled so far after each of 3 calls: {frames}; "
                "the route's code must be compiled by the first call only"
            )
        assert r["compiled_frames"]["head_tail"][0] > r["compiled_frames"]["contiguous"][-1], (
            f"rank {rank}: another route did not compile new code {r['compiled_frames']}"
        )


# ---------------------------------------------------------------------- scripts


def test_tutorial_without_torchrun_says_how_to_launch_it() -> None:
    env = {"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin"}
    done = run_tree(
        [sys.executable, str(ROOT / "examples" / "context_parallel_tutorial.py")],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode != 0
    assert "Traceback" not in done.stderr, done.stderr
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and "torchrun --standalone --nproc-per-node=4" in lines[0], done.stderr


def _compiled_mha_weights_on_one_rank(ctx) -> str:
    torch._dynamo.reset()
    mha = torch.nn.MultiheadAttention(8, 2, batch_first=True)
    x = torch.randn(1, 8 * ctx.world_size, 8)

    def forward(t):
        return mha(t, t, t, need_weights=ctx.rank == 0)[0]

    with ring_impl.context_parallel(ctx.group, buffers=[x], buffer_seq_dims=[1]):
        torch.compile(forward, backend="aot_eager", fullgraph=True)(x)
    return "no error"


def test_compiled_multihead_attention_weights_on_one_rank_raise_everywhere(ring) -> None:
    """Compiled, need_weights=True on rank 0 only: rank 0's graph holds the refusing op in place
    of the module's attention, rank 1's the ring's agreement; when the graphs run, both raise
    (no rank raises alone while tracing, leaving the other waiting)."""
    outcomes = ring.rank_pool(2).run_outcomes(_compiled_mha_weights_on_one_rank, timeout=120.0)
    summary = assert_every_rank_raised(outcomes)
    assert all(
        "InputError" in (o.exc_type or "") or "need_weights" in (o.exc_message or "")
        for o in outcomes
    ), summary
    assert "need_weights=False" in outcomes[0].exc_message, summary
    assert "rank 0 rejected their input" in outcomes[1].exc_message, summary
