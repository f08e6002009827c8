"""The ring simulation: step kinds and work by independent rules, partials by direct computation,
and the merged result equal to unchunked attention for any world size and layout."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from reference.attention import attention
from reference.layout import LAYOUTS
from reference.simulate import logsigmoid, lower_triangular, merge_partials, simulate_ring
from tests.reference.strategies import REFERENCE_SETTINGS, make_problem, simulate


def held_positions(layout: str, world_size: int, rank: int, seq_len: int) -> list[int]:
    """The layouts restated from their definition, so the tests do not trust reference.layout."""
    if layout == "contiguous":
        c = seq_len // world_size
        return list(range(rank * c, (rank + 1) * c))
    c = seq_len // (2 * world_size)
    tail = 2 * world_size - 1 - rank
    return list(range(rank * c, (rank + 1) * c)) + list(range(tail * c, (tail + 1) * c))


def problem(
    world_size: int, layout: str, is_causal: bool, chunk: int = 2, seq_k: int | None = None
):
    seq = world_size * chunk * (2 if layout == "head_tail" else 1)
    return make_problem(
        seed=world_size, groups=2, seq_q=seq, seq_k=seq_k, head_dim=4, is_causal=is_causal
    )


@pytest.mark.parametrize("world_size", [1, 2, 3, 5])
def test_contiguous_causal_kinds(world_size: int) -> None:
    sim = simulate(problem(world_size, "contiguous", True), world_size, "contiguous")
    assert [(r.rank, r.step) for r in sim.steps] == [
        (r, s) for r in range(world_size) for s in range(world_size)
    ]
    for rec in sim.steps:
        assert rec.kv_rank == (rec.rank - rec.step) % world_size  # the ring convention
        want = "causal" if rec.step == 0 else ("full" if rec.kv_rank < rec.rank else "skip")
        assert rec.kind == want, (rec.rank, rec.step)
        assert [kind for _, _, kind in rec.pairs] == [want]


@pytest.mark.parametrize("world_size", [1, 2, 3, 4])
def test_head_tail_causal_kinds_and_pairs(world_size: int) -> None:
    sim = simulate(problem(world_size, "head_tail", True), world_size, "head_tail")
    last = 2 * world_size - 1
    for rec in sim.steps:
        r, j = rec.rank, rec.kv_rank
        q_chunks, k_chunks = (r, last - r), (j, last - j)
        if rec.step == 0:
            kind, pair_kinds = "causal", ["causal", "skip", "full", "causal"]
        elif j < r:  # both query chunks see only the kv's first chunk
            kind, pair_kinds = "partial", ["full", "skip", "full", "skip"]
        else:  # only the second query chunk sees, and it sees both kv chunks
            kind, pair_kinds = "partial", ["skip", "skip", "full", "full"]
        assert rec.kind == kind, (r, rec.step)
        assert rec.pairs == tuple(
            (qc, kc, pk)
            for (qc, kc), pk in zip(
                [(a, b) for a in q_chunks for b in k_chunks], pair_kinds, strict=True
            )
        ), (r, rec.step)


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("seq_k_factor", [1, 3], ids=["self", "cross"])
def test_non_causal_steps_are_all_full(layout: str, seq_k_factor: int) -> None:
    world_size = 3
    seq_k = world_size * (2 if layout == "head_tail" else 1) * seq_k_factor
    p = problem(world_size, layout, False, chunk=1, seq_k=seq_k)
    sim = simulate(p, world_size, layout)
    assert {r.kind for r in sim.steps} == {"full"}
    seq_q_local = p.query.shape[2] // world_size
    assert sim.work_per_rank() == [seq_q_local * seq_k] * world_size


@pytest.mark.parametrize("world_size", [1, 2, 3, 4, 6])
@pytest.mark.parametrize("chunk", [1, 3])
def test_work_per_rank_by_formula(world_size: int, chunk: int) -> None:
    # contiguous: rank r's queries see r whole earlier chunks plus a triangle of its own.
    c = chunk
    sim = simulate(problem(world_size, "contiguous", True, chunk=c), world_size, "contiguous")
    assert sim.work_per_rank() == [r * c * c + c * (c + 1) // 2 for r in range(world_size)]
    if world_size > 1:
        assert len(set(sim.work_per_rank())) == world_size  # unbalanced: the point of head_tail

    # head_tail, 2W chunks of length c: chunk a sees a*c*c + c(c+1)/2 entries; rank r holds
    # chunks r and 2W-1-r, together (2W-1)c^2 + c^2 + c = 2Wc^2 + c, the same on every rank.
    sim = simulate(problem(world_size, "head_tail", True, chunk=c), world_size, "head_tail")
    assert sim.work_per_rank() == [2 * world_size * c * c + c] * world_size
    seq = 2 * world_size * c
    assert sum(sim.work_per_rank()) == seq * (seq + 1) // 2


@pytest.mark.parametrize("layout", LAYOUTS)
def test_partials_are_attention_over_the_visible_keys(layout: str) -> None:
    world_size = 3
    p = problem(world_size, layout, True, chunk=2)
    sim = simulate(p, world_size, layout)
    seq = p.query.shape[2]
    k_full = p.key.repeat_interleave(p.groups, dim=1)
    v_full = p.value.repeat_interleave(p.groups, dim=1)
    for rec in sim.steps:
        qpos = held_positions(layout, world_size, rec.rank, seq)
        kpos = held_positions(layout, world_size, (rec.rank - rec.step) % world_size, seq)
        assert rec.work == sum(k <= q for q in qpos for k in kpos)
        for row, qp in enumerate(qpos):
            seen = [k for k in kpos if k <= qp]
            if not seen:
                assert torch.all(rec.partial_lse[..., row] == -math.inf)
                assert torch.all(rec.partial_out[..., row, :] == 0)
                continue
            # head_dim 4: the default scale is 1/2.
            s = torch.einsum("bhd,bhkd->bhk", p.query[:, :, qp], k_full[:, :, seen]) / 2.0
            w = torch.softmax(s, dim=-1)
            torch.testing.assert_close(
                rec.partial_lse[..., row], torch.logsumexp(s, -1), rtol=0, atol=1e-13
            )
            torch.testing.assert_close(
                rec.partial_out[..., row, :],
                torch.einsum("bhk,bhkd->bhd", w, v_full[:, :, seen]),
                rtol=0,
                atol=1e-13,
            )


@REFERENCE_SETTINGS
@given(st.data())
def test_property_merge_equals_full_attention(data: st.DataObject) -> None:
    layout = data.draw(st.sampled_from(LAYOUTS), label="layout")
    world_size = data.draw(st.integers(1, 8), label="world_size")
    is_causal = data.draw(st.booleans(), label="is_causal")
    n = world_size * (2 if layout == "head_tail" else 1)  # chunks the sequence is cut into
    seq_q = n * data.draw(st.integers(1, 3), label="q_chunk_len")
    seq_k = seq_q if is_causal else n * data.draw(st.integers(1, 3), label="k_chunk_len")
    p = make_problem(
        seed=data.draw(st.integers(0, 2**31 - 1), label="seed"),
        batch=1,
        heads_kv=data.draw(st.integers(1, 2), label="heads_kv"),
        groups=data.draw(st.integers(1, 3), label="gqa_groups"),
        seq_q=seq_q,
        seq_k=seq_k,
        head_dim=data.draw(st.integers(1, 6), label="head_dim"),
        head_dim_v=data.draw(
            st.one_of(st.none(), st.integers(1, 7)), label="head_dim_v"
        ),  # MLA: value's own
        is_causal=is_causal,
        scale=data.draw(st.one_of(st.none(), st.floats(0.05, 2.0)), label="scale"),
    )
    sim = simulate(p, world_size, layout)
    out, lse = attention(p.query, p.key, p.value, is_causal=p.is_causal, scale=p.scale)
    torch.testing.assert_close(sim.out, out, rtol=0, atol=1e-13)
    torch.testing.assert_close(sim.lse, lse, rtol=0, atol=1e-13)


def test_merge_partials_handles_empty_rows_and_huge_lse() -> None:
    out_a = torch.tensor([[[[1.0, 2.0], [0.0, 0.0], [0.0, 0.0], [4.0, 4.0]]]], dtype=torch.float64)
    lse_a = torch.tensor([[[1e4, -math.inf, -math.inf, 3.0]]], dtype=torch.float64)
    out_b = torch.tensor([[[[3.0, 6.0], [5.0, 5.0], [0.0, 0.0], [2.0, 2.0]]]], dtype=torch.float64)
    lse_b = torch.tensor([[[1e4 + math.log(3.0), 7.0, -math.inf, -math.inf]]], dtype=torch.float64)
    for a, b in (((out_a, lse_a), (out_b, lse_b)), ((out_b, lse_b), (out_a, lse_a))):
        out, lse = merge_partials([a, b])
        assert not torch.isnan(out).any() and not torch.isnan(lse).any()
        # Row 0: weights about 1:3 at LSE 1e4, where exp() overflows. The stored gap is not
        # exactly log(3) (1e4 has ulp 1.8e-12), so the weight comes from the stored gap, which
        # the subtraction of two close floats gives exactly.
        gap = lse_b[0, 0, 0].item() - lse_a[0, 0, 0].item()
        w = 1.0 / (1.0 + math.exp(-gap))  # ~3/4
        want = [(1 - w) * 1.0 + w * 3.0, (1 - w) * 2.0 + w * 6.0]
        torch.testing.assert_close(
            out[0, 0, 0], torch.tensor(want, dtype=torch.float64), rtol=0, atol=1e-14
        )
        assert lse[0, 0, 0].item() == pytest.approx(1e4 + math.log(4.0), abs=4e-12)
        assert out[0, 0, 1].tolist() == [5.0, 5.0] and lse[0, 0, 1].item() == 7.0
        assert out[0, 0, 2].tolist() == [0.0, 0.0] and lse[0, 0, 2].item() == -math.inf
        assert out[0, 0, 3].tolist() == [4.0, 4.0] and lse[0, 0, 3].item() == 3.0


def test_bad_arguments_raise() -> None:
    p = problem(2, "contiguous", True)
    with pytest.raises(ValueError, match="seq_q == seq_k"):
        simulate_ring(
            p.query,
            p.key[:, :, :2],
            p.value[:, :, :2],
            world_size=2,
            layout="contiguous",
            is_causal=True,
        )
    with pytest.raises(ValueError, match="seq_k: seq_len 6 is not divisible by 4"):
        simulate_ring(
            p.query,
            p.key[:, :, :2].repeat(1, 1, 3, 1),
            p.value[:, :, :2].repeat(1, 1, 3, 1),
            world_size=2,
            layout="head_tail",
        )
    sim = simulate(p, 2, "contiguous")
    with pytest.raises(ValueError, match="outside a ring of size 2"):
        sim.step(0, 2)
    with pytest.raises(ValueError, match="at least one"):
        merge_partials([])


@pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs CUDA: run on a GPU runner to check device handling"
)
def test_simulation_budget_and_diagnosis_run_on_cuda() -> None:
    from reference.budget import check
    from reference.diagnose import diagnose

    p = problem(2, "head_tail", True)
    cuda = [t.cuda() for t in (p.query, p.key, p.value)]
    sim = simulate_ring(*cuda, world_size=2, layout="head_tail", is_causal=True)
    out, lse = attention(p.query, p.key, p.value, is_causal=True)
    torch.testing.assert_close(sim.out.cpu(), out, rtol=0, atol=1e-13)
    torch.testing.assert_close(sim.lse.cpu(), lse, rtol=0, atol=1e-13)
    assert check("out", sim.out, sim.out, sim.out, layout="head_tail", world_size=2).passed
    wrong = [sim.local_out(0), sim.local_out(1) * 2]
    d = diagnose(sim, wrong)
    assert not d.ok and d.rank == 1


def test_merge_helpers_equal_the_torch_functions_they_replace() -> None:
    x = torch.cat(
        [
            torch.randn(1000, dtype=torch.float64, generator=torch.Generator().manual_seed(0)) * 40,
            torch.tensor([0.0, 1e-300, 36.9, -36.9, 700.0, -700.0, 1e4, -1e4], dtype=torch.float64),
        ]
    )
    torch.testing.assert_close(logsigmoid(x), torch.nn.functional.logsigmoid(x), rtol=1e-15, atol=0)
    for n in (1, 2, 7):
        assert torch.equal(lower_triangular(n), torch.ones(n, n, dtype=torch.bool).tril())
