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


def test_table_and_unit_roundoffs() -> None:
    assert {d: t.k for d, t in TOLERANCES.items()} == {
        torch.float64: 2.0,
        torch.float32: 2.0,
        torch.bfloat16: 2.0,
        torch.float16: 2.0,
    }
    for dtype, u in budget.UNIT_ROUNDOFF.items():
        assert u == torch.finfo(dtype).eps / 2, dtype  # half an ulp at 1
    assert budget.compute_dtype(torch.bfloat16) == torch.float32
    assert budget.compute_dtype(torch.float64) == torch.float64


@pytest.mark.parametrize("dtype", list(TOLERANCES), ids=str)
def test_a_result_at_the_baseline_passes_and_k_plus_one_times_fails(dtype: torch.dtype) -> None:
    ref = reference_tensor()
    e = (
        1e4 * budget.floors(None, ref, result_dtype=dtype, input_dtype=dtype).max_floor
    )  # far above the floor
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


def test_floor_without_magnitudes_is_one_rounding_of_each_kind_per_block() -> None:
    ref = reference_tensor()
    m = float(ref.abs().max())
    u64 = budget.UNIT_ROUNDOFF[torch.float64]
    v = check("out", ref.clone(), ref, ref.clone(), world_size=3)
    assert v.passed and v.max_err == 0.0 and v.ratio == 0.0
    assert v.floor == pytest.approx((u64 + 4 * u64) * m)  # u(X) M + (W + 1) u(c) M
    assert v.mean_floor == pytest.approx((u64 + 2 * u64) * m)  # sqrt(W + 1) roundings
    over = check("out", with_error(ref, (0, 0, 0, 0), 2 * v.floor), ref, ref, world_size=3)
    assert not over.passed and over.ratio == math.inf
    small = torch.full((4,), 1e-3, dtype=torch.float64)
    assert check("x", small, small, small).floor == pytest.approx(3 * u64)  # max(1, 1e-3) = 1
    assert check("x", small, small, small, roundings=10).floor == pytest.approx(11 * u64)


def test_floor_with_magnitudes_follows_its_formula() -> None:
    shape = (1, 1, 4, 2)
    mag = torch.tensor([1.0, 2.0, 3.0, 4.0, 0.0, 0.0, 0.0, 8.0], dtype=torch.float64).reshape(shape)
    comp, cond = 2 * mag, 10 * mag
    scale = budget.ErrorScale(mag, comp, cond, mag / 2, comp / 3, cond / 4)
    ref = torch.zeros(shape, dtype=torch.float64)
    u16, u32 = budget.UNIT_ROUNDOFF[torch.bfloat16], budget.UNIT_ROUNDOFF[torch.float32]
    uc = budget.APPROXIMATE_EXP_ROUNDOFF  # 16-bit inputs: kernels' exp may be a 20-ulp one
    fl = budget.floors(
        scale, ref, result_dtype=torch.bfloat16, input_dtype=torch.bfloat16, roundings=5
    )
    per_element = u16 * mag + 5 * uc * (comp + cond)
    assert fl.max_floor == pytest.approx(float(per_element.max()))
    assert fl.mean_floor == pytest.approx(
        float((u16 * mag / 2 + math.sqrt(5) * uc * (comp / 3 + cond / 4)).mean())
    )
    # The same quantity in float32 (e.g. an LSE of bfloat16 inputs) gets float32's rounding.
    fl32 = budget.floors(
        scale, ref, result_dtype=torch.float32, input_dtype=torch.bfloat16, roundings=5
    )
    assert fl32.max_floor == pytest.approx(float((u32 * mag + 5 * uc * (comp + cond)).max()))
    # float32 inputs: kernels form everything at float32's roundoff.
    f32 = budget.floors(
        scale, ref, result_dtype=torch.float32, input_dtype=torch.float32, roundings=5
    )
    assert f32.max_floor == pytest.approx(float((u32 * mag + 5 * u32 * (comp + cond)).max()))
    assert budget.compute_roundoff(torch.float16) == uc == 40 * u32


def _brute_force_scales(q, k, v, do, visible, scale):
    """M, A and C by explicit loops over (b, h, i, j): written apart from error_scales."""
    b, h, sq, d = q.shape
    hkv, sk = k.shape[1], k.shape[2]
    g = h // hkv
    res = {
        n: [torch.zeros(t, dtype=torch.float64) for _ in range(6)]
        for n, t in (
            ("out", (b, h, sq, d)),
            ("lse", (b, h, sq)),
            ("dq", (b, h, sq, d)),
            ("dk", (b, hkv, sk, d)),
            ("dv", (b, hkv, sk, d)),
        )
    }
    for bi in range(b):
        for hi in range(h):
            kh = hi // g
            s = [[float(q[bi, hi, i] @ k[bi, kh, j]) * scale for j in range(sk)] for i in range(sq)]
            for i in range(sq):
                seen = [j for j in range(sk) if visible[i, j]]
                if not seen:
                    continue
                lse = math.log(sum(math.exp(s[i][j]) for j in seen))
                p = {j: math.exp(s[i][j] - lse) for j in seen}
                o = sum(p[j] * v[bi, kh, j] for j in seen)
                dmag = float((do[bi, hi, i].abs() * o.abs()).sum())
                delta = float((do[bi, hi, i] * o).sum())
                for idx in (0, 1, 3, 4):  # one term: its sum and its root-sum-square agree
                    res["lse"][idx][bi, hi, i] = 1 + abs(lse)

                def add(name, idx, where, term):  # plain sum in idx, squares in idx + 3
                    res[name][idx][where] += term
                    res[name][idx + 3][where] += term**2

                for j in seen:
                    kap = abs(lse)
                    add("out", 0, (bi, hi, i), p[j] * v[bi, kh, j].abs())
                    add("out", 2, (bi, hi, i), p[j] * kap * v[bi, kh, j].abs())
                    add("lse", 2, (bi, hi, i), p[j] * kap)
                    dp = float(do[bi, hi, i] @ v[bi, kh, j])
                    dpa = float(do[bi, hi, i].abs() @ v[bi, kh, j].abs())
                    dcond = float(
                        (
                            do[bi, hi, i].abs() * sum(p[jj] * v[bi, kh, jj].abs() for jj in seen)
                        ).sum()
                    )
                    m_ds, a_ds = p[j] * (abs(dp - delta) + dmag), p[j] * (dpa + dmag)
                    c_ds = p[j] * kap * (abs(dp - delta) + dcond)
                    for idx, w in enumerate((m_ds, a_ds, c_ds)):
                        add("dq", idx, (bi, hi, i), scale * w * k[bi, kh, j].abs())
                        add("dk", idx, (bi, kh, j), scale * w * q[bi, hi, i].abs())
                    add("dv", 0, (bi, kh, j), p[j] * do[bi, hi, i].abs())
                    add("dv", 2, (bi, kh, j), p[j] * kap * do[bi, hi, i].abs())
    for name in ("out", "dv"):
        res[name][1], res[name][4] = res[name][0], res[name][3]
    for name in ("out", "lse", "dq", "dk", "dv"):
        for idx in (3, 4, 5):
            if name == "lse" and idx in (3, 4):
                continue
            res[name][idx] = res[name][idx].sqrt()
    return res


def test_error_scales_match_a_brute_force_count() -> None:
    gen = torch.Generator().manual_seed(3)
    q = torch.randn(1, 4, 5, 3, generator=gen, dtype=torch.float64)
    k = torch.randn(1, 2, 5, 3, generator=gen, dtype=torch.float64) * 3
    v = torch.randn(1, 2, 5, 3, generator=gen, dtype=torch.float64)
    do = torch.randn(1, 4, 5, 3, generator=gen, dtype=torch.float64)
    visible = torch.ones(5, 5, dtype=torch.bool).tril()
    visible[0, 0] = False  # a row that sees nothing: its magnitudes are 0
    got = budget.error_scales(q, k, v, do, visible=visible, scale=0.7)
    want = _brute_force_scales(q, k, v, do, visible, 0.7)
    fields = (
        "magnitude",
        "compute",
        "conditioning",
        "magnitude_rss",
        "compute_rss",
        "conditioning_rss",
    )
    for name, values in want.items():
        for field, expected in zip(fields, values):
            torch.testing.assert_close(
                getattr(got[name], field),
                expected.double(),
                rtol=1e-9,
                atol=1e-12,
                msg=lambda text, n=name, f=field: f"{n}.{f}: {text}",
            )
    assert float(got["out"].magnitude[0, :, 0].abs().sum()) == 0.0


def test_conditioning_floor_grows_with_the_logits() -> None:
    """At logits of ~1e3 one rounding of a score or of the LSE is a relative error of ~1e-4 in
    float32: a correct ring whose probabilities differ from the kernel's by that much passes
    however exact the kernel happened to be; at ordinary logits the same error fails."""
    gen = torch.Generator().manual_seed(5)
    q, k, v, do = (torch.randn(1, 2, 16, 16, generator=gen, dtype=torch.float64) for _ in range(4))
    visible = torch.ones(16, 16, dtype=torch.bool).tril()
    from reference.attention import attention_grads

    def dv_case(magnitude: float):
        qm, km = (q * magnitude).float().double(), (k * magnitude).float().double()
        scales = budget.error_scales(qm, km, v, do, visible=visible)
        ref = attention_grads(qm, km, v, do, is_causal=True).dv
        return ref, scales["dv"]

    ref1, s1 = dv_case(1.0)
    ref30, s30 = dv_case(30.0)
    assert float(s30.conditioning.max()) > 100 * float(s1.conditioning.max())
    err = 7.4e-5  # an independent correct ring's dV error at x30 (float32), kernel exact there
    kw = dict(dtype=torch.float32, world_size=2)
    assert check("dv", with_error(ref30, (0, 0, 3, 1), err), ref30, ref30, scales=s30, **kw).passed
    assert not check("dv", with_error(ref1, (0, 0, 3, 1), err), ref1, ref1, scales=s1, **kw).passed


def test_lse_is_judged_in_float32_for_16_bit_inputs() -> None:
    """Every kernel returns the LSE in float32: an LSE off by 4e-3 is a broken LSE, even though
    4e-3 is about one rounding of bfloat16."""
    gen = torch.Generator().manual_seed(9)
    q, k, v = (
        torch.randn(1, 2, 8, 16, generator=gen, dtype=torch.float64).to(torch.bfloat16).double()
        for _ in range(3)
    )
    from reference.attention import attention

    lse = attention(q, k, v).lse
    scales = budget.error_scales(q, k, v)["lse"]
    off = lse + 4e-3

    def judged_as(result_dtype: torch.dtype) -> budget.Verdict:
        return check(
            "lse",
            off.float(),
            lse,
            lse.float(),
            dtype=torch.bfloat16,
            result_dtype=result_dtype,
            scales=scales,
        )

    v32 = judged_as(torch.float32)
    assert not v32.passed and "float32 result of bfloat16 inputs" in v32.message
    as_bf16 = judged_as(torch.bfloat16)
    assert as_bf16.passed  # what judging it by its input dtype let through


def test_mean_error_bound_is_enforced_on_its_own() -> None:
    ref = torch.zeros(100, dtype=torch.float64)
    base = with_error(ref, (0,), 1.0)  # max 1, mean 0.01
    x = torch.full_like(ref, 0.5)  # max 0.5 (passes), mean 0.5 > 2 * 0.01 + floor (fails)
    v = check("dv", x, ref, base)
    assert not v.passed and v.max_err <= v.k * v.base_max_err
    assert "exceeded" in v.message


def test_mean_rule_bites_on_a_ring_systematically_worse_than_the_kernel() -> None:
    """Every element off by 10x the kernel's mean error, none beyond what the max rule allows:
    the mean rule fails it (its floor is a typical rounding, not a worst case)."""
    gen = torch.Generator().manual_seed(11)
    q, k, v, do = (
        torch.randn(2, 4, 32, 16, generator=gen, dtype=torch.float64).float() for _ in range(4)
    )
    from reference.attention import attention_grads

    ref = attention_grads(q, k, v, do).out
    scales = budget.error_scales(q, k, v, do)["out"]
    base = torch.softmax((q @ k.transpose(-2, -1)) / 4, dim=-1) @ v  # the kernel: float32 math
    mean_base = float((base.double() - ref).abs().mean())
    noise = torch.randn(ref.shape, generator=gen, dtype=torch.float64)
    worse = ref + noise.sign() * 10 * mean_base
    verdict = check("out", worse, ref, base, dtype=torch.float32, scales=scales, world_size=4)
    assert verdict.max_err <= verdict.max_bound, verdict.message
    assert not verdict.passed and "exceeded" in verdict.message.split("mean err")[1], (
        verdict.message
    )
    fine = ref + noise.sign() * 1.5 * mean_base  # within k of the kernel on average: passes
    assert check("out", fine, ref, base, dtype=torch.float32, scales=scales, world_size=4).passed


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
    assert "= 2 x single-device + floor" in v.message and "exceeded) at (0, 3, 17, 5)" in v.message
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
    m = float(ref.abs().max())
    u16, uc = budget.UNIT_ROUNDOFF[torch.bfloat16], budget.APPROXIMATE_EXP_ROUNDOFF
    v = check("out", ref.to(torch.bfloat16), ref, ref.to(torch.bfloat16))
    assert (v.k, v.floor) == (TOLERANCES[torch.bfloat16].k, pytest.approx((u16 + 2 * uc) * m))
    monkeypatch.setitem(TOLERANCES, torch.bfloat16, Tolerance(k=7.0, step_rel=1.0))
    v = check("out", ref.to(torch.bfloat16), ref, ref.to(torch.bfloat16))
    assert v.k == 7.0


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
    with pytest.raises(AssertionError, match="ratio inf; bound"):
        assert_close("dq", with_error(ref, (0, 0, 0, 0), 1.0), ref, ref, rank=0)
    for helper in (budget.assert_close, budget.assert_verdict):
        assert "__tracebackhide__" in helper.__code__.co_varnames
