"""No call mixes device and host tensors: on a GPU such a mix raises, and CI has no GPU.

Every path a GPU runs (the CUDA kernels' CPU emulations, reads made to count as on a GPU so that
the device-side paths run: document ids and ``cu_seqlens`` on the device, one-rank reads before
the kernel, per-call decisions) runs forward and backward under
:class:`~tests.ring_impl.placement.DevicePlacement`, which tells the tensors that would be on
the device from those that would be on the host, at W=1 and W=2 (the hybrid at W=4). A mix
fails the test with the function and the ``ring_impl`` lines that made it.

Not here: a ``MaskMod`` whose function reads tables on the device. The ring plans on host
positions, and such a function fails there on a GPU by design; ``ring_impl.masks.visibility``
then evaluates it again on the device (a fallback that a placement check cannot tell from a
mix).
"""

from __future__ import annotations

import pytest
import torch

from .placement import DevicePlacement, backwards_checked

SEQ = 256  # tokens per rank
DOC_LENGTHS = (40, 60, 1, 100, 55)  # (sum SEQ), times the world size
KV_SEQ = 96  # key/value tokens per rank of the cross-attention case


def _lengths(case: str, world: int) -> list[int]:
    """Query tokens per rank: SEQ each, or uneven (``shard_lengths``) for the uneven cases."""
    if case.startswith("uneven"):
        return [SEQ + 44 if r % 2 == 0 else SEQ - 44 for r in range(world)]
    return [SEQ] * world


def _rows(case: str, world: int, rank: int) -> tuple[slice, slice]:
    """This rank's query and key/value rows of the global sequences: consecutive rows of the
    right lengths (what placement depends on), whatever the case's layout."""
    lengths = _lengths(case, world)
    q_rows = slice(sum(lengths[:rank]), sum(lengths[: rank + 1]))
    if case == "cross_documents":
        return q_rows, slice(rank * KV_SEQ, (rank + 1) * KV_SEQ)
    return q_rows, q_rows


#: a table a flex-style score_mod reads by global position (on the device: marked in _mixes)
_TABLE = torch.linspace(-1.0, 1.0, 4096)


def _table_score(score, b, h, q, kv):
    return score + _TABLE[kv] - _TABLE[q]


def _options(case: str, world: int) -> dict:
    from ring_impl.masks import ChunkedCausal, Documents, MaskMod, PrefixLM, SlidingWindow
    from ring_impl.score_mods import Alibi, PostScaleBias, ScoreModFn, SoftCap, alibi_slopes

    ids = torch.repeat_interleave(torch.arange(len(DOC_LENGTHS)), torch.tensor(DOC_LENGTHS) * world)
    varlen, efficient = "cpu_flash_varlen_layout", "cpu_efficient_layout"
    return {
        "causal": dict(is_causal=True, op=efficient),
        "causal_varlen": dict(is_causal=True, op=varlen),
        "causal_head_tail_chunks": dict(
            is_causal=True, layout="head_tail", head_chunks=2, op=efficient
        ),
        # the ids live on the device (made so below)
        "documents": dict(mask=Documents(ids), op=varlen),
        "documents_masked_efficient": dict(mask=Documents(ids), op="cpu_efficient_masked_layout"),
        "documents_head_tail": dict(mask=Documents(ids), layout="head_tail", op=varlen),
        "window": dict(mask=SlidingWindow(17, 0), op=varlen),
        "window_masked_efficient": dict(
            mask=SlidingWindow(17, 3), op="cpu_efficient_masked_layout"
        ),
        "chunked": dict(mask=ChunkedCausal(32), op=varlen),
        "prefix": dict(mask=PrefixLM(50), op=varlen),
        "mask_mod": dict(
            mask=MaskMod(lambda b, h, q, kv: (kv <= q) & ((q - kv) % 3 != 1)), op=varlen
        ),
        "sinks": dict(is_causal=True, op=efficient),
        "max_logit": dict(is_causal=True, return_max_logit=True, op=efficient),
        "packed": dict(op=varlen),
        "halo": dict(mask=SlidingWindow(17, 0), exchange="halo", op=varlen),
        "gather": dict(mask=SlidingWindow(17, 0), exchange="gather", op=varlen),
        "ulysses": dict(is_causal=True, exchange="ulysses", op=efficient),
        "ulysses_documents": dict(mask=Documents(ids), exchange="ulysses", op=varlen),
        "context_parallel": {},
        # ranks hold uneven shares of the SEQ * W tokens (_lengths: shard_lengths, given below)
        "uneven": dict(is_causal=True, op=varlen),
        "uneven_documents": dict(mask=Documents(ids), op=varlen),
        # KV_SEQ * W keys, each query document seeing its own (kv_doc_ids on the device too)
        "cross_documents": dict(
            mask=Documents(
                ids, kv_doc_ids=torch.arange(KV_SEQ * world) * len(DOC_LENGTHS) // (KV_SEQ * world)
            ),
            op=varlen,
        ),
        # score_mods run on the math op; their tensors (slopes, bias, a table) on the device
        "alibi": dict(is_causal=True, score_mod=Alibi(4), op="math"),
        "alibi_slopes": dict(is_causal=True, score_mod=Alibi(alibi_slopes(4).float()), op="math"),
        "soft_cap": dict(mask=Documents(ids), score_mod=SoftCap(5.0), op="math"),
        "bias": dict(
            score_mod=PostScaleBias(torch.randn(1, 4, SEQ * world, SEQ * world)), op="math"
        ),
        "score_fn": dict(is_causal=True, score_mod=ScoreModFn(_table_score), op="math"),
        "hybrid": dict(is_causal=True, exchange="hybrid", op=efficient),
        "hybrid_window": dict(mask=SlidingWindow(17, 0), exchange="hybrid", op=varlen),
    }[case]


def _context_parallel(group, query, key, value, grad_out) -> None:
    """SDPA and its backward under ``context_parallel`` on buffers holding the whole sequence
    (sharded on entry, restored on exit; ``grad_out`` sharded with them), the output unsharded."""
    import torch.nn.functional as F

    import ring_impl

    world = group.size()
    buffers = [t.detach().repeat(1, 1, world, 1) for t in (query, key, value, grad_out)]
    with ring_impl.context_parallel(group, buffers=buffers, buffer_seq_dims=[2] * 4):
        q, k, v = (t.requires_grad_() for t in buffers[:3])
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        (out * buffers[3]).sum().backward()
        ring_impl.context_parallel_unshard(group, [out.detach()], [2])


def _mixes(ctx, case: str) -> list[str]:
    """The mixes (function, ring_impl lines, count) of three calls of ``case`` on this rank."""
    import ring_impl
    from ring_impl import masks
    from ring_impl.exchanges.ring import RingAttention

    world, rank = ctx.world_size, ctx.rank
    gen = torch.Generator().manual_seed(0)
    q_rows, kv_rows = _rows(case, world, rank)
    kv_seq = (KV_SEQ if case == "cross_documents" else SEQ) * world
    q, grad_out = (torch.randn(1, 4, SEQ * world, 16, generator=gen)[:, :, q_rows] for _ in "qg")
    k, v = (torch.randn(1, 4, kv_seq, 16, generator=gen)[:, :, kv_rows] for _ in "kv")
    group = ctx.device_mesh((2, 2), ("ring", "ulysses")) if case.startswith("hybrid") else ctx.group
    check = DevicePlacement()
    shortcut, free = RingAttention.reads_are_free, masks.reads_are_free
    RingAttention.reads_are_free = lambda self, tensors: False  # as on a GPU
    masks.reads_are_free = lambda t: False
    try:
        with backwards_checked(check):
            for _ in range(3):  # the first call plans; the later ones take what it kept
                options = _options(case, world)
                inputs = [t.clone().requires_grad_() for t in (q, k, v)]
                grad = grad_out
                if case.startswith("uneven"):
                    options["shard_lengths"] = _lengths(case, world)
                if case == "sinks":
                    options["sinks"] = torch.randn(4, generator=gen).requires_grad_()
                if case == "packed":
                    cu = torch.tensor([0, *DOC_LENGTHS], dtype=torch.int32).cumsum(0) * world
                    options["cu_seqlens"] = cu.to(torch.int32)
                    inputs = [t[0].transpose(0, 1).detach().requires_grad_() for t in inputs]
                    grad = grad_out[0].transpose(0, 1).contiguous()
                mask = options.get("mask")
                for t in [*inputs, grad, *[x for x in options.values() if torch.is_tensor(x)]]:
                    check.mark(t)
                score_mod = options.get("score_mod")
                for held in ("slopes", "bias"):
                    if torch.is_tensor(getattr(score_mod, held, None)):
                        check.mark(getattr(score_mod, held))
                check.mark(_TABLE)
                if isinstance(mask, masks.Documents):
                    check.mark(mask.doc_ids)
                    if mask.kv_doc_ids is not None:
                        check.mark(mask.kv_doc_ids)
                with check:
                    if case == "context_parallel":
                        _context_parallel(group, *inputs, grad)
                        continue
                    out = ring_impl.ring_attention(*inputs, group=group, **options)
                    out = out[0] if isinstance(out, tuple) else out
                    out.backward(grad)
    finally:
        RingAttention.reads_are_free, masks.reads_are_free = shortcut, free
    return [
        f"{name} at {' <- '.join(reversed(lines))} ({n}x)"
        for (name, lines), n in check.mixes.items()
    ]


ONE_RANK = (
    "causal",
    "causal_varlen",
    "documents",
    "documents_masked_efficient",
    "window",
    "window_masked_efficient",
    "chunked",
    "prefix",
    "mask_mod",
    "sinks",
    "max_logit",
    "packed",
    "score_fn",
)
TWO_RANKS = (
    *ONE_RANK,
    "causal_head_tail_chunks",
    "documents_head_tail",
    "halo",
    "gather",
    "ulysses",
    "ulysses_documents",
    "context_parallel",
    "uneven",
    "uneven_documents",
    "cross_documents",
    "alibi",
    "alibi_slopes",
    "soft_cap",
    "bias",
)
FOUR_RANKS = ("hybrid", "hybrid_window")


@pytest.mark.parametrize(
    "world,case",
    [(1, c) for c in ONE_RANK] + [(2, c) for c in TWO_RANKS] + [(4, c) for c in FOUR_RANKS],
)
def test_no_call_mixes_device_and_host_tensors(ring, world: int, case: str) -> None:
    per_rank = ring.rank_pool(world).run(_mixes, case)
    for rank, mixes in enumerate(per_rank):
        assert not mixes, (
            f"{case}, W={world}, rank {rank}: device and host tensors mixed (a device mismatch "
            "on a GPU):\n  " + "\n  ".join(mixes)
        )


# ---------------------------------------------------------------------- the check itself


def test_placement_finds_a_host_tensor_beside_a_device_tensor() -> None:
    q = torch.randn(1, 2, 4, 8)
    with DevicePlacement(q) as check:
        doubled = q * 2
        torch.cat([doubled, torch.zeros(1, 2, 1, 8, device=q.device)], dim=2)  # on the device
        torch.cat([doubled, torch.zeros(1, 2, 4, 8).to(q)], dim=2)  # moved there
        torch.cat([doubled, doubled.new_zeros(1, 2, 1, 8)], dim=2)  # made beside it
        torch.cat([doubled, torch.zeros(1, 2, 1, 8)], dim=2)  # a host tensor: the mix
        doubled[:, torch.tensor([0, 1, 0])]  # a host index: CUDA takes it
        host = doubled.cpu()
        torch.cat([host, torch.zeros(1, 2, 1, 8)], dim=2)  # both on the host
        torch.cat([doubled, host], dim=2)  # the second mix
    assert dict(check.mixes) == {("cat", ()): 2}  # (no ring_impl frame made them)


def test_placement_checks_custom_backwards() -> None:
    class HostOnes(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            return x * 2

        @staticmethod
        def backward(ctx, grad):
            return grad + torch.ones(grad.shape)  # made on the host: a mix on a GPU

    q = torch.randn(4, 8, requires_grad=True)
    check = DevicePlacement(q)
    with backwards_checked(check), check:
        HostOnes.apply(q).sum().backward()
    assert dict(check.mixes) == {("add", ()): 1}
