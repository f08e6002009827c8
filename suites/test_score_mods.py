"""Score modifications under context parallelism: logit soft-capping (Gemma), ALiBi (signed and
symmetric, slopes on the distance of *global* positions), a post-scale bias on the global
sequence and a flex-style ``score_mod(score, b, h, q_idx, kv_idx)`` reading the score, the head
and both positions; alone, with ``is_causal`` and with a mask of the mask suite, with sinks;
every rotation, both built-in layouts, W 1, 2 and 4 (nightly: every enabled world size and
dtype), float64/float32/bfloat16, GQA; ALiBi and the function under Ulysses and the hybrid on
the 4-rank meshes (capability ``strategies``). Judged against the float64 oracle with the same
score_mod (reference.score_mods, written apart from ring_impl) by the numerics policy, the
baseline being the same kernel with the score_mod on one device. A Hypothesis property draws the
score_mod and its parameter (the soft-cap, per-head ALiBi slopes, the bias's scale) with the world
size, layout, rotation, float64/float32, GQA, batch, head dim, length, mask and sinks.

Failures name the bug classes the output points at: a soft-cap (any score_mod) not applied in
the blocks (the output is attention without it: applied after the merge, or not at all), a
score_mod evaluated at local row indices instead of global positions.

Capability ``score_mod`` (undeclared claims it); ``lse`` (the LSE is judged), ``masks`` and
``sinks`` for the cases that use them.
"""

from __future__ import annotations

import itertools
from typing import Any

import pytest
from hypothesis import strategies as st

from harness.pytest_plugin import settings_of
from suites.cases_score_mods import (
    SCORE_MOD_NAMES,
    ScoreModCase,
    diagnose_scored,
    judge_scored,
    scored_case,
)
from suites.inputs import InputSpec
from suites.matrix import (
    LAYOUTS,
    ROTATIONS,
    draw_claimed,
    draw_world_size,
    drawn,
    generate,
    params,
    seed_for,
    tier,
    world_sizes,
)
from suites.meshes import STRATEGY_MESHES

#: Masks the cases cycle through: none, is_causal (the kernel's causal blocks), a mask of
#: documents and a window (masked blocks, rows that see nothing).
_MASKS = ("", "causal", "documents_window")


def _cases(config) -> list:
    nightly = tier(config) == "nightly"
    sizes = world_sizes(config) if nightly else world_sizes(config, at_most=4)
    dtypes = ("float64", "float32", "bfloat16")
    out = []
    for i, (name, w, layout) in enumerate(itertools.product(SCORE_MOD_NAMES, sizes, LAYOUTS)):
        chosen = dtypes if nightly else (dtypes[i % 3],)
        for j, dtype in enumerate(chosen):
            mask = _MASKS[(i + j) % 3]
            if (
                name == "alibi_symmetric" and mask
            ):  # symmetric ALiBi is for attention that sees both ways
                mask = ""
            spec = InputSpec.per_rank(
                w,
                rows=24,
                batch=2 if (i + j) % 4 == 1 else 1,
                heads_kv=2 if (i + j) % 2 else 4,
                dtype=dtype,
                lse_grad=(i // 2 + j) % 2 == 1,  # the loss uses the LSE too
                noncontiguous=(i + j) % 3 == 2,  # a (batch, seq, heads, dim) model's views
            )
            out.append(
                ScoreModCase(
                    spec,
                    w,
                    is_causal=mask == "causal",
                    layout=layout,
                    rotate_method=ROTATIONS[(i // 2 + j) % 3],
                    score_mod=name,
                    mask="" if mask == "causal" else mask,
                    sinks=(i + j) % 5 == 0,
                )
            )
    out += _strategy_cases(config)
    return params(
        out,
        id_extra=lambda c: (
            *((c.strategy, f"{c.mesh_shape[0]}x{c.mesh_shape[1]}") if c.mesh_shape else ()),
            c.score_mod,
            *((c.mask,) if c.mask else ()),
            *(("sinks",) if c.sinks else ()),
            *(("lse-grad",) if c.inputs.lse_grad else ()),
            *(("bshd-views",) if c.inputs.noncontiguous else ()),
        ),
    )


def _strategy_cases(config) -> list[ScoreModCase]:
    """ALiBi (slopes of each rank's global heads) and the flex-style function (the head and both
    positions) under Ulysses and the hybrid on 4 ranks, GQA with fewer key/value heads than the
    Ulysses degree; the layout, causality and dtype turned per case."""
    if 4 not in settings_of(config).mesh_world_sizes:
        return []
    out = []
    for i, ((strategy, mesh), name) in enumerate(
        itertools.product(STRATEGY_MESHES, ("alibi", "callable"))
    ):
        spec = InputSpec(
            batch=1,
            heads=4,
            heads_kv=2,
            seq_q=64,
            seq_kv=64,
            head_dim=16,
            dtype=("float64", "float32")[i % 2],
            lse_grad=i % 4 < 2,
        )
        out.append(
            ScoreModCase(
                spec,
                4,
                is_causal=i % 3 != 1,
                layout=LAYOUTS[(i // 2 + i) % 2],
                rotate_method=ROTATIONS[i % 3],
                score_mod=name,
                strategy=strategy,
                mesh_shape=mesh,
                sinks=i == 2,
            )
        )
    return out


pytest_generate_tests = generate(case=_cases)


def _prepare(ring, case: ScoreModCase) -> ScoreModCase:
    __tracebackhide__ = True
    op = ring.record_case(case)
    ring.require("score_mod", why=f"score_mod {case.score_mod!r}")
    ring.require("lse", why="the LSE of the modified scores is part of the contract")
    if case.mask:
        for kind in ("and", "document", "sliding_window"):
            ring.require("masks", kind, why=f"mask {case.mask!r}")
    if case.sinks:
        ring.require("sinks")
    ring.require_exchange(case)
    ring.require("backward")
    if isinstance(op, str) and ":" not in op and op != "auto":
        from conformance.kernels import kernel_computes_scores

        if not kernel_computes_scores(op):
            pytest.skip(
                f"the session's op {op!r} declares no OpCapabilities.score_mod (a fused kernel "
                "computes no "
                "explicit scores); the score_mod cases run with --op math or without --op"
            )
    ring.require_inputs(case, op)
    return ring.loss_of(case).with_(impl=ring.impl.spec, op=op)


def _run_and_judge(ring, case: ScoreModCase) -> None:
    __tracebackhide__ = True
    ring.judged(case, scored_case, judge_scored, diagnose_scored)


def test_score_mod_matches_reference(ring, case: ScoreModCase) -> None:
    """out, LSE, dQ, dK, dV (and dSinks) with the score_mod against the float64 oracle."""
    case = _prepare(ring, case)
    assert case.score_mod in SCORE_MOD_NAMES
    _run_and_judge(ring, case)


def _params(data, name: str, heads: int) -> tuple[tuple[str, Any], ...]:
    """The drawn parameter of score_mod ``name`` (ScoreModCase.params): a soft-cap from well
    below the logits' size to well above, per-head ALiBi slopes (zero included), the post-scale
    bias times 0..4; the flex-style function has none."""
    finite = dict(allow_nan=False, allow_infinity=False)
    if name == "softcap":
        return (("cap", data.draw(st.floats(0.1, 8.0, **finite), label="cap")),)
    if name in ("alibi", "alibi_symmetric"):
        slopes = st.lists(st.floats(0.0, 4.0, **finite), min_size=heads, max_size=heads)
        return (("slopes", tuple(data.draw(slopes, label="slopes"))),)
    if name == "bias":
        return (("bias_scale", data.draw(st.floats(0.0, 4.0, **finite), label="bias_scale")),)
    return ()


@drawn
def test_any_score_mod_matches_reference(ring, pytestconfig, data) -> None:
    """A drawn score_mod and its parameter (soft-cap, ALiBi slopes, post-scale bias scale, the
    flex-style function) with a drawn world size, layout, rotation, float64/float32, GQA, mask
    (none, is_causal, documents with a window) and sinks: judged as the named cases."""
    caps = ring.caps
    nightly = tier(pytestconfig) == "nightly"
    w = draw_world_size(data, pytestconfig, at_most=None if nightly else 4)
    layout = draw_claimed(data, caps, "layouts", LAYOUTS, "layout")
    rotate = draw_claimed(data, caps, "rotate_methods", ROTATIONS, "rotate_method")
    name = data.draw(st.sampled_from(SCORE_MOD_NAMES), label="score_mod")
    heads_kv = data.draw(st.integers(1, 2), label="heads_kv")
    group = data.draw(st.integers(1, 2), label="gqa_group") if caps.claims("gqa") else 1
    params = _params(data, name, heads_kv * group)
    step = 2 if layout == "head_tail" else 1
    seq = data.draw(st.integers(2, 12), label="tokens_per_rank") * step * w
    # The named mask of documents needs room for its five documents; symmetric ALiBi is for
    # attention that sees both ways (as the named cases).
    masks = [""]
    if name != "alibi_symmetric":
        masks.append("causal")
        if seq >= 24 and all(
            caps.claims("masks", k) for k in ("and", "document", "sliding_window")
        ):
            masks.append("documents_window")
    mask = data.draw(st.sampled_from(masks), label="mask")
    dtypes = [d for d in ("float64", "float32") if caps.claims("dtypes", d)] or ["float64"]
    spec = InputSpec(
        batch=data.draw(st.integers(1, 2), label="batch"),
        heads=heads_kv * group,
        heads_kv=heads_kv,
        seq_q=seq,
        seq_kv=seq,
        head_dim=data.draw(st.sampled_from((8, 16)), label="head_dim"),
        dtype=data.draw(st.sampled_from(dtypes), label="dtype"),
    )
    sinks = caps.claims("sinks") and data.draw(st.booleans(), label="sinks")
    case = ScoreModCase(
        spec.with_(seed=seed_for(f"{spec!r} {name} {params}")),
        w,
        is_causal=mask == "causal",
        layout=layout,
        rotate_method=rotate,
        score_mod=name,
        mask="" if mask == "causal" else mask,
        sinks=sinks,
        params=params,
    )
    _run_and_judge(ring, _prepare(ring, case))
