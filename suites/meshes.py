"""The strategy axis of the capability suites: Ulysses and the hybrid (Ulysses x ring on a 2-D
mesh) on meshes ``U x R`` (Ulysses degree x ring degree), as cases of the forward/backward,
collectives, compile and bad-input suites.

Meshes: quick W=4 (``ulysses`` 4; ``hybrid`` 4x1, 2x2, 1x4) and W=6 (``ulysses`` 6; ``hybrid``
2x3, 3x2); nightly adds W=8 (8x1, 2x4, 4x2) and W=16 (4x4, 2x8); ``--world-sizes 32,64`` (the
simulated tier, ``--launcher simulated``) W=32 (8x4, 4x8) and W=64 (8x8). The world sizes are the
session's mesh world sizes (``harness.settings.DEFAULT_MESH_WORLD_SIZES``, or ``--world-sizes``
when given). Key/value heads: as many as the query heads (MHA), fewer than the Ulysses degree
(GQA, each head replicated; a replication order error shows only with two or more of them), one
(MQA). Causal and not, both layouts, float64 / float32 / bfloat16, every rotation of the hybrid's
ring, the LSE's gradient, every CPU op (their LSE layouts), cross-attention lengths and
non-contiguous inputs. On the meshes of up to 6 ranks the nightly tier runs the product of mesh,
dtype, layout and causal, key/value heads and rotation; the quick tier a pairwise selection of it
(suites.coverage: every value and every pair of values of two axes).

The axis's cases by suite: :func:`reference_cases` (forward/backward), :func:`collectives_cases`,
:func:`compile_cases`, :func:`bad_input_cases`, :func:`kernel_cases` (LSE layouts),
:func:`cross_cases` and :func:`noncontiguous_cases` (shapes). Each runs where the suite's own
ring cases run first, so a ring bug is named by the ring's diagnosis before a strategy case
meets it.

A case is a :class:`suites.cases.RingCase` with ``strategy`` and ``mesh_shape``; its id starts
with the strategy (``hybrid-2x2-bf16-causal-head_tail-gqa-p2p``), so ``-k "ulysses or hybrid"``
selects the axis. Judged by :func:`suites.judge.judge` (the policy of every ring case;
``world_size`` = the ring degree): a failure names the replayed strategy bug it matches (local
attention only, key/value heads in the wrong order, the all-to-all on the wrong dim, the
head_tail reorder missing), an output whose heads are permuted (head i holds head j's
attention), and an LSE returned in the head-sharded layout instead of the sequence shard.
"""

from __future__ import annotations

import itertools
from typing import Any

import pytest

from harness.pytest_plugin import settings_of
from suites.cases import RingCase
from suites.cases_strategies import BAD_INPUTS
from suites.coverage import combos
from suites.inputs import SHORT, InputSpec
from suites.matrix import LAYOUTS, ROTATIONS, seed_for, session_ops

__all__ = [
    "MESHES",
    "bad_input_cases",
    "collectives_cases",
    "compile_cases",
    "cross_cases",
    "heads_of",
    "kernel_cases",
    "mesh_case",
    "meshes",
    "noncontiguous_cases",
    "reference_cases",
]

#: (strategy, (U, R)) per world size.
MESHES: dict[int, list[tuple[str, tuple[int, int]]]] = {
    4: [("ulysses", (4, 1)), ("hybrid", (4, 1)), ("hybrid", (2, 2)), ("hybrid", (1, 4))],
    6: [("ulysses", (6, 1)), ("hybrid", (2, 3)), ("hybrid", (3, 2))],
    8: [("hybrid", (8, 1)), ("hybrid", (2, 4)), ("hybrid", (4, 2))],
    16: [("hybrid", (4, 4)), ("hybrid", (2, 8))],
    # Only when asked for (--world-sizes 32,64): the simulated tier (--launcher simulated).
    32: [("hybrid", (8, 4)), ("hybrid", (4, 8))],
    64: [("hybrid", (8, 8))],
}
#: One Ulysses and one hybrid mesh of 4 ranks (of :data:`MESHES`): the strategy cases of the mask
#: and score_mod suites, run when the session enables 4-rank meshes.
STRATEGY_MESHES: tuple[tuple[str, tuple[int, int]], ...] = (("ulysses", (4, 1)), ("hybrid", (2, 2)))
#: (layout, causal): non-causal head_tail only where the matrix is full (nightly).
LAYOUT_CAUSAL = (("contiguous", False), ("contiguous", True), ("head_tail", True))


def meshes(config: pytest.Config) -> list[tuple[str, tuple[int, int]]]:
    sizes = settings_of(config).mesh_world_sizes
    return [m for w in sorted(MESHES) if w in sizes for m in MESHES[w]]


def heads_of(u: int) -> tuple[int, dict[str, int]]:
    """Query heads divisible by ``u`` and the key/value head counts: MHA, GQA below the degree
    (two or more heads where the degree allows, so a wrong replication order shows), MQA."""
    heads = 16 if u == 8 else 12
    return heads, {"mha": heads, "gqa": 2 if u > 2 else heads // 2, "mqa": 1}


def spec_for(mesh: tuple[int, int], dtype: str, kv: str, **changes: Any) -> InputSpec:
    """Tiny global inputs: local length 4U (a multiple of U and even; 2U from W=32 on, where the
    float64 oracle of the global sequence is what costs), batch 2 (packing mixes batches if it is
    wrong), head_dim 8."""
    u, r = mesh
    heads, kvs = heads_of(u)
    seq = (4 if u * r <= 16 else 2) * u * u * r
    return InputSpec(
        batch=2, heads=heads, heads_kv=kvs[kv], seq_q=seq, seq_kv=seq, head_dim=8, dtype=dtype
    ).with_(**changes)


def mesh_case(inputs: InputSpec, strategy: str, mesh: tuple[int, int], **options: Any) -> RingCase:
    """A ring case of ``strategy`` on the ``(U, R)`` mesh ``mesh`` (its U * R ranks)."""
    return RingCase(inputs, mesh[0] * mesh[1], strategy=strategy, mesh_shape=mesh, **options)


def case_id(case: RingCase, kv: str, *extra: str) -> str:
    """e.g. ``hybrid-2x2-bf16-causal-head_tail-gqa-p2p``."""
    parts = [
        case.strategy,
        case.mesh,
        SHORT[case.inputs.dtype],
        "causal" if case.is_causal else "full",
        case.layout,
        kv,
    ]
    if case.rotates:
        parts.append(case.rotate_method)
    return "-".join(
        [*parts, *([case.op] if case.op else []), *([case.compile] if case.compile else []), *extra]
    )


def param(case: RingCase, kv: str, *extra: str):
    cid = case_id(case, kv, *extra)
    case = case.with_(inputs=case.inputs.with_(seed=seed_for(cid)))
    marks = [pytest.mark.world_size(n=case.world_size)] + (
        [pytest.mark.compile] if case.compile else []
    )
    return pytest.param(case, id=cid, marks=marks)


def _ring_dim(mesh: tuple[int, int], strategy: str) -> bool:
    """Whether the strategy has a ring dimension (its rotation method matters)."""
    return strategy == "hybrid" and mesh[1] > 1


def reference_cases(config: pytest.Config) -> list:
    nightly = settings_of(config).tier == "nightly"
    out = []
    small = [(s, m) for s, m in meshes(config) if m[0] * m[1] <= 6]
    # Meshes of up to 6 ranks: (mesh, dtype, layout and causal, key/value heads, rotation) with
    # the rotation of a mesh without a ring dimension fixed (it has none to rotate); quick:
    # every value and pair of values (suites.coverage), nightly: the product.
    rows = combos(
        config,
        small,
        ("float64", "float32", "bfloat16"),
        [(lay, c) for lay in LAYOUTS for c in (False, True)] if nightly else LAYOUT_CAUSAL,
        ("mha", "gqa", "mqa"),
        ROTATIONS,
        where=lambda sm, dtype, lc, kv, rotate: _ring_dim(sm[1], sm[0]) or rotate == ROTATIONS[0],
    )
    # Larger meshes (the nightly tier's): the rotation cycled; float64 nightly only.
    dtypes = ("float64", "float32", "bfloat16") if nightly else ("float32", "bfloat16")
    i = 0
    for strategy, mesh in meshes(config):
        if mesh[0] * mesh[1] <= 6:
            continue
        for dtype, lc, kv in itertools.product(dtypes, LAYOUT_CAUSAL, ("mha", "gqa", "mqa")):
            rows.append(((strategy, mesh), dtype, lc, kv, ROTATIONS[i % 3]))
            i += 1
    for (strategy, mesh), dtype, (layout, causal), kv, rotate in rows:
        spec = spec_for(mesh, dtype, kv, lse_grad=dtype == "float64")
        out.append(
            param(
                mesh_case(
                    spec, strategy, mesh, is_causal=causal, layout=layout, rotate_method=rotate
                ),
                kv,
            )
        )
    return out


def _four_rank_meshes(config: pytest.Config) -> list[tuple[str, tuple[int, int]]]:
    return [(s, m) for s, m in meshes(config) if m[0] * m[1] == 4]


def kernel_cases(config: pytest.Config) -> list:
    """The LSE-layout suite's axis: every op of the session device on the 4-rank meshes (their
    LSE layouts reach the strategy's merge)."""
    out = []
    for (strategy, mesh), op in itertools.product(_four_rank_meshes(config), session_ops(config)):
        spec = spec_for(mesh, "float32", "gqa")
        case = mesh_case(
            spec,
            strategy,
            mesh,
            is_causal=True,
            layout="head_tail",
            op=op,
            rotate_method="alltoall",
        )
        out.append(param(case, "gqa"))
    return out


def cross_cases(config: pytest.Config) -> list:
    """The shapes suite's cross-attention axis: key/value half the query length (MQA)."""
    out = []
    for strategy, mesh in _four_rank_meshes(config):
        cross = spec_for(mesh, "float32", "mqa")
        cross = cross.with_(seq_kv=cross.seq_kv // 2)
        out.append(param(mesh_case(cross, strategy, mesh, rotate_method="p2p"), "mqa", "cross"))
    return out


def noncontiguous_cases(config: pytest.Config) -> list:
    """The shapes suite's memory-layout axis: shards as transposed (batch, seq, heads, dim)
    views, and as every other element of a head dim twice as wide (NaN between)."""
    out = []
    for strategy, mesh in _four_rank_meshes(config):
        nc = spec_for(mesh, "float32", "gqa", noncontiguous=True)
        case = mesh_case(nc, strategy, mesh, is_causal=True, layout="head_tail")
        out.append(param(case, "gqa", "noncontig"))
        st = spec_for(mesh, "float64", "gqa", strided_head_dim=True)
        case = mesh_case(st, strategy, mesh, layout="contiguous", rotate_method="p2p")
        out.append(param(case, "gqa", "strided"))
    return out


def collectives_cases(config: pytest.Config) -> list:
    nightly = settings_of(config).tier == "nightly"
    out = []
    for strategy, mesh in meshes(config):
        for rotate in (
            ROTATIONS
            if _ring_dim(mesh, strategy) and (nightly or mesh[0] * mesh[1] == 4)
            else ("allgather",)
        ):
            for dtype, kv, lse in (("float32", "mha", True), ("bfloat16", "gqa", False)):
                case = mesh_case(
                    spec_for(mesh, dtype, kv),
                    strategy,
                    mesh,
                    is_causal=True,
                    layout="head_tail",
                    rotate_method=rotate,
                    return_lse=lse,
                    account=True,
                )
                out.append(param(case, kv, "lse" if lse else "nolse"))
    return out


def compile_cases(config: pytest.Config) -> list:
    nightly = settings_of(config).tier == "nightly"
    out = []
    for strategy, mesh in meshes(config):
        if mesh[0] * mesh[1] != 4 or (not nightly and mesh not in ((4, 1), (2, 2))):
            continue
        backends = ("aot_eager", "inductor") if nightly else ("aot_eager",)
        for backend, (layout, causal) in itertools.product(
            backends, (("head_tail", True), ("contiguous", False))
        ):
            spec = spec_for(mesh, "float32", "gqa")
            options = dict(is_causal=causal, layout=layout, rotate_method="alltoall")
            out.append(param(mesh_case(spec, strategy, mesh, compile=backend, **options), "gqa"))
    return out


def bad_input_cases(config: pytest.Config) -> list:
    out = []
    for strategy, mesh in meshes(config):
        if (
            mesh[0] == 1
            or mesh[0] * mesh[1] not in (4, 6)
            or (strategy, mesh) == ("hybrid", (4, 1))
        ):
            # Ulysses 4, 6 and the hybrids 2x2, 2x3, 3x2: a degree > 1 in each dim that has one
            continue
        for kind, (_, applies) in sorted(BAD_INPUTS.items()):
            if strategy not in applies or (
                kind == "head_tail_odd_rows" and strategy == "hybrid" and mesh[0] % 2 == 0
            ):
                continue  # an even number of pieces always makes a row of even length
            out.append(
                pytest.param(
                    (strategy, mesh, kind),
                    id=f"{strategy}-{mesh[0]}x{mesh[1]}-{kind}",
                    marks=[pytest.mark.world_size(n=mesh[0] * mesh[1])],
                )
            )
    return out
