"""Values at the edges: NaN in the inputs, and softmax scales <= 0.

NaN. A NaN input must reach every result that depends on it; a ring must not hide it (a kernel
that drops NaN on short key blocks, which sharding creates, makes a NaN query row come back as
0.0). Checked against the float64 reference on the same inputs, whose NaN are exactly where the
input reaches by dependency (reference.attention.nonfinite_reach): every element NaN there is
NaN (or inf) in the result. More NaN is allowed (single-process SDPA itself multiplies masked-out
zero weights by a NaN value and spreads it to rows that do not see it), but only within the NaN's
own batch entry and GQA group: attention never mixes batch entries or head groups, so anything
there is invented. Elements finite in both are judged by the numerics policy, with the baseline
and magnitudes of the same inputs without the NaN (identical there in exact arithmetic).

Scale <= 0. Legitimate (a negative temperature flips the attention) and handled by SDPA; the CPU
flash kernel returns NaN for causal attention with such a scale. An implementation must route
around a kernel's known fault or reject the call, never return the fault's result.
"""

from __future__ import annotations

import itertools

import pytest
import torch

from reference.budget import ErrorScale, assert_verdict, check, compute_dtype
from suites.cases import RingCase
from suites.inputs import InputSpec, nan_position
from suites.judge import QUANTITIES, baseline_for, reference_for, scales_for, unshard_results
from suites.matrix import LAYOUTS, ROTATIONS, params, world_sizes


def _nan_cases(config):
    cases = []
    combos = itertools.product(
        world_sizes(config, at_least=2), ("query", "key", "value"), (False, True), LAYOUTS
    )
    for i, (w, where, causal, layout) in enumerate(combos):
        inputs = InputSpec.per_rank(w, heads_kv=2, dtype="float32", nan_in=where)
        cases.append(
            RingCase(
                inputs,
                w,
                is_causal=causal,
                layout=layout,
                rotate_method=ROTATIONS[i % len(ROTATIONS)],
            )
        )
    return params(cases, id_extra=lambda c: (f"nan-in-{c.inputs.nan_in}",))


def _scale_cases(config):
    cases = []
    for w, scale, layout, dtype in itertools.product(
        world_sizes(config, at_least=2, at_most=3), (-0.3, 0.0), LAYOUTS, ("float32", "bfloat16")
    ):
        inputs = InputSpec.per_rank(w, batch=1, heads=2, heads_kv=2, dtype=dtype, scale=scale)
        cases.append(RingCase(inputs, w, is_causal=True, layout=layout, rotate_method="alltoall"))
    return params(cases, id_extra=lambda c: (f"scale{c.inputs.scale:g}",))


def pytest_generate_tests(metafunc):
    if "nan_case" in metafunc.fixturenames:
        metafunc.parametrize("nan_case", _nan_cases(metafunc.config))
    if "scale_case" in metafunc.fixturenames:
        metafunc.parametrize("scale_case", _scale_cases(metafunc.config))


def _where(mask: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
    return torch.where(mask, t.to(torch.float64), torch.zeros((), dtype=torch.float64))


def test_nan_in_the_inputs_reaches_the_outputs(ring, nan_case: RingCase) -> None:
    case = ring.prepare(nan_case)
    spec = case.inputs
    got = unshard_results(ring.run(case), case.layout)
    ref = reference_for(spec, case.is_causal)
    clean = spec.with_(nan_in=None)
    base, scales = (
        baseline_for(clean, case.is_causal, case.op or getattr(ring.impl.obj, "baseline_op", None)),
        scales_for(clean, case.is_causal),
    )
    where = f"NaN in {spec.nan_in} at global {nan_position(spec)}"
    for name in QUANTITIES:
        x, r = got[name], ref[name]
        if x is None:
            continue
        hidden = torch.isnan(r) & torch.isfinite(x)
        assert not hidden.any(), (
            f"{name}: {int(hidden.sum())} element(s) finite where the reference is NaN ({where}), "
            f"first at {tuple(int(i) for i in hidden.nonzero()[0])}: the NaN was hidden (e.g. a "
            f"kernel that drops NaN on short key blocks) [{case.label}]"
        )
        # The NaN sits in batch 0 and in query/key/value head 0: its GQA group is query heads
        # [0, group) and key/value head 0. Nothing else can depend on it.
        group = spec.heads // spec.heads_kv
        heads_reached = 1 if name in ("dk", "dv") else group
        untouchable = torch.ones(x.shape, dtype=torch.bool)
        untouchable[0, :heads_reached] = False
        invented = untouchable & ~torch.isfinite(x)
        assert not invented.any(), (
            f"{name}: {int(invented.sum())} element(s) NaN/inf outside the NaN's batch entry and "
            f"head group ({where}), first at {tuple(int(i) for i in invented.nonzero()[0])}: "
            f"attention never mixes those [{case.label}]"
        )
        both = torch.isfinite(r) & torch.isfinite(x)
        sc = scales[name]
        masked = ErrorScale(
            *(
                _where(both, t)
                for t in (
                    sc.magnitude,
                    sc.compute,
                    sc.conditioning,
                    sc.magnitude_rss,
                    sc.compute_rss,
                    sc.conditioning_rss,
                )
            )
        )
        assert_verdict(
            check(
                f"{name} (finite elements)",
                _where(both, x),
                _where(both, r),
                _where(both, base[name]),
                dtype=spec.torch_dtype,
                result_dtype=compute_dtype(spec.torch_dtype) if name == "lse" else spec.torch_dtype,
                scales=masked,
                world_size=case.world_size,
                context=f"({where}) [{case.label}]",
            )
        )


def test_nonpositive_scale_is_right_or_rejected(ring, scale_case: RingCase) -> None:
    """Causal attention with scale <= 0: the result meets the numerics policy (an implementation
    must not pass on its kernel's NaN); rejecting the call on every rank is the alternative, and
    only with an InputError-like ValueError that names the scale."""
    case = ring.prepare(scale_case)
    from suites.cases import ring_case

    outcomes = ring.rank_pool(case.world_size).run_outcomes(ring_case, case, timeout=ring.timeout)
    if all(not o.ok for o in outcomes):
        for o in outcomes:
            assert "scale" in o.exc_message.lower(), (
                f"rank {o.rank} rejected scale {case.inputs.scale} without saying so: "
                f"{o.exc_type}: {o.exc_message}"
            )
        pytest.skip(
            f"{ring.impl.name} rejects causal attention with scale {case.inputs.scale} on every "
            "rank"
        )
    failed = [f"rank {o.rank}: {o.exc_type}: {o.exc_message}" for o in outcomes if not o.ok]
    assert not failed, "some ranks raised and others did not:\n" + "\n".join(failed)
    ring.check(case, results=[o.value for o in outcomes])
