"""Diagnosis: deliberately wrong ring results, built here from the simulation's blocks, must be
pinned to the rank and ring step that broke them."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch

from reference.attention import attention_grads, masked_attention
from reference.diagnose import diagnose
from reference.layout import shard
from reference.simulate import RingSimulation, merge_partials
from tests.reference.strategies import make_problem, simulate

Partial = tuple[torch.Tensor, torch.Tensor]


def make_sim(
    world_size: int, layout: str, is_causal: bool, scale: float | None = None, chunk: int = 2
) -> RingSimulation:
    seq = world_size * chunk * (2 if layout == "head_tail" else 1)
    p = make_problem(seed=7, groups=2, seq_q=seq, head_dim=4, is_causal=is_causal, scale=scale)
    return simulate(p, world_size, layout)


def block(
    sim: RingSimulation,
    rank: int,
    kv_rank: int,
    visible: torch.Tensor | None,
    scale: float | None = None,
) -> Partial:
    """rank's queries against kv_rank's key/value block under an explicit mask and scale."""
    return masked_attention(
        sim.query_shard(rank),
        sim.key_shard(kv_rank),
        sim.value_shard(kv_rank),
        visible,
        scale=sim.scale if scale is None else scale,
    )


def outputs(sim: RingSimulation, bug: Callable[[int, int, Partial], Partial | None]) -> list:
    """Per-rank local outputs of a ring in which bug(rank, step, partial) replaces each step's
    partial (None drops the step)."""
    outs = []
    for rank in range(sim.world_size):
        parts = [bug(rank, r.step, (r.partial_out, r.partial_lse)) for r in sim.rank_steps(rank)]
        outs.append(merge_partials([p for p in parts if p is not None])[0])
    return outs


def only(rank: int, step: int, replacement: Callable[[], Partial | None]):
    return lambda r, s, p: replacement() if (r, s) == (rank, step) else p


def test_a_correct_ring_is_ok() -> None:
    sim = make_sim(3, "head_tail", True)
    d = diagnose(sim, [sim.local_out(r).float() for r in range(3)], dtype=torch.float32)
    assert d.ok and d.rank is None and d.step is None and not d.findings
    assert "no divergence" in d.summary


def test_dropped_step_is_pinned() -> None:
    sim = make_sim(4, "contiguous", True)
    assert sim.step(2, 1).kind == "full"
    d = diagnose(sim, outputs(sim, only(2, 1, lambda: None)))
    assert (d.rank, d.step) == (2, 1)
    assert list(d.bad_rows) == [2]
    assert d.bad_rows[2] == (4, 5)  # every row of rank 2 sees rank 1's keys
    assert "step 1 (kv from rank 1, full) was skipped" in d.summary
    assert "first divergence at rank 2, ring step 1" in d.summary


def test_skipped_step_computed_as_full_is_pinned() -> None:
    sim = make_sim(4, "contiguous", True)
    assert sim.step(1, 2).kind == "skip" and sim.step(1, 2).kv_rank == 3
    d = diagnose(sim, outputs(sim, only(1, 2, lambda: block(sim, 1, 3, None))))
    assert (d.rank, d.step) == (1, 2)
    assert "step 2 (kv from rank 3, skip) was computed as full" in d.findings[0].what


def test_single_rank_ring_is_diagnosed() -> None:
    sim = make_sim(1, "contiguous", True)
    d = diagnose(sim, outputs(sim, only(0, 0, lambda: block(sim, 0, 0, None))))
    assert (d.rank, d.step) == (0, 0)
    assert "step 0 (kv from rank 0, causal) was computed as full" in d.findings[0].what
    tril = sim.step(0, 0).visible
    d = diagnose(sim, outputs(sim, only(0, 0, lambda: block(sim, 0, 0, tril, scale=1.0))))
    assert (d.rank, d.step) == (0, 0) and "used scale 1" in d.findings[0].what


def test_full_step_computed_as_causal_is_pinned() -> None:
    sim = make_sim(3, "contiguous", True)
    tril = torch.ones(2, 2, dtype=torch.bool).tril()
    d = diagnose(sim, outputs(sim, only(2, 1, lambda: block(sim, 2, 1, tril))))
    assert (d.rank, d.step) == (2, 1)
    assert "was computed as causal" in d.findings[0].what
    # Under tril, block row 1 still sees both keys of rank 1; only row 0 (global 4) loses one.
    assert d.bad_rows == {2: (4,)}


def test_wrong_key_value_block_is_pinned_in_head_tail() -> None:
    sim = make_sim(4, "head_tail", True)
    rec = sim.step(1, 1)  # rank 1 should hold rank 0's block; it got rank 2's (wrong neighbour)
    assert rec.kv_rank == 0
    d = diagnose(sim, outputs(sim, only(1, 1, lambda: block(sim, 1, 2, rec.visible))))
    assert (d.rank, d.step) == (1, 1)
    assert "used the key/value block of rank 2" in d.findings[0].what


def test_wrong_scale_on_later_steps_is_pinned_on_every_rank() -> None:
    sim = make_sim(3, "contiguous", False, scale=0.3)
    bug = lambda r, s, p: p if s == 0 else block(sim, r, (r - s) % 3, None, scale=0.5)  # noqa: E731
    d = diagnose(sim, outputs(sim, bug))
    assert (d.rank, d.step) == (0, 1)
    assert sorted(d.bad_rows) == [0, 1, 2]
    assert {(f.rank, f.step) for f in d.findings} == {(0, 1), (1, 1), (2, 1)}
    assert "steps 1..2 used scale 0.5 instead of 0.3" in d.findings[0].what


def test_first_divergence_is_first_in_ring_time() -> None:
    sim = make_sim(4, "contiguous", True)
    bug_late = only(0, 3, lambda: block(sim, 0, 1, None))  # rank 0 step 3: skip computed full
    bug_early = only(3, 1, lambda: None)  # rank 3 step 1: needed, dropped
    d = diagnose(sim, outputs(sim, lambda r, s, p: bug_late(r, s, bug_early(r, s, p))))
    assert (d.rank, d.step) == (3, 1)
    assert [(f.rank, f.step) for f in d.findings] == [(3, 1), (0, 3)]


def test_unexplained_error_still_names_the_rank_and_rows() -> None:
    sim = make_sim(2, "contiguous", False)
    outs = [sim.local_out(r).clone() for r in range(2)]
    outs[1][0, 1, 1, 0] += 1.0  # one corrupted element: no ring-step bug looks like this
    d = diagnose(sim, outs)
    assert not d.ok and d.rank == 1 and d.step is None
    assert d.bad_rows == {1: (3,)}
    assert "no single-step hypothesis" in d.summary
    assert "rank 1 at global query positions 3" in d.summary


def test_low_precision_results_are_judged_with_the_dtype_tolerance() -> None:
    sim = make_sim(4, "head_tail", True)
    good = [sim.local_out(r).to(torch.bfloat16) for r in range(4)]
    assert diagnose(sim, good, dtype=torch.bfloat16).ok
    bad = [o.to(torch.bfloat16) for o in outputs(sim, only(2, 3, lambda: None))]
    d = diagnose(sim, bad, dtype=torch.bfloat16)
    assert (d.rank, d.step) == (2, 3)


def test_gradient_shards_are_attributed_to_ranks() -> None:
    sim = make_sim(3, "head_tail", True)
    grad_out = torch.randn(
        sim.query.shape, dtype=torch.float64, generator=torch.Generator().manual_seed(1)
    )
    ref = attention_grads(sim.query, sim.key, sim.value, grad_out, is_causal=True)
    grads = {
        name: [shard(getattr(ref, name), "head_tail", 3, r) for r in range(3)]
        for name in ("dq", "dk", "dv")
    }
    grads["dk"][1] = grads["dk"][1] * 1.5  # dK not returned home correctly on rank 1
    d = diagnose(sim, [sim.local_out(r) for r in range(3)], grads_by_rank=grads, grad_out=grad_out)
    assert not d.ok
    assert d.grad_bad_ranks == {"dq": (), "dk": (1,), "dv": ()}
    assert "dk shards wrong on rank 1" in d.summary
    assert "dv shards match on every rank" in d.summary
    with pytest.raises(ValueError, match="needs grad_out"):
        diagnose(sim, None, grads_by_rank=grads)


# ---------------------------------------------------------------- with per-step records


def records_of(sim: RingSimulation, dtype: torch.dtype = torch.float64) -> list[dict]:
    """What a correct implementation would record: each non-skipped step's partial, trimmed to
    the query rows that see any key of the block (as head_tail implementations compute them)."""
    recs = []
    for r in sim.steps:
        if r.kind == "skip":
            continue
        rows = r.visible.any(dim=1).nonzero()[:, 0]
        start, stop = int(rows.min()), int(rows.max()) + 1
        recs.append(
            {
                "rank": r.rank,
                "step": r.step,
                "kv_rank": r.kv_rank,
                "q_rows": (start, stop),
                "out": r.partial_out[..., start:stop, :].to(dtype),
                "lse": r.partial_lse[..., start:stop].to(dtype),
            }
        )
    return recs


def find(recs: list[dict], rank: int, step: int) -> dict:
    return next(e for e in recs if (e["rank"], e["step"]) == (rank, step))


def assert_records_pinned(
    sim: RingSimulation, recs: list[dict], rank_step: tuple[int, int], phrase: str
) -> None:
    """Diagnosing ``recs`` alone pins ``rank_step`` (rank, ring step) and says ``phrase``."""
    __tracebackhide__ = True
    d = diagnose(sim, None, records=recs)
    assert (d.rank, d.step) == rank_step, d.summary
    assert phrase in d.summary, d.summary


@pytest.mark.parametrize("layout", ["contiguous", "head_tail"])
def test_correct_records_are_ok(layout: str) -> None:
    sim = make_sim(3, layout, True)
    recs = records_of(sim, torch.float32)
    rows_per_rank = sim.query.shape[2] // 3
    assert any(e["q_rows"] != (0, rows_per_rank) for e in recs) == (layout == "head_tail")
    d = diagnose(sim, [sim.local_out(r) for r in range(3)], records=recs, dtype=torch.float32)
    assert d.ok, d.summary


def test_record_with_wrong_partial_is_pinned() -> None:
    sim = make_sim(4, "head_tail", True)
    recs = records_of(sim)
    e = find(recs, 2, 2)
    e["out"] = e["out"] * 1.01
    d = diagnose(sim, None, records=recs)
    assert (d.rank, d.step) == (2, 2)
    assert "partial out max err" in d.findings[0].what


def test_record_of_a_step_that_must_be_skipped() -> None:
    sim = make_sim(3, "contiguous", True)
    recs = records_of(sim)
    wrong_out, wrong_lse = block(sim, 0, 2, None)
    recs.append(
        {"rank": 0, "step": 1, "kv_rank": 2, "q_rows": (0, 2), "out": wrong_out, "lse": wrong_lse}
    )
    assert_records_pinned(sim, recs, (0, 1), "must be skipped")


def test_missing_record_of_a_needed_step() -> None:
    sim = make_sim(3, "contiguous", True)
    recs = [e for e in records_of(sim) if (e["rank"], e["step"]) != (2, 2)]
    assert_records_pinned(sim, recs, (2, 2), "skipped, but 4 query-key pairs are visible")


def test_record_with_wrong_kv_rank() -> None:
    sim = make_sim(4, "contiguous", False)
    recs = records_of(sim)
    find(recs, 1, 1)["kv_rank"] = 2
    assert_records_pinned(sim, recs, (1, 1), "key/value block of rank [2]")


def test_record_with_untrimmed_lse_padding() -> None:
    sim = make_sim(2, "contiguous", False)
    recs = records_of(sim)
    e = find(recs, 1, 0)
    # Memory-efficient attention pads LSE to a multiple of 32 with garbage.
    e["lse"] = torch.cat([e["lse"], torch.full((1, 2, 30), 123.0, dtype=torch.float64)], dim=-1)
    assert_records_pinned(sim, recs, (1, 0), "LSE padding not trimmed")


def test_records_fine_but_output_wrong_blames_the_merge() -> None:
    sim = make_sim(2, "contiguous", True)
    outs = [sim.local_out(r) for r in range(2)]
    outs[1] = outs[1] * 0.5
    d = diagnose(sim, outs, records=records_of(sim))
    assert not d.ok and d.rank == 1 and d.step is None
    assert "merge of the partials" in d.summary
