"""The numerics policy: baseline-relative bounds, the floor, non-finite results, messages."""

from __future__ import annotations

import math

import pytest
import torch

from reference import budget
from reference.budget import TOLERANCES, Tolerance, assert_close, assert_verdict, check

SHAPE = (1, 4, 32, 8)


def reference_tensor() -> torch.Tensor:
    return torch.randn(SHAPE, dtype=torch.float64, generator=torch.Generator().manual_seed(0))


def with_error(ref: torch.Tensor, index: tuple[int, ...], err: float) -> torch.Tensor:
    x = ref.clone()
    x[index] += err
    return x


def test_table_starts_at_the_agreed_values() -> None:
    assert {d: (t.k, t.floor_rel) for d, t in TOLERANCES.items()} == {
        torch.float64: (2.0, 1e-12),
        torch.float32: (2.0, 2e-6),
        torch.bfloat16: (3.0, 2e-3),
        torch.float16: (3.0, 4e-4),
    }


@pytest.mark.parametrize("dtype", list(TOLERANCES), ids=str)
def test_a_result_at_the_baseline_passes_and_k_plus_one_times_fails(dtype: torch.dtype) -> None:
    ref = reference_tensor()
    # Error well above the floor (floor_rel * max(1, max|ref|) with max|ref| ~ 3-4).
    e = 1e4 * TOLERANCES[dtype].floor_rel * max(1.0, float(ref.abs().max()))
    base = with_error(ref, (0, 1, 2, 3), e)
    k = TOLERANCES[dtype].k
    at_baseline = check("out", with_error(ref, (0, 1, 2, 3), e), ref, base, dtype=dtype)
    assert at_baseline.passed, at_baseline.message
    assert at_baseline.ratio == pytest.approx(1.0)
    at_k = check("out", with_error(ref, (0, 1, 2, 3), k * e), ref, base, dtype=dtype)
    assert at_k.passed, at_k.message
    beyond = check("out", with_error(ref, (0, 1, 2, 3), (k + 1) * e), ref, base, dtype=dtype)
    assert not beyond.passed
    assert beyond.ratio == pytest.approx(k + 1)
    assert beyond.worst_index == (0, 1, 2, 3)


def test_zero_baseline_error_and_exact_result_passes_by_the_floor() -> None:
    ref = reference_tensor()
    exact = check("lse", ref.clone(), ref, ref.clone())
    assert exact.passed and exact.max_err == 0.0 and exact.ratio == 0.0
    # float64 ring vs an exact baseline: rounding below the floor passes, above it fails.
    floor = 1e-12 * float(ref.abs().max())
    assert check("out", with_error(ref, (0, 0, 0, 0), floor / 2), ref, ref).passed
    over = check("out", with_error(ref, (0, 0, 0, 0), floor * 2), ref, ref)
    assert not over.passed and over.ratio == math.inf
    assert over.floor == pytest.approx(floor)


def test_floor_is_relative_to_the_reference_magnitude_but_at_least_absolute() -> None:
    small = torch.full((4,), 1e-3, dtype=torch.float64)
    assert check("x", small, small, small).floor == 1e-12  # max(1, 1e-3) = 1
    big = torch.full((4,), 1e3, dtype=torch.float64)
    assert check("x", big, big, big).floor == pytest.approx(1e-9)


def test_mean_error_bound_is_enforced_on_its_own() -> None:
    ref = torch.zeros(100, dtype=torch.float64)
    base = with_error(ref, (0,), 1.0)  # max 1, mean 0.01
    x = torch.full_like(ref, 0.5)  # max 0.5 (passes), mean 0.5 > 2 * 0.01 + floor (fails)
    v = check("dv", x, ref, base)
    assert not v.passed and v.max_err <= v.k * v.base_max_err
    assert "exceeded" in v.message


@pytest.mark.parametrize("bad", [math.nan, math.inf, -math.inf])
def test_non_finite_results_never_pass(bad: float) -> None:
    ref = reference_tensor()
    x = with_error(ref, (0, 2, 5, 1), 0.0)
    x[0, 2, 5, 1] = bad
    for base in (ref.clone(), x.clone()):  # even when the baseline is broken the same way
        v = check("out", x, ref, base)
        assert not v.passed
        assert v.max_err == math.inf and v.worst_index == (0, 2, 5, 1)
        assert "NaN/inf" in v.message


def test_matching_infinities_count_as_equal() -> None:
    # Partial LSEs hold -inf on rows that see no key; a result with -inf there is exact.
    ref = torch.tensor([0.5, -math.inf], dtype=torch.float64)
    v = check("lse", ref.clone(), ref, ref.clone())
    assert v.passed and v.max_err == 0.0
    nan_ref = torch.tensor([0.5, math.nan], dtype=torch.float64)
    assert check("lse", nan_ref.clone(), nan_ref, nan_ref.clone()).passed


def test_message_names_rank_ratio_index_and_context() -> None:
    ref = reference_tensor()
    base = with_error(ref, (0, 1, 1, 1), 4.0e-3)
    x = with_error(ref, (0, 3, 17, 5), 3.1e-2)
    v = check(
        "dk",
        x.float(),
        ref,
        base.float(),
        dtype=torch.float32,
        rank=2,
        context="[ring_attention(causal=True, rotate=alltoall, W=4)]",
    )
    assert not v.passed
    assert v.message.startswith("dk[rank=2] max err 3.1e-2 vs single-device 4.0e-3 (ratio 7.7")
    assert "> 2) at (0, 3, 17, 5)" in v.message
    assert "mean err" in v.message
    assert v.message.endswith("[ring_attention(causal=True, rotate=alltoall, W=4)]")
    assert v.rank == 2 and v.worst_index == (0, 3, 17, 5)
    with pytest.raises(AssertionError, match=r"dk\[rank=2\] max err 3.1e-2"):
        assert_verdict(v)


@pytest.mark.parametrize(
    ("layout", "rank", "local"), [("contiguous", 2, (0, 3, 1, 5)), ("head_tail", 3, (0, 3, 5, 5))]
)
def test_rank_is_located_from_the_layout(layout: str, rank: int, local: tuple) -> None:
    ref = reference_tensor()  # seq 32, W 4: contiguous chunks of 8, head_tail chunks of 4
    v = check(
        "out", with_error(ref, (0, 3, 17, 5), 1.0), ref, ref, layout=layout, world_size=4, step=1
    )
    assert v.rank == rank
    assert v.message.startswith(f"out[rank={rank}, step=1] max err")
    assert f"local {local} on rank {rank}" in v.message


def test_dtype_defaults_to_the_result_dtype_and_every_check_reads_the_table(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    ref = reference_tensor()
    v = check("out", ref.to(torch.bfloat16), ref, ref.to(torch.bfloat16))
    assert (v.k, v.floor) == (TOLERANCES[torch.bfloat16].k, pytest.approx(TOLERANCES[torch.bfloat16].floor_rel * float(ref.abs().max())))
    monkeypatch.setitem(TOLERANCES, torch.bfloat16, Tolerance(k=7.0, floor_rel=0.5, step_rel=1.0))
    v = check("out", ref.to(torch.bfloat16), ref, ref.to(torch.bfloat16))
    assert (v.k, v.floor) == (7.0, pytest.approx(0.5 * float(ref.abs().max())))


def test_misuse_raises_with_the_fix() -> None:
    ref = reference_tensor()
    with pytest.raises(ValueError, match=r"no tolerance for dtype torch\.int64"):
        check("out", ref.long(), ref, ref)
    with pytest.raises(ValueError, match="shapes differ"):
        check("out", ref[..., :4], ref, ref)


def test_assert_close_passes_through_and_hides_its_frame() -> None:
    ref = reference_tensor()
    v = assert_close("dq", ref.clone(), ref, ref)
    assert v.passed
    with pytest.raises(AssertionError, match="ratio inf > 2"):
        assert_close("dq", with_error(ref, (0, 0, 0, 0), 1.0), ref, ref, rank=0)
    for helper in (budget.assert_close, budget.assert_verdict):
        assert "__tracebackhide__" in helper.__code__.co_varnames
