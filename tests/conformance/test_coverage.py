"""The quick tier's cases are a pairwise selection of the nightly tier's product (suites.coverage).

Two levels, both exact: the selector itself (every value of every axis and every pair of values
of two axes that the product holds is in the selection, and nothing outside the product is), and
the suites' matrices built by their real case builders for both tiers: each quick case is also a
nightly case (by test id), and the quick cases cover every value and pair of values of the
matrix's quick axes that the nightly product holds. The quick counts are pinned: the selection is
deterministic, so a change to an axis shows here with its new size.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import pytest

from harness.pytest_plugin import SETTINGS_KEY
from harness.settings import DEFAULT_WORLD_SIZES, HarnessSettings
from suites import (
    meshes,
    test_collectives,
    test_lse_layouts,
    test_masks,
    test_replicated_kv,
    test_shapes,
)
from suites.cases_balance import BALANCER_LAYOUTS
from suites.cases_masks import MASK_NAMES
from suites.coverage import combos, pairs_of, pairwise, uncovered
from suites.matrix import CPU_OPS, DTYPES, LAYOUTS, ROTATIONS

# ---------------------------------------------------------------------- the selector

AXES = {
    "one axis": ((1, 2, 3),),
    "two axes": ((1, 2, 3), "abcd"),
    "ring matrix": ((1, 2, 3, 4), DTYPES, (False, True), ROTATIONS, LAYOUTS),
    "uneven sizes": (range(7), range(2), range(5), range(3), range(2), range(2), range(4)),
}


@pytest.mark.parametrize("name", sorted(AXES))
def test_pairwise_covers_every_value_and_pair(name: str) -> None:
    axes = AXES[name]
    product = list(itertools.product(*axes))
    rows = pairwise(*axes)
    assert set(rows) <= set(product)
    assert len(rows) == len(set(rows)), "a row selected twice"
    assert uncovered(rows, product) == set()
    # the two largest axes bound it from below: every pair of their values is a row
    big = sorted(len(a) for a in axes)[-2:]
    assert len(rows) >= (big[0] * big[1] if len(axes) > 1 else big[0])
    assert rows == sorted(rows, key=product.index), "rows come in the product's order"
    assert pairwise(*axes) == rows, "the selection is deterministic"


def test_pairwise_is_smaller_than_the_product() -> None:
    axes = AXES["ring matrix"]
    assert len(pairwise(*axes)) == 16 < len(list(itertools.product(*axes))) == 192


def test_pairwise_covers_only_what_the_filtered_product_holds() -> None:
    axes = ((1, 2, 3, 4), ("contiguous", "head_tail", "work_aware"), ROTATIONS)
    where = lambda w, layout, rotate: w > 1 or layout != "work_aware"  # noqa: E731
    allowed = [r for r in itertools.product(*axes) if where(*r)]
    rows = pairwise(*axes, where=where)
    assert set(rows) <= set(allowed)
    assert uncovered(rows, allowed) == set()
    assert ((0, 1), (1, "work_aware")) not in set().union(*map(pairs_of, rows))


def test_pairwise_keeps_the_rows_asked_for() -> None:
    axes = AXES["ring matrix"]
    keep = [
        (3, "float16", True, "p2p", "head_tail"),
        (1, "float64", False, "allgather", "contiguous"),
    ]
    rows = pairwise(*axes, keep=keep)
    assert set(keep) <= set(rows)
    assert uncovered(rows, itertools.product(*axes)) == set()
    # a value the axes lack (a world size the session leaves out): nothing to keep
    assert pairwise(*axes, keep=[(5, "float16", True, "p2p", "head_tail")]) == pairwise(*axes)
    with pytest.raises(ValueError, match="`where` refuses"):
        pairwise(*axes, where=lambda w, *_: w > 1, keep=keep)


class _Config:
    """What a suite's case builder reads of a pytest config: the session's settings (real
    :class:`HarnessSettings`: the tier's defaults, or the world sizes ``--world-sizes`` gives)."""

    def __init__(self, tier: str, world_sizes: tuple[int, ...] | None = None) -> None:
        settings = HarnessSettings(
            tier=tier,
            world_sizes=world_sizes or DEFAULT_WORLD_SIZES[tier],
            sources={"world_sizes": "--world-sizes"} if world_sizes else {},
        )
        self.stash = {SETTINGS_KEY: settings}


QUICK, NIGHTLY = _Config("quick"), _Config("nightly")


def test_combos_is_the_product_nightly_and_pairwise_quick() -> None:
    axes = AXES["uneven sizes"]
    assert combos(NIGHTLY, *axes) == list(itertools.product(*axes))
    assert combos(QUICK, *axes) == pairwise(*axes)


# ---------------------------------------------------------------------- the suites' matrices

QUICK_W = DEFAULT_WORLD_SIZES["quick"]
FT = (False, True)


@dataclass(frozen=True)
class Matrix:
    """One suite matrix: its builder, which of the builder's cases are the matrix's (``part``),
    a case's row of axis values (``row``), the quick tier's axes and its pinned size."""

    build: Callable[[Any], list]
    row: Callable[[Any], tuple]
    axes: Sequence[Sequence[Any]]
    quick_count: int
    part: Callable[[Any], bool] = lambda case: True


def _kv(case) -> str:
    _, kvs = meshes.heads_of(case.mesh_shape[0])
    return next(name for name, n in kvs.items() if n == case.inputs.heads_kv)


def _strategy_row(case) -> tuple:
    return (
        (case.strategy, case.mesh_shape),
        case.inputs.dtype,
        (case.layout, case.is_causal),
        _kv(case),
        case.rotate_method,
    )


def _plain_strategy_case(case) -> bool:
    s = case.inputs
    return (
        case.op is None and s.seq_q == s.seq_kv and not s.noncontiguous and not s.strided_head_dim
    )


MATRICES = {
    "strategies": Matrix(
        meshes.reference_cases,
        _strategy_row,
        (
            meshes.MESHES[4] + meshes.MESHES[6],
            ("float64", "float32", "bfloat16"),
            meshes.LAYOUT_CAUSAL,
            ("mha", "gqa", "mqa"),
            ROTATIONS,
        ),
        21,
        part=_plain_strategy_case,
    ),
    "collectives": Matrix(
        test_collectives._cases,
        lambda c: (
            c.world_size,
            c.rotate_method,
            c.layout,
            c.is_causal,
            (c.inputs.dtype, c.inputs.heads_kv),
        ),
        (QUICK_W, ROTATIONS, LAYOUTS, FT, (("float32", 4), ("bfloat16", 2))),
        13,
        part=lambda c: c.inputs.head_dim_v is None,
    ),
    "lse_layouts": Matrix(
        test_lse_layouts._cases,
        lambda c: (c.op, c.world_size, c.inputs.dtype, c.is_causal, c.layout),
        (CPU_OPS, (2, 3), ("float32", "bfloat16"), FT, LAYOUTS),
        9,
        part=lambda c: c.inputs.heads_kv == 2,
    ),
    "masks": Matrix(
        test_masks._cases,
        lambda c: (
            c.mask,
            c.world_size,
            c.layout,
            c.inputs.dtype,
            c.rotate_method,
            c.inputs.heads_kv,
            c.sinks,
        ),
        (
            MASK_NAMES,
            QUICK_W,
            (*LAYOUTS, *BALANCER_LAYOUTS),
            ("float64", "float32", "bfloat16"),
            ROTATIONS,
            (4, 2),
            FT,
        ),
        55,
        part=lambda c: (
            c.mesh_shape is None
            and c.compile is None
            and not c.refill
            and c.inputs.scale is None
            and c.inputs.head_dim_v is None
        ),
    ),
    "replicated_kv": Matrix(
        test_replicated_kv._cases,
        lambda c: (
            c.world_size,
            c.layout,
            c.inputs.dtype,
            c.inputs.heads_kv,
            c.inputs.seq_kv,
            c.sinks,
        ),
        (
            (2, 3, 4),
            LAYOUTS,
            test_replicated_kv.DTYPES,
            test_replicated_kv.HEADS_KV,
            test_replicated_kv.SEQ_KV,
            FT,
        ),
        14,
        # (value's own head dim and the masked cases are added beside the matrix)
        part=lambda c: c.inputs.head_dim_v is None and c.mask is None,
    ),
    "shapes gqa": Matrix(
        test_shapes._gqa,
        lambda c: (c.world_size, (c.inputs.heads, c.inputs.heads_kv), c.is_causal, c.rotate_method),
        ((2, 3, 4), ((8, 4), (8, 2), (8, 1)), FT, ROTATIONS),
        11,
    ),
    "shapes cross": Matrix(
        test_shapes._cross,
        lambda c: (
            c.world_size,
            (c.inputs.seq_q // c.world_size, c.inputs.seq_kv // c.world_size),
            c.layout,
            c.rotate_method,
        ),
        ((2, 3, 4), ((8, 24), (24, 8), (2, 16)), LAYOUTS, ROTATIONS),
        11,
    ),
    "shapes bshd views": Matrix(
        test_shapes._noncontiguous,
        lambda c: (c.world_size, c.is_causal, c.rotate_method, c.inputs.dtype),
        ((2, 3, 4), FT, ROTATIONS, ("float32", "bfloat16")),
        11,
        part=lambda c: not c.inputs.strided_head_dim,
    ),
    "shapes strided head dim": Matrix(
        test_shapes._noncontiguous,
        lambda c: (c.world_size, c.is_causal, c.inputs.dtype),
        (QUICK_W, FT, ("float64", "float32")),
        8,
        part=lambda c: c.inputs.strided_head_dim,
    ),
    "shapes large logits": Matrix(
        test_shapes._large_logits,
        lambda c: (c.world_size, c.is_causal, c.inputs.dtype, c.inputs.magnitude),
        ((2, 3, 4), FT, ("float64", "float32", "bfloat16"), (30.0, 300.0)),
        11,
    ),
    "shapes odd sizes": Matrix(
        test_shapes._odd_sizes,
        lambda c: (c.world_size, c.inputs.head_dim, c.inputs.seq_q // c.world_size, c.is_causal),
        ((2, 3), (8, 24, 64, 128), (1, 3, 5), FT),
        13,
    ),
}


def _built(matrix: Matrix, config: _Config) -> tuple[dict[str, Any], list[tuple]]:
    """The matrix's cases that the builder makes for a tier, by id, and their rows."""
    params = [p for p in matrix.build(config) if matrix.part(p.values[0])]
    return {p.id: p.values[0] for p in params}, [matrix.row(p.values[0]) for p in params]


@pytest.mark.parametrize("name", sorted(MATRICES))
def test_quick_matrix_is_a_pairwise_selection_of_the_nightly_product(name: str) -> None:
    matrix = MATRICES[name]
    quick_cases, quick = _built(matrix, QUICK)
    nightly_cases, nightly = _built(matrix, NIGHTLY)
    # each quick case is the very nightly case of its id (shapes, seed and all)
    lost = {i for i, case in quick_cases.items() if nightly_cases.get(i) != case}
    assert not lost, f"quick cases the nightly tier lacks or runs otherwise: {sorted(lost)}"
    # The quick axes' product as the nightly tier holds it (its filters included).
    universe = [r for r in itertools.product(*matrix.axes) if r in set(nightly)]
    assert len(set(universe)) == len(universe)
    assert set(quick) <= set(universe), set(quick) - set(universe)
    missing = uncovered(quick, universe)
    assert len(missing) == 0, f"values and pairs the quick tier does not cover: {sorted(missing)}"
    assert len(quick) == len(set(quick)) == matrix.quick_count
    assert len(quick) < len(universe)


@pytest.mark.parametrize("world_sizes", [None, (2,)], ids=["default", "W2"])
def test_cases_other_tests_select_by_id_stay_in_the_quick_tier(world_sizes) -> None:
    """tests/conformance/test_protocol.py, test_report.py and tests/packaging select these
    collective cases by id, at the default world sizes and at ``--world-sizes 2``."""
    ids = {p.id for p in test_collectives._cases(_Config("quick", world_sizes))}
    assert {
        "W2-f32-causal-alltoall-contiguous-hkv4",
        "W2-f32-causal-allgather-contiguous-hkv4",
    } <= ids
