"""The import graph of source trees, read with :mod:`ast` (nothing is imported or run).

Every ``import`` and ``from ... import`` counts, wherever it stands (module level, inside a
function, under ``if TYPE_CHECKING``): a deferred import is still a dependency. Relative imports
are resolved. ``from package import name`` is an edge to ``package.name`` when that is a module
of the tree, else to ``package``. Only edges between modules of the scanned packages are kept.
"""

from __future__ import annotations

import ast
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class Edge:
    """``source`` imports ``target`` at ``path``:``line``."""

    source: str
    target: str
    path: str
    line: int

    def __str__(self) -> str:
        return f"{self.path}:{self.line}: {self.source} imports {self.target}"


def module_names(root: Path, packages: Iterable[str]) -> dict[str, Path]:
    """Dotted module name -> source file, for every ``.py`` file of ``packages`` under ``root``."""
    modules = {}
    for package in packages:
        for path in sorted((root / package).rglob("*.py")):
            parts = list(path.relative_to(root).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            modules[".".join(parts)] = path
    return modules


def _resolve(module: str, is_package: bool, level: int, name: str | None) -> str:
    """The absolute name of ``from <level dots><name> import ...`` written in ``module``."""
    if level == 0:
        return name or ""
    base = module.split(".")
    # In a package's __init__, one dot is the package itself; in a module, its parent.
    base = base if is_package else base[:-1]
    base = base[: len(base) - (level - 1)]
    return ".".join([*base, name] if name else base)


def import_edges(root: Path, packages: Iterable[str]) -> list[Edge]:
    """Every import between modules of ``packages`` (see the module docstring)."""
    modules = module_names(root, packages)
    edges = []
    for module, path in modules.items():
        is_package = path.name == "__init__.py"
        tree = ast.parse(path.read_text(), filename=str(path))
        for node in ast.walk(tree):
            targets: list[str] = []
            if isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = _resolve(module, is_package, node.level, node.module)
                targets = [
                    f"{base}.{alias.name}" if f"{base}.{alias.name}" in modules else base
                    for alias in node.names
                ]
            for target in targets:
                # ``import a.b.c`` of a module outside the tree's modules: its longest known prefix.
                while target and target not in modules:
                    target = target.rpartition(".")[0]
                if target and target != module:
                    edges.append(Edge(module, target, str(path.relative_to(root)), node.lineno))
    return edges


def package_of(module: str) -> str:
    return module.split(".", 1)[0]


def cycles(edges: Iterable[Edge], node=lambda name: name) -> list[list[str]]:
    """The strongly connected components with more than one node of the graph whose nodes are
    ``node(module)`` (modules, or ``package_of`` for packages), each sorted; Tarjan's algorithm."""
    graph: dict[str, set[str]] = {}
    for e in edges:
        a, b = node(e.source), node(e.target)
        graph.setdefault(a, set())
        graph.setdefault(b, set())
        if a != b:
            graph[a].add(b)
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return sorted(found)
