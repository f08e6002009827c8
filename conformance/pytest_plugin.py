"""pytest glue of the conformance layer: the implementation under test, N/A, which tests are
conformance cases, and the tier markers of suite cases.

Registered through the ``conformance.pytest_plugin`` ``pytest11`` entry point of the installed
package, and from the root ``conftest.py`` in a checkout (options must be known before test
collection).
Adds to the "ring attention" option group:

``--impl package.module:object`` (``RING_IMPL``)
    The implementation under test (protocol: conformance/implementation.py). Default: ring_impl.
``--op name-or-package.module:object`` (``RING_OP``)
    The attention op (local kernel) to run inside the implementation (op contract: ring_impl/ops/).

What the implementation does not declare it lacks is claimed and tested
(conformance/implementation.py). A case that needs what it declares it lacks is reported **N/A**:
neither passed, failed nor an ordinary skip (the terminal shows ``N`` and the summary counts "N/A").
A case that needs a protocol piece the implementation claims but does not have
(``collective_schedule``, ``record_steps``, ``api_module``) fails, naming the missing attribute.

Conformance cases are the tests of the ``suites`` package, wherever it is: in a checkout, or
installed and run with ``pytest --pyargs suites`` from any directory. Their node ids then depend
on the rootdir and the arguments, so each gets a stable id, ``suites/<module>.py::<name>`` (the
node id of a checkout run), kept in the report, matched by vendor files, and carried to the xdist
controller as the user property ``suite_id``.

Tier markers of suite cases (applied at collection, so ``-m`` selects by them): ``quick`` for a
case of the quick tier and ``nightly`` for a case only the nightly tier has (with ``--tier
nightly`` a case is ``quick`` when the quick tier generates the very same case). The case
markers ``world_size(n=N)`` and ``compile`` come from the suites' runner (suites/pytest_plugin.py).
"""

from __future__ import annotations

import functools
from pathlib import Path
from typing import Any

import pytest

from conformance.implementation import Implementation, ImplSpecError, load_implementation, load_op
from harness.pytest_plugin import SETTINGS_KEY, add_ring_option, ring_option, settings_of
from harness.settings import DEFAULT_WORLD_SIZES

__all__ = [
    "NA_PREFIX",
    "SUITE_ID_PROPERTY",
    "SUITE_PACKAGE",
    "is_suite_item",
    "not_applicable",
    "report_suite_id",
    "suite_id",
]

NA_PREFIX = "N/A: "
#: The package whose tests are the conformance cases; the project's own tests are not.
SUITE_PACKAGE = "suites"
#: The user property that carries a suite case's stable id to the report (and the xdist controller).
SUITE_ID_PROPERTY = "suite_id"


def not_applicable(reason: str) -> None:
    """Report the current test as N/A (the implementation declares it lacks what it needs)."""
    __tracebackhide__ = True
    pytest.skip(NA_PREFIX + reason)


@functools.lru_cache(maxsize=256)
def _top_package(directory: Path) -> Path | None:
    """The outermost package directory that contains ``directory`` (None outside any package)."""
    top = None
    while (directory / "__init__.py").is_file():
        top, directory = directory, directory.parent
    return top


def suite_id(item: pytest.Item) -> str | None:
    """``suites/<module>.py::<name>`` for a test of the suites package, wherever it is installed
    and whatever the rootdir; None for any other test."""
    path = Path(item.path)
    top = _top_package(path.parent)
    if top is None or top.name != SUITE_PACKAGE:
        return None
    _, sep, name = item.nodeid.partition("::")
    return path.relative_to(top.parent).as_posix() + sep + name


def is_suite_item(item: pytest.Item) -> bool:
    return suite_id(item) is not None


def report_suite_id(report: pytest.TestReport) -> str | None:
    """The stable id of the suite case a report is about (None for the project's own tests)."""
    return next((str(v) for k, v in report.user_properties if k == SUITE_ID_PROPERTY), None)


def pytest_addoption(parser: pytest.Parser) -> None:
    add_ring_option(
        parser,
        "--impl",
        env="RING_IMPL",
        metavar="MODULE:OBJECT",
        help="Implementation under test (default: ring_impl's adapter; 'ring_impl' names it too)",
    )
    add_ring_option(
        parser,
        "--op",
        env="RING_OP",
        metavar="NAME|MODULE:OBJECT",
        help="Attention op (local kernel) to run inside the implementation",
    )


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
                f"--op={op_spec!r} given, but implementation {impl.name!r} does not accept op "
                f"objects (it {impl.capabilities.lacking('ops', '*')}); drop --op or plug the "
                "kernel into an implementation that does"
            )
    config.stash[_IMPL_KEY] = impl
    config.stash[_OP_KEY] = op_spec or None
    config.stash[_QUICK_KEY] = {}


def pytest_report_teststatus(report: pytest.TestReport, config: pytest.Config):
    if (
        report.skipped
        and isinstance(report.longrepr, tuple)
        and str(report.longrepr[2]).startswith(("Skipped: " + NA_PREFIX, NA_PREFIX))
    ):
        return "n/a", "N", "N/A"
    return None


_IMPL_KEY = pytest.StashKey[Implementation]()
_OP_KEY = pytest.StashKey[Any]()
# definition node id -> {argname: [values the quick tier generates]} (nightly sessions only)
_QUICK_KEY = pytest.StashKey[dict[str, dict[str, list]]]()


# ---------------------------------------------------------------------- tier markers of suite cases


class _ParametrizeRecorder:
    """Stands in for a Metafunc: records what a module's ``pytest_generate_tests`` parametrizes."""

    def __init__(self, metafunc: pytest.Metafunc):
        self._metafunc = metafunc
        self.values: dict[str, list] = {}

    def __getattr__(self, name: str) -> Any:
        return getattr(self._metafunc, name)

    def parametrize(self, argnames, argvalues, *args: Any, **kwargs: Any) -> None:
        names = (
            [n.strip() for n in argnames.split(",")]
            if isinstance(argnames, str)
            else list(argnames)
        )
        for value in argvalues:
            values = (
                value.values
                if hasattr(value, "values") and hasattr(value, "marks")
                else ((value,) if len(names) == 1 else tuple(value))
            )
            for name, v in zip(names, values):
                self.values.setdefault(name, []).append(v)


def quick_tier_settings(settings):
    """The settings under which the quick tier would generate its cases in this session: the
    quick tier and its world sizes (the session's, where given explicitly)."""
    sizes = (
        settings.world_sizes if "world_sizes" in settings.sources else DEFAULT_WORLD_SIZES["quick"]
    )
    return settings.with_(tier="quick", world_sizes=tuple(sizes))


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    """In a nightly session, record what the module's own generator makes for the quick tier, so
    collection can tell the quick tier's cases from the ones only the nightly tier has."""
    module = metafunc.module
    generate = getattr(module, "pytest_generate_tests", None)
    if not callable(generate) or not is_suite_item(metafunc.definition):
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


@pytest.hookimpl(tryfirst=True)  # before -m deselects
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    settings = settings_of(config)
    quick_values = config.stash.get(_QUICK_KEY, {})
    for item in items:
        sid = suite_id(item)
        if sid is None:
            continue
        item.user_properties.append((SUITE_ID_PROPERTY, sid))
        params: dict[str, Any] = dict(getattr(getattr(item, "callspec", None), "params", {}) or {})
        quick = True
        if settings.tier != "quick":
            generated = quick_values.get(item.nodeid.split("[", 1)[0])
            if generated is not None:
                quick = all(
                    params[name] in values for name, values in generated.items() if name in params
                )
        item.add_marker(pytest.mark.quick if quick else pytest.mark.nightly)


# ---------------------------------------------------------------------- fixtures


@pytest.fixture(scope="session")
def impl(pytestconfig: pytest.Config) -> Implementation:
    """The implementation under test."""
    return pytestconfig.stash[_IMPL_KEY]


@pytest.fixture(scope="session")
def op_under_test(pytestconfig: pytest.Config) -> str | None:
    """``--op`` (a spec string the ranks load), or None for the implementation's own choice."""
    return pytestconfig.stash[_OP_KEY]
