"""pytest glue of the conformance suites: the implementation under test, the case runner, N/A,
and the markers of suite cases.

Registered from the root conftest (options must be known before test collection). Adds to the
"ring attention" option group:

``--impl package.module:object`` (``RING_IMPL``)
    The implementation under test (protocol: harness/implementation.py). Default: ring_impl.
``--op name-or-package.module:object`` (``RING_OP``)
    The attention op (local kernel) to run inside the implementation (op contract: ring_impl/ops.py).

What the implementation does not declare it lacks is claimed and tested (harness/implementation.py).
A case that needs what it declares it lacks is reported **N/A**: neither passed, failed nor an
ordinary skip (the terminal shows ``N`` and the summary counts "N/A"). A case that needs a
protocol piece the implementation claims but does not have (``collective_schedule``,
``record_steps``, ``api_module``) fails, naming the missing attribute.

Markers of suite cases (applied at collection, so ``-m`` selects by them): ``world_size(n=N)``
from the case's world size; ``compile`` for a case with a torch.compile backend; ``quick`` for a
case of the quick tier and ``nightly`` for a case only the nightly tier has (with ``--tier
nightly`` a case is ``quick`` when the quick tier generates the very same case).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import replace
from typing import Any

import pytest

from harness.implementation import (
    PROTOCOL_ATTRIBUTES,
    Capabilities,
    Implementation,
    ImplSpecError,
    load_implementation,
    load_op,
)
from harness.pytest_plugin import (
    SETTINGS_KEY,
    add_ring_option,
    repro_command,
    ring_option,
    settings_of,
)
from harness.settings import DEFAULT_WORLD_SIZES

__all__ = ["NA_PREFIX", "SUITE_PREFIX", "RingRunner", "is_suite_item", "not_applicable"]

NA_PREFIX = "N/A: "
#: Test ids of conformance cases start with this; the project's own tests are not suite cases.
SUITE_PREFIX = "suites/"


def not_applicable(reason: str) -> None:
    """Report the current test as N/A (the implementation declares it lacks what it needs)."""
    __tracebackhide__ = True
    pytest.skip(NA_PREFIX + reason)


def is_suite_item(nodeid: str) -> bool:
    return nodeid.startswith(SUITE_PREFIX)


def pytest_addoption(parser: pytest.Parser) -> None:
    add_ring_option(parser, "--impl", env="RING_IMPL", metavar="MODULE:OBJECT",
                    help="Implementation under test (default: ring_impl's adapter; 'ring_impl' names it too)")
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
        if not impl.capabilities.claims("ops", "*"):
            raise pytest.UsageError(
                f"--op={op_spec!r} given, but implementation {impl.name!r} does not accept op objects "
                f"(it {impl.capabilities.lacking('ops', '*')}); drop --op or plug the kernel into an implementation that does"
            )
    config.stash[_IMPL_KEY] = impl
    config.stash[_OP_KEY] = op_spec or None
    config.stash[_QUICK_KEY] = {}


def pytest_report_teststatus(report: pytest.TestReport, config: pytest.Config):
    if report.skipped and isinstance(report.longrepr, tuple) and str(report.longrepr[2]).startswith(
        ("Skipped: " + NA_PREFIX, NA_PREFIX)
    ):
        return "n/a", "N", "N/A"
    return None


_IMPL_KEY = pytest.StashKey[Implementation]()
_OP_KEY = pytest.StashKey[Any]()
# definition node id -> {argname: [values the quick tier generates]} (nightly sessions only)
_QUICK_KEY = pytest.StashKey[dict[str, dict[str, list]]]()


# ---------------------------------------------------------------------- markers of suite cases


class _ParametrizeRecorder:
    """Stands in for a Metafunc: records what a module's ``pytest_generate_tests`` parametrizes."""

    def __init__(self, metafunc: pytest.Metafunc):
        self._metafunc = metafunc
        self.values: dict[str, list] = {}

    def __getattr__(self, name: str) -> Any:
        return getattr(self._metafunc, name)

    def parametrize(self, argnames, argvalues, *args: Any, **kwargs: Any) -> None:
        names = [n.strip() for n in argnames.split(",")] if isinstance(argnames, str) else list(argnames)
        for value in argvalues:
            values = value.values if hasattr(value, "values") and hasattr(value, "marks") else (
                (value,) if len(names) == 1 else tuple(value))
            for name, v in zip(names, values):
                self.values.setdefault(name, []).append(v)


def quick_tier_settings(settings):
    """The settings under which the quick tier would generate its cases in this session: the
    quick tier and its world sizes (the session's, where given explicitly)."""
    sizes = settings.world_sizes if "world_sizes" in settings.sources else DEFAULT_WORLD_SIZES["quick"]
    return settings.with_(tier="quick", world_sizes=tuple(sizes))


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    """In a nightly session, record what the module's own generator makes for the quick tier, so
    collection can tell the quick tier's cases from the ones only the nightly tier has."""
    module = metafunc.module
    generate = getattr(module, "pytest_generate_tests", None)
    if not callable(generate) or not is_suite_item(metafunc.definition.nodeid):
        return
    config = metafunc.config
    settings = settings_of(config)
    if settings.tier == "quick":
        return
    recorder = _ParametrizeRecorder(metafunc)
    config.stash[SETTINGS_KEY] = quick_tier_settings(settings)
    try:
        generate(recorder)
    finally:
        config.stash[SETTINGS_KEY] = settings
    config.stash[_QUICK_KEY][metafunc.definition.nodeid] = recorder.values


def _case_of(params: dict[str, Any]):
    from suites.cases import RingCase

    return next((v for v in params.values() if isinstance(v, RingCase)), None)


@pytest.hookimpl(tryfirst=True)  # before the harness reads world_size and before -m deselects
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    settings = settings_of(config)
    quick_values = config.stash.get(_QUICK_KEY, {})
    for item in items:
        if not is_suite_item(item.nodeid):
            continue
        params: dict[str, Any] = dict(getattr(getattr(item, "callspec", None), "params", {}) or {})
        case = _case_of(params)
        world_size = case.world_size if case is not None else params.get("w")
        if isinstance(world_size, int) and item.get_closest_marker("world_size") is None:
            item.add_marker(pytest.mark.world_size(n=world_size))
        if case is not None and case.compile:
            item.add_marker(pytest.mark.compile)
        quick = True
        if settings.tier != "quick":
            generated = quick_values.get(item.nodeid.split("[", 1)[0])
            if generated is not None:
                quick = all(params[name] in values for name, values in generated.items() if name in params)
        item.add_marker(pytest.mark.quick if quick else pytest.mark.nightly)


# ---------------------------------------------------------------------- fixtures and runner


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
        """N/A when the implementation declares it lacks ``field`` (or ``value`` in it).

        Undeclared is claimed: the case runs. For a protocol piece (``collective_schedule``,
        ``record_steps``, ``context_parallel``) that is claimed but missing, the test fails with
        a message naming the missing attribute.
        """
        __tracebackhide__ = True
        lacking = self.caps.lacking(field, value)
        if lacking:
            not_applicable(f"{self.impl.name} {lacking}{f' ({why})' if why else ''}")
        if field in PROTOCOL_ATTRIBUTES:
            missing = self.impl.missing(field)
            if missing:
                pytest.fail(missing + (f" [needed for: {why}]" if why else ""), pytrace=False)

    def protocol(self, field: str, why: str = "") -> Any:
        """The implementation's attribute for protocol piece ``field`` (N/A or fail as :meth:`require`)."""
        __tracebackhide__ = True
        self.require(field, why=why)
        return self.impl.protocol(field)

    def prepare(self, case):
        """Check capabilities (N/A) and fill in the session's implementation and op."""
        __tracebackhide__ = True
        spec = case.inputs
        op = case.op if case.op is not None else self.op_spec
        # Recorded first, so a case that ends N/A, skipped or raising still lands in its cell.
        self.request.node.user_properties.append(("ring_case", case_properties(replace(case, op=op))))
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
        if case.record:
            self.require("record_steps", why="per-step partials")
        if op is not None:
            self.require("ops", "*", why=f"runs op {op!r}")
        return replace(case, impl=self.impl.spec, op=op, return_lse=case.return_lse and self.caps.claims("lse"))

    def timeout_for(self, case) -> float:
        """This test's timeout, or the compile bound for a case that compiles."""
        settings = settings_of(self.request.config)
        return max(self.timeout, settings.timeout_for(compiles=True)) if case.compile else self.timeout

    def run(self, case, fn=None) -> list:
        """Raw per-rank results of ``fn`` (default :func:`suites.cases.ring_case`)."""
        from suites.cases import ring_case

        pool = self.rank_pool(case.world_size)
        return pool.run(fn or ring_case, case, timeout=self.timeout_for(case))

    def check(self, case, *, results: Sequence[dict] | None = None) -> list:
        """Run (unless results are given), judge every quantity, diagnose and raise on failure."""
        __tracebackhide__ = True
        from suites.judge import diagnose_case, format_failure, judge

        if results is None:
            results = self.run(case)
        try:
            verdicts = judge(case, results, baseline_op=getattr(self.impl.obj, "baseline_op", None))
        except AssertionError as exc:  # a broken contract (dtype, shape, missing result): no numbers to judge
            pytest.fail(f"{exc}\nrepro: {self.repro()}", pytrace=False)
        self.record(case, verdicts)
        failed = [v for v in verdicts if not v.passed]
        if failed:
            records, note = None, ""
            if case.compile:
                # Step records are taken eagerly only; compare with the eager run instead.
                note = " " + self.eager_comparison(case)
            elif self.caps.claims("record_steps"):
                missing = self.impl.missing("record_steps")
                if missing:
                    note = f" (no per-step records: {missing})"
                else:
                    try:
                        records = [rec for r in self.run(replace(case, record=True)) for rec in (r["records"] or [])]
                    except Exception as exc:  # diagnosis is best effort; the verdict stands
                        note = f" (re-run with step recording failed: {exc})"
            diagnosis = diagnose_case(case, results, records) + note
            pytest.fail(format_failure(failed, diagnosis, self.repro()), pytrace=False)
        return verdicts

    def eager_comparison(self, case) -> str:
        """One sentence on the same case run without torch.compile (for a failed compiled case)."""
        from suites.judge import judge

        try:
            eager = judge(replace(case, compile=None), self.run(replace(case, compile=None)),
                          baseline_op=getattr(self.impl.obj, "baseline_op", None))
        except Exception as exc:  # the eager run failing too is information, not a new failure
            return f"The same case run eagerly fails too ({type(exc).__name__}: {str(exc).splitlines()[0][:200]})."
        if all(v.passed for v in eager):
            return (f"The same case run eagerly (without torch.compile) passes: wrong only when compiled "
                    f"(backend {case.compile}).")
        return "The same case run eagerly fails too: the ring is wrong with or without torch.compile."

    def record(self, case, verdicts) -> None:
        """Attach case parameters and error figures to the test report (for the conformance report)."""
        if ("ring_case", case_properties(case)) not in self.request.node.user_properties:
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
        """A command that re-runs this test alone with every ring option of the session."""
        return repro_command(self.request.config, self.request.node.nodeid, "-p", "no:xdist")


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
