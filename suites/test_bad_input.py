"""Bad input: every error class raises on every rank with a clear message, never a hang.

A hang would surface as the harness's CaseTimeout with every rank's stack; a rank that returns
normally while another raises fails here with the outcome of each rank. The strategy axis
(:mod:`suites.meshes`): Ulysses and the hybrid's own bad input on their meshes.
"""

from __future__ import annotations

import re

import pytest

from harness.errors import ABORTED, CaseTimeout
from suites import meshes
from suites.cases_errors import BAD_INPUTS, bad_input_case
from suites.cases_strategies import BAD_INPUTS as STRATEGY_BAD_INPUTS
from suites.cases_strategies import MASKED_BAD_INPUTS, strategy_bad_input_case
from suites.matrix import world_sizes

TIMEOUT_S = 30.0


def pytest_generate_tests(metafunc):
    if "bad" in metafunc.fixturenames:
        metafunc.parametrize("bad", meshes.bad_input_cases(metafunc.config))
    if "w" in metafunc.fixturenames:
        sizes = world_sizes(metafunc.config, at_least=2, at_most=4)
        ends = sorted({sizes[0], sizes[-1]}) if sizes else []  # the smallest and largest ring
        metafunc.parametrize("w", [pytest.param(w, id=f"W{w}") for w in ends])


@pytest.mark.parametrize(
    "kind",
    [
        pytest.param(k, marks=[pytest.mark.gpu] if BAD_INPUTS[k][1] == "cuda" else [])
        for k in sorted(BAD_INPUTS)
    ],
)
def test_bad_input_raises_on_every_rank(ring, w: int, kind: str) -> None:
    ring.require("input_errors", why="raises on every rank for bad input")
    pattern, needs = BAD_INPUTS[kind]
    # needs == "cuda": the gpu marker skips the case unless --device cuda, saying how to enable it.
    if needs == "context_parallel":
        ring.require("context_parallel", why="the SDPA route")
    if needs == "ops":
        ring.require("ops", "*", why="selecting an op by name")
    if needs in ("sinks", "score_mod", "packed", "replicated_kv"):
        ring.require(needs, why=f"a {needs} that differs between ranks")
    if needs in ("mask_mod", "document", "sliding_window"):
        ring.require("masks", needs, why=f"a {needs} mask that differs between ranks")
    _assert_every_rank_raises(
        ring,
        kind,
        pattern,
        lambda timeout: ring.rank_pool(w).run_outcomes(
            bad_input_case, ring.impl.spec, kind, timeout=timeout
        ),
    )


def test_strategy_bad_input_raises_on_every_rank(ring, bad) -> None:
    """The strategy axis (:mod:`suites.meshes`): bad input to Ulysses or the hybrid on any rank,
    the same InputError (or TypeError for a wrong group) on every rank, no hang."""
    strategy, mesh, kind = bad
    ring.require("strategies", strategy, why=f"strategy={strategy!r}")
    if kind in MASKED_BAD_INPUTS:
        ring.require("masks", MASKED_BAD_INPUTS[kind], why=f"{strategy} {kind}")
    ring.require("input_errors", why="raises on every rank for bad input")
    pattern, _ = STRATEGY_BAD_INPUTS[kind]
    outcomes = _assert_every_rank_raises(
        ring,
        f"{strategy} {kind}",
        pattern,
        lambda timeout: ring.rank_pool(mesh[0] * mesh[1]).run_outcomes(
            strategy_bad_input_case, ring.impl.spec, strategy, mesh, kind, timeout=timeout
        ),
    )
    # a rank whose input was right may say only that others rejected theirs
    vague = [
        o.rank
        for o in outcomes
        if not re.search(pattern, o.exc_message, re.IGNORECASE)
        and "rejected their input" not in o.exc_message
    ]
    assert not vague, (
        f"{strategy} {kind}: the error of rank(s) {vague} says neither what was wrong "
        f"(/{pattern}/) nor that other ranks rejected their input\n{_summary(outcomes)}"
    )


def _summary(outcomes) -> str:
    return "\n".join(
        f"rank {o.rank}: " + (f"returned {o.value!r}" if o.ok else f"{o.exc_type}: {o.exc_message}")
        for o in outcomes
    )


def _assert_every_rank_raises(ring, kind: str, pattern: str, run_outcomes) -> list:
    """Run ``run_outcomes(timeout)`` (each rank's outcome) and fail unless every rank raised, none
    hung, some rank's error mentions /pattern/ and none is too terse to act on; the outcomes."""
    __tracebackhide__ = True
    timeout = min(TIMEOUT_S, ring.timeout)
    try:
        outcomes = run_outcomes(timeout)
    except CaseTimeout as exc:
        states = ", ".join(
            f"rank {o.rank} {'raised ' + o.exc_type if not o.ok and o.exc_type else o.status}"
            for o in exc.outcomes
        )
        pytest.fail(
            f"{kind}: the ranks hung ({states}) for {timeout:g} s: a rank that rejected its input "
            f"left the others waiting in a collective\nrepro: {ring.repro()}",
            pytrace=False,
        )
    summary = _summary(outcomes)
    waiting = [o.rank for o in outcomes if o.status == ABORTED]  # the harness ended their wait
    if waiting:
        pytest.fail(
            f"{kind}: the ranks hung (rank(s) {waiting} still waiting in a collective after "
            "another rank raised; the harness aborted them): a rank that rejected its input left "
            f"the others waiting\n{summary}\nrepro: {ring.repro()}",
            pytrace=False,
        )
    raised = [o.rank for o in outcomes if not o.ok]
    if not raised:
        pytest.fail(f"{kind}: no rank raised: the bad input was accepted\n{summary}", pytrace=False)
    if len(raised) < len(outcomes):
        pytest.fail(
            f"{kind}: only rank(s) {raised} raised, the others returned\n{summary}", pytrace=False
        )
    assert any(re.search(pattern, o.exc_message, re.IGNORECASE) for o in outcomes), (
        f"{kind}: no rank's error mentions /{pattern}/; errors must say what was wrong\n{summary}"
    )
    for o in outcomes:
        assert len(o.exc_message) >= 20, (
            f"{kind}: rank {o.rank}'s error is too terse to act on: {o.exc_message!r}"
        )
    return outcomes
