"""Covering arrays: the quick tier's cases chosen by coverage, not by the full product.

A suite's matrix is a product of discrete axes (world size, dtype, causal, rotation, layout,
GQA, ...). The nightly tier runs the whole product. The quick tier runs a *pairwise* selection
from it: rows of the product such that every value of every axis, and every pair of values of
two axes that some row of the product holds together, appears in at least one selected row. A
bug that needs one value, or two values together (float16 with head_tail, p2p at W=3), is hit
by the quick tier; one that needs three at once may need the nightly tier.

:func:`pairwise` is a greedy covering array (one row at a time, the row of the product that
covers the most pairs not yet covered; ties go to the row that comes first in the product's
order), so the selection is deterministic: the same axes give the same rows on every machine,
worker and run, and a test id means the same case everywhere. :func:`combos` is what a suite
calls in place of ``itertools.product``: the product in the nightly tier, the pairwise rows
in the quick tier, so every quick case is also a nightly case. A case other tests select by id
is kept in the quick selection with ``keep``.

The selection has at least ``n_a * n_b`` rows for the two largest axes (every pair of their
values); greedy covering arrays stay close to that bound for the suites' axes.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import numpy as np
import pytest

from harness.pytest_plugin import settings_of

__all__ = ["combos", "pairs_of", "pairwise", "uncovered"]

Row = tuple[Any, ...]


def pairs_of(row: Row) -> set[tuple[tuple[int, Any], ...]]:
    """The values and pairs of values one row holds: ``((axis, value),)`` for each axis and
    ``((axis_i, value_i), (axis_j, value_j))`` for each two axes i < j."""
    cells = list(enumerate(row))
    return {(c,) for c in cells} | set(itertools.combinations(cells, 2))


def uncovered(rows: Iterable[Row], universe: Iterable[Row]) -> set[tuple[tuple[int, Any], ...]]:
    """The values and pairs some row of ``universe`` holds that no row of ``rows`` does (empty
    when ``rows`` covers ``universe`` pairwise). The plain definition, for checking a
    selection."""
    need = set().union(*(pairs_of(r) for r in universe))
    have = set().union(*(pairs_of(r) for r in rows))
    return need - have


def pairwise(
    *axes: Sequence[Any],
    where: Callable[..., bool] | None = None,
    keep: Iterable[Row] = (),
) -> list[Row]:
    """Rows of ``itertools.product(*axes)`` (those for which ``where(*row)`` holds) covering
    every value and every pair of values that some such row holds, in the product's order.

    ``keep``: rows selected whenever the product holds them (cases other tests select by id);
    a row of values outside the axes (a world size the session leaves out) is skipped, one that
    fails ``where`` is an error. The greedy rows cover what they leave. Deterministic: rows are
    added one at a time, each the one covering the most values and pairs not yet covered, the
    first in the product's order on a tie.
    """
    axes = tuple(tuple(a) for a in axes)
    rows = [r for r in itertools.product(*axes) if where is None or where(*r)]
    if not rows:
        return []
    keep = [
        tuple(r)
        for r in keep
        if len(r) == len(axes) and all(v in a for v, a in zip(r, axes, strict=True))
    ]
    refused = [r for r in keep if r not in rows]
    if refused:
        raise ValueError(f"rows to keep that `where` refuses: {refused}")
    # Each row as the ids of the cells (a value, or two values of two axes) it holds: value v
    # of axis i has index idx[i][v]; a single cell is (i, v), a pair (i, v, j, w) with i < j.
    idx = [{v: n for n, v in enumerate(a)} for a in axes]
    sizes = [len(a) for a in axes]
    offsets, start = {}, 0
    for i in range(len(axes)):
        offsets[(i,)] = start
        start += sizes[i]
    for i, j in itertools.combinations(range(len(axes)), 2):
        offsets[(i, j)] = start
        start += sizes[i] * sizes[j]
    coded = np.array([[idx[i][v] for i, v in enumerate(r)] for r in rows], dtype=np.int64)
    cols = [offsets[(i,)] + coded[:, i] for i in range(len(axes))]
    cols += [
        offsets[(i, j)] + coded[:, i] * sizes[j] + coded[:, j]
        for i, j in itertools.combinations(range(len(axes)), 2)
    ]
    cells = np.stack(cols, axis=1)  # (rows, cells per row)
    covered = np.ones(start, dtype=bool)
    covered[np.unique(cells)] = False  # what the product holds must be covered
    chosen = [rows.index(r) for r in dict.fromkeys(keep)]
    for n in chosen:
        covered[cells[n]] = True
    while not covered.all():
        gain = (~covered[cells]).sum(axis=1)
        n = int(np.argmax(gain))  # the first row of the largest gain
        chosen.append(n)
        covered[cells[n]] = True
    return [rows[n] for n in sorted(chosen)]


def combos(
    config: pytest.Config,
    *axes: Sequence[Any],
    where: Callable[..., bool] | None = None,
    keep: Iterable[Row] = (),
) -> list[Row]:
    """The rows of a suite's matrix for the session's tier: ``itertools.product(*axes)``
    (filtered by ``where``) in the nightly tier, :func:`pairwise` of the same in the quick tier.
    Used as ``for w, dtype, ... in combos(config, world_sizes(config), DTYPES, ...)``."""
    if settings_of(config).tier == "nightly":
        return [r for r in itertools.product(*axes) if where is None or where(*r)]
    return pairwise(*axes, where=where, keep=keep)
