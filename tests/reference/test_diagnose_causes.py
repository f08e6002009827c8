"""Diagnosis names causes, not symptoms: a replayed bug that reproduces a step's partial, the
dtype a result went through, an exp overflow, an LSE in base 2 or shifted, and backward bugs
(own block reused, dK/dV short of their owners). Each wrong result is built here from the
simulation's blocks with one bug."""

from __future__ import annotations

import math

import pytest
import torch

from reference.attention import attention_grads
from reference.diagnose import _replay_backward, compare_records, diagnose, narrowest_dtype
from reference.layout import shard
from reference.simulate import lower_triangular
from tests.reference.strategies import make_problem, simulate
from tests.reference.test_diagnose import block, find, make_sim, records_of


def test_narrowest_dtype_sees_the_rounding_a_result_went_through() -> None:
    x = torch.randn(64, dtype=torch.float64)
    assert narrowest_dtype(x) is None
    assert narrowest_dtype(x.float().double()) == torch.float32
    assert narrowest_dtype(x.bfloat16().double()) == torch.bfloat16
    assert narrowest_dtype(x.bfloat16().float()) == torch.bfloat16
    assert narrowest_dtype(x.float(), wider=torch.float32) is None
    assert narrowest_dtype(x[:4].float().double()) is None  # too few values to tell
    exact = torch.arange(1, 65, dtype=torch.float64)  # the truth itself is exact: nothing to blame
    assert narrowest_dtype(exact, exact) is None


def _diagnosed_step(layout: str, is_causal: bool, rank: int, step: int, partial) -> str:
    sim = make_sim(3, layout, is_causal)
    recs = records_of(sim)
    e = find(recs, rank, step)
    start, stop = e["q_rows"]
    e["out"], e["lse"] = partial(sim)[0][..., start:stop, :], partial(sim)[1][..., start:stop]
    findings = compare_records(sim, recs)
    assert findings and (findings[0].rank, findings[0].step) == (rank, step)
    return findings[0].what


def test_full_step_computed_with_a_diagonal_mask_is_named() -> None:
    what = _diagnosed_step(
        "contiguous", True, 2, 1, lambda sim: block(sim, 2, 1, lower_triangular(2))
    )
    assert "explained by: computed with a causal (diagonal) mask, though this block is full" in what


def test_non_causal_step_with_the_causal_mask_is_named() -> None:
    sim = make_sim(3, "head_tail", False)
    causal = make_sim(3, "head_tail", True).step(1, 1).visible
    what = _diagnosed_step("head_tail", False, 1, 1, lambda s: block(sim, 1, 0, causal))
    assert "causal mask of these positions, though attention is not causal" in what


def test_swapped_head_tail_chunks_are_named() -> None:
    def swapped(sim):
        k, v = sim.key_shard(0), sim.value_shard(0)
        n = k.shape[2] // 2
        perm = torch.cat([torch.arange(n, 2 * n), torch.arange(0, n)])
        from reference.attention import masked_attention

        return masked_attention(
            sim.query_shard(2),
            k[..., perm, :],
            v[..., perm, :],
            sim.step(2, 2).visible,
            scale=sim.scale,
        )

    assert "wrong key/value chunk of the head_tail pair" in _diagnosed_step(
        "head_tail", True, 2, 2, swapped
    )


def test_wrong_block_scale_and_lse_only_are_named() -> None:
    assert "used the key/value block of rank 2 instead of rank 1" in _diagnosed_step(
        "contiguous", False, 0, 2, lambda sim: block(sim, 0, 2, None)
    )
    assert "used scale 1 instead of" in _diagnosed_step(
        "contiguous", False, 1, 1, lambda sim: block(sim, 1, 0, None, scale=1.0)
    )
    what = _diagnosed_step(
        "contiguous",
        False,
        1,
        1,
        lambda sim: (block(sim, 1, 0, None)[0], block(sim, 1, 0, None)[1] + 3),
    )
    assert "the partial output matches but its LSE does not" in what


def test_partial_computed_in_float32_is_named() -> None:
    sim = make_sim(2, "contiguous", True, chunk=8)
    recs = records_of(sim)
    for e in recs:
        e["out"] = e["out"].float().double()
        e["lse"] = (e["lse"] + 1e-7).float().double()
    what = compare_records(sim, recs)[0].what
    assert (
        "partial of this float64 ring is a float32 number: the step was computed in float32" in what
    )


def test_results_rounded_through_a_narrower_dtype_are_named() -> None:
    sim = make_sim(2, "contiguous", False, chunk=8)
    lses = [sim.local_lse(r).bfloat16().float() for r in range(2)]
    d = diagnose(
        sim, [sim.local_out(r).bfloat16() for r in range(2)], lse_by_rank=lses, dtype=torch.bfloat16
    )
    assert "lse on rank 0-1: every value of the float32 result is a bfloat16 number" in d.summary


def test_lse_in_base_2_or_shifted_is_named() -> None:
    sim = make_sim(2, "contiguous", False, chunk=8)
    outs = [sim.local_out(r).float() for r in range(2)]
    base2 = diagnose(
        sim,
        outs,
        lse_by_rank=[sim.local_lse(r) / math.log(2) for r in range(2)],
        dtype=torch.float32,
    )
    assert (
        "lse on rank 0-1 is the natural-log LSE divided by ln 2: it is in base 2" in base2.summary
    )
    shifted = diagnose(
        sim,
        outs,
        lse_by_rank=[sim.local_lse(r).float() + 4e-3 for r in range(2)],
        dtype=torch.bfloat16,
    )
    assert (
        "lse is shifted by a constant on every row (4.0e-3 on rank 0, 4.0e-3 on rank 1)"
        in shifted.summary
    )


def test_overflow_is_named_only_where_the_lse_is_beyond_exp() -> None:
    calm = make_sim(
        2, "contiguous", False, chunk=4
    )  # LSE of a few units: a NaN there is no overflow
    d = diagnose(
        calm, [torch.full_like(calm.local_out(r), math.nan) for r in range(2)], dtype=torch.float32
    )
    assert not d.ok and "overflowed" not in d.summary
    hot = simulate(make_problem(seed=3, seq_q=8, head_dim=8, magnitude=30.0), 2, "contiguous")
    assert float(hot.lse.abs().max()) > math.log(torch.finfo(torch.float32).max)
    d = diagnose(
        hot, [torch.full_like(hot.local_out(r), math.nan) for r in range(2)], dtype=torch.float32
    )
    assert "an exp of the LSE (or of raw scores) overflowed" in d.summary


@pytest.mark.parametrize("layout", ["contiguous", "head_tail"])
def test_backward_bugs_are_named(layout: str) -> None:
    sim = make_sim(3, layout, True)
    g = torch.randn(
        sim.query.shape, dtype=torch.float64, generator=torch.Generator().manual_seed(5)
    )
    outs = [sim.local_out(r) for r in range(3)]
    own = _replay_backward(sim, g, lambda rec: rec.rank)
    d = diagnose(sim, outs, grads_by_rank=own, grad_out=g)
    assert "the backward used each rank's own key/value block at every ring step" in d.summary
    ref = attention_grads(
        sim.query, sim.key, sim.value, g, is_causal=True, scale=sim.scale
    )._asdict()
    right = {n: [shard(ref[n], layout, 3, r) for r in range(3)] for n in ("dq", "dk", "dv")}
    short = {
        "dq": right["dq"],
        "dk": [right["dk"][(r + 1) % 3] for r in range(3)],
        "dv": [right["dv"][(r + 1) % 3] for r in range(3)],
    }
    d = diagnose(sim, outs, grads_by_rank=short, grad_out=g)
    assert "dq matches on every rank, but rank r holds the dk/dv of rank r+1's block" in d.summary
    assert diagnose(sim, outs, grads_by_rank=right, grad_out=g).ok


@pytest.mark.parametrize("layout", ["contiguous", "head_tail"])
def test_a_loss_with_the_lse_is_diagnosed_with_its_gradient(layout: str) -> None:
    """Right gradients of a loss that uses the LSE are right to the diagnosis only when it is
    given the LSE's gradient: without it, they look like a broken backward. A backward bug
    under such a loss is still named."""
    sim = make_sim(3, layout, True)
    gen = torch.Generator().manual_seed(6)
    g = torch.randn(sim.query.shape, dtype=torch.float64, generator=gen)
    g_lse = torch.randn(sim.query.shape[:3], dtype=torch.float64, generator=gen)
    outs = [sim.local_out(r) for r in range(3)]
    ref = attention_grads(
        sim.query, sim.key, sim.value, g, is_causal=True, scale=sim.scale, grad_lse=g_lse
    )._asdict()
    right = {n: [shard(ref[n], layout, 3, r) for r in range(3)] for n in ("dq", "dk", "dv")}
    assert diagnose(sim, outs, grads_by_rank=right, grad_out=g, grad_lse=g_lse).ok
    blamed = diagnose(sim, outs, grads_by_rank=right, grad_out=g)
    assert "the backward is at fault" in blamed.summary
    own = _replay_backward(sim, g, lambda rec: rec.rank, grad_lse=g_lse)
    d = diagnose(sim, outs, grads_by_rank=own, grad_out=g, grad_lse=g_lse)
    assert "the backward used each rank's own key/value block at every ring step" in d.summary


def _grads_with_step_outputs(sim, grad_out: torch.Tensor) -> dict[str, list[torch.Tensor]]:
    """dq, dk, dv of a ring whose backward takes each step's own partial output in the row term
    ``D = rowsum(dO * O)``, written out here per step (softmax against the merged LSE) apart from
    the diagnosis's replay. GQA: key/value heads repeated for their query groups, folded back."""
    w = sim.world_size
    grads = {
        "dq": [torch.zeros_like(sim.query_shard(r)) for r in range(w)],
        "dk": [torch.zeros_like(sim.key_shard(r)) for r in range(w)],
        "dv": [torch.zeros_like(sim.value_shard(r)) for r in range(w)],
    }
    for rank in range(w):
        q, (_, lse) = sim.query_shard(rank), sim.local_merge(rank)
        do = shard(grad_out, sim.layout, w, rank)
        group = q.shape[1] // sim.key_shard(0).shape[1]
        for rec in sim.rank_steps(rank):
            if rec.kind == "skip":
                continue
            k = sim.key_shard(rec.kv_rank).repeat_interleave(group, 1)
            v = sim.value_shard(rec.kv_rank).repeat_interleave(group, 1)
            s = torch.einsum("bhqd,bhkd->bhqk", q, k) * sim.scale
            p = torch.exp(s - lse.unsqueeze(-1)) * rec.visible
            d_step = torch.einsum("bhqd,bhqd->bhq", do, rec.partial_out).unsqueeze(-1)
            ds = p * (torch.einsum("bhqd,bhkd->bhqk", do, v) - d_step)
            grads["dq"][rank] += torch.einsum("bhqk,bhkd->bhqd", ds, k) * sim.scale
            dk = torch.einsum("bhqk,bhqd->bhkd", ds, q) * sim.scale
            dv = torch.einsum("bhqk,bhqd->bhkd", p, do)
            b, h, n, d = dk.shape
            grads["dk"][rec.kv_rank] += dk.reshape(b, h // group, group, n, d).sum(2)
            grads["dv"][rec.kv_rank] += dv.reshape(b, h // group, group, n, d).sum(2)
    return grads


@pytest.mark.parametrize("layout", ["contiguous", "head_tail"])
@pytest.mark.parametrize("causal", [False, True])
def test_backward_with_each_steps_own_output_is_named(layout: str, causal: bool) -> None:
    sim = make_sim(3, layout, causal)
    g = torch.randn(
        sim.query.shape, dtype=torch.float64, generator=torch.Generator().manual_seed(6)
    )
    outs = [sim.local_out(r) for r in range(3)]
    wrong = _grads_with_step_outputs(sim, g)
    ref = attention_grads(
        sim.query, sim.key, sim.value, g, is_causal=causal, scale=sim.scale
    )._asdict()
    assert (
        max(float((wrong["dq"][r] - shard(ref["dq"], layout, 3, r)).abs().max()) for r in range(3))
        > 1e-3
    )
    d = diagnose(sim, outs, grads_by_rank=wrong, grad_out=g)
    assert "each ring step's own partial output instead of the merged output" in d.summary, (
        d.summary
    )
    # dv does not read the row term: the replay must hold for it too,
    # and a right dv alone is not the bug
    assert all(
        torch.allclose(wrong["dv"][r], shard(ref["dv"], layout, 3, r), atol=1e-12) for r in range(3)
    )
