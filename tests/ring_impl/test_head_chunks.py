"""``head_chunks``: the ring run over groups of heads one after another (ring_impl.exchanges.heads).

The chunked ring must give the same results as one ring over every head (judged against the
float64 reference with the suites' policy), issue exactly the declared schedule (calls times
the chunks, bytes unchanged), keep the chunks' collectives in one order under torch.compile,
record per-step partials over all heads for diagnosis, and reject a bad ``head_chunks`` on
every rank.
"""

from __future__ import annotations

import itertools

import pytest
import torch

from ring_impl import collective_schedule
from ring_impl.exchanges.heads import check_head_chunks, head_spans
from suites.cases import RingCase
from suites.inputs import InputSpec
from tests.ring_impl.outcomes import assert_input_error_on_every_rank
from tests.ring_impl.routes import sdpa_both_routes


@pytest.mark.parametrize(
    "heads,heads_kv,chunks", [(8, 8, 1), (8, 8, 4), (8, 8, 3), (6, 3, 2), (12, 4, 4), (4, 1, 1)]
)
def test_head_spans_partition_heads_along_gqa_groups(
    heads: int, heads_kv: int, chunks: int
) -> None:
    spans = head_spans(heads, heads_kv, chunks)
    assert len(spans) == chunks
    q_heads = [h for hq, _ in spans for h in range(heads)[hq]]
    kv_heads = [h for _, hkv in spans for h in range(heads_kv)[hkv]]
    assert q_heads == list(range(heads)) and kv_heads == list(range(heads_kv))
    group = heads // heads_kv
    sizes = []
    for hq, hkv in spans:
        # every query head of the chunk attends a key/value head of the same chunk (SDPA's GQA map)
        assert {h // group for h in range(heads)[hq]} == set(range(heads_kv)[hkv])
        sizes.append(hkv.stop - hkv.start)
    assert max(sizes) - min(sizes) <= 1, f"uneven split {sizes}"


@pytest.mark.parametrize(
    "bad,why",
    [
        (0, "positive"),
        (-1, "positive"),
        (True, "positive"),
        (2.0, "positive"),
        (5, "exceeds the 4 key/value heads"),
    ],
)
def test_check_head_chunks_names_the_problem(bad, why: str) -> None:
    problem = check_head_chunks(bad, 4)
    assert problem is not None and why in problem
    with pytest.raises(ValueError, match="head_chunks"):
        collective_schedule(
            2,
            "alltoall",
            batch=1,
            heads_kv=4,
            seq_kv=8,
            head_dim=4,
            dtype=torch.float32,
            head_chunks=bad,
        )


def test_schedule_multiplies_calls_and_keeps_bytes() -> None:
    kw = dict(batch=2, heads_kv=4, seq_kv=8, head_dim=16, dtype=torch.bfloat16)
    for w, method, compiled in itertools.product(
        (2, 3, 4), ("allgather", "alltoall", "p2p"), (False, True)
    ):
        one = collective_schedule(w, method, compiled=compiled, **kw)
        four = collective_schedule(w, method, compiled=compiled, head_chunks=4, **kw)
        for phase, kinds in one.items():
            assert kinds.keys() == four[phase].keys()
            for kind, entry in kinds.items():
                calls = entry["calls"] if kind == "all_reduce" else 4 * entry["calls"]
                assert four[phase][kind] == {"calls": calls, "bytes": entry["bytes"]}, (
                    w,
                    method,
                    compiled,
                    phase,
                    kind,
                )


def _cases() -> list:
    out = []
    # (world, rotate, causal, layout, dtype, heads, heads_kv, chunks)
    grid = [
        (2, "allgather", True, "head_tail", "float32", 4, 4, 2),
        (2, "alltoall", False, "contiguous", "float64", 4, 4, 4),
        (3, "p2p", True, "head_tail", "float32", 6, 3, 2),  # GQA, uneven chunks (1 and 2 kv heads)
        (3, "alltoall", True, "contiguous", "bfloat16", 4, 2, 2),
        (4, "allgather", False, "contiguous", "float32", 6, 3, 3),
        (4, "p2p", True, "head_tail", "float64", 4, 4, 3),
    ]
    for w, rotate, causal, layout, dtype, heads, heads_kv, chunks in grid:
        spec = InputSpec(
            batch=2,
            heads=heads,
            heads_kv=heads_kv,
            seq_q=8 * w,
            seq_kv=8 * w,
            head_dim=16,
            dtype=dtype,
            seed=1000 + w,
        )
        case = RingCase(
            spec,
            w,
            is_causal=causal,
            layout=layout,
            rotate_method=rotate,
            account=True,
            extras=(("head_chunks", chunks),),
        )
        out.append(
            pytest.param(
                case,
                id=f"W{w}-{dtype}-{'causal' if causal else 'full'}-{rotate}-{layout}-"
                f"h{heads}kv{heads_kv}-c{chunks}",
            )
        )
    return out


@pytest.mark.parametrize("case", _cases())
def test_chunked_ring_matches_reference_and_schedule(ring, case: RingCase) -> None:
    case = ring.prepare(case)
    results = ring.run(case)
    ring.check(case, results=results)
    expected = case.declared_schedule(
        collective_schedule, head_chunks=dict(case.extras)["head_chunks"]
    )
    for rank, r in enumerate(results):
        issued = {phase: kinds for phase, kinds in r["collectives"].items() if kinds}
        assert issued == {p: k for p, k in expected.items() if k}, (
            f"rank {rank}: issued {issued}, declared {expected}"
        )


@pytest.mark.compile
@pytest.mark.parametrize("backend", ["aot_eager", "inductor"])
@pytest.mark.parametrize("rotate", ["allgather", "p2p"])
def test_chunked_ring_compiles_in_one_order(ring, backend: str, rotate: str) -> None:
    """W=3 causal, compiled: the chunked ring is right and does not hang.

    The ranks' graphs differ (their causal plans do). torch 2.13 also keeps the chunks in
    program order without heads.py's ordering tie, so this checks the compiled chunked ring's
    results, not the tie itself.
    """
    spec = InputSpec(
        batch=1, heads=4, heads_kv=4, seq_q=24, seq_kv=24, head_dim=16, dtype="float32", seed=77
    )
    case = RingCase(
        spec,
        3,
        is_causal=True,
        layout="head_tail",
        rotate_method=rotate,
        compile=backend,
        extras=(("head_chunks", 2),),
    )
    ring.check(ring.prepare(case))


def test_chunked_records_cover_every_head(ring) -> None:
    """Per-step partials (for diagnosis) are joined across chunks:
    the same records as one ring's."""
    spec = InputSpec(
        batch=1, heads=4, heads_kv=2, seq_q=12, seq_kv=12, head_dim=8, dtype="float64", seed=5
    )
    base = ring.prepare(
        RingCase(spec, 3, is_causal=True, layout="head_tail", rotate_method="alltoall", record=True)
    )
    whole = ring.run(base)
    chunked = ring.run(base.with_(extras=(("head_chunks", 2),)))
    for rank, (a, b) in enumerate(zip(whole, chunked)):
        assert [(r["step"], r["q_rows"]) for r in a["records"]] == [
            (r["step"], r["q_rows"]) for r in b["records"]
        ]
        for ra, rb in zip(a["records"], b["records"]):
            assert rb["out"].shape == ra["out"].shape, f"rank {rank} step {ra['step']}"
            torch.testing.assert_close(rb["out"], ra["out"], rtol=1e-12, atol=1e-12)
            torch.testing.assert_close(rb["lse"], ra["lse"], rtol=1e-12, atol=1e-12)


def _bad_chunks(ctx, kind: str):
    import ring_impl

    q = torch.randn(1, 4, 8, 8)
    k, v = torch.randn(1, 2, 8, 8), torch.randn(1, 2, 8, 8)
    chunks = {"too_many": 3, "zero": 0, "differ": 1 + (ctx.rank == ctx.world_size - 1)}[kind]
    ring_impl.ring_attention(q, k, v, group=ctx.group, rotate_method="alltoall", head_chunks=chunks)
    return "no error"


@pytest.mark.parametrize(
    "kind,pattern",
    [
        ("too_many", "exceeds the 2 key/value heads"),
        ("zero", "positive int"),
        ("differ", "head_chunks (rank 0 1; rank 1 2)"),
    ],
)
def test_bad_head_chunks_raise_on_every_rank(ring, kind: str, pattern: str) -> None:
    outcomes = ring.rank_pool(2).run_outcomes(_bad_chunks, kind, timeout=30.0)
    assert_input_error_on_every_rank(outcomes, pattern)


def _routed_with_chunks(ctx) -> dict:
    """SDPA under ``context_parallel`` and under ``ContextParallel``, head_chunks 1 and 2."""
    gen = torch.Generator().manual_seed(3)
    q, k, v = (
        torch.randn(1, 4, 8 * ctx.world_size, 8, dtype=torch.float64, generator=gen)
        for _ in range(3)
    )
    out: dict = {}
    for chunks in (1, 2):
        routed = sdpa_both_routes(ctx, q, k, v, head_chunks=chunks)
        out[f"cp{chunks}"], out[f"style{chunks}"] = routed["cp"], routed["style"]
    return out


def test_context_parallel_routes_head_chunks(ring) -> None:
    for rank, r in enumerate(ring.rank_pool(2).run(_routed_with_chunks, timeout=60.0)):
        for route in ("cp", "style"):
            (o1, log1), (o2, log2) = r[f"{route}1"], r[f"{route}2"]
            torch.testing.assert_close(
                o2,
                o1,
                rtol=1e-12,
                atol=1e-12,
                msg=lambda m, at=f"rank {rank} {route}": f"{at}: {m}",
            )
            calls1, calls2 = _hops(log1), _hops(log2)
            assert calls2 == 2 * calls1, (
                f"rank {rank} {route}: head_chunks=2 issued {calls2} hops, 1 issued {calls1}"
            )


def _hops(summary: dict) -> int:
    return sum(kinds.get("all_to_all", {}).get("calls", 0) for kinds in summary.values())
