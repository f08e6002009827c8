"""``ring_attention``'s front door: a real signature, one ``exchange=`` choice (the older
``strategy=``/``halo=``/``sparse_kv=`` as deprecated aliases), the call described once
(:class:`ring_impl.call.Call`), and few frames between the user's call and the kernel."""

from __future__ import annotations

import inspect
import re
import traceback
import warnings

import pytest
import torch

import ring_impl
from ring_impl.call import EXCHANGES, Call, exchange_of
from ring_impl.ops.cpu import CpuFlashOp
from tests.ring_impl.outcomes import assert_input_error_on_every_rank

#: Every keyword of ring_attention, in order: the signature tools, IDEs and help() show.
PARAMETERS = (
    "query",
    "key",
    "value",
    "group",
    "is_causal",
    "scale",
    "rotate_method",
    "op",
    "layout",
    "return_lse",
    "return_max_logit",
    "head_chunks",
    "mask",
    "sinks",
    "score_mod",
    "exchange",
    "cu_seqlens",
    "shard_lengths",
    "replicated_kv",
    "strategy",
    "halo",
    "sparse_kv",
)


def test_the_signature_names_every_parameter_and_the_docstring_each() -> None:
    for fn in (ring_impl.ring_attention, ring_impl.bind(ring_impl.RingAttention())):
        params = inspect.signature(fn).parameters
        assert tuple(params) == PARAMETERS
        assert not any(p.kind in (p.VAR_KEYWORD, p.VAR_POSITIONAL) for p in params.values())
        assert params["exchange"].default == "auto"
        doc = inspect.getdoc(fn)
        assert doc is not None and fn.__name__ == "ring_attention"
        for name in PARAMETERS[3:]:
            assert re.search(rf"^    (\w+, )*{name}[,:]", doc, re.M), name  # an entry under Args
        for exchange in EXCHANGES:
            assert f'"{exchange}"' in doc, exchange


@pytest.mark.parametrize(
    "aliases,exchange",
    [
        (dict(strategy="ulysses"), "ulysses"),
        (dict(strategy="hybrid"), "hybrid"),
        (dict(strategy="ring"), "auto"),
        (dict(halo=True), "halo"),
        (dict(halo=False), "ring"),
        (dict(sparse_kv=True), "gather"),
        (dict(sparse_kv=False), "auto"),
        (dict(strategy="ring", halo=False), "ring"),
    ],
)
def test_each_alias_names_one_exchange_and_warns(aliases, exchange) -> None:
    full = {"strategy": None, "halo": None, "sparse_kv": None, **aliases}
    with pytest.warns(DeprecationWarning, match="deprecated; pass exchange="):
        assert exchange_of("auto", **full) == (exchange, None)
    with pytest.warns(DeprecationWarning):  # the same exchange named both ways agrees
        assert exchange_of(exchange, **full) == (exchange, None)


@pytest.mark.parametrize(
    "exchange,aliases,problem",
    [
        ("ring", dict(halo=True), "ask for different exchanges; pass exchange= alone"),
        ("gather", dict(strategy="ulysses"), "ask for different exchanges"),
        ("auto", dict(halo=True, sparse_kv=True), "two different exchanges"),
        ("auto", dict(strategy="ulysses", halo=True), "runs with strategy='ring' only"),
        ("auto", dict(halo="yes"), "halo must be None (automatic), True or False, got 'yes'"),
        ("auto", dict(sparse_kv=1), "sparse_kv must be True or False, got 1"),
        ("auto", dict(strategy="tree"), "unknown strategy 'tree'"),
        ("sideways", dict(halo=True), "unknown exchange 'sideways'"),
    ],
)
def test_contradicting_aliases_are_a_problem_not_a_guess(exchange, aliases, problem) -> None:
    full = {"strategy": None, "halo": None, "sparse_kv": None, **aliases}
    with pytest.warns(DeprecationWarning):
        _, found = exchange_of(exchange, **full)
    assert found is not None and problem in found, found


def test_exchange_alone_warns_nothing_and_an_unknown_one_is_a_problem() -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for exchange in EXCHANGES:
            assert exchange_of(exchange, None, None, None) == (exchange, None)
        _, problem = exchange_of(["ring"], None, None, None)
    assert problem is not None and "unknown exchange ['ring']" in problem


def test_the_call_knows_its_strategy_and_whether_the_lse_is_needed() -> None:
    assert [Call(exchange=e).strategy for e in EXCHANGES] == [
        "ring",
        "ring",
        "ring",
        "ring",
        "ulysses",
        "hybrid",
    ]
    assert Call(exchange="sideways").strategy == "ring"  # the ring's check refuses it
    assert not Call().lse_needed and Call(return_lse=True).lse_needed
    assert Call(sinks=torch.zeros(2)).lse_needed
    options = Call(exchange="halo", scale=0.5).options()
    assert "group" not in options and "mask" not in options and "sinks" not in options
    assert options["exchange"] == "halo" and options["scale"] == 0.5


class _Deepest(CpuFlashOp):
    """The CPU flash op, noting how many frames lie between ``ring_attention`` and its forward."""

    name = "cpu_flash"

    def __init__(self) -> None:
        self.depths: list[int] = []

    def forward(self, *args, **kwargs):
        stack = traceback.extract_stack()[:-1]
        entry = max(
            i
            for i, f in enumerate(stack)
            if f.name == "ring_attention" and f.filename.endswith("api.py")
        )
        self.depths.append(len(stack) - entry)
        return super().forward(*args, **kwargs)


def _frames(ctx, masked: bool) -> list[int]:
    from ring_impl.masks import SlidingWindow

    op = _Deepest()
    q, k, v = (torch.randn(1, 2, 16, 8, requires_grad=True) for _ in range(3))
    mask = SlidingWindow(5) if masked else None
    ring_impl.ring_attention(
        q, k, v, group=ctx.group, is_causal=True, op=op, mask=mask, exchange="ring"
    )
    return op.depths


@pytest.mark.parametrize("world", [1, 2])
@pytest.mark.parametrize("masked", [False, True])
def test_at_most_eight_frames_from_ring_attention_to_the_kernel(
    rank_pool, world: int, masked: bool
) -> None:
    for depths in rank_pool(world).run(_frames, masked, timeout=60.0):
        assert depths and max(depths) <= 8, depths


def _both_ways(ctx, exchange: str, aliases: dict):
    from ring_impl.masks import Documents, SlidingWindow

    seq = 16 * ctx.world_size
    gen = torch.Generator().manual_seed(3)
    q, k, v = (
        ring_impl.shard(t, ctx.world_size, ctx.rank)
        for t in torch.randn(3, 1, 2, seq, 8, generator=gen)
    )
    mask = (
        SlidingWindow(4) if exchange != "gather" else Documents(torch.arange(seq) // 5, causal=True)
    )
    new = ring_impl.ring_attention(
        q, k, v, group=ctx.group, mask=mask, exchange=exchange, op="math"
    )
    with pytest.warns(DeprecationWarning):
        old = ring_impl.ring_attention(q, k, v, group=ctx.group, mask=mask, op="math", **aliases)
    sizes = dict(batch=1, heads=2, heads_kv=2, seq_kv=16, seq_q=16, head_dim=8, dtype=torch.float32)
    schedule = ring_impl.collective_schedule(
        ctx.world_size, "allgather", mask=mask, rank=ctx.rank, exchange=exchange, **sizes
    )
    aliased = ring_impl.collective_schedule(
        ctx.world_size, "allgather", mask=mask, rank=ctx.rank, **aliases, **sizes
    )
    return torch.equal(new, old), schedule == aliased, schedule


@pytest.mark.parametrize(
    "exchange,aliases",
    [
        ("halo", dict(halo=True)),
        ("ring", dict(halo=False)),
        ("gather", dict(sparse_kv=True)),
    ],
)
def test_an_exchange_and_its_alias_run_the_same_path(
    rank_pool, exchange: str, aliases: dict
) -> None:
    results = rank_pool(2).run(_both_ways, exchange, aliases, timeout=60.0)
    assert all(same_out and same_schedule for same_out, same_schedule, _ in results), results
    # The exchanges differ: the halo and the gather send other collectives than the ring.
    kinds = {kind for phase in results[0][2].values() for kind in phase}
    assert kinds, results[0][2]


def _bad_exchange(ctx, kind: str) -> str:
    from ring_impl.masks import SlidingWindow

    q = torch.randn(1, 2, 8, 8)
    options: dict = {"mask": SlidingWindow(3)}
    if kind == "unknown":
        options["exchange"] = "sideways" if ctx.rank == 1 else "auto"
    elif kind == "contradicting":
        options.update(exchange="ring", halo=True)
    elif kind == "ranks_differ":
        options["exchange"] = "ring" if ctx.rank == 0 else "halo"
    elif kind == "ring_or_ulysses":
        options["exchange"] = "ulysses" if ctx.rank == 0 else "ring"
    elif kind == "auto_resolves_apart":  # the halo serves rank 0's window, not rank 1's
        options["mask"] = SlidingWindow(3 if ctx.rank == 0 else None)
    elif kind == "halo_cannot":
        options.update(exchange="halo", mask=SlidingWindow(9))
    elif kind == "mask_on_one_rank_only":  # (a hook that drops the mask on rank 1)
        options["mask"] = SlidingWindow(3) if ctx.rank == 0 else None
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        ring_impl.ring_attention(q, q, q, group=ctx.group, **options)
    return "no error"


@pytest.mark.parametrize(
    "kind,pattern",
    [
        ("unknown", "unknown exchange 'sideways'"),
        ("contradicting", "ask for different exchanges"),
        ("ranks_differ", "ranks disagree on exchange (rank 0 'ring'; rank 1 'halo')"),
        ("ring_or_ulysses", "ranks disagree on exchange (rank 0 'ulysses'; rank 1 'ring')"),
        ("auto_resolves_apart", "ranks disagree on exchange (rank 0 'halo'; rank 1 'ring')"),
        # the cause first: a mask chooses the exchange under "auto"
        ("mask_on_one_rank_only", "ranks disagree on mask (rank 0 mask/sinks/score_mod digest"),
        ("halo_cannot", "exchange='halo' but the halo exchange cannot serve this call"),
    ],
)
def test_a_bad_exchange_raises_on_every_rank(rank_pool, kind: str, pattern: str) -> None:
    outcomes = rank_pool(2).run_outcomes(_bad_exchange, kind, timeout=30.0)
    assert_input_error_on_every_rank(outcomes, pattern)


def test_the_schedule_refuses_an_unknown_or_contradicted_exchange() -> None:
    sizes = dict(batch=1, heads_kv=2, seq_kv=8, head_dim=8, dtype=torch.float32)
    with pytest.raises(ValueError, match="unknown exchange 'sideways'"):
        ring_impl.collective_schedule(2, "allgather", exchange="sideways", **sizes)
    with pytest.raises(ValueError, match="contradicts"):
        ring_impl.collective_schedule(2, "allgather", exchange="ring", halo=True, **sizes)
    assert ring_impl.collective_schedule(
        2, "allgather", exchange="ring", **sizes
    ) == ring_impl.collective_schedule(2, "allgather", halo=False, **sizes)
