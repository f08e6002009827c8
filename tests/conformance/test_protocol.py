"""The implementation protocol as the suites apply it: undeclared is claimed, N/A only for what
is declared lacking, a claimed piece that is missing fails naming it, ``--impl ring_impl``, and
the api_module resolution."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from conformance import implementation
from tests.conformance.subproc import run_pytest


def test_undeclared_is_claimed_and_only_declared_lacking_is_not() -> None:
    caps = implementation.Capabilities(
        layouts=frozenset({"contiguous"}), lse=False, ops=frozenset()
    )
    assert implementation.Capabilities().claims("gqa") and implementation.Capabilities().claims(
        "layouts", "head_tail"
    )
    assert caps.claims("layouts", "contiguous") and not caps.claims("layouts", "head_tail")
    assert not caps.claims("lse") and not caps.claims("ops", "*") and caps.claims("compile")
    assert caps.declares("compile") is None and caps.declares("lse") is False
    assert (
        caps.lacking("layouts", "head_tail")
        == "declares capabilities.layouts=['contiguous'], without 'head_tail'"
    )
    assert caps.lacking("lse") == "declares capabilities.lse=False" and caps.lacking("gqa") == ""
    assert implementation.Capabilities(ops=frozenset({"*"})).claims("ops", "cpu_flash")


def test_impl_ring_impl_means_the_default_implementation() -> None:
    impl = implementation.load_implementation("ring_impl")
    assert (
        impl.spec == implementation.DEFAULT_IMPL_SPEC
        and impl is implementation.load_implementation(implementation.DEFAULT_IMPL_SPEC)
    )
    # A module named alone stands for its IMPLEMENTATION when it has one.
    assert (
        implementation.load_implementation("conformance.adapters.torch_cp").spec
        == "conformance.adapters.torch_cp:IMPLEMENTATION"
    )
    with pytest.raises(implementation.ImplSpecError, match="has no callable ring_attention"):
        implementation.load_implementation("tests.conformance")


def test_missing_protocol_pieces_are_named() -> None:
    bare = implementation.load_implementation("tests.conformance.undeclared_impl:IMPLEMENTATION")
    for capability, attribute in (
        ("collective_schedule", "collective_schedule"),
        ("record_steps", "record_steps"),
        ("context_parallel", "api_module"),
    ):
        message = bare.missing(capability)
        assert f"has no {attribute}" in message and f"capabilities.{capability}=False" in message, (
            message
        )
    with pytest.raises(implementation.ProtocolError, match="has no api_module"):
        bare.api_module()


def test_api_module_resolution() -> None:
    import ring_impl

    assert implementation.load_implementation().api_module() is ring_impl

    class Declared:
        name = "declared"
        ring_attention = staticmethod(ring_impl.ring_attention)
        capabilities = implementation.Capabilities(context_parallel=False)

    class WrongModule(Declared):
        capabilities = implementation.Capabilities()
        api_module = "conformance.report"  # importable, but offers no context_parallel

    class Unimportable(Declared):
        capabilities = implementation.Capabilities()
        api_module = "no_such_package.api"

    with pytest.raises(
        implementation.ProtocolError, match=r"declares capabilities.context_parallel=False"
    ):
        implementation.Implementation("x:Declared", Declared()).api_module()
    with pytest.raises(
        implementation.ProtocolError,
        match=r"lacks \['context_parallel', 'context_parallel_unshard', 'ContextParallel'\]",
    ):
        implementation.Implementation("x:WrongModule", WrongModule()).api_module()
    with pytest.raises(implementation.ProtocolError, match="cannot be imported"):
        implementation.Implementation("x:Unimportable", Unimportable()).api_module()


def test_bare_implementation_is_tested_and_missing_pieces_fail(tmp_path: Path) -> None:
    """An object with ring_attention only: nothing is N/A; the cases that need a piece it lacks
    fail naming the attribute; the others run and pass."""
    proc = run_pytest(
        "suites/test_forward_backward.py",
        "suites/test_collectives.py",
        "suites/test_causal_layouts.py",
        "suites/test_context_parallel.py",
        "-q",
        "--world-sizes",
        "2",
        "-k",
        "W2-f32-causal-alltoall-contiguous or test_exception_inside or "
        "W2-f64-causal-allgather-contiguous",
        "--impl",
        "tests.conformance.undeclared_impl:IMPLEMENTATION",
        "--report-dir",
        str(tmp_path),
    )
    assert proc.returncode == 1, proc.stdout[-4000:]
    doc = json.loads((tmp_path / "conformance.json").read_text())
    outcomes = {c["nodeid"].split("::")[-1]: (c["outcome"], c["message"]) for c in doc["cases"]}
    assert doc["counts"]["n/a"] == 0, outcomes
    assert (
        outcomes["test_forward_backward_match_reference[W2-f32-causal-alltoall-contiguous]"][0]
        == "passed"
    )
    for test, attribute in (
        (
            "test_collectives_match_declared_schedule[W2-f32-causal-alltoall-contiguous-hkv4]",
            "collective_schedule",
        ),
        ("test_exception_inside_restores_buffers_and_sdpa[W2]", "api_module"),
    ):
        outcome, message = outcomes[test]
        assert outcome == "failed" and f"has no {attribute}" in message, (test, outcome, message)
    outcome, message = outcomes[
        "test_every_ring_step_matches_the_simulation[W2-f64-causal-allgather-contiguous]"
    ]
    assert outcome == "failed" and "has no record_steps" in message, (outcome, message)
    assert (
        outcomes["test_work_per_rank_is_minimal_and_balanced[W2-f64-causal-allgather-contiguous]"][
            0
        ]
        == "passed"
    )


def test_all_na_run_exits_nonzero_saying_why(tmp_path: Path) -> None:
    proc = run_pytest(
        "suites/test_forward_backward.py",
        "-q",
        "--world-sizes",
        "2",
        "-k",
        "W2-bf16 and allgather",
        "--impl",
        "tests.conformance.minimal_impl:IMPLEMENTATION",
        "--report-dir",
        "none",
    )
    assert proc.returncode == 1, proc.stdout[-3000:]
    assert (
        "no conformance case was executed; of 54 suite cases 4 N/A, 0 skipped, 50 deselected by "
        "-k/-m" in proc.stdout
    )
    assert "the implementation declares it lacks what those cases need" in proc.stdout


def test_all_skipped_and_all_deselected_runs_exit_nonzero(tmp_path: Path) -> None:
    # --world-sizes 1: test_rotation generates no case at W >= 2, so its one item is skipped
    skipped = run_pytest(
        "suites/test_rotation.py", "-q", "--world-sizes", "1", "--report-dir", "none"
    )
    assert skipped.returncode == 1 and "of 1 suite cases 0 N/A, 1 skipped" in skipped.stdout, (
        skipped.stdout[-3000:]
    )
    # quick tier: no case is nightly-only, so -m nightly leaves nothing: every case deselected
    collected = run_pytest("suites/test_compile.py", "-q", "--collect-only", "--report-dir", "none")
    count = re.search(r"(\d+) tests? collected", collected.stdout)
    assert count and int(count.group(1)) > 0, collected.stdout[-3000:]
    deselected = run_pytest("suites/test_compile.py", "-q", "-m", "nightly", "--report-dir", "none")
    assert deselected.returncode != 0, deselected.stdout[-3000:]
    assert (
        f"{count.group(1)} deselected by -k/-m" in deselected.stdout
        and "nightly cases exist only with --tier nightly" in deselected.stdout
    ), deselected.stdout[-3000:]


def test_project_tests_alone_are_not_a_conformance_run() -> None:
    proc = run_pytest(
        "tests/conformance/test_report.py",
        "suites/test_compile.py",
        "-q",
        "-k",
        "effective_ratio",
        "--report-dir",
        "none",
    )
    assert proc.returncode == 0, proc.stdout[-3000:]
    assert "no conformance case was executed" not in proc.stdout
