"""Model integration through the parallel style and context_parallel: outputs and parameter
gradients (after the all-reduce a CP training step needs) equal the unsharded model's."""

from __future__ import annotations

import pytest

from suites import cases_api
from suites.judge import judge_float64_model
from suites.matrix import world_sizes

# context_parallel patches F.scaled_dot_product_attention, a module attribute of the rank's process.
pytestmark = pytest.mark.process_state


def pytest_generate_tests(metafunc):
    if "w" in metafunc.fixturenames:
        metafunc.parametrize(
            "w", [pytest.param(w, id=f"W{w}") for w in world_sizes(metafunc.config, at_least=2)]
        )


def _judge_model(results, what: str, tokens: int) -> None:
    """Every rank's output and parameter gradients (after the all-reduce) against the unsharded
    float64 model's (:func:`suites.judge.judge_float64_model`)."""
    __tracebackhide__ = True
    for rank, r in enumerate(results):
        judge_float64_model(rank, "out", r["out"], r["ref_out"], what, tokens)
        assert r["grads"].keys() == r["ref_grads"].keys(), (
            f"rank {rank}: parameters without gradients differ"
        )
        for name, g in r["grads"].items():
            judge_float64_model(rank, f"grad {name}", g, r["ref_grads"][name], what, tokens)


@pytest.mark.parametrize("layout", ["contiguous", "head_tail"])
def test_transformer_encoder_with_parallel_style(ring, w: int, layout: str) -> None:
    ring.require("context_parallel", why="ContextParallel parallel style")
    results = ring.rank_pool(w).run(
        cases_api.encoder_case, ring.impl.spec, layout, timeout=ring.timeout
    )
    _judge_model(
        results,
        f"nn.TransformerEncoder, ContextParallel(layout={layout}), W={w}",
        tokens=results[0]["ref_out"].shape[:2].numel(),
    )


@pytest.mark.parametrize("layout", ["contiguous", "head_tail"])
def test_llama_like_model_under_context_parallel(ring, w: int, layout: str) -> None:
    ring.require("context_parallel", why="context_parallel API")
    results = ring.rank_pool(w).run(
        cases_api.llama_case, ring.impl.spec, layout, timeout=ring.timeout
    )
    assert all(r["rope_restored"] for r in results), (
        "RoPE tables were not restored after context_parallel"
    )
    _judge_model(
        results,
        f"Llama-like decoder, context_parallel(layout={layout}), W={w}",
        tokens=results[0]["ref_out"].shape[:2].numel(),
    )
