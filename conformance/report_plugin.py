"""pytest glue for the conformance report and vendor expectation files.

Registered through the ``conformance.report_plugin`` ``pytest11`` entry point of the installed
package, and from the root ``conftest.py`` in a checkout. Options (group "ring attention"):

``--report-dir DIR`` (``RING_REPORT_DIR``, default ``reports``)
    Where ``conformance.json``, ``conformance.md`` and ``conformance.xml`` (JUnit) are written at
    the end of every run that ran suite cases; ``--report-dir none`` writes nothing. With
    ``GITHUB_STEP_SUMMARY`` set, the Markdown is also appended there. Checked at start: a path
    that is a file, lies under a file, or cannot be written is a usage error before any case runs.
``--vendor-file PATH`` (``RING_VENDOR_FILE``)
    Expected failures and skips of an implementation, one per line::

        xfail suites/test_compile.py::test_compiled_matches_eager_and_reference[W2  inductor graph break (ACME-123)
        skip  suites/test_shapes.py::test_odd_sizes                              head_dim must be a multiple of 8

    ``xfail``/``skip``, a test-id prefix, then the reason (required). ``#`` starts a comment. An
    entry that matches no collected test warns, so a typo or a renamed test does not hide.

Only the tests of the suites package are conformance cases (:func:`conformance.pytest_plugin.suite_id`);
the project's own tests are not reported. Vendor-file prefixes and the report's ids are the
stable ids ``suites/<module>.py::<name>``, the same for a checkout and an installed package.

A run that reports suite cases but executes none of them (every one N/A or skipped) exits
non-zero, with a message that says why: it tested nothing. So does a run whose only collected
tests are suite cases that ``-k``/``-m`` deselected. A run that collects no suite case (the
project's own tests alone) is not a conformance run and is left alone.
"""  # noqa: E501

from __future__ import annotations

import os
import time
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from conformance.pytest_plugin import (
    _IMPL_KEY,
    _OP_KEY,
    NA_PREFIX,
    is_suite_item,
    report_suite_id,
    suite_id,
)
from conformance.report import (
    EXECUTED,
    CaseRecord,
    build_report,
    render_markdown,
    render_terminal,
    to_json,
)
from harness.pytest_plugin import add_ring_option, ring_environment_lines, ring_option, settings_of

__all__ = [
    "VendorEntry",
    "VendorFileWarning",
    "check_report_dir",
    "nothing_executed",
    "parse_vendor_file",
]


class VendorFileWarning(UserWarning):
    """An entry of the vendor file matched no collected test."""


@dataclass(frozen=True)
class VendorEntry:
    kind: str  # "xfail" | "skip"
    prefix: str
    reason: str
    line: int


def parse_vendor_file(path: str | os.PathLike[str]) -> list[VendorEntry]:
    """Parse a vendor expectation file; raises ValueError naming the line and the fix."""
    entries = []
    for n, raw in enumerate(Path(path).read_text().splitlines(), start=1):
        text = (
            raw.split("#", 1)[0].strip()
            if not raw.lstrip().startswith(("xfail", "skip"))
            else raw.strip()
        )
        if not text or text.startswith("#"):
            continue
        parts = text.split(None, 2)
        if parts[0] not in ("xfail", "skip") or len(parts) < 3:
            raise ValueError(
                f"{path}:{n}: expected '<xfail|skip> <test-id prefix> <reason>', got "
                f"{raw.strip()!r}"
            )
        entries.append(VendorEntry(parts[0], parts[1], parts[2].strip(), n))
    return entries


def pytest_addoption(parser: pytest.Parser) -> None:
    add_ring_option(
        parser,
        "--report-dir",
        env="RING_REPORT_DIR",
        metavar="DIR",
        help="Directory for conformance.json/.md/.xml ('none' to write nothing; default reports)",
    )
    add_ring_option(
        parser,
        "--vendor-file",
        env="RING_VENDOR_FILE",
        metavar="PATH",
        help="Vendor expectations: lines of '<xfail|skip> <test-id prefix> <reason>'",
    )


_VENDOR = pytest.StashKey[list]()


def _is_worker(config: pytest.Config) -> bool:
    return hasattr(config, "workerinput")


def _report_dir(config: pytest.Config) -> Path | None:
    raw = ring_option(config, "report_dir", "reports")
    return None if str(raw).lower() == "none" else Path(raw)


def check_report_dir(out: Path) -> None:
    """Raise ValueError (what is wrong, what to do) unless ``out`` is, or can be created as, a
    writable directory. Creates nothing."""
    fix = (
        "point --report-dir (RING_REPORT_DIR) at a directory you can write, or use 'none' for no "
        "report files"
    )
    if out.exists() and not out.is_dir():
        raise ValueError(f"{str(out)!r} exists and is not a directory; {fix}")
    probe = out.absolute()
    while not probe.exists():
        probe = probe.parent
    if not probe.is_dir():
        raise ValueError(
            f"{str(out)!r} cannot be created: {str(probe)!r} is a file, not a directory; {fix}"
        )
    if not os.access(probe, os.W_OK | os.X_OK):
        what = "is" if probe == out.absolute() else f"would be created in {str(probe)!r}, which is"
        raise ValueError(f"{str(out)!r} {what} not writable; {fix}")


@pytest.hookimpl(tryfirst=True)
def pytest_configure(config: pytest.Config) -> None:
    vendor = ring_option(config, "vendor_file")
    config.stash[_VENDOR] = []
    if vendor:
        try:
            config.stash[_VENDOR] = parse_vendor_file(vendor)
        except OSError as exc:
            raise pytest.UsageError(
                f"--vendor-file/RING_VENDOR_FILE: cannot read {vendor!r}: {exc}"
            ) from None
        except ValueError as exc:
            raise pytest.UsageError(f"--vendor-file/RING_VENDOR_FILE: {exc}") from None
    torchrun_rank = int(os.environ.get("RANK", "0")) if "LOCAL_RANK" in os.environ else 0
    if _is_worker(config) or torchrun_rank != 0:
        return  # the controller (or torchrun's rank 0) reports for everyone
    out = _report_dir(config)
    if out is not None:
        try:
            check_report_dir(out)
        except ValueError as exc:
            raise pytest.UsageError(f"--report-dir/RING_REPORT_DIR: {exc}") from None
    # JUnit XML next to the other files, unless the user asked for it elsewhere (junitxml reads
    # the option in its own pytest_configure, which runs after this one).
    if out is not None and not config.option.xmlpath:
        config.option.xmlpath = str(out / "conformance.xml")
    config.pluginmanager.register(ConformanceReporter(config, out), "ring-conformance-report")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    entries = config.stash.get(_VENDOR, [])
    used = set()
    for item in items:
        test_id = suite_id(item) or item.nodeid
        for e in entries:
            if test_id.startswith(e.prefix):
                used.add(e)
                reason = f"vendor file line {e.line}: {e.reason}"
                item.add_marker(
                    pytest.mark.xfail(reason=reason, strict=True)
                    if e.kind == "xfail"
                    else pytest.mark.skip(reason=reason)
                )
                break
    for e in entries:
        if e not in used:
            warnings.warn(
                VendorFileWarning(
                    f"vendor file line {e.line}: '{e.kind} {e.prefix}' matches no collected test; "
                    "fix the prefix or drop the line"
                ),
                stacklevel=1,
            )


def nothing_executed(counts: dict[str, int], deselected: int = 0) -> str:
    """Why a run that reported suite cases tested nothing ("" when some case ran to a verdict).

    ``counts``: outcome -> number of suite cases (conformance.report.OUTCOMES); ``deselected``:
    suite cases that ``-k``/``-m`` deselected.
    """
    executed = sum(counts.get(o, 0) for o in EXECUTED)
    reported = sum(counts.values())
    if executed or not (reported or deselected):
        return ""
    na, skipped = counts.get("n/a", 0), counts.get("skipped", 0)
    parts = [f"{na} N/A", f"{skipped} skipped"] + (
        [f"{deselected} deselected by -k/-m"] if deselected else []
    )
    why = []
    if na:
        why.append(
            "N/A: the implementation declares it lacks what those cases need (capabilities set to "
            "False, or sets without the value); undeclared capabilities are claimed and tested"
        )
    if skipped:
        why.append(
            "skipped: see the skip reasons (pytest -rs); a world size, tier or device that is not "
            "enabled, or vendor-file skips"
        )
    if deselected:
        why.append(
            "deselected: the -k/-m expression left no suite case (suite cases carry the markers "
            "quick, nightly, compile, world_size(n=N); nightly cases exist only with --tier "
            "nightly)"
        )
    return (
        (
            f"no conformance case was executed; of {reported + deselected} suite cases "
            f"{', '.join(parts)}. A run that tests nothing is not a pass. "
        )
        + "; ".join(why)
        + "."
    )


def _outcome(report: pytest.TestReport) -> str:
    if hasattr(report, "wasxfail"):
        return "xpassed" if report.passed else "xfailed"
    if report.skipped:
        reason = str(report.longrepr[2]) if isinstance(report.longrepr, tuple) else ""
        return "n/a" if NA_PREFIX in reason[:20] else "skipped"
    return "failed" if report.failed else "passed"


class ConformanceReporter:
    """Collects suite outcomes in the controlling process and writes the report at the end."""

    def __init__(self, config: pytest.Config, out: Path | None):
        self.config, self.out = config, out
        self.records: dict[str, CaseRecord] = {}
        self.started = time.time()
        self.deselected = (
            0  # suite cases -k/-m deselected (seen without xdist; workers keep theirs)
        )
        self.collected_other = False  # a test that is not a suite case was selected
        self.vacuous = ""

    def pytest_deselected(self, items: list[pytest.Item]) -> None:
        self.deselected += sum(is_suite_item(item) for item in items)

    def pytest_collection_finish(self, session: pytest.Session) -> None:
        self.collected_other = any(not is_suite_item(item) for item in session.items)

    def pytest_runtest_logreport(self, report: pytest.TestReport) -> None:
        test_id = report_suite_id(report)
        if test_id is None:
            self.collected_other = True
            return
        outcome = _outcome(report)
        decisive = (
            report.when == "call"
            or (report.when == "setup" and outcome != "passed")
            or (report.when == "teardown" and outcome == "failed")
        )
        prev = self.records.get(test_id)
        if not decisive or (prev is not None and prev.outcome == "failed"):
            return  # a teardown error after a failed call keeps the call's message
        module = (
            test_id.split("::", 1)[0].rsplit("/", 1)[-1].removeprefix("test_").removesuffix(".py")
        )
        properties: list[tuple[str, Any]] = list(report.user_properties)
        cases = [v for k, v in properties if k == "ring_case"]
        verdicts = [v for k, vs in properties if k == "ring_verdicts" for v in vs]
        # A test may run several cases (rotation agreement, hypothesis examples): keep the
        # parameters they share; the others become "any".
        params = (
            {k: v for k, v in cases[0].items() if all(c.get(k) == v for c in cases)}
            if cases
            else {}
        )
        message = ""
        if outcome == "failed":
            message = str(report.longrepr)[-2000:] if report.longrepr else ""
        elif outcome in ("xfailed", "xpassed"):
            message = str(getattr(report, "wasxfail", "") or "")
        elif outcome in ("n/a", "skipped") and isinstance(report.longrepr, tuple):
            message = str(report.longrepr[2]).removeprefix("Skipped: ")
        self.records[test_id] = CaseRecord(
            test_id,
            outcome,
            module,
            params,
            verdicts,
            report.duration,
            message,
        )

    def header(self) -> dict[str, str]:
        import torch

        settings = settings_of(self.config)
        impl = self.config.stash.get(_IMPL_KEY, None)
        header = {
            "implementation": f"{impl.name} ({impl.spec})" if impl is not None else "?",
            "op": str(self.config.stash.get(_OP_KEY, None) or "implementation's default"),
            "torch": torch.__version__,
            "device": settings.device,
            "backend": settings.backend,
            "tier": settings.tier,
            "world sizes": ",".join(map(str, settings.world_sizes)),
            "started": time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(self.started)),
        }
        for line in ring_environment_lines()[1:]:
            key, _, value = line.strip().partition("=")
            header[key] = value
        return header

    def report(self):
        if not self.records:
            return None
        impl = self.config.stash.get(_IMPL_KEY, None)
        return build_report(
            impl.name if impl is not None else "?", self.header(), list(self.records.values())
        )

    def pytest_terminal_summary(self, terminalreporter) -> None:
        if self.vacuous:
            terminalreporter.section(
                "ring attention conformance: nothing tested", red=True, bold=True
            )
            terminalreporter.write_line(self.vacuous, red=True)
        report = self.report()
        if report is None:
            return
        terminalreporter.section("ring attention conformance")
        for line in render_terminal(report).splitlines():
            terminalreporter.write_line(line)
        if self.out is not None:
            terminalreporter.write_line(
                f"report files: {self.out / 'conformance.json'}, {self.out / 'conformance.md'}, "
                f"{self.config.option.xmlpath}"
            )

    def pytest_sessionfinish(self, session: pytest.Session) -> None:
        counts: dict[str, int] = {}
        for rec in self.records.values():
            counts[rec.outcome] = counts.get(rec.outcome, 0) + 1
        # A conformance run reported suite cases, or selected nothing but had suite cases
        # deselected; the project's own tests alone are not one.
        if not self.config.option.collectonly and (self.records or not self.collected_other):
            self.vacuous = nothing_executed(counts, self.deselected)
        if self.vacuous and session.exitstatus == pytest.ExitCode.OK:
            session.exitstatus = pytest.ExitCode.TESTS_FAILED
        report = self.report()
        if report is None or self.out is None:
            return
        self.out.mkdir(parents=True, exist_ok=True)
        (self.out / "conformance.json").write_text(to_json(report))
        markdown = render_markdown(report)
        (self.out / "conformance.md").write_text(markdown)
        summary = os.environ.get("GITHUB_STEP_SUMMARY")
        if summary:
            with open(summary, "a") as fh:
                fh.write(markdown + "\n")
