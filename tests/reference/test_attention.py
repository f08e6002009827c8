"""The float64 oracle against torch's math SDPA, an independent numpy implementation, float64
gradcheck, and the properties attention must have whatever the implementation."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from reference.attention import attention, attention_grads, masked_attention
from tests.reference import numpy_attention
from tests.reference.strategies import REFERENCE_SETTINGS, draw_problem, make_problem


def assert_tight(actual: torch.Tensor, expected: torch.Tensor) -> None:
    """Equal to 1e-12 absolute: the agreement two correct float64 attentions reach."""
    __tracebackhide__ = True
    torch.testing.assert_close(actual, expected, rtol=0.0, atol=1e-12)


def math_sdpa(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, is_causal: bool, scale: float | None
) -> torch.Tensor:
    """torch's math backend in float64: the textbook implementation torch checks kernels with."""
    out, _ = torch.ops.aten._scaled_dot_product_attention_math(
        q, k, v, None, 0.0, is_causal, None, scale=scale, enable_gqa=q.shape[1] != k.shape[1]
    )
    return out


CASES = [
    pytest.param(dict(batch=2, heads_kv=3, seq_q=17, head_dim=8), id="mha"),
    pytest.param(dict(batch=2, heads_kv=3, seq_q=17, head_dim=8, is_causal=True), id="mha-causal"),
    pytest.param(
        dict(heads_kv=2, groups=4, seq_q=16, head_dim=16, is_causal=True, scale=0.3),
        id="gqa-causal-scale",
    ),
    pytest.param(dict(groups=4, seq_q=5, seq_k=23, head_dim=4), id="mqa-cross"),
    pytest.param(
        dict(
            batch=2, heads_kv=2, groups=2, seq_q=23, seq_k=7, head_dim=3, is_causal=True, scale=1.7
        ),
        id="gqa-causal-cross-longer-q",
    ),
    pytest.param(dict(seq_q=1, head_dim=1, is_causal=True), id="tiny"),
    # value's own head dim (multi-head latent attention): wider and narrower than query's and key's
    pytest.param(
        dict(batch=2, heads_kv=2, seq_q=11, head_dim=8, head_dim_v=13), id="mla-wider-value"
    ),
    pytest.param(
        dict(heads_kv=2, groups=2, seq_q=12, head_dim=24, head_dim_v=8, is_causal=True, scale=0.2),
        id="mla-narrower-value-gqa-causal",
    ),
]


@pytest.mark.parametrize("case", CASES)
def test_matches_math_sdpa_and_numpy(case: dict) -> None:
    p = make_problem(seed=1, **case)
    out, lse = attention(p.query, p.key, p.value, is_causal=p.is_causal, scale=p.scale)
    assert out.dtype == lse.dtype == torch.float64
    assert out.shape == p.query.shape[:3] + p.value.shape[3:]
    assert lse.shape == p.query.shape[:3]
    assert_tight(out, math_sdpa(p.query, p.key, p.value, p.is_causal, p.scale))
    np_out, np_lse = numpy_attention.forward(
        p.query.numpy(), p.key.numpy(), p.value.numpy(), p.is_causal, p.scale
    )
    np.testing.assert_allclose(out.numpy(), np_out, rtol=0, atol=1e-12)
    np.testing.assert_allclose(lse.numpy(), np_lse, rtol=0, atol=1e-12)


@pytest.mark.parametrize("case", CASES)
def test_gradients_match_numpy_analytic(case: dict) -> None:
    p = make_problem(seed=2, **case)
    grad_out = torch.randn(
        p.query.shape[:3] + p.value.shape[3:],
        dtype=torch.float64,
        generator=torch.Generator().manual_seed(3),
    )
    res = attention_grads(p.query, p.key, p.value, grad_out, is_causal=p.is_causal, scale=p.scale)
    assert res.dk.shape == p.key.shape and res.dv.shape == p.value.shape
    assert res.dq.shape == p.query.shape
    dq, dk, dv = numpy_attention.backward(
        p.query.numpy(), p.key.numpy(), p.value.numpy(), grad_out.numpy(), p.is_causal, p.scale
    )
    for name, got, want in (("dq", res.dq, dq), ("dk", res.dk, dk), ("dv", res.dv, dv)):
        assert got.dtype == torch.float64, name
        np.testing.assert_allclose(got.numpy(), want, rtol=0, atol=1e-12, err_msg=name)


@pytest.mark.parametrize("is_causal", [False, True], ids=["full", "causal"])
def test_gradcheck_float64(is_causal: bool) -> None:
    p = make_problem(seed=4, groups=2, seq_q=4, head_dim=3, is_causal=is_causal, scale=0.7)
    inputs = tuple(t.clone().requires_grad_() for t in (p.query, p.key, p.value))
    assert torch.autograd.gradcheck(
        lambda q, k, v: attention(q, k, v, is_causal=is_causal, scale=0.7), inputs
    )


def test_low_precision_inputs_are_upcast_not_recomputed_in_low_precision() -> None:
    p = make_problem(seed=5, heads_kv=2, groups=2, seq_q=9, head_dim=8, is_causal=True)
    q, k, v = (t.to(torch.bfloat16) for t in (p.query, p.key, p.value))
    out, lse = attention(q, k, v, is_causal=True)
    want_out, want_lse = attention(q.double(), k.double(), v.double(), is_causal=True)
    assert out.dtype == torch.float64
    # Bitwise equal: the oracle of bf16 inputs is exactly the float64 oracle of their values.
    assert torch.equal(out, want_out) and torch.equal(lse, want_lse)
    res = attention_grads(q, k, v, torch.ones_like(out), is_causal=True)
    assert {t.dtype for t in res[:5]} == {torch.float64} and res.dsinks is None


def test_logits_of_1e4_are_finite_and_exact() -> None:
    # Scores 1e4 and 0.99e4: exp(1e4) is inf in float64, so only a max-shifted softmax survives.
    # Softmax weights are (1, exp(-100)), so out = v[0] up to 4e-44 and lse = 1e4 + log1p(e^-100).
    q = torch.tensor([[[[100.0]]]], dtype=torch.float64)
    k = torch.tensor([[[[100.0], [99.0]]]], dtype=torch.float64)
    v = torch.tensor([[[[3.0, -2.0], [5.0, 7.0]]]], dtype=torch.float64)
    out, lse = attention(q, k, v, scale=1.0)
    assert torch.isfinite(out).all() and torch.isfinite(lse).all()
    assert out[0, 0, 0].tolist() == [3.0, -2.0]
    assert lse.item() == 1e4  # log1p(exp(-100)) is far below one ulp of 1e4


def test_masked_attention_rows_that_see_nothing_are_neutral() -> None:
    p = make_problem(seed=6, seq_q=3, seq_k=4, head_dim=2)
    visible = torch.tensor([[True, False, True, False], [False] * 4, [True] * 4])
    out, lse = masked_attention(p.query, p.key, p.value, visible)
    assert torch.equal(out[0, 0, 1], torch.zeros(2, dtype=torch.float64))
    assert lse[0, 0, 1].item() == -math.inf
    # Row 0 sees keys 0 and 2 only: it equals attention over exactly those keys.
    sub_out, sub_lse = attention(p.query[:, :, :1], p.key[:, :, [0, 2]], p.value[:, :, [0, 2]])
    assert_tight(out[:, :, :1], sub_out)
    assert_tight(lse[:, :, :1], sub_lse)


def _with_grad_out(seed: int, **sizes) -> tuple[torch.Tensor, ...]:
    """(query, key, value, grad_out) float64 of a :func:`make_problem` problem."""
    p = make_problem(seed=seed, **sizes)
    gen = torch.Generator().manual_seed(seed)
    grad_out = torch.randn(p.query.shape, generator=gen, dtype=torch.float64)
    return p.query.clone(), p.key.clone(), p.value.clone(), grad_out


@pytest.mark.parametrize("bad", [math.nan, math.inf, -math.inf])
def test_a_nonfinite_value_reaches_no_dv(bad: float) -> None:
    """dV = P^T dO reads no value: with one value entry non-finite every dV entry, that entry's
    own included, is the one computed from the probabilities directly."""
    q, k, v, do = _with_grad_out(8, seq_q=5, seq_k=6, head_dim=3)
    v[0, 0, 2, 1] = bad
    ref = attention_grads(q, k, v, do)
    probs = torch.softmax(q @ k.transpose(-2, -1) / math.sqrt(q.shape[-1]), dim=-1)
    assert_tight(ref.dv, probs.transpose(-2, -1) @ do)
    assert ref.out[0, 0, :, 1].isnan().all() and ref.out[0, 0, :, [0, 2]].isfinite().all()


def test_a_row_that_sees_nothing_depends_on_nothing() -> None:
    """Row 1 sees no key: a NaN query and an inf output gradient there reach nothing (out 0,
    LSE -inf, dQ 0), and every other result is the one of the same problem without them."""
    q, k, v, do = _with_grad_out(9, seq_q=3, seq_k=4, head_dim=2)
    visible = torch.tensor([[True, False, True, False], [False] * 4, [True] * 4])
    clean = attention_grads(q, k, v, do, visible=visible)
    q[0, 0, 1, 0], do[0, 0, 1, 1] = math.nan, math.inf
    ref = attention_grads(q, k, v, do, visible=visible)
    assert torch.equal(ref.out[0, 0, 1], torch.zeros(2, dtype=torch.float64))
    assert ref.lse[0, 0, 1].item() == -math.inf
    assert torch.equal(ref.dq[0, 0, 1], torch.zeros(2, dtype=torch.float64))
    for name in ("out", "dq", "dk", "dv"):
        assert_tight(getattr(ref, name), getattr(clean, name))


@pytest.mark.parametrize(
    ("q_shape", "k_shape", "v_shape", "match"),
    [
        ((1, 3, 4, 8), (1, 2, 4, 8), (1, 2, 4, 8), "multiple of key/value heads"),
        ((1, 2, 4, 8), (1, 2, 4, 4), (1, 2, 4, 4), "head_dim"),
        ((1, 2, 4, 8), (1, 2, 4, 8), (1, 2, 5, 8), "must agree"),
        ((2, 4, 8), (2, 4, 8), (2, 4, 8), "4-d"),
    ],
)
def test_bad_shapes_raise_with_the_shapes(
    q_shape: tuple[int, ...], k_shape: tuple[int, ...], v_shape: tuple[int, ...], match: str
) -> None:
    with pytest.raises(ValueError, match=match):
        attention(torch.zeros(q_shape), torch.zeros(k_shape), torch.zeros(v_shape))


# ------------------------------------------------------------------ hypothesis properties


@REFERENCE_SETTINGS
@given(st.data())
def test_property_matches_numpy(data: st.DataObject) -> None:
    p = draw_problem(data)
    out, lse = attention(p.query, p.key, p.value, is_causal=p.is_causal, scale=p.scale)
    np_out, np_lse = numpy_attention.forward(
        p.query.numpy(), p.key.numpy(), p.value.numpy(), p.is_causal, p.scale
    )
    np.testing.assert_allclose(out.numpy(), np_out, rtol=0, atol=1e-12)
    np.testing.assert_allclose(lse.numpy(), np_lse, rtol=0, atol=1e-12)


@REFERENCE_SETTINGS
@given(st.data())
def test_property_rows_are_convex_combinations_of_values(data: st.DataObject) -> None:
    p = draw_problem(data)
    out, _ = attention(p.query, p.key, p.value, is_causal=p.is_causal, scale=p.scale)
    # Per kv head and column, every output lies within the values' range (over all keys).
    v = p.value.repeat_interleave(p.groups, dim=1)
    lo, hi = v.amin(dim=2, keepdim=True), v.amax(dim=2, keepdim=True)
    assert (out >= lo - 1e-12).all() and (out <= hi + 1e-12).all()


@REFERENCE_SETTINGS
@given(st.data())
def test_property_lse_is_logsumexp_of_scaled_scores(data: st.DataObject) -> None:
    p = draw_problem(data)
    _, lse = attention(p.query, p.key, p.value, is_causal=p.is_causal, scale=p.scale)
    scale = p.scale if p.scale is not None else p.query.shape[-1] ** -0.5
    k = p.key.repeat_interleave(p.groups, dim=1)
    scores = torch.einsum("bhqd,bhkd->bhqk", p.query, k) * scale
    if p.is_causal:
        i = torch.arange(scores.shape[-2])[:, None]
        j = torch.arange(scores.shape[-1])[None, :]
        scores = scores.masked_fill(j > i, -math.inf)
    assert_tight(lse, torch.logsumexp(scores, dim=-1))


@REFERENCE_SETTINGS
@given(st.data())
def test_property_permuting_keys_and_values_together_changes_nothing(data: st.DataObject) -> None:
    p = draw_problem(data, causal=False)
    seq_k = p.key.shape[2]
    perm = torch.tensor(data.draw(st.permutations(range(seq_k)), label="key_permutation"))
    out, lse = attention(p.query, p.key, p.value, scale=p.scale)
    pout, plse = attention(p.query, p.key[:, :, perm], p.value[:, :, perm], scale=p.scale)
    assert_tight(pout, out)
    assert_tight(plse, lse)


@REFERENCE_SETTINGS
@given(st.data())
def test_property_first_causal_query_sees_only_the_first_key(data: st.DataObject) -> None:
    p = draw_problem(data, causal=True)
    out, lse = attention(p.query, p.key, p.value, is_causal=True, scale=p.scale)
    scale = p.scale if p.scale is not None else p.query.shape[-1] ** -0.5
    v0 = p.value[:, :, 0].repeat_interleave(p.groups, dim=1)  # (batch, heads, head_dim)
    k0 = p.key[:, :, 0].repeat_interleave(p.groups, dim=1)
    assert torch.equal(out[:, :, 0], v0)  # one key: weight exactly 1
    assert_tight(lse[:, :, 0], (p.query[:, :, 0] * k0).sum(-1) * scale)


@REFERENCE_SETTINGS
@given(st.data())
def test_property_huge_logits_are_finite_and_match_numpy(data: st.DataObject) -> None:
    # q and k scaled by 100: logits up to ~1e4 * head_dim, far beyond exp overflow (~709).
    p = draw_problem(data, magnitude=100.0)
    out, lse = attention(p.query, p.key, p.value, is_causal=p.is_causal, scale=p.scale)
    assert torch.isfinite(out).all() and torch.isfinite(lse).all()
    np_out, np_lse = numpy_attention.forward(
        p.query.numpy(), p.key.numpy(), p.value.numpy(), p.is_causal, p.scale
    )
    # Scores of size ~1e5 carry absolute rounding ~1e-11, which moves softmax weights by as much.
    np.testing.assert_allclose(out.numpy(), np_out, rtol=0, atol=1e-9)
    np.testing.assert_allclose(lse.numpy(), np_lse, rtol=1e-13, atol=1e-12)


@REFERENCE_SETTINGS
@given(st.data())
def test_property_gradients_match_numpy(data: st.DataObject) -> None:
    p = draw_problem(data)
    seed = data.draw(st.integers(0, 2**31 - 1), label="grad_seed")
    grad_out = torch.randn(
        p.query.shape, dtype=torch.float64, generator=torch.Generator().manual_seed(seed)
    )
    res = attention_grads(p.query, p.key, p.value, grad_out, is_causal=p.is_causal, scale=p.scale)
    want = numpy_attention.backward(
        p.query.numpy(), p.key.numpy(), p.value.numpy(), grad_out.numpy(), p.is_causal, p.scale
    )
    for name, got, w in zip(("dq", "dk", "dv"), res[2:5], want, strict=True):
        np.testing.assert_allclose(got.numpy(), w, rtol=0, atol=1e-12, err_msg=name)
