"""Key/value every rank holds whole (``ring_attention(..., replicated_kv=True)``): cross-attention
of sequence-sharded queries over text tokens, an image's patches, any key/value not on the query's
sequence.

Each rank attends its own query rows to all of the key/value once and nothing is exchanged: the
ranks' outputs and LSEs, unsharded, and their dQ are the float64 oracle's on the global query
(judged by the numerics policy as one block), and the sum over ranks of dK, dV (and dsinks) is
the oracle's gradient of the replicated tensors (judged as W partial sums). Every layout, op,
dtype, GQA, a value head dim of its own, head_chunks, sinks, a loss through the LSE, and masks
read at (the query's global position, the key's index): a key padding MaskMod reading a per-key
table, and Documents with kv_doc_ids (eager and compiled). The only
collective is the cross-rank input check, as ``collective_schedule(..., replicated_kv=True)``
declares; the same key/value passed without the flag is attention over W copies of it (the LSE
off by exactly log W), the bug class this keyword exists for. What the keyword cannot serve is
refused on every rank, and ranks that disagree on it raise together, also when the call was
checked before (ring_impl.checks.remembered).
"""

from __future__ import annotations

import math

import pytest
import torch

from conformance.baseline import single_device_baseline
from reference import attention_grads
from reference.budget import assert_close, error_scales
from tests.ring_impl.outcomes import assert_input_error_on_every_rank

BATCH, HEADS, SHARD = 2, 4, 6


def lse_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


def _inputs(world, dtype, heads_kv, seq_kv, d, dv, *, sinks=False, lse_grad=False, seed=0):
    """Global query (b, h, S, d), the whole key (b, hkv, L, d) and value (b, hkv, L, dv),
    grad_out, and grad_lse / sinks (or None): drawn in float64, rounded to ``dtype`` (grad_lse
    and sinks exact in float32)."""
    gen = torch.Generator().manual_seed(1000 * seed + 10 * world + seq_kv)
    seq = SHARD * world

    def draw(*shape, to=dtype):
        return torch.randn(*shape, generator=gen, dtype=torch.float64).to(to)

    q, k, v = (
        draw(BATCH, HEADS, seq, d),
        draw(BATCH, heads_kv, seq_kv, d),
        draw(BATCH, heads_kv, seq_kv, dv),
    )
    dout = draw(BATCH, HEADS, seq, dv)
    glse = draw(BATCH, HEADS, seq, to=torch.float32).double() if lse_grad else None
    sink = draw(HEADS, to=torch.float32).double() if sinks else None
    return q, k, v, dout, glse, sink


CASES = {
    # name: (world, layout, dtype, heads_kv, seq_kv, d, dv, options)
    "w2_f64": (2, "contiguous", torch.float64, 2, 7, 16, 16, {}),
    "w3_head_tail_sinks": (3, "head_tail", torch.float32, 4, 5, 16, 16, {"sinks": True}),
    "w2_bf16_gqa_head_chunks": (
        2,
        "contiguous",
        torch.bfloat16,
        2,
        9,
        16,
        16,
        {"op": "cpu_flash", "head_chunks": 2},
    ),
    "w4_one_key_lse_loss": (4, "contiguous", torch.float32, 1, 1, 16, 16, {"lse_grad": True}),
    "w2_value_head_dim": (2, "head_tail", torch.float64, 2, 11, 12, 20, {"sinks": True}),
    # a key padding mask per batch row (a MaskMod reading a per-key table), and query documents
    # each seeing their own keys (Documents with kv_doc_ids): read at the query's global positions
    "w3_head_tail_key_padding": (
        3,
        "head_tail",
        torch.float32,
        2,
        9,
        16,
        16,
        {"mask": "key_padding", "sinks": True},
    ),
    "w2_cross_documents": (
        2,
        "contiguous",
        torch.float64,
        4,
        10,
        16,
        16,
        {"mask": "cross_documents", "op": "cpu_flash"},
    ),
    "w4_head_tail_cross_documents_bf16": (
        4,
        "head_tail",
        torch.bfloat16,
        2,
        6,
        16,
        16,
        {"mask": "cross_documents"},
    ),
}


def _mask(name: str, world: int, seq_kv: int):
    """(the ring_impl mask, its visibility (batch, 1, S, seq_kv) for the oracle) of the mask
    ``name`` on the global query (S = SHARD * world) and the whole key/value."""
    from ring_impl.masks import Documents, MaskMod

    seq = SHARD * world
    if name == "key_padding":
        # row 0 keeps its first keys, row 1 all but its last two: padding after the caption
        keep = torch.arange(seq_kv).view(1, -1) < torch.tensor([[seq_kv // 2], [seq_kv - 2]])
        mask = MaskMod(lambda b, h, q, kv: keep[b, kv])
        visible = keep.view(BATCH, 1, 1, seq_kv).expand(BATCH, 1, seq, seq_kv)
        return mask, visible
    # query documents cut at other places than the key documents; the last queries padding,
    # and one key document no query has
    q_ids = torch.arange(seq) * 3 // seq
    q_ids[-2:] = -1
    kv_ids = torch.arange(seq_kv) * 4 // seq_kv
    mask = Documents(q_ids, causal=False, kv_doc_ids=kv_ids)
    visible = (q_ids.view(-1, 1) == kv_ids.view(1, -1)) & (q_ids.view(-1, 1) >= 0)
    return mask, visible.expand(BATCH, 1, seq, seq_kv)


def _run(ctx, name):
    import ring_impl
    from harness.accounting import CollectiveLog

    world, layout, dtype, heads_kv, seq_kv, d, dv, options = CASES[name]
    options = dict(options)
    sinks, lse_grad = options.pop("sinks", False), options.pop("lse_grad", False)
    if "mask" in options:
        options["mask"] = _mask(options["mask"], world, seq_kv)[0]
    q, k, v, dout, glse, sink = _inputs(
        world, dtype, heads_kv, seq_kv, d, dv, sinks=sinks, lse_grad=lse_grad
    )
    w, r = ctx.world_size, ctx.rank
    q, dout = (ring_impl.shard(t, w, r, layout=layout) for t in (q, dout))
    if glse is not None:
        glse = ring_impl.shard(glse.unsqueeze(-1), w, r, layout=layout).squeeze(-1)
    q, k, v = (t.clone().requires_grad_() for t in (q, k, v))
    if sink is not None:
        options["sinks"] = sink.to(lse_dtype(dtype)).requires_grad_()
    with CollectiveLog() as log:
        with log.phase("forward"):
            out, lse = ring_impl.ring_attention(
                q,
                k,
                v,
                group=ctx.group,
                layout=layout,
                return_lse=True,
                replicated_kv=True,
                **options,
            )
        with log.phase("backward"):
            loss = (out * dout).sum()
            if glse is not None:
                loss = loss + (lse * glse.to(lse.dtype)).sum()
            loss.backward()
    sinks_grad = options["sinks"].grad if sink is not None else None
    return {
        "out": out.detach(),
        "lse": lse.detach(),
        "dq": q.grad,
        "dk": k.grad,
        "dv": v.grad,
        "dsinks": sinks_grad,
        "log": log.summary(),
    }


@pytest.mark.parametrize("name", sorted(CASES))
def test_replicated_key_value_match_the_oracle(ring, name: str) -> None:
    import ring_impl

    world, layout, dtype, heads_kv, seq_kv, d, dv, options = CASES[name]
    results = ring.rank_pool(world).run(_run, name)
    q, k, v, dout, glse, sink = _inputs(
        world,
        dtype,
        heads_kv,
        seq_kv,
        d,
        dv,
        sinks=options.get("sinks", False),
        lse_grad=options.get("lse_grad", False),
    )
    visible = _mask(options["mask"], world, seq_kv)[1] if "mask" in options else None
    oracle = dict(grad_lse=glse, sinks=sink, visible=visible)
    ref = attention_grads(q, k, v, dout, **oracle)
    scales = error_scales(q, k, v, dout, **oracle, input_dtype=dtype)
    base = single_device_baseline(q, k, v, dout, op_spec=options.get("op", "auto"), **oracle)
    declared = ring_impl.collective_schedule(
        world,
        "allgather",
        batch=BATCH,
        heads_kv=heads_kv,
        seq_kv=seq_kv,
        head_dim=d,
        head_dim_v=dv,
        dtype=dtype,
        head_chunks=options.get("head_chunks", 1),
        replicated_kv=True,
    )
    assert set(declared["forward"]) == {"all_reduce"} and not declared["backward"]
    for rank, res in enumerate(results):
        assert res["log"] == {p: kinds for p, kinds in declared.items() if kinds}, (
            f"rank {rank} issued {res['log']}, declared {declared}: a replicated key/value moves "
            f"nowhere, only the input check runs [{name}]"
        )
        assert (res["dk"].shape, res["dv"].shape) == (k.shape, v.shape), name
    for n in ("out", "lse", "dq"):  # each row's result: one block, its rank's own
        got = ring_impl.unshard([res[n] for res in results], layout=layout)
        assert_close(
            f"{n} [{name}]",
            got.to(torch.float64),
            getattr(ref, n),
            base[n].to(torch.float64),
            dtype=dtype,
            result_dtype=lse_dtype(dtype) if n == "lse" else dtype,
            scales=scales[n],
            world_size=1,
        )
    summed = ["dk", "dv", *(["dsinks"] if sink is not None else [])]
    for n in summed:  # the replicated tensors' gradients: every rank's share, summed
        got = torch.stack([res[n].to(torch.float64) for res in results]).sum(0)
        assert_close(
            f"{n} summed over ranks [{name}]",
            got,
            getattr(ref, n),
            base[n].to(torch.float64),
            dtype=dtype,
            result_dtype=lse_dtype(dtype) if n == "dsinks" else dtype,
            scales=scales[n],
            world_size=world,
            **({"roundings": BATCH * SHARD * world} if n == "dsinks" else {}),
        )


def _without_the_flag(ctx):
    """The same call with and without replicated_kv=True: (out, lse) of each."""
    import ring_impl

    gen = torch.Generator().manual_seed(5)
    q = torch.randn(1, 2, 4, 8, generator=gen, dtype=torch.float64)
    k, v = (torch.randn(1, 2, 3, 8, generator=gen, dtype=torch.float64) for _ in range(2))
    return [
        ring_impl.ring_attention(q, k, v, group=ctx.group, return_lse=True, replicated_kv=flag)
        for flag in (True, False)
    ]


@pytest.mark.parametrize("world", [2, 3])
def test_without_the_flag_every_rank_sees_w_copies(ring, world: int) -> None:
    """What the keyword prevents: the whole key/value taken for a shard is attention over W
    copies of it. The output does not show it (equal keys keep the softmax); the LSE is off by
    exactly log W."""
    for (out, lse), (dup_out, dup_lse) in ring.rank_pool(world).run(_without_the_flag):
        torch.testing.assert_close(dup_out, out, rtol=1e-12, atol=1e-12)
        torch.testing.assert_close(dup_lse - lse, torch.full_like(lse, math.log(world)))


def _bad(ctx, kind: str) -> str:
    import ring_impl
    from ring_impl.masks import Documents, MaskMod
    from ring_impl.score_mods import SoftCap

    gen = torch.Generator().manual_seed(0)
    q = torch.randn(1, 2, 4, 8, generator=gen)
    k, v = (torch.randn(1, 2, 5, 8, generator=gen) for _ in range(2))
    kwargs: dict = {"replicated_kv": True}
    if kind == "causal":
        kwargs.update(is_causal=True)
        k, v = k[:, :, :4], v[:, :, :4]
    elif kind == "kv_ids_for_shards":  # key ids for W shards of 5 keys: the keys are 5, whole
        ids = torch.zeros(4 * ctx.world_size, dtype=torch.int64)
        kwargs.update(mask=Documents(ids, kv_doc_ids=torch.zeros(5 * ctx.world_size).long()))
    elif kind == "masks_differ":  # the last rank pads one key more
        kept = 3 if ctx.rank == ctx.world_size - 1 else 4
        kwargs.update(mask=MaskMod(lambda b, h, q_idx, kv_idx: kv_idx < kept))
    elif kind == "score_mod":
        kwargs.update(score_mod=SoftCap(20.0))
    elif kind == "max_logit":
        kwargs.update(return_max_logit=True)
    elif kind == "ulysses":
        kwargs.update(exchange="ulysses")
    elif kind == "halo":
        kwargs.update(exchange="halo")
    elif kind == "cu_seqlens":
        q, k, v = (t[0].transpose(0, 1) for t in (q, k, v))
        kwargs.update(cu_seqlens=[0, 4 * ctx.world_size])
    elif kind == "shard_lengths":
        kwargs.update(shard_lengths=[4] * ctx.world_size)
    elif kind == "not_a_bool":
        kwargs.update(replicated_kv="yes")
    elif kind == "differs":  # the last rank takes its key/value for a shard
        kwargs.update(replicated_kv=ctx.rank != ctx.world_size - 1)
    elif kind == "differs_after_a_checked_call":
        # (rank 0's second call finds its first checked: ring_impl.checks.remembered)
        ring_impl.ring_attention(q, k, v, group=ctx.group, replicated_kv=True)
        kwargs.update(replicated_kv=ctx.rank == 0)
    ring_impl.ring_attention(q, k, v, group=ctx.group, **kwargs)
    return "no error"


@pytest.mark.parametrize(
    "kind,pattern",
    [
        (
            "causal",
            "replicated_kv=True (key and value the whole key/value sequence on every rank) "
            "takes no is_causal=True",
        ),
        ("kv_ids_for_shards", "kv_doc_ids"),
        ("masks_differ", "disagree"),
        ("score_mod", "takes no score_mod="),
        ("max_logit", "takes no return_max_logit=True"),
        ("ulysses", "replicated_kv=True moves no key/value, so it takes no exchange='ulysses'"),
        ("halo", "so it takes no exchange='halo'"),
        ("cu_seqlens", "replicated_kv=True takes no cu_seqlens="),
        ("shard_lengths", "replicated_kv=True takes no shard_lengths="),
        ("not_a_bool", "replicated_kv must be True or False, got 'yes'"),
        ("differs", "ranks disagree on exchange (rank 0 'replicated_kv'; rank 1 'ring')"),
        (
            "differs_after_a_checked_call",
            "ranks disagree on exchange (rank 0 'replicated_kv'; rank 1 'ring')",
        ),
    ],
)
def test_what_it_cannot_serve_raises_on_every_rank(ring, kind: str, pattern: str) -> None:
    outcomes = ring.rank_pool(2).run_outcomes(_bad, kind, timeout=30.0)
    assert_input_error_on_every_rank(outcomes, pattern)


def test_the_schedule_refuses_what_the_call_refuses() -> None:
    import ring_impl

    sizes = dict(batch=1, heads_kv=2, seq_kv=5, head_dim=8, dtype=torch.float32)
    assert ring_impl.collective_schedule(1, "p2p", **sizes, replicated_kv=True) == {
        "forward": {},
        "backward": {},
    }
    # nothing rotates: no rotation needs naming
    assert ring_impl.collective_schedule(3, None, **sizes, replicated_kv=True) == (
        ring_impl.collective_schedule(3, "alltoall", **sizes, replicated_kv=True)
    )
    for options, words in (
        ({"is_causal": True}, "is_causal=True"),
        ({"exchange": "ulysses", "heads": 2, "seq_q": 4}, "strategy other than 'ring'"),
        ({"exchange": "gather"}, "sparse_kv=True"),
        ({"replicated_kv": 1}, "replicated_kv must be True or False"),
    ):
        with pytest.raises(ValueError, match=words.replace("(", r"\(")):
            ring_impl.collective_schedule(
                2, "allgather", **sizes, **{"replicated_kv": True, **options}
            )


def _compiled(ctx, masked: bool):
    import ring_impl
    from ring_impl.masks import MaskMod

    gen = torch.Generator().manual_seed(3)
    q = torch.randn(2, 2, 4, 8, generator=gen)
    k, v = (torch.randn(2, 2, 5, 8, generator=gen) for _ in range(2))
    # (a key padding mask per batch row: evaluated on the query's global positions and the
    # five keys, a table in the graph)
    kept = torch.tensor([2, 5])
    mask = MaskMod(lambda b, h, q_idx, kv_idx: kv_idx < kept[b]) if masked else None

    def attend(q, k, v):
        return ring_impl.ring_attention(
            q, k, v, group=ctx.group, replicated_kv=True, mask=mask, layout="head_tail"
        )

    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    out = torch.compile(attend, fullgraph=True, backend="aot_eager")(*leaves)
    out.sum().backward()
    eager = [t.clone().requires_grad_() for t in (q, k, v)]
    want = attend(*eager)
    want.sum().backward()
    return [
        (a.detach(), b.detach())
        for a, b in zip((out, *(t.grad for t in leaves)), (want, *(t.grad for t in eager)))
    ]


@pytest.mark.parametrize("masked", [False, True])
def test_compiled_it_matches_the_eager_call(ring, masked: bool) -> None:
    for pairs in ring.rank_pool(2).run(_compiled, masked):
        for got, want in pairs:
            torch.testing.assert_close(got, want, rtol=0, atol=0)


# ---------------------------------------------------------------------- the parallel style


class _CrossAttention(torch.nn.Module):
    """Queries from the sequence, key/value from text tokens every rank holds whole."""

    def __init__(self, causal: bool = False):
        super().__init__()
        self.causal = causal
        self.q = torch.nn.Linear(16, 16, dtype=torch.float64)
        self.kv = torch.nn.Linear(12, 32, dtype=torch.float64)

    def forward(self, x: torch.Tensor, text: torch.Tensor, text_mask=None) -> torch.Tensor:
        b, s, _ = x.shape
        q = self.q(x).view(b, s, 2, 8).transpose(1, 2)
        k, v = self.kv(text).view(b, text.shape[1], 2, 2, 8).permute(2, 0, 3, 1, 4)
        return torch.nn.functional.scaled_dot_product_attention(
            q, k, v, attn_mask=text_mask, is_causal=self.causal
        )


#: a key padding attn_mask (batch, 1, 1, text tokens): row 0's caption is 3 tokens, row 1's 5
TEXT_MASK = torch.tensor([[True, True, True, False, False], [True] * 5]).view(2, 1, 1, 5)


def _cross_attention(ctx, layout: str, padded: bool = False, compiled: bool = False) -> dict:
    """The module whole on one process, then under ContextParallel(replicated_kv=True) on this
    rank's rows of the sequence and the whole text: the output rows and parameter gradients."""
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.tensor.parallel import parallelize_module

    import ring_impl
    from harness.accounting import CollectiveLog

    torch.manual_seed(4)
    module = _CrossAttention()
    x = torch.randn(2, 4 * ctx.world_size, 16, dtype=torch.float64)
    text = torch.randn(2, 5, 12, dtype=torch.float64)
    text_mask = TEXT_MASK if padded else None
    module(x, text, text_mask).pow(2).sum().backward()
    whole = {name: p.grad.clone() for name, p in module.named_parameters()}
    module.zero_grad()
    expected = ring_impl.shard(
        module(x, text, text_mask).detach(), ctx.world_size, ctx.rank, layout=layout, dim=2
    )
    mesh = DeviceMesh.from_group(ctx.group, "cpu")
    parallelize_module(module, mesh, ring_impl.ContextParallel(layout=layout, replicated_kv=True))
    local = ring_impl.shard(x, ctx.world_size, ctx.rank, layout=layout, dim=1)
    if compiled:  # (ranks live across tests: a reset keeps dynamo's limits to this one)
        torch._dynamo.reset()
    if compiled:  # (the log's mode would keep dynamo from the frame: collectives asserted eagerly)
        out = torch.compile(module, fullgraph=True, backend="aot_eager")(local, text, text_mask)
        out.pow(2).sum().backward()
        summary = None
    else:
        with CollectiveLog() as log:
            with log.phase("forward"):
                out = module(local, text, text_mask)
            with log.phase("backward"):
                out.pow(2).sum().backward()
        summary = log.summary()
    return {
        "log": summary,
        "error": float((out.detach() - expected).abs().max()),
        "grads": {name: p.grad for name, p in module.named_parameters()},
        "whole": whole,
    }


@pytest.mark.parametrize(
    "layout,padded,compiled",
    [("contiguous", False, False), ("head_tail", True, False), ("head_tail", True, True)],
)
def test_a_cross_attention_module_under_the_parallel_style(
    ring, layout: str, padded: bool, compiled: bool
) -> None:
    """ContextParallel(replicated_kv=True) on a cross-attention module: its rows of the output are
    the whole module's, and its parameters' gradients, summed over the ranks (as a data-parallel
    reduction over them sums), are the whole module's."""
    import ring_impl

    results = ring.rank_pool(2).run(_cross_attention, layout, padded, compiled)
    # (the collectives tell it from the route without the flag, which gives the same output and
    # summed gradients: equal keys keep the softmax)
    declared = ring_impl.collective_schedule(
        2, None, batch=2, heads_kv=2, seq_kv=5, head_dim=8, dtype=torch.float64, replicated_kv=True
    )
    for rank, r in enumerate(results):
        assert r["error"] < 1e-12, f"rank {rank}: output off by {r['error']}"
        if not compiled:
            assert r["log"] == {p: kinds for p, kinds in declared.items() if kinds}, (
                rank,
                r["log"],
            )
    for name, want in results[0]["whole"].items():
        got = sum(r["grads"][name] for r in results)
        torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-12, msg=name)


def _refused_cross_attention(ctx, kind: str) -> str:
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.tensor.parallel import parallelize_module

    import ring_impl

    module = _CrossAttention(causal=kind == "causal")
    mesh = DeviceMesh.from_group(ctx.group, "cpu")
    parallelize_module(module, mesh, ring_impl.ContextParallel(replicated_kv=True))
    x = torch.randn(1, 4, 16, dtype=torch.float64)
    # (a mask with rows of this rank's queries: not the same on every rank)
    per_query = torch.ones(1, 1, 4, 4, dtype=torch.bool) if kind == "per_query_mask" else None
    module(x, torch.randn(1, 4, 12, dtype=torch.float64), per_query)
    return "no error"


def test_the_parallel_style_refuses_what_replicated_kv_cannot_serve(ring) -> None:
    import ring_impl
    from ring_impl.torch_api.context_parallel import ContextParallelError

    with pytest.raises(ContextParallelError, match="takes no strategy='ulysses'"):
        ring_impl.ContextParallel(strategy="ulysses", replicated_kv=True)
    with pytest.raises(ContextParallelError, match="replicated_kv must be True or False"):
        ring_impl.ContextParallel(replicated_kv="yes")
    for kind, pattern in (
        ("causal", "takes no is_causal=True"),
        ("per_query_mask", "a boolean attn_mask equal for every query"),
    ):
        outcomes = ring.rank_pool(2).run_outcomes(_refused_cross_attention, kind, timeout=30.0)
        assert_input_error_on_every_rank(outcomes, pattern)
        assert any("scaled_dot_product_attention" in o.exc_message for o in outcomes)
