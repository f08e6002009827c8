"""The conformance report: a matrix on the terminal, and JSON and Markdown files.

Input: one :class:`CaseRecord` per test (built from pytest reports by
conformance/report_plugin.py, so it works the same under xdist, where reports reach the
controller with their ``user_properties``).

The matrix has a row per (capability, rotation) and a column per dtype; a capability is a suite
module (``suites/test_<capability>.py``). A cell names the state of its cases and the worst error
ratio among them: ``max|X - R| / (max|B - R| + floor / k)``, the single-device ratio of the
numerics policy with the floor folded in, so it is always finite and a case passes its max-error
bound exactly when the ratio is at most ``k``.

States (pytest outcome -> cell): passed ``pass``, failed ``FAIL``, expected failure (vendor file)
``xfail``, unexpected pass of a non-strict expected failure ``XPASS``, declared lacking ``N/A``,
skipped ``skip``. A cell whose cases share one state shows it; ``FAIL`` wins over everything;
a cell with some passes and other states shows ``part p/n`` (p of its n cases passed); a cell
with no pass and several states joins them (``xfail+N/A``).

Only passes are passes. Scores use the full feature set as denominator: every collected case
counts, so failed, xfailed, xpassed, N/A and skipped cases lower the score instead of vanishing
from it.
"""

from __future__ import annotations

import json
import math
from collections import defaultdict
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

__all__ = [
    "OUTCOMES",
    "CaseRecord",
    "Report",
    "build_report",
    "render_markdown",
    "render_terminal",
    "to_json",
]

OUTCOMES = ("passed", "failed", "n/a", "skipped", "xfailed", "xpassed")
#: The cell text of each outcome.
STATES = {
    "passed": "pass",
    "failed": "FAIL",
    "xpassed": "XPASS",
    "xfailed": "xfail",
    "n/a": "N/A",
    "skipped": "skip",
}
#: Outcomes of a case that ran (a verdict was reached); N/A and skipped cases did not.
EXECUTED = ("passed", "failed", "xfailed", "xpassed")
DTYPE_ORDER = ("float64", "float32", "bfloat16", "float16", "any")
ROTATION_ORDER = ("allgather", "alltoall", "p2p", "any")


@dataclass
class CaseRecord:
    """One test's outcome, its case parameters (if a ring case) and error figures."""

    nodeid: str
    outcome: str  # one of OUTCOMES
    capability: str
    params: dict[str, Any] = field(default_factory=dict)
    verdicts: list[dict[str, Any]] = field(default_factory=list)
    duration_s: float = 0.0
    message: str = ""

    @property
    def dtype(self) -> str:
        return str(self.params.get("dtype") or "any")

    @property
    def rotation(self) -> str:
        return str(self.params.get("rotate_method") or "any")

    @property
    def worst_ratio(self) -> float | None:
        ratios = [r for r in (effective_ratio(v) for v in self.verdicts) if r is not None]
        return max(ratios) if ratios else None


def effective_ratio(v: dict[str, Any]) -> float | None:
    """max_err / (base_max_err + floor / k); None when the figures are missing."""
    try:
        denom = float(v["base_max_err"]) + float(v["floor"]) / float(v["k"])
        err = float(v["max_err"])
    except (KeyError, TypeError, ValueError, ZeroDivisionError):
        return None
    if not math.isfinite(err):
        return math.inf
    return err / denom if denom > 0 else (0.0 if err == 0 else math.inf)


@dataclass
class Cell:
    counts: dict[str, int] = field(default_factory=lambda: defaultdict(int))
    worst_ratio: float | None = None

    def add(self, rec: CaseRecord) -> None:
        self.counts[rec.outcome] += 1
        r = rec.worst_ratio
        if r is not None and (self.worst_ratio is None or r > self.worst_ratio):
            self.worst_ratio = r

    @property
    def status(self) -> str:
        c = self.counts
        present = [
            o for o in STATES if c.get(o)
        ]  # most telling first: xpassed, xfailed, n/a, skipped
        if c.get("failed"):
            return "FAIL"
        if len(present) == 1:
            return STATES[present[0]]
        if c.get("passed"):
            return f"part {c['passed']}/{sum(c.values())}"
        return "+".join(STATES[o] for o in present)

    def text(self) -> str:
        ratio = (
            ""
            if self.worst_ratio is None
            else (" inf" if math.isinf(self.worst_ratio) else f" {self.worst_ratio:.2g}")
        )
        return self.status + ratio


@dataclass
class Report:
    implementation: str
    header: dict[str, Any]
    records: list[CaseRecord]

    def counts(self, records: Iterable[CaseRecord] | None = None) -> dict[str, int]:
        c = {o: 0 for o in OUTCOMES}
        for r in self.records if records is None else records:
            c[r.outcome] = c.get(r.outcome, 0) + 1
        return c

    def score(self, records: Sequence[CaseRecord] | None = None) -> tuple[int, int]:
        """(passed, total) over every collected case: the full feature set is the denominator,
        and only a pass is a pass (not an xfail, an XPASS, N/A or a skip)."""
        recs = self.records if records is None else records
        return sum(r.outcome == "passed" for r in recs), len(recs)

    def executed(self, records: Iterable[CaseRecord] | None = None) -> int:
        """Cases that ran to a verdict (passed, failed, xfailed, xpassed)."""
        return sum(r.outcome in EXECUTED for r in (self.records if records is None else records))

    def capabilities(self) -> list[str]:
        return sorted({r.capability for r in self.records})

    def matrix(self) -> dict[tuple[str, str], dict[str, Cell]]:
        cells: dict[tuple[str, str], dict[str, Cell]] = defaultdict(lambda: defaultdict(Cell))
        for rec in self.records:
            cells[(rec.capability, rec.rotation)][rec.dtype].add(rec)
        return cells

    def dtypes(self) -> list[str]:
        seen = {r.dtype for r in self.records}
        return [d for d in DTYPE_ORDER if d in seen] + sorted(seen - set(DTYPE_ORDER))

    def rows(self) -> list[tuple[str, str]]:
        keys = set(self.matrix())
        order = {r: i for i, r in enumerate(ROTATION_ORDER)}
        return sorted(keys, key=lambda k: (k[0], order.get(k[1], 99), k[1]))


def build_report(
    implementation: str, header: dict[str, Any], records: Sequence[CaseRecord]
) -> Report:
    return Report(implementation, header, sorted(records, key=lambda r: r.nodeid))


def _table(report: Report) -> tuple[list[str], list[list[str]]]:
    dtypes = report.dtypes()
    matrix = report.matrix()
    head = ["capability", "rotation", *dtypes, "score"]
    body = []
    for cap, rot in report.rows():
        row_cells = matrix[(cap, rot)]
        recs = [r for r in report.records if r.capability == cap and r.rotation == rot]
        passed, total = report.score(recs)
        body.append(
            [
                cap,
                rot,
                *[row_cells[d].text() if d in row_cells else "" for d in dtypes],
                f"{passed}/{total}",
            ]
        )
    return head, body


def _summary_line(report: Report) -> str:
    passed, total = report.score()
    c = report.counts()
    pct = 100.0 * passed / total if total else 0.0
    return (
        f"{report.implementation}: {passed}/{total} cases pass ({pct:.1f}%); {c['failed']} "
        f"failed, {c['xfailed']} xfailed, {c['xpassed']} xpassed, {c['n/a']} N/A, {c['skipped']} "
        "skipped"
    )


LEGEND = (
    "cell: pass, FAIL, xfail (expected failure), XPASS (unexpected pass), N/A (declared lacking), "
    "skip, 'part p/n' (p of n passed, the rest in other states) or the states of a cell without "
    "passes joined by '+'; then the worst error ratio max|X-R| / (max|B-R| + floor/k): a case "
    "passes its max bound when the ratio <= k"
)


def render_terminal(report: Report) -> str:
    from tabulate import tabulate

    head, body = _table(report)
    return "\n".join([_summary_line(report), tabulate(body, head, tablefmt="simple"), LEGEND])


def render_markdown(report: Report) -> str:
    from tabulate import tabulate

    head, body = _table(report)
    lines = [
        f"## Ring attention conformance: {report.implementation}",
        "",
        f"**{_summary_line(report)}**",
        "",
    ]
    lines += [f"- {k}: `{v}`" for k, v in report.header.items()]
    lines += ["", tabulate(body, head, tablefmt="github"), "", LEGEND, ""]
    failed = [r for r in report.records if r.outcome in ("failed", "xpassed")]
    if failed:
        lines += ["### Failures", ""]
        for r in failed[:50]:
            first = (r.message.strip().splitlines() or [""])[0][:300]
            lines.append(f"- `{r.nodeid}`: {first}")
        if len(failed) > 50:
            lines.append(f"- ... and {len(failed) - 50} more (see the JSON report)")
        lines.append("")
    for outcome, title, fallback in (
        ("xfailed", "Expected failures (xfail)", "no reason given"),
        ("n/a", "N/A (what the implementation declares it lacks)", "declared lacking"),
        ("skipped", "Skipped", "no reason given"),
    ):
        reasons = _reasons(r for r in report.records if r.outcome == outcome)
        if reasons:
            lines += [f"### {title}", ""]
            lines += [f"- {n} x {reason or fallback}" for reason, n in reasons]
            lines.append("")
    return "\n".join(lines)


def _reasons(records: Iterable[CaseRecord]) -> list[tuple[str, int]]:
    """(first line of the message, count), most frequent first."""
    counts: dict[str, int] = defaultdict(int)
    for r in records:
        counts[(r.message.strip().splitlines() or [""])[0]] += 1
    return sorted(counts.items(), key=lambda x: (-x[1], x[0]))


def to_json(report: Report) -> str:
    """Every case with its parameters and error figures; strict JSON (inf/nan as strings)."""
    passed, total = report.score()
    doc = {
        "implementation": report.implementation,
        "header": report.header,
        "score": {"passed": passed, "total": total},
        "executed": report.executed(),
        "counts": report.counts(),
        "cases": [{**asdict(r), "worst_ratio": r.worst_ratio} for r in report.records],
    }
    return json.dumps(_jsonable(doc), indent=1, allow_nan=False)


def _jsonable(obj: Any) -> Any:
    if isinstance(obj, float) and not math.isfinite(obj):
        return str(obj)
    if isinstance(obj, dict):
        return {str(k): _jsonable(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_jsonable(v) for v in obj]
    if obj is None or isinstance(obj, (str, int, float, bool)):
        return obj
    return str(obj)
