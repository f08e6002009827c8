"""Forward and backward (out, LSE, dQ, dK, dV) against the float64 reference, across the matrix.

Every quantity must meet the numerics policy (reference/budget.py): its error against the float64
reference on the same rounded inputs at most k times the single-device error of the same kernel
in the same dtype, plus a floor; a float64 ring must agree to about 1e-12.

A value head dim other than query's and key's (``head_dim_v``: multi-head latent attention,
d_v != d_qk; capability ``value_head_dim``) runs through every rotation, both layouts, causal and
not, GQA and the LSE's gradient, wider and narrower than d_qk. A failing one is run again with
d_v = d_qk: when that passes, the failure says the implementation is wrong only with its own
value head dim (the typical bug: a key/value buffer, or a dK/dV accumulator, sized by d_qk).

The strategy axis (:mod:`suites.meshes`): Ulysses and the hybrid on the session's meshes, by
the same test and judge (ids ``ulysses-4x1-...``, ``hybrid-2x2-...``).
"""

from __future__ import annotations

import itertools

import pytest

from suites import meshes
from suites.cases import RingCase
from suites.inputs import InputSpec
from suites.matrix import DTYPES, LAYOUTS, ROTATIONS, params, tier, world_sizes


def _cases(config) -> list:
    nightly = tier(config) == "nightly"
    cases = []
    for w, dtype, causal, rotate, layout in itertools.product(
        world_sizes(config), DTYPES, (False, True), ROTATIONS, LAYOUTS
    ):
        seq = (16 if nightly else 8) * w
        inputs = InputSpec(
            batch=2,
            heads=4,
            heads_kv=4,
            seq_q=seq,
            seq_kv=seq,
            head_dim=32 if nightly else 16,
            dtype=dtype,
        )
        cases.append(RingCase(inputs, w, is_causal=causal, layout=layout, rotate_method=rotate))
    return params(cases)


def _value_head_dim_cases(config) -> list:
    """d_v != d_qk: (d_qk, d_v) of 16 and 24 (value wider) or 24 and 8 (narrower, as DeepSeek's 192
    and 128; nightly 32/48 and 48/16 on twice the length), every rotation and layout at every world
    size, causal or not, with GQA and a loss through the LSE in some; float64 (held to ~1e-12) or
    float32 (nightly: both, one causal)."""
    nightly = tier(config) == "nightly"
    cases = []
    combos = itertools.product(world_sizes(config), ROTATIONS, LAYOUTS)
    for i, (w, rotate, layout) in enumerate(combos):
        pairs = ((i % 3 != 1, "float64"), (i % 3 == 1, "float32"))  # one causal, one not
        for causal, dtype in pairs if nightly else pairs[(i + w) % 2 :][:1]:
            # nightly: larger, as its other cases (seq, head dims),
            # so none is also a quick-tier case
            d, dv = (((32, 48), (48, 16)) if nightly else ((16, 24), (24, 8)))[
                (i + int(causal)) % 2
            ]
            seq = (16 if nightly else 8) * w
            inputs = InputSpec(
                batch=1,
                heads=4,
                heads_kv=(4, 2)[i % 2],
                seq_q=seq,
                seq_kv=seq,
                head_dim=d,
                head_dim_v=dv,
                dtype=dtype,
                lse_grad=i % 3 != 2,
            )
            cases.append(RingCase(inputs, w, is_causal=causal, layout=layout, rotate_method=rotate))
    return params(
        cases,
        id_extra=lambda c: (
            f"d{c.inputs.head_dim}-dv{c.inputs.head_dim_v}",
            f"hkv{c.inputs.heads_kv}",
            *(("lse-grad",) if c.inputs.lse_grad else ()),
        ),
    )


def pytest_generate_tests(metafunc):
    if "case" in metafunc.fixturenames:
        metafunc.parametrize(
            "case", _cases(metafunc.config) + meshes.reference_cases(metafunc.config)
        )
    if "dv_case" in metafunc.fixturenames:
        metafunc.parametrize("dv_case", _value_head_dim_cases(metafunc.config))


def test_forward_backward_match_reference(ring, case: RingCase) -> None:
    ring.check(ring.prepare(case))


def test_value_head_dim(ring, dv_case: RingCase) -> None:
    case = ring.prepare(dv_case)  # (the loss on the output only where the LSE takes no gradient)
    try:
        ring.check(case)
        return
    except (
        pytest.fail.Exception,
        Exception,
    ) as exc:  # a rank's error counts too: a buffer of the wrong size
        failure = exc
    same = case.with_(
        inputs=case.inputs.with_(head_dim_v=None, head_dim=case.inputs.value_head_dim)
    )
    try:
        ring.check(same)
    except (pytest.fail.Exception, Exception):
        raise failure from None
    d, dv = case.inputs.head_dim, case.inputs.value_head_dim
    pytest.fail(
        f"{failure}\nThe same case with value's head dim equal to query's and key's ({dv}) "
        f"passes: the implementation is wrong only when d_v != d_qk (d_qk={d}, d_v={dv}): look "
        "for a buffer, accumulator or output sized by one head dim where the other was meant "
        "(value, out, dV by d_v; query, key, dQ, dK by d_qk)",
        pytrace=False,
    )
