"""The numerics policy as code (design.md, "Numerics policy").

For a quantity X (out, lse, dq, dk, dv) with float64 reference R (on the same dtype-rounded
inputs) and single-device baseline B (the same kernel, dtype and inputs on one device):

    pass  iff  max|X - R|  <= k * max|B - R|  + max floor
          and  mean|X - R| <= k * mean|B - R| + mean floor

k, the allowed multiple of what the same kernel achieves on one device, is in TOLERANCES (the
one table). The floor is the slack a correct ring needs beyond that multiple, which matters
where the baseline happens to be (nearly) exact; it is derived below from the arithmetic of
attention, element by element, and never tuned per test.

Magnitudes (:func:`error_scales`, float64, from the inputs)
-----------------------------------------------------------
Every element of every quantity is an exact sum of terms. A sum rounded anywhere is off by a
multiple of the unit roundoff times the *magnitude of its terms*, not of its result (which may
cancel to ~0 while its terms do not). Per element:

``M``  the absolute values of the terms as kernels return them: ``P|V|`` (out), ``P^T|dO|``
       (dV), ``scale (P o (|dP - D| + |dO|.|O|)) |K|`` (dQ; dK the same transposed with ``|Q|``),
       ``1 + |lse|`` (LSE).
``A``  the same with the backward's intermediates dP and D at their own magnitudes
       (``|dO||V|^T + |dO|.|O|`` instead of ``|dP - D| + ...``): what roundings inside the
       compute dtype are relative to.
``C``  the conditioning: the same sums with each probability ``p_ij`` weighted by
       ``kappa_i = |lse_i|`` (and dS by ``|dP - D| + |dO|.P|V|``: D is formed from the output,
       which carries the same conditioning). A ring's backward recomputes
       ``p_ij = exp(s_ij - lse_i)`` from its *merged* LSE, which each of the row's merges rounds
       at the LSE's magnitude; one such rounding moves every probability of the row by the
       relative amount ``u * |lse_i|`` (and the forward's merge weights, sigmoids of LSE
       differences, by as much), so ``u * C`` is how far the element moves then. It grows with
       the logits: at an LSE of 1e3 in float32 one rounding is already a relative error of 6e-5
       in every probability, whatever the ring; at 1e5 in float64, 1e-11. (Roundings of the
       logits themselves are the kernel's own and in the baseline too.)

The floor
---------
    floor_i      = u(X) * M_i  +  n * u(c) * (A_i + C_i)                  (max rule: max_i)
    mean floor   = mean_i of  u(X) * M'_i  +  sqrt(n) * u(c) * (A'_i + C'_i)

- ``u(X)``: the unit roundoff of the quantity's own dtype (the input dtype for out, dQ, dK, dV;
  float32, or float64 for float64 inputs, for the LSE). A ring rounds each step's partial result
  to that dtype (kernels return them so); those roundings are weighted by terms whose
  magnitudes add up to at most ``M``: together at most ``u(X) * M``.
- ``u(c)``: the relative error with which kernels form scores, probabilities and sums
  (:func:`compute_roundoff`): the unit roundoff of the compute dtype (float32; float64 for
  float64), except for 16-bit inputs, where kernels may take exp from an approximation. PyTorch's
  CPU flash kernel does: for bfloat16 and float16 inputs its vectorised exp is a float32
  polynomial of at most 20 ulp (``at::vec::Vectorized<float>::exp_u20``; the scalar tail of a
  row, fewer keys than a vector, gets the exact exp), so u(c) = 20 ulp = 40 * 2^-24 there. Held
  to float32's roundoff instead, a correct ring's LSE of bfloat16 inputs would fail the mean rule
  at W 5-8 (2.4x the one-call error on blocks of 8 keys); its out and gradients are rounded to 16
  bits, against which the change is a few per cent of the floor.
- ``n = W + 1`` (W, the ring's number of key/value blocks): each of a row's W merges, and the
  backward's recomputation of the probabilities from the merged LSE, may perturb the element by
  one rounding of its intermediates (``A``) and of each probability (``C``).
- The max rule takes the worst case: every rounding at its bound, all of one sign. The mean rule
  takes the typical case: round-to-nearest errors are unbiased and independent, so a sum of
  them grows like the root-sum-square of its terms (``M'``, ``A'``, ``C'``: the same terms, root
  of the sum of squares) and n roundings like ``sqrt(n)``; its floor is about twice the expected
  extra error of a correct ring (the expected size of a uniform rounding is half its bound).
  It is then of the order of the baseline's own mean error, so the mean rule fails a ring that
  is systematically several times worse than the kernel even where the max rule's worst case
  lets it through. Where one key dominates a row (saturated softmax, large logits) the
  root-sum-square equals the sum: the conditioning is covered there too.
- Where the magnitudes cannot be computed (a whole model), ``M = A = max(1, max|R|)``, ``C = 0``
  everywhere, and the caller says how many roundings an element may carry (``roundings``).

The baseline of a masked case whose kernel takes no mask
---------------------------------------------------------
B is the same kernel on one device. A kernel that takes no mask (FlashAttention, the
memory-efficient kernel, cuDNN) cannot run a masked call on one device; the ring runs the mask's
unmasked pieces (whole documents, causal diagonals, full rectangles) on that kernel and only its
masked tiles on the math op. So B's error is that of *both*: per element, the larger of the math
op's error on the masked problem and the kernel's own error on the same inputs unmasked
(:func:`baseline_error_of_both`), on the elements that see something (rows that see nothing
keep the math op's exact 0 and -inf, gradients of keys nobody sees their exact 0). With the math
op alone, a ring whose window pieces ran on the memory-efficient kernel in float32 was held to
the math op's error, 7x smaller (NVIDIA H200, torch 2.11: out 1.3e-6 against 1.8e-7, a window of
4 keys); the kernel's own unmasked error there is of the ring's order.

Measured (ring_impl, quick tier, 726 cases, CPU, 2026-11-22): the largest share of the max
bound any quantity used was 0.66 (bfloat16 dV), of the mean bound 0.42 (float32 LSE); the mean
floor was 1.3-2.9x k * mean|B - R| for 16-bit inputs and 3-10x for float32/float64 (whose
kernels are more accurate than their floors' single rounding). Two independently written
correct rings (meta_tests/correct.py) pass the same tier.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import Tensor

from reference.layout import locate

__all__ = [
    "APPROXIMATE_EXP_ROUNDOFF",
    "TOLERANCES",
    "UNIT_ROUNDOFF",
    "ErrorScale",
    "Floors",
    "Tolerance",
    "Verdict",
    "assert_close",
    "assert_verdict",
    "baseline_error_of_both",
    "check",
    "compute_dtype",
    "compute_roundoff",
    "error_scales",
    "floors",
    "max_logit_scale",
    "tolerance_for",
    "unit_roundoff",
]


@dataclass(frozen=True)
class Tolerance:
    """k: allowed multiple of the single-device error. step_rel: slack, relative to
    max(1, max|R|), for comparisons that have no baseline (diagnosis of one ring step's partial
    result against the float64 simulation)."""

    k: float
    step_rel: float


# The policy's one table (k per input dtype). k = 2: a ring may be up to twice as far from the
# float64 truth as the same kernel on one device, beyond the floor (which carries the roundings
# a ring makes and a single kernel does not, so 16-bit inputs need no larger k). step_rel is roughly
# 10-30x the rounding unit of one attention call of that dtype: diagnosis only has to tell rounding
# from a wrong mask, block or scale, which err by O(1).
TOLERANCES: dict[torch.dtype, Tolerance] = {
    torch.float64: Tolerance(k=2.0, step_rel=1e-10),
    torch.float32: Tolerance(k=2.0, step_rel=1e-4),
    torch.bfloat16: Tolerance(k=2.0, step_rel=5e-2),
    torch.float16: Tolerance(k=2.0, step_rel=1e-2),
}

#: Unit roundoff (half the machine epsilon) of each dtype: round-to-nearest is off by at most
#: ``u * |x|``.
UNIT_ROUNDOFF: dict[torch.dtype, float] = {
    torch.float64: 2.0**-53,
    torch.float32: 2.0**-24,
    torch.bfloat16: 2.0**-8,
    torch.float16: 2.0**-11,
}


def tolerance_for(dtype: torch.dtype) -> Tolerance:
    """TOLERANCES[dtype], or a ValueError that lists the dtypes the policy covers."""
    try:
        return TOLERANCES[dtype]
    except KeyError:
        raise ValueError(
            f"no tolerance for dtype {dtype}; the numerics policy covers "
            f"{sorted(str(d) for d in TOLERANCES)} (add a row to reference.budget.TOLERANCES)"
        ) from None


def unit_roundoff(dtype: torch.dtype) -> float:
    if dtype not in UNIT_ROUNDOFF:
        raise ValueError(
            f"no unit roundoff for dtype {dtype}; known: {sorted(map(str, UNIT_ROUNDOFF))}"
        )
    return UNIT_ROUNDOFF[dtype]


#: u(c) of 16-bit inputs: a 20-ulp float32 exp (see the module docstring).
APPROXIMATE_EXP_ROUNDOFF = 40 * 2.0**-24


def compute_roundoff(dtype: torch.dtype) -> float:
    """u(c) for inputs of ``dtype``: the unit roundoff of :func:`compute_dtype`, or for 16-bit
    inputs that of an exp of 20 ulp (:data:`APPROXIMATE_EXP_ROUNDOFF`), whichever is larger."""
    u = unit_roundoff(compute_dtype(dtype))
    return max(u, APPROXIMATE_EXP_ROUNDOFF) if dtype in (torch.bfloat16, torch.float16) else u


def compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype attention kernels accumulate in for inputs of ``dtype`` (and the LSE's dtype):
    float64 for float64, float32 otherwise."""
    return torch.float64 if dtype == torch.float64 else torch.float32


# ------------------------------------------------------------------------------ magnitudes


@dataclass(frozen=True)
class ErrorScale:
    """Per-element magnitudes of one quantity (each of the quantity's shape, float64, >= 0).

    magnitude: M, the absolute values of the element's terms as kernels return them, summed
    (what rounding a partial result to the quantity's dtype is relative to).
    compute: A, the same with the backward's intermediates dP and D at their own magnitudes
    (what roundings inside the compute dtype are relative to).
    conditioning: C, the element's change when every probability of row i moves by ``u * |lse_i|``.
    The ``*_rss`` fields are the same terms' root-sum-square: the typical size of a sum of
    independent roundings, where the plain sums are their worst case (see the module docstring).
    """

    magnitude: Tensor
    compute: Tensor
    conditioning: Tensor
    magnitude_rss: Tensor
    compute_rss: Tensor
    conditioning_rss: Tensor


def _reduce_heads(t: Tensor, heads_kv: int) -> Tensor:
    """(b, heads, s, d) -> (b, heads_kv, s, d): sum each GQA group (query head h reads key/value
    head h // group)."""
    b, h, s, d = t.shape
    return t if h == heads_kv else t.reshape(b, heads_kv, h // heads_kv, s, d).sum(2)


class _Terms:
    """Element = sum over j of weight_ij * |x_j|: the plain sum and the root-sum-square."""

    def __init__(self, heads_kv: int):
        self.heads_kv = heads_kv

    def rows(self, weight: Tensor, x: Tensor) -> tuple[Tensor, Tensor]:
        """Sums over keys for each query row: (weight @ |x|, sqrt(weight^2 @ x^2))."""
        return weight @ x.abs(), torch.sqrt(weight.square() @ x.square())

    def cols(self, weight: Tensor, x: Tensor) -> tuple[Tensor, Tensor]:
        """Sums over queries for each key row (GQA groups summed): weight^T @ |x|, ..."""
        wt = weight.transpose(-2, -1)
        return (
            _reduce_heads(wt @ x.abs(), self.heads_kv),
            torch.sqrt(_reduce_heads(wt.square() @ x.square(), self.heads_kv)),
        )


def _scale(
    m: tuple[Tensor, Tensor], a: tuple[Tensor, Tensor], c: tuple[Tensor, Tensor]
) -> ErrorScale:
    return ErrorScale(m[0], a[0], c[0], m[1], a[1], c[1])


def error_scales(
    query: Tensor,
    key: Tensor,
    value: Tensor,
    grad_out: Tensor | None = None,
    *,
    visible: Tensor | None = None,
    scale: float | None = None,
    grad_lse: Tensor | None = None,
    sinks: Tensor | None = None,
    input_dtype: torch.dtype | None = None,
    score_mod: dict | None = None,
) -> dict[str, ErrorScale]:
    """M, A and C of out, lse (and dq, dk, dv when grad_out is given; dsinks too with
    ``sinks``), computed in float64.

    query (b, h, sq, d), key/value (b, hkv, sk, d), grad_out (b, h, sq, d), grad_lse (b, h, sq)
    or None (the gradient reaching the LSE: it joins D as ``D - grad_lse``); visible (sq, sk) bool
    (None: every key visible; pass the causal or any other mask the case uses). Rows that see no
    key have M = A = C = 0: their exact result (out 0, LSE -inf, zero gradients) must be met
    exactly. With sinks, grad_out and grad_lse reach the output and LSE *after* the sink term,
    and the magnitudes of out and lse are those without it (the sink only lowers P: an upper bound).

    dsinks (heads,), with ``sinks`` (heads,) and ``input_dtype`` (the case's dtype): the sink's
    gradient is ``sum_i sigma_i (g_i - dO_i . O_i)`` over every row i of the head (sigma_i the
    sink's probability, g_i the LSE's gradient, O_i the output with the sink, dO_i its
    gradient). ``O_i`` enters as a ring returns it, in the input dtype: rounded once per partial
    result (weights summing to at most 1: at most one rounding of ``|O_i|`` in all) and once
    when merged, so those terms carry two roundings of the input dtype, counted in M in units of
    the result dtype's (float32; float64 for float64) roundoff: ``2 u(input) / u(result)``. A
    and C: the terms at their own magnitude, C weighted by ``|lse_i|`` (sigma_i comes from the
    merged LSE).

    score_mod (reference.score_mods' plain data, or None): the magnitudes are those of the
    modified problem: P and the LSE from the modified scores, and dS (of the modified scores)
    carried back to the scaled scores by ``|d score_mod / d s|`` (1 for ALiBi and a bias, at most
    1 for the soft-cap), as the backward carries its roundings.
    """
    from reference.attention import default_scale, expand_kv_heads

    q = query.detach().to(torch.float64)
    k = expand_kv_heads(key.detach().to(torch.float64), q.shape[1])
    v = expand_kv_heads(value.detach().to(torch.float64), q.shape[1])
    scale = default_scale(q.shape[-1]) if scale is None else float(scale)
    terms = _Terms(key.shape[1])

    s = torch.matmul(q, k.transpose(-2, -1)) * scale
    chain = None  # |d score_mod / d s| per score entry
    if score_mod is not None:
        from reference.score_mods import apply_score_mod

        raw = s.detach().requires_grad_(True)
        with torch.enable_grad():
            modified = apply_score_mod(score_mod, raw)
            (d,) = torch.autograd.grad(modified.sum(), raw, allow_unused=True)
        chain = torch.zeros_like(s) if d is None else d.abs()
        s = modified.detach()
    vis = (
        torch.ones(s.shape[-2:], dtype=torch.bool, device=s.device)
        if visible is None
        else visible.to(s.device)
    )
    s = s.masked_fill(~vis, -math.inf)
    lse = torch.logsumexp(s, dim=-1, keepdim=True)  # -inf for rows that see nothing
    seen = torch.isfinite(lse)
    lse0 = torch.where(seen, lse, torch.zeros_like(lse))
    p = torch.where(vis & seen, torch.exp(s - lse0), torch.zeros_like(s))
    pk = p * lse0.abs()  # each p_ij weighted by its conditioning kappa_ij = |lse_i|

    out_m = terms.rows(p, v)
    lse_m = torch.where(seen, 1 + lse0.abs(), torch.zeros_like(lse0)).squeeze(-1)
    lse_c = (pk.sum(-1), pk.square().sum(-1).sqrt())
    scales = {
        "out": _scale(out_m, out_m, terms.rows(pk, v)),
        "lse": _scale((lse_m, lse_m), (lse_m, lse_m), lse_c),
    }
    if grad_out is None:
        return scales
    do = grad_out.detach().to(torch.float64)
    o = p @ v
    delta = (do * o).sum(-1, keepdim=True)  # D_i = rowsum(dO * O)
    d_magnitude = (do.abs() * o.abs()).sum(-1, keepdim=True)  # D from the rounded output O
    if grad_lse is not None:
        g = torch.where(
            seen, grad_lse.detach().to(torch.float64).unsqueeze(-1), torch.zeros_like(lse0)
        )
        delta, d_magnitude = delta - g, d_magnitude + g.abs()
    dp_minus_d = (do @ v.transpose(-2, -1) - delta).abs()
    ds_m = (
        abs(scale) * p * (dp_minus_d + d_magnitude)
    )  # dS = P o (dP - D) as returned, with D's rounding
    ds_a = (
        abs(scale) * p * (do.abs() @ v.abs().transpose(-2, -1) + d_magnitude)
    )  # dP, D at their own size
    # dS's change when every p_ij moves by u * kappa_i, directly and through D: the output O in
    # D = rowsum(dO * O) carries the same conditioning (C of out, |lse_i| * P|V|).
    d_conditioning = (do.abs() * out_m[0]).sum(-1, keepdim=True)
    ds_c = abs(scale) * pk * (dp_minus_d + d_conditioning)
    if chain is not None:  # dS of the modified scores, carried back to the scaled ones
        ds_m, ds_a, ds_c = ds_m * chain, ds_a * chain, ds_c * chain
    scales["dq"] = _scale(terms.rows(ds_m, k), terms.rows(ds_a, k), terms.rows(ds_c, k))
    scales["dk"] = _scale(terms.cols(ds_m, q), terms.cols(ds_a, q), terms.cols(ds_c, q))
    dv_m = terms.cols(p, do)
    scales["dv"] = _scale(dv_m, dv_m, terms.cols(pk, do))
    if sinks is not None:
        scales["dsinks"] = _sink_scale(
            sinks, lse, o, do, None if grad_lse is None else g, input_dtype or query.dtype
        )
    return scales


def _sink_scale(
    sinks: Tensor, lse: Tensor, o: Tensor, do: Tensor, g: Tensor | None, input_dtype: torch.dtype
) -> ErrorScale:
    """M, A, C of dsinks (heads,) (see :func:`error_scales`). lse (b, h, sq, 1) and o (b, h, sq, d)
    without the sink; do, g: the gradients reaching the output and LSE with it."""
    sk = sinks.detach().to(torch.float64).view(1, -1, 1)
    lse0 = lse.squeeze(-1)
    lse_s = torch.logaddexp(lse0, sk.expand_as(lse0))
    sigma = torch.exp(sk - lse_s)  # (b, h, sq)
    o_s = o * torch.exp(lse0 - lse_s).unsqueeze(-1)  # 0 for rows that see nothing
    t_out = sigma * (do.abs() * o_s.abs()).sum(-1)
    t_g = sigma * (g.squeeze(-1).abs() if g is not None else torch.zeros_like(sigma))
    weight = 2 * unit_roundoff(input_dtype) / unit_roundoff(compute_dtype(input_dtype))
    cond = lse_s.abs()

    def per_head(t: Tensor) -> tuple[Tensor, Tensor]:
        return t.sum(dim=(0, 2)), t.square().sum(dim=(0, 2)).sqrt()

    return _scale(
        per_head(weight * t_out + t_g), per_head(t_out + t_g), per_head(cond * (t_out + t_g))
    )


def max_logit_scale(
    query: Tensor, key: Tensor, *, scale: float | None = None, visible: Tensor | None = None
) -> ErrorScale:
    """M (= A; C = 0) of the per-head max logit (heads,), in float64 from the inputs.

    The max logit is one logit per head, ``scale * q_i . k_j``, formed in the compute dtype like
    the kernel's own scores: a dot product of ``head_dim`` products summed, then scaled, each
    step one rounding relative to at most ``|scale| sum_d |q_id| |k_jd|`` (the dot product's
    error bound, gamma_(d+1) times that sum). ``max`` moves by no more than the largest move of
    an element it takes the maximum of (``|max a - max b| <= max |a - b|``), so M of a head is
    that sum's maximum over the visible pairs (i, j) (0 for a head that sees nothing, whose
    -inf must be met exactly). Judged with ``roundings = head_dim + 1`` in the compute dtype
    (result dtype the compute dtype): the floor is then that bound, whatever order a ring's
    block matmul sums in. No LSE is involved: no conditioning term.

    query (b, h, sq, d), key (b, hkv, sk, d); visible: bool broadcastable to (b, h, sq, sk), None:
    every key. Non-finite inputs count as 0 here (where they reach, the max is NaN on both sides).
    """
    from reference.attention import default_scale, expand_kv_heads

    def finite_abs(t: Tensor) -> Tensor:
        return torch.nan_to_num(t.detach().to(torch.float64), nan=0.0, posinf=0.0, neginf=0.0).abs()

    q = finite_abs(query)
    k = expand_kv_heads(finite_abs(key), q.shape[1])
    scale = default_scale(q.shape[-1]) if scale is None else float(scale)
    s = abs(scale) * (q @ k.transpose(-2, -1))
    if visible is not None:
        s = s.masked_fill(~visible.to(s.device).expand_as(s), 0.0)
    m = s.amax(dim=(0, 2, 3)) if s.numel() else torch.zeros(q.shape[1], dtype=torch.float64)
    zero = torch.zeros_like(m)
    return ErrorScale(m, m, zero, m, m, zero)


@dataclass(frozen=True)
class Floors:
    """The floors of one check: ``max_floor`` for the max rule, ``mean_floor`` for the mean rule."""

    max_floor: float
    mean_floor: float


def floors(
    scale: ErrorScale | None,
    ref: Tensor,
    *,
    result_dtype: torch.dtype,
    input_dtype: torch.dtype,
    roundings: int = 2,
) -> Floors:
    """The floors for a quantity of ``result_dtype`` computed from inputs of ``input_dtype`` with
    ``roundings`` roundings in the compute dtype (a ring of W blocks: W + 1). See the module
    docstring."""
    u_x, u_c = unit_roundoff(result_dtype), compute_roundoff(input_dtype)
    n = max(1, int(roundings))
    if scale is None:
        r64 = ref.detach().to(torch.float64)
        finite = r64[torch.isfinite(r64)]
        m = max(1.0, float(finite.abs().max()) if finite.numel() else 0.0)
        return Floors((u_x + n * u_c) * m, (u_x + math.sqrt(n) * u_c) * m)
    if scale.magnitude.numel() == 0:
        return Floors(0.0, 0.0)
    worst = u_x * scale.magnitude + n * u_c * (scale.compute + scale.conditioning)
    typical = u_x * scale.magnitude_rss + math.sqrt(n) * u_c * (
        scale.compute_rss + scale.conditioning_rss
    )
    return Floors(float(worst.max()), float(typical.mean()))


# ------------------------------------------------------------------------------ verdicts


@dataclass(frozen=True)
class Verdict:
    """Outcome of one check. Errors are float64 absolute errors against the reference; ratio is
    max_err / base_max_err (inf when the baseline is exact and X is not), mean_ratio the same for
    the means. ``floor`` and ``mean_floor`` are the two rules' floors; worst_index indexes the
    tensors as passed (global or local); rank/step say where the worst element lives, if known."""

    name: str
    passed: bool
    max_err: float
    mean_err: float
    base_max_err: float
    base_mean_err: float
    ratio: float
    k: float
    floor: float
    worst_index: tuple[int, ...]
    rank: int | None
    step: int | None
    message: str
    mean_floor: float = 0.0
    mean_ratio: float = 0.0

    @property
    def max_bound(self) -> float:
        return self.k * self.base_max_err + self.floor

    @property
    def mean_bound(self) -> float:
        return self.k * self.base_mean_err + self.mean_floor


def abs_error(x: Tensor, ref: Tensor) -> Tensor:
    """|x - ref| in float64, elementwise. A non-finite x counts as an infinite error unless ref
    holds the very same non-finite value there (both NaN, or the same infinity)."""
    x64, r64 = x.detach().to(torch.float64), ref.detach().to(torch.float64).to(x.device)
    err = (x64 - r64).abs()
    same_nonfinite = (x64 == r64) | (torch.isnan(x64) & torch.isnan(r64))
    err = torch.where(same_nonfinite, torch.zeros_like(err), err)
    return torch.where(torch.isnan(err), torch.full_like(err, math.inf), err)


def fmt_err(v: float) -> str:
    """3.1e-2 rather than 3.1e-02: the form the messages are read (and grepped) in."""
    text = f"{v:.1e}"
    if "e" not in text:  # inf, nan
        return text
    mantissa, exponent = text.split("e")
    return f"{mantissa}e{int(exponent)}"


def _ratio(err: float, base: float) -> float:
    return err / base if base > 0 else (math.inf if err > 0 else 0.0)


def check(
    name: str,
    x: Tensor,
    ref: Tensor,
    base: Tensor,
    *,
    dtype: torch.dtype | None = None,
    result_dtype: torch.dtype | None = None,
    scales: ErrorScale | None = None,
    rank: int | None = None,
    step: int | None = None,
    context: str = "",
    layout: str | None = None,
    world_size: int | None = None,
    roundings: int | None = None,
    seq_dim: int = 2,
) -> Verdict:
    """Judge x against the float64 reference ref, relative to the single-device baseline base.

    x, ref, base: the same shape, any dtype (compared in float64). dtype: the input dtype of the
    case (picks k and the compute dtype; default x.dtype); result_dtype: the dtype the quantity
    is specified in (default: dtype; the LSE's is float32, or float64 for float64 inputs).
    scales: the quantity's magnitudes from :func:`error_scales` (None: ``max(1, max|R|)``, see
    the module docstring). world_size: the ring's number of key/value blocks (default 1); with
    layout, the rank holding the worst element is filled in when rank is None. roundings: how
    many roundings in the compute dtype each element may carry beyond the baseline's (default
    world_size + 1; a caller summing more partial results, e.g. parameter gradients over
    tokens, says how many).
    context is appended to the message, e.g. "[ring_attention(causal=True, W=4)]".
    """
    if not (x.shape == ref.shape == base.shape):
        raise ValueError(
            f"{name}: shapes differ: result {tuple(x.shape)}, reference {tuple(ref.shape)}, "
            f"baseline {tuple(base.shape)}; compare the same (global or local) tensors"
        )
    in_dtype = dtype or x.dtype
    out_dtype = result_dtype or in_dtype
    tol = tolerance_for(in_dtype)
    if scales is not None and tuple(scales.magnitude.shape) != tuple(ref.shape):
        raise ValueError(
            f"{name}: scales of shape {tuple(scales.magnitude.shape)} for a result of shape "
            f"{tuple(ref.shape)}"
        )
    n = roundings if roundings is not None else (world_size or 1) + 1
    fl = floors(scales, ref, result_dtype=out_dtype, input_dtype=in_dtype, roundings=n)
    err, base_err = abs_error(x, ref), abs_error(base, ref)

    if err.numel() == 0:
        max_err = mean_err = base_max = base_mean = 0.0
        worst: tuple[int, ...] = ()
    else:
        max_err, mean_err = float(err.max()), float(err.mean())
        base_max, base_mean = float(base_err.max()), float(base_err.mean())
        flat = int(torch.argmax(err))  # first maximum; inf marks a NaN/inf element
        worst = tuple(int(i) for i in torch.unravel_index(torch.tensor(flat), tuple(err.shape)))

    held_at = ""
    if rank is None and layout is not None and world_size is not None and worst:
        rank, local = locate(worst, layout, world_size, x.shape[seq_dim], dim=seq_dim)
        held_at = f" (local {local} on rank {rank}, layout {layout})"

    ratio, mean_ratio = _ratio(max_err, base_max), _ratio(mean_err, base_mean)
    max_bound, mean_bound = tol.k * base_max + fl.max_floor, tol.k * base_mean + fl.mean_floor
    base_finite = math.isfinite(base_max)
    max_ok, mean_ok = max_err <= max_bound, mean_err <= mean_bound
    passed = base_finite and max_ok and mean_ok

    where = ", ".join(f"{key}={v}" for key, v in (("rank", rank), ("step", step)) if v is not None)
    label = f"{name}[{where}]" if where else name
    parts = [
        f"{label} max err {fmt_err(max_err)} vs single-device {fmt_err(base_max)} "
        f"(ratio {ratio:.3g}; bound {fmt_err(max_bound)} = {tol.k:g} x single-device + floor "
        f"{fmt_err(fl.max_floor)}{', exceeded' if not max_ok else ''}) at {worst}{held_at}",
        f"mean err {fmt_err(mean_err)} vs single-device {fmt_err(base_mean)} "
        f"(ratio {mean_ratio:.3g}; bound {fmt_err(mean_bound)}, floor {fmt_err(fl.mean_floor)}"
        f"{', exceeded' if not mean_ok else ''})",
        f"{str(out_dtype).removeprefix('torch.')} result of "
        f"{str(in_dtype).removeprefix('torch.')} inputs",
    ]
    if not math.isfinite(max_err):
        bad = float(x.detach()[worst].to(torch.float64))
        parts.insert(1, f"result is {bad} there, a NaN/inf where the reference is finite")
    if not base_finite:
        parts.insert(
            1,
            "the single-device baseline itself has NaN/inf: the kernel is broken on "
            "one device, so no ring result can be judged against it",
        )
    message = "; ".join(parts) + (f" {context}" if context else "")
    return Verdict(
        name,
        passed,
        max_err,
        mean_err,
        base_max,
        base_mean,
        ratio,
        tol.k,
        fl.max_floor,
        worst,
        rank,
        step,
        message,
        fl.mean_floor,
        mean_ratio,
    )


def assert_verdict(verdict: Verdict) -> Verdict:
    """Raise AssertionError with the verdict's message unless it passed; return it otherwise."""
    __tracebackhide__ = True
    if not verdict.passed:
        raise AssertionError(verdict.message)
    return verdict


def assert_close(name: str, x: Tensor, ref: Tensor, base: Tensor, **kwargs: object) -> Verdict:
    """check(...) then assert_verdict(...); keyword arguments as for check."""
    __tracebackhide__ = True
    return assert_verdict(check(name, x, ref, base, **kwargs))  # type: ignore[arg-type]


def baseline_error_of_both(
    masked: Tensor, reference: Tensor, kernel: Tensor, kernel_reference: Tensor, seen: Tensor
) -> Tensor:
    """A baseline whose error is, per element, the larger of two runs' errors (the section
    "The baseline of a masked case whose kernel takes no mask").

    masked, reference: the math op's result on the masked problem and its float64 reference;
    kernel, kernel_reference: the kernel's result on the same inputs unmasked and the float64
    reference of that; seen: bool, broadcastable to them, True where the element sees something
    (elsewhere the masked run's exact value stays). Returns ``reference + e * sign(masked -
    reference)`` with ``e = fmax(|masked - reference|, |kernel - kernel_reference|)``, in
    float64; non-finite values of ``masked`` stay as they are.
    """
    r = reference.to(torch.float64)
    m = masked.to(torch.float64)
    own = (m - r).abs()
    other = (kernel.to(torch.float64) - kernel_reference.to(torch.float64)).abs()
    error = torch.where(seen, torch.fmax(own, other), own)
    sign = torch.where(m >= r, 1.0, -1.0).to(torch.float64)
    both = r + sign * error
    return torch.where(torch.isfinite(m) & torch.isfinite(both), both, m)
