"""pytest glue of the conformance suites: the implementation under test, the case runner, N/A.

Registered from the root conftest (options must be known before test collection). Adds to the
"ring attention" option group:

``--impl package.module:object`` (``RING_IMPL``)
    The implementation under test (protocol: harness/implementation.py). Default: ring_impl.
``--op name-or-package.module:object`` (``RING_OP``)
    The attention kernel to run inside the implementation (op contract: ring_impl/ops.py).

A case that needs a capability the implementation does not declare is reported **N/A**: it is
neither passed, failed nor an ordinary skip (the terminal shows ``N`` and the summary counts
"N/A").
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import replace
from typing import Any

import pytest

from harness.implementation import (
    Capabilities,
    Implementation,
    ImplSpecError,
    load_implementation,
    load_op,
)
from harness.pytest_plugin import add_ring_option, ring_option

__all__ = ["NA_PREFIX", "RingRunner", "not_applicable"]

NA_PREFIX = "N/A: "


def not_applicable(reason: str) -> None:
    """Report the current test as N/A (the implementation does not declare what it needs)."""
    __tracebackhide__ = True
    pytest.skip(NA_PREFIX + reason)


def pytest_addoption(parser: pytest.Parser) -> None:
    add_ring_option(parser, "--impl", env="RING_IMPL", metavar="MODULE:OBJECT",
                    help="Implementation under test (default: ring_impl's adapter)")
    add_ring_option(parser, "--op", env="RING_OP", metavar="NAME|MODULE:OBJECT",
                    help="Attention op (local kernel) to run inside the implementation")


def pytest_configure(config: pytest.Config) -> None:
    # Fail at start, naming the option, rather than in every test.
    try:
        impl = load_implementation(ring_option(config, "impl"))
    except ImplSpecError as exc:
        raise pytest.UsageError(str(exc)) from None
    op_spec = ring_option(config, "op")
    if op_spec:
        try:
            load_op(op_spec)
        except (ImplSpecError, ValueError) as exc:
            raise pytest.UsageError(f"--op/RING_OP: {exc}") from None
        if not impl.capabilities.declares("ops", "*"):
            raise pytest.UsageError(
                f"--op={op_spec!r} given, but implementation {impl.name!r} does not accept op objects "
                "(its capabilities.ops lacks '*'); drop --op or plug the kernel into an implementation that does"
            )
    config.stash[_IMPL_KEY] = impl
    config.stash[_OP_KEY] = op_spec or None


def pytest_report_teststatus(report: pytest.TestReport, config: pytest.Config):
    if report.skipped and isinstance(report.longrepr, tuple) and str(report.longrepr[2]).startswith(
        ("Skipped: " + NA_PREFIX, NA_PREFIX)
    ):
        return "n/a", "N", "N/A"
    return None


_IMPL_KEY = pytest.StashKey[Implementation]()
_OP_KEY = pytest.StashKey[Any]()


@pytest.fixture(scope="session")
def impl(pytestconfig: pytest.Config) -> Implementation:
    """The implementation under test."""
    return pytestconfig.stash[_IMPL_KEY]


@pytest.fixture(scope="session")
def op_under_test(pytestconfig: pytest.Config) -> str | None:
    """``--op`` (a spec string the ranks load), or None for the implementation's own choice."""
    return pytestconfig.stash[_OP_KEY]


class RingRunner:
    """Runs :class:`suites.cases.RingCase` on a pool and judges it (one per test)."""

    def __init__(self, request: pytest.FixtureRequest, rank_pool: Callable[..., Any], impl: Implementation,
                 op_spec: str | None, timeout: float):
        self.request, self.rank_pool, self.impl, self.op_spec, self.timeout = request, rank_pool, impl, op_spec, timeout

    @property
    def caps(self) -> Capabilities:
        return self.impl.capabilities

    def require(self, field: str, value: Any = True, why: str = "") -> None:
        """N/A unless the implementation declares ``field`` (containing ``value``)."""
        __tracebackhide__ = True
        declared = self.caps.declares(field, value)
        if declared is None:
            not_applicable(f"{self.impl.name} does not declare capabilities.{field}{f' ({why})' if why else ''}")
        if not declared:
            shown = value if value is not True else "True"
            not_applicable(f"{self.impl.name} declares capabilities.{field} without {shown}{f' ({why})' if why else ''}")

    def prepare(self, case):
        """Check capabilities (N/A) and fill in the session's implementation and op."""
        __tracebackhide__ = True
        spec = case.inputs
        self.require("layouts", case.layout)
        self.require("rotate_methods", case.rotate_method)
        self.require("dtypes", spec.dtype)
        self.require("devices", self.request.getfixturevalue("device"))
        if case.backward:
            self.require("backward")
        if spec.heads != spec.heads_kv:
            self.require("gqa", why="key/value with fewer heads than query")
        if spec.seq_q != spec.seq_kv:
            self.require("cross_attention", why="key/value length differs from query length")
        if case.compile:
            self.require("compile")
        if case.count_work:
            self.require("ops", "*", why="counting work wraps the attention op")
        op = case.op if case.op is not None else self.op_spec
        if op is not None:
            self.require("ops", "*", why=f"runs op {op!r}")
        return replace(case, impl=self.impl.spec, op=op, return_lse=case.return_lse and bool(self.caps.lse))

    def run(self, case, fn=None) -> list:
        """Raw per-rank results of ``fn`` (default :func:`suites.cases.ring_case`)."""
        from suites.cases import ring_case

        pool = self.rank_pool(case.world_size)
        return pool.run(fn or ring_case, case, timeout=self.timeout)

    def check(self, case, *, results: Sequence[dict] | None = None) -> list:
        """Run (unless results are given), judge every quantity, diagnose and raise on failure."""
        __tracebackhide__ = True
        from suites.judge import diagnose_case, format_failure, judge

        if results is None:
            results = self.run(case)
        verdicts = judge(case, results, baseline_op=getattr(self.impl.obj, "baseline_op", None))
        self.record(case, verdicts)
        failed = [v for v in verdicts if not v.passed]
        if failed:
            records, note = None, ""
            if callable(getattr(self.impl.obj, "record_steps", None)):
                try:
                    records = [rec for r in self.run(replace(case, record=True)) for rec in (r["records"] or [])]
                except Exception as exc:  # diagnosis is best effort; the verdict stands
                    note = f" (re-run with step recording failed: {exc})"
            diagnosis = diagnose_case(case, results, records) + note
            pytest.fail(format_failure(failed, diagnosis, self.repro()), pytrace=False)
        return verdicts

    def record(self, case, verdicts) -> None:
        """Attach case parameters and error figures to the test report (for the conformance report)."""
        self.request.node.user_properties.append(("ring_case", case_properties(case)))
        self.request.node.user_properties.append((
            "ring_verdicts",
            [
                {"name": v.name, "passed": v.passed, "max_err": v.max_err, "base_max_err": v.base_max_err,
                 "mean_err": v.mean_err, "base_mean_err": v.base_mean_err, "ratio": v.ratio,
                 "k": v.k, "floor": v.floor, "mean_floor": v.mean_floor, "mean_ratio": v.mean_ratio, "rank": v.rank, "worst_index": list(v.worst_index)}
                for v in verdicts
            ],
        ))

    def repro(self) -> str:
        impl = "" if self.impl.spec == _default_spec() else f" --impl {self.impl.spec}"
        return f"pytest '{self.request.node.nodeid}'{impl} -p no:xdist"


def _default_spec() -> str:
    from harness.implementation import DEFAULT_IMPL_SPEC

    return DEFAULT_IMPL_SPEC


def case_properties(case) -> dict[str, Any]:
    s = case.inputs
    return {
        "world_size": case.world_size, "dtype": s.dtype, "is_causal": case.is_causal, "layout": case.layout,
        "rotate_method": case.rotate_method, "op": case.op, "compile": case.compile,
        "batch": s.batch, "heads": s.heads, "heads_kv": s.heads_kv, "seq_q": s.seq_q, "seq_kv": s.seq_kv,
        "head_dim": s.head_dim,
    }


@pytest.fixture
def ring(request: pytest.FixtureRequest, rank_pool, impl: Implementation, op_under_test, case_timeout) -> RingRunner:
    """The case runner for this test: ``ring.check(ring.prepare(case))``."""
    return RingRunner(request, rank_pool, impl, op_under_test, case_timeout)
