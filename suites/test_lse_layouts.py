"""LSE handling: every kernel's LSE layout, normalised before the merge.

The CPU ops ``cpu_efficient_layout`` (LSE padded to a multiple of 32 with garbage in the padding,
as CUDA memory-efficient attention) and ``cpu_cudnn_layout`` (LSE with a trailing dim of 1, as
cuDNN) exercise the trimming and reshaping paths without a GPU, including local lengths of 1 and
2 (a 32-wide LSE for a single query) and lengths just past a multiple of 32. The strategy axis
(:mod:`suites.meshes`): every op under Ulysses and the hybrid on the 4-rank meshes.
"""

from __future__ import annotations

import itertools

from suites import meshes
from suites.cases import RingCase
from suites.coverage import combos
from suites.inputs import InputSpec
from suites.matrix import LAYOUTS, padded_lse_ops, params, session_ops, tier, world_sizes


def _cases(config) -> list:
    nightly = tier(config) == "nightly"
    sizes = (
        world_sizes(config, at_least=2) if nightly else world_sizes(config, at_least=2, at_most=3)
    )
    dtypes = ("float64", "float32", "bfloat16", "float16") if nightly else ("float32", "bfloat16")
    cases = []
    # The session device's kernels (--device cuda: the CUDA kernels and their real LSE layouts); a
    # kernel that cannot run a dtype skips that case with its reason (suites.pytest_plugin).
    # Quick: every value and pair of values of the five axes (suites.coverage); nightly: all.
    for op, w, dtype, causal, layout in combos(
        config, session_ops(config), sizes, dtypes, (False, True), LAYOUTS
    ):
        inputs = InputSpec.per_rank(w, rows=6, batch=1, heads=2, heads_kv=2, dtype=dtype)
        cases.append(RingCase(inputs, w, is_causal=causal, layout=layout, op=op))
    # Tiny and just-past-32 local lengths, where padded layouts differ most from the plain one.
    for op, local, layout in itertools.product(padded_lse_ops(config), (1, 2, 33, 34), LAYOUTS):
        if layout == "head_tail" and local % 2:
            continue
        w = 2
        inputs = InputSpec(
            batch=1,
            heads=2,
            heads_kv=1,
            seq_q=local * w,
            seq_kv=local * w,
            head_dim=8,
            dtype="float32",
        )
        cases.append(RingCase(inputs, w, is_causal=True, layout=layout, op=op))
    return params(cases, id_extra=lambda c: (f"s{c.inputs.seq_q // c.world_size}",))


def pytest_generate_tests(metafunc):
    if "case" in metafunc.fixturenames:
        metafunc.parametrize("case", _cases(metafunc.config) + meshes.kernel_cases(metafunc.config))


def test_lse_layouts_are_normalised(ring, case: RingCase) -> None:
    ring.check(ring.prepare(case))
