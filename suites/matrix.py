"""The discrete axes of the conformance matrix and readable case ids.

Quick tier: what ``pytest suites -n auto`` runs on 2 CPU cores in minutes: the largest matrices
are pairwise selections of their nightly product (:mod:`suites.coverage`). Nightly tier
(``--tier nightly``): the full matrix, world sizes up to 8, every CPU op. Which tier and world
sizes are on comes from the harness settings (``--tier``, ``--world-sizes``), read when the
tests are generated, so a quick run does not even collect nightly cases.
"""

from __future__ import annotations

import zlib
from collections.abc import Callable, Iterable, Sequence

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from harness.pytest_plugin import settings_of
from suites.cases import RingCase
from suites.inputs import SHORT, InputSpec

__all__ = [
    "CPU_OPS",
    "CUDA_OPS",
    "DTYPES",
    "LAYOUTS",
    "ROTATIONS",
    "case_id",
    "draw_inputs",
    "draw_lse_grad",
    "draw_world_size",
    "generate",
    "padded_lse_ops",
    "params",
    "seed_for",
    "session_ops",
    "tier",
    "world_sizes",
]

DTYPES = ("float64", "float32", "bfloat16", "float16")
ROTATIONS = ("allgather", "alltoall", "p2p")
LAYOUTS = ("contiguous", "head_tail")
#: Kernels that run on CPU, including the CPU emulations of the CUDA kernels' LSE layouts.
CPU_OPS = ("cpu_flash", "math", "cpu_efficient_layout", "cpu_cudnn_layout")
#: Kernels that run on CUDA: the real padded-LSE (memory-efficient) and trailing-dim (cuDNN) ones.
CUDA_OPS = ("cuda_flash", "math", "cuda_efficient", "cudnn")


def generate(**builders: Callable[[pytest.Config], list]) -> Callable:
    r"""A module's ``pytest_generate_tests``: a test taking the argument ``name`` of
    ``name=cases`` runs once per entry of ``cases(config)`` (cases or ``pytest.param``\ s)."""

    def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
        for argument, cases in builders.items():
            if argument in metafunc.fixturenames:
                metafunc.parametrize(argument, cases(metafunc.config))

    return pytest_generate_tests


def session_ops(config: pytest.Config) -> tuple[str, ...]:
    """The registered kernels of the session's device (``--device``)."""
    return CUDA_OPS if settings_of(config).device == "cuda" else CPU_OPS


def padded_lse_ops(config: pytest.Config) -> tuple[str, ...]:
    """The kernels whose LSE is not plain (batch, heads, seq) on the session's device: the CUDA
    ones themselves on CUDA, their CPU emulations elsewhere."""
    return (
        ("cuda_efficient", "cudnn")
        if settings_of(config).device == "cuda"
        else ("cpu_efficient_layout", "cpu_cudnn_layout")
    )


def tier(config: pytest.Config) -> str:
    return settings_of(config).tier


def world_sizes(
    config: pytest.Config, *, at_most: int | None = None, at_least: int = 1
) -> list[int]:
    """The session's enabled world sizes, optionally bounded."""
    return [
        w
        for w in settings_of(config).world_sizes
        if w >= at_least and (at_most is None or w <= at_most)
    ]


def case_id(case: RingCase, *extra: str) -> str:
    """e.g. ``W4-bf16-causal-alltoall-head_tail-cpu_flash``."""
    parts = [
        f"W{case.world_size}",
        SHORT[case.inputs.dtype],
        "causal" if case.is_causal else "full",
        case.rotate_method,
        case.layout,
    ]
    if case.op:
        parts.append(case.op)
    if case.compile:
        parts.append(case.compile)
    return "-".join([*parts, *extra])


def seed_for(text: str) -> int:
    """A stable per-case seed, so cases differ in data but every run and rank agrees."""
    return zlib.crc32(text.encode()) & 0x7FFFFFFF


def params(cases: Iterable[RingCase], *, id_extra=lambda case: ()) -> list:
    """``pytest.param`` per case with its readable id and a seed derived from the id."""
    out = []
    for case in cases:
        cid = case_id(case, *id_extra(case))
        seeded = case.with_(inputs=case.inputs.with_(seed=seed_for(cid)))
        out.append(pytest.param(seeded, id=cid))
    return out


def drawn(test):
    """``test(ring, ..., data)`` as a Hypothesis property drawing from ``data`` (``st.data()``)
    with the suites' settings: no deadline (a drawn case runs collectives on a rank pool) and the
    function-scoped ``ring`` fixture allowed (it is the same runner for every example). The
    number of examples is the tier's profile's."""
    return settings(
        deadline=None,
        suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
    )(given(data=st.data())(test))


def draw_world_size(data, config: pytest.Config, **bounds: int | None) -> int:
    """A Hypothesis draw (``data``: ``st.data()``, labelled ``world_size``) of one of the
    session's enabled world sizes (``bounds``: :func:`world_sizes`' ``at_most`` / ``at_least``);
    the property is skipped, saying why, when none is enabled."""
    sizes = world_sizes(config, **bounds)
    if not sizes:
        low, high = bounds.get("at_least"), bounds.get("at_most")
        within = "" if low is None and high is None else f" in {low or 1}..{high or 'any'}"
        pytest.skip(f"no world size{within} is enabled (--world-sizes); the property needs one")
    return data.draw(st.sampled_from(sizes), label="world_size")


def draw_inputs(
    data,
    caps,
    seq: int,
    *,
    dtype: str | None = None,
    dtypes: Sequence[str] = ("float64", "float32"),
    heads_kv: int | None = None,
    most_kv: int = 2,
    batch: int | None = None,
    head_dims: Sequence[int] = (8, 16),
) -> InputSpec:
    """Self-attention inputs of ``seq`` tokens for a Hypothesis property (``data``:
    ``st.data()``), drawn in this order and labelled: ``heads_kv`` key/value heads (unless given:
    1 to ``most_kv``), a GQA group of 1 or 2 query heads each where the implementation (``caps``)
    claims ``gqa``, the batch (unless given: 1 or 2), the head dim (of ``head_dims``) and the dtype
    (unless given: of ``dtypes``, those the implementation claims; float64 when it claims none)."""
    if heads_kv is None:
        heads_kv = data.draw(st.integers(1, most_kv), label="heads_kv")
    group = data.draw(st.integers(1, 2), label="gqa_group") if caps.claims("gqa") else 1
    if batch is None:
        batch = data.draw(st.integers(1, 2), label="batch")
    head_dim = data.draw(st.sampled_from(tuple(head_dims)), label="head_dim")
    if dtype is None:
        claimed = [d for d in dtypes if caps.claims("dtypes", d)] or ["float64"]
        dtype = data.draw(st.sampled_from(claimed), label="dtype")
    return InputSpec(
        batch=batch,
        heads=heads_kv * group,
        heads_kv=heads_kv,
        seq_q=seq,
        seq_kv=seq,
        head_dim=head_dim,
        dtype=dtype,
    )


def draw_lse_grad(data, caps) -> bool:
    """A Hypothesis draw (labelled ``lse_grad``) of whether the case's loss uses the returned LSE
    too (``InputSpec.lse_grad``); False without a draw where the implementation declares it lacks
    the LSE or its gradient."""
    return bool(
        caps.claims("lse")
        and caps.claims("lse_grad")
        and data.draw(st.booleans(), label="lse_grad")
    )


def draw_claimed(data, caps, capability: str, values, label: str):
    """A Hypothesis draw (``data``: ``st.data()``) of one of ``values`` that the implementation
    claims for ``capability`` (undeclared is claimed); all of ``values`` when it claims none of
    them, so the property still runs and the case is N/A where declared lacking."""
    from hypothesis import strategies as st

    claimed = [v for v in values if caps.claims(capability, v)]
    return data.draw(st.sampled_from(claimed or list(values)), label=label)
