"""The conformance report, vendor files and N/A reporting, end to end and in parts."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from conformance.report import (
    CaseRecord,
    build_report,
    effective_ratio,
    render_markdown,
    render_terminal,
    to_json,
)
from conformance.reporting import parse_vendor_file
from tests.conformance.subproc import run_pytest


def _verdict(max_err: float, base: float, floor: float = 1e-6, k: float = 2.0) -> dict:
    return {
        "name": "out",
        "passed": max_err <= k * base + floor,
        "max_err": max_err,
        "base_max_err": base,
        "floor": floor,
        "k": k,
        "ratio": max_err / base if base else float("inf"),
    }


def test_effective_ratio_folds_the_floor_in_and_is_finite_for_exact_baselines() -> None:
    assert effective_ratio(_verdict(2e-3, 1e-3, floor=0.0)) == pytest.approx(2.0)
    assert effective_ratio(_verdict(1e-6, 0.0, floor=1e-6, k=2.0)) == pytest.approx(
        2.0
    )  # at the bound
    assert effective_ratio(_verdict(float("nan"), 1e-3)) is not None


def test_matrix_cells_scores_and_files() -> None:
    def a(n: int, outcome: str, dtype: str, verdicts=(), message: str = "") -> CaseRecord:
        """Case ``n`` of suite a, its dtype ``dtype`` on the p2p rotation."""
        axes = {"dtype": dtype, "rotate_method": "p2p"}
        return CaseRecord(
            f"suites/test_a.py::t[{n}]", outcome, "a", axes, [*verdicts], message=message
        )

    records = [
        a(1, "passed", "float32", [_verdict(1e-3, 1e-3)]),
        a(2, "failed", "float32", [_verdict(9e-3, 1e-3)], message="boom"),
        a(3, "n/a", "bfloat16", message="N/A: no bf16"),
        CaseRecord("suites/test_b.py::t", "passed", "b"),
    ]
    report = build_report("impl-x", {"torch": "2.13"}, records)
    assert report.score() == (2, 4)  # N/A and failures count in the denominator
    text = render_terminal(report)
    assert "impl-x: 2/4 cases pass" in text and "FAIL 9" in text and "N/A" in text
    md = render_markdown(report)
    assert "### Failures" in md and "`suites/test_a.py::t[2]`: boom" in md and "N/A: no bf16" in md
    doc = json.loads(to_json(report))
    assert doc["score"] == {"passed": 2, "total": 4} and len(doc["cases"]) == 4


def test_vendor_file_parsing_rejects_lines_without_reason(tmp_path: Path) -> None:
    good = tmp_path / "vendor.txt"
    good.write_text(
        "# comment\nxfail suites/test_compile.py  graph break (ACME-1)\n\nskip "
        "suites/test_shapes.py::test_odd_sizes  head_dim % 8\n"
    )
    entries = parse_vendor_file(good)
    assert [(e.kind, e.prefix, e.reason) for e in entries] == [
        ("xfail", "suites/test_compile.py", "graph break (ACME-1)"),
        ("skip", "suites/test_shapes.py::test_odd_sizes", "head_dim % 8"),
    ]
    bad = tmp_path / "bad.txt"
    bad.write_text("xfail suites/test_compile.py\n")
    with pytest.raises(ValueError, match=r"bad.txt:1: expected"):
        parse_vendor_file(bad)


def test_minimal_vendor_impl_gets_na_not_failures_and_a_report(tmp_path: Path) -> None:
    vendor = tmp_path / "vendor.txt"
    vendor.write_text(
        "xfail suites/test_determinism.py  known nondeterminism (expected to pass: strict xfail "
        "fails)\n"
        "skip suites/test_no_such_module.py  typo on purpose\n"
    )
    proc = run_pytest(
        "suites/test_forward_backward.py",
        "suites/test_collectives.py",
        "-q",
        "--world-sizes",
        "2",
        "--impl",
        "tests.conformance.minimal_impl:IMPLEMENTATION",
        "--report-dir",
        str(tmp_path / "out"),
        "-k",
        "W2-f32 and contiguous and allgather or W2-bf16",
        "-W",
        "always::conformance.reporting.VendorFileWarning",
        "--vendor-file",
        str(vendor),
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-2000:]
    assert "matches no collected test" in proc.stdout, "an unmatched vendor entry must warn"
    doc = json.loads((tmp_path / "out" / "conformance.json").read_text())
    outcomes = {c["nodeid"].split("::")[-1]: c["outcome"] for c in doc["cases"]}
    assert (
        outcomes["test_forward_backward_match_reference[W2-f32-causal-allgather-contiguous]"]
        == "passed"
    )
    assert (
        outcomes["test_forward_backward_match_reference[W2-bf16-causal-allgather-contiguous]"]
        == "n/a"
    )
    assert (
        outcomes[
            "test_collectives_match_declared_schedule[W2-f32-causal-allgather-contiguous-hkv4]"
        ]
        == "n/a"
    )
    assert doc["score"]["total"] == len(doc["cases"]) > doc["score"]["passed"]
    assert (
        (tmp_path / "out" / "conformance.md")
        .read_text()
        .startswith("## Ring attention conformance: minimal-vendor-ring")
    )
    assert (tmp_path / "out" / "conformance.xml").exists()
    assert " N/A" in proc.stdout or "n/a" in proc.stdout


def test_bad_impl_option_fails_at_start_naming_the_option(tmp_path: Path) -> None:
    proc = run_pytest("suites/test_determinism.py", "--impl", "no_such_pkg.mod:obj")
    assert proc.returncode != 0
    assert "--impl" in proc.stderr and "cannot import module" in proc.stderr


def _cell_text(*outcomes: str) -> tuple[str, tuple[int, int]]:
    records = [
        CaseRecord(
            f"suites/test_a.py::t[{i}]", o, "a", {"dtype": "float32", "rotate_method": "p2p"}
        )
        for i, o in enumerate(outcomes)
    ]
    report = build_report("impl", {}, records)
    return report.matrix()[("a", "p2p")]["float32"].text(), report.score()


@pytest.mark.parametrize(
    ("outcomes", "cell", "passed"),
    [
        (("passed", "passed"), "pass", 2),
        (
            ("xfailed", "xfailed"),
            "xfail",
            0,
        ),  # an expectation file does not turn failures into passes
        (("xpassed",), "XPASS", 0),
        (("n/a", "n/a"), "N/A", 0),
        (("skipped",), "skip", 0),
        (("passed", "xfailed", "n/a"), "part 1/3", 1),
        (("xfailed", "n/a"), "xfail+N/A", 0),
        (("passed", "failed", "xfailed"), "FAIL", 1),
    ],
)
def test_states_are_their_own_and_only_passes_score(outcomes, cell: str, passed: int) -> None:
    text, score = _cell_text(*outcomes)
    assert text == cell and score == (passed, len(outcomes))


def test_summary_and_markdown_list_every_state() -> None:
    records = [
        CaseRecord(
            "suites/test_a.py::t[0]", "xfailed", "a", message="vendor file line 3: known (ACME-1)"
        ),
        CaseRecord(
            "suites/test_a.py::t[1]", "skipped", "a", message="needs CUDA: run on a CUDA machine"
        ),
        CaseRecord(
            "suites/test_a.py::t[2]",
            "n/a",
            "a",
            message="N/A: impl declares capabilities.lse=False",
        ),
        CaseRecord("suites/test_a.py::t[3]", "passed", "a"),
    ]
    report = build_report("impl", {}, records)
    assert (
        "impl: 1/4 cases pass (25.0%); 0 failed, 1 xfailed, 0 xpassed, 1 N/A, 1 skipped"
        in render_terminal(report)
    )
    md = render_markdown(report)
    for section, line in (
        ("### Expected failures (xfail)", "- 1 x vendor file line 3: known (ACME-1)"),
        (
            "### N/A (what the implementation declares it lacks)",
            "- 1 x N/A: impl declares capabilities.lse=False",
        ),
        ("### Skipped", "- 1 x needs CUDA: run on a CUDA machine"),
    ):
        assert section in md and line in md
    assert json.loads(to_json(report))["executed"] == 2


@pytest.mark.parametrize("where", ["file", "under_file"])
def test_report_dir_that_cannot_be_a_directory_is_a_usage_error_at_start(
    tmp_path: Path, where: str
) -> None:
    afile = tmp_path / "taken"
    afile.write_text("not a directory")
    target = afile if where == "file" else afile / "reports"
    proc = run_pytest("suites/test_forward_backward.py", "-q", "--report-dir", str(target))
    assert proc.returncode == 4, (
        proc.stdout[-2000:] + proc.stderr[-2000:]
    )  # pytest's usage error, before any test
    expected = "exists and is not a directory" if where == "file" else "is a file, not a directory"
    assert "--report-dir/RING_REPORT_DIR:" in proc.stderr and expected in proc.stderr, proc.stderr
    assert "passed" not in proc.stdout and "failed" not in proc.stdout


def test_report_dir_check_covers_unwritable_parents(tmp_path: Path) -> None:
    from conformance.reporting import check_report_dir

    check_report_dir(tmp_path / "new" / "deeper")  # creatable: fine, and nothing is created
    assert not (tmp_path / "new").exists()
    if os.geteuid() != 0:  # root writes anywhere
        locked = tmp_path / "locked"
        locked.mkdir(mode=0o500)
        with pytest.raises(ValueError, match="not writable"):
            check_report_dir(locked / "reports")
