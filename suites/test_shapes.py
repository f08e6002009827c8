"""Shapes and inputs nobody tried: GQA, cross-attention lengths, non-contiguous inputs,
large-magnitude logits, odd sizes (head_dim 8..128, one or an odd number of tokens per rank,
batch 1).

Each family is a product of axes: the nightly tier runs it whole, the quick tier a pairwise
selection of it (suites.coverage: every value and every pair of values of two axes). The strategy
axis (:mod:`suites.meshes`): cross-attention lengths and non-contiguous shards under Ulysses and
the hybrid on the 4-rank meshes."""

from __future__ import annotations

import pytest

from suites import meshes
from suites.cases import RingCase
from suites.coverage import combos
from suites.inputs import InputSpec
from suites.matrix import LAYOUTS, ROTATIONS, params, tier, world_sizes


def _gqa(config):
    cases = []
    for w, (heads, heads_kv), causal, rotate in combos(
        config, world_sizes(config, at_least=2), ((8, 4), (8, 2), (8, 1)), (False, True), ROTATIONS
    ):
        inputs = InputSpec.per_rank(
            w, rows=4, batch=1, heads=heads, heads_kv=heads_kv, dtype="float32"
        )
        cases.append(
            RingCase(inputs, w, is_causal=causal, layout="head_tail", rotate_method=rotate)
        )
    return params(cases, id_extra=lambda c: (f"gqa{c.inputs.heads}x{c.inputs.heads_kv}",))


def _cross(config):
    cases = []
    for w, (sq, skv), layout, rotate in combos(
        config, world_sizes(config, at_least=2), ((8, 24), (24, 8), (2, 16)), LAYOUTS, ROTATIONS
    ):
        inputs = InputSpec(
            batch=2, heads=4, heads_kv=2, seq_q=sq * w, seq_kv=skv * w, head_dim=16, dtype="float64"
        )
        cases.append(RingCase(inputs, w, is_causal=False, layout=layout, rotate_method=rotate))
    return params(
        cases,
        id_extra=lambda c: (
            f"q{c.inputs.seq_q // c.world_size}-kv{c.inputs.seq_kv // c.world_size}",
        ),
    )


def _noncontiguous(config):
    cases = []
    for w, causal, rotate, dtype in combos(
        config, world_sizes(config, at_least=2), (False, True), ROTATIONS, ("float32", "bfloat16")
    ):
        inputs = InputSpec.per_rank(w, heads_kv=2, dtype=dtype, noncontiguous=True)
        cases.append(
            RingCase(inputs, w, is_causal=causal, layout="head_tail", rotate_method=rotate)
        )
    # every other element of a wider buffer on the head dim (x[..., ::2]), W from 1: one rank
    # has no collective that would copy its inputs before the kernel reads them
    for w, causal, dtype in combos(
        config, world_sizes(config), (False, True), ("float64", "float32")
    ):
        inputs = InputSpec.per_rank(w, heads_kv=2, dtype=dtype, strided_head_dim=True)
        cases.append(
            RingCase(
                inputs, w, is_causal=causal, layout="contiguous", rotate_method=ROTATIONS[w % 3]
            )
        )
    return params(
        cases,
        id_extra=lambda c: ("strided-head-dim" if c.inputs.strided_head_dim else "bshd-views",),
    )


def _large_logits(config):
    cases = []
    for w, causal, dtype, magnitude in combos(
        config,
        world_sizes(config, at_least=2),
        (False, True),
        ("float64", "float32", "bfloat16"),
        (30.0, 300.0),
    ):
        inputs = InputSpec.per_rank(
            w, batch=1, heads=2, heads_kv=2, dtype=dtype, magnitude=magnitude
        )
        cases.append(RingCase(inputs, w, is_causal=causal, layout="head_tail", rotate_method="p2p"))
    return params(cases, id_extra=lambda c: (f"x{c.inputs.magnitude:g}",))


def _odd_sizes(config):
    nightly = tier(config) == "nightly"
    cases = []
    sizes = (
        world_sizes(config, at_least=2) if nightly else world_sizes(config, at_least=2, at_most=3)
    )
    for w, head_dim, local, causal in combos(
        config, sizes, (8, 24, 64, 128), (1, 3, 5), (False, True)
    ):
        inputs = InputSpec(
            batch=1,
            heads=3,
            heads_kv=1,
            seq_q=local * w,
            seq_kv=local * w,
            head_dim=head_dim,
            dtype="float32",
            scale=0.37,
        )
        cases.append(
            RingCase(inputs, w, is_causal=causal, layout="contiguous", rotate_method="alltoall")
        )
    return params(
        cases, id_extra=lambda c: (f"d{c.inputs.head_dim}-s{c.inputs.seq_q // c.world_size}",)
    )


def pytest_generate_tests(metafunc):
    for name, make in (
        ("gqa_case", _gqa),
        ("cross_case", lambda config: _cross(config) + meshes.cross_cases(config)),
        (
            "noncontig_case",
            lambda config: _noncontiguous(config) + meshes.noncontiguous_cases(config),
        ),
        ("large_case", _large_logits),
        ("odd_case", _odd_sizes),
    ):
        if name in metafunc.fixturenames:
            metafunc.parametrize(name, make(metafunc.config))


def test_grouped_query_attention(ring, gqa_case: RingCase) -> None:
    ring.check(ring.prepare(gqa_case))


def test_cross_attention_lengths(ring, cross_case: RingCase) -> None:
    ring.check(ring.prepare(cross_case))


def _strides(shape: tuple[int, ...], order: tuple[int, ...]) -> tuple[int, ...]:
    """Strides of a tensor of ``shape`` whose memory
    holds its dims in ``order`` (outermost first)."""
    strides = [0] * len(shape)
    step = 1
    for dim in reversed(order):
        strides[dim] = step
        step *= shape[dim]
    return tuple(strides)


def noncontiguous_problems(case: RingCase, results) -> list[str]:
    """What every rank handed to ring_attention must be the memory the case asks for, not the
    contiguous one: the (batch, seq, heads, dim) memory of a model seen as (batch, heads, seq,
    dim), or a head dim of stride 2. One line per tensor and rank that is not."""
    spec, w = case.inputs, case.world_size
    local = {
        "query": (spec.batch, spec.heads, spec.seq_q // w, spec.head_dim),
        "key": (spec.batch, spec.heads_kv, spec.seq_kv // w, spec.head_dim),
        "value": (spec.batch, spec.heads_kv, spec.seq_kv // w, spec.head_dim),
    }
    problems = []
    for rank, r in enumerate(results):
        for (name, shape), strides in zip(local.items(), r["input_strides"], strict=True):
            contiguous = _strides(shape, (0, 1, 2, 3))
            if spec.strided_head_dim:
                want = tuple(2 * s for s in contiguous)
                what = "head dim of stride 2"
            else:
                want = _strides(shape, (0, 2, 1, 3))
                what = "(batch, seq, heads, dim) view"
            if tuple(strides) != want or want == contiguous:
                problems.append(
                    f"rank {rank}: {name} {shape} passed with strides {tuple(strides)}, "
                    f"expected the {what}'s {want} (contiguous: {contiguous})"
                )
    return problems


def test_noncontiguous_inputs(ring, noncontig_case: RingCase) -> None:
    case = ring.prepare(noncontig_case)
    results = ring.run(case)
    problems = noncontiguous_problems(case, results)
    assert not problems, (
        "the suite did not pass the non-contiguous views it means to test:\n" + "\n".join(problems)
    )
    try:
        ring.check(case, results=results)
    except pytest.fail.Exception as failure:
        contiguous = case.with_(
            inputs=case.inputs.with_(noncontiguous=False, strided_head_dim=False)
        )
        try:
            ring.check(contiguous)
        except pytest.fail.Exception:
            raise failure from None
        what = (
            "a strided head dim (a kernel read it as if its stride were 1, as aten's CPU flash "
            "kernel does in torch 2.13)"
            if case.inputs.strided_head_dim
            else "non-contiguous inputs (it reads their memory as if contiguous, ignoring strides)"
        )
        pytest.fail(
            f"{failure}\nThe same case with contiguous inputs passes: the implementation is wrong "
            f"only with {what}",
            pytrace=False,
        )


def test_large_magnitude_logits(ring, large_case: RingCase) -> None:
    ring.check(ring.prepare(large_case))


def test_odd_sizes(ring, odd_case: RingCase) -> None:
    ring.check(ring.prepare(odd_case))
