"""The harness is generic and the packages form layers, checked on the import graph of the sources.

The harness knows ranks, pools, faults, accounting and pytest, nothing of attention: it imports
nothing of ``ring_impl``, ``reference``, ``conformance`` or ``suites``. The conformance layer sits
on the harness and below the suites; the suites import nothing of ``ring_impl`` (they reach an
implementation, the default one included, through the conformance layer). No two modules, and no
two packages, import each other, directly or around a loop. Every import counts, deferred ones
included (tests/harness/import_graph.py).
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.harness.import_graph import Edge, cycles, import_edges, package_of

ROOT = Path(__file__).resolve().parents[2]
#: The packages of the product, whose imports are checked.
PACKAGES = ("harness", "conformance", "suites", "ring_impl", "reference")
#: package -> packages it must not import.
FORBIDDEN = {
    "harness": {"ring_impl", "reference", "conformance", "suites"},
    "conformance": {"suites"},
    # the suites speak plain data (conformance.specs) and reach an implementation only through
    # the conformance layer: a vendor never receives this project's classes
    "suites": {"ring_impl"},
}


def forbidden_edges(edges: list[Edge], forbidden: dict[str, set[str]]) -> list[Edge]:
    return [e for e in edges if package_of(e.target) in forbidden.get(package_of(e.source), set())]


@pytest.fixture(scope="module")
def edges() -> list[Edge]:
    found = import_edges(ROOT, PACKAGES)
    assert any(e.source.startswith("harness.") for e in found), (
        "no import of the harness was read: wrong root?"
    )
    return found


def test_no_package_imports_a_layer_it_must_not(edges: list[Edge]) -> None:
    bad = forbidden_edges(edges, FORBIDDEN)
    assert not bad, "imports across the layers:\n" + "\n".join(map(str, bad))


def test_no_import_cycle_between_modules(edges: list[Edge]) -> None:
    loops = cycles(edges)
    assert not loops, "modules that import each other (around a loop): " + "; ".join(
        " <-> ".join(c)
        + " ("
        + ", ".join(str(e) for e in edges if e.source in c and e.target in c)
        + ")"
        for c in loops
    )


def test_no_import_cycle_between_packages(edges: list[Edge]) -> None:
    loops = cycles(edges, package_of)
    assert not loops, "packages that import each other (around a loop): " + "; ".join(
        " <-> ".join(c)
        + " ("
        + ", ".join(
            str(e)
            for e in edges
            if package_of(e.source) in c
            and package_of(e.target) in c
            and package_of(e.source) != package_of(e.target)
        )
        + ")"
        for c in loops
    )


def _write(root: Path, files: dict[str, str]) -> None:
    for name, text in files.items():
        path = root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)


def test_the_checks_catch_a_forbidden_import_and_cycles(tmp_path: Path) -> None:
    """The checks above on a small tree that breaks every rule, deferred and relative imports
    included: each is found, at its line."""
    _write(
        tmp_path,
        {
            "low/__init__.py": "",
            "low/pool.py": "from . import runner\n",
            "low/runner.py": "def f():\n    from low.pool import x\n    import high.cases\n",
            "high/__init__.py": "from low import pool\n",
            "high/cases.py": "from ..low import runner\nfrom high import helpers\n",
            "high/helpers.py": "import os\n",
        },
    )
    edges = import_edges(tmp_path, ("low", "high"))
    assert {(e.source, e.target, e.line) for e in edges} == {
        ("low.pool", "low.runner", 1),
        ("low.runner", "low.pool", 2),
        ("low.runner", "high.cases", 3),
        ("high", "low.pool", 1),
        ("high.cases", "low.runner", 1),
        ("high.cases", "high.helpers", 2),
    }
    assert [str(e) for e in forbidden_edges(edges, {"low": {"high"}})] == [
        "low/runner.py:3: low.runner imports high.cases"
    ]
    assert cycles(edges) == [["high.cases", "low.pool", "low.runner"]]
    assert cycles(edges, package_of) == [["high", "low"]]
    clean = [e for e in edges if e.target != "high.cases" and e.target != "low.pool"]
    assert cycles(clean) == [] and cycles(clean, package_of) == []
