"""Tables in the docs made from a benchmark's JSON, never edited by hand.

A generated table sits in a Markdown file between two markers that name the benchmark whose
report it shows and that report's JSON (written by the benchmark's ``--json``), relative to the
repository root:

    <!-- table: host_work docs/results/host_work_cpu.json -->
    | row | ... |
    <!-- end table -->

    python benchmarks/tables.py            # rewrite every marked table from its JSON
    python benchmarks/tables.py --check    # exit 1 naming each table its JSON disagrees with

To refresh a table, run its benchmark with ``--json`` at the path the marker names, then this
script. ``RENDERERS`` holds how each benchmark's report becomes a table; a table whose
benchmark has none is an error, so every marker has a renderer.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
from collections.abc import Callable, Iterator

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

#: ``<!-- table: NAME PATH -->`` ... ``<!-- end table -->``, the table between them
MARKED = re.compile(
    r"(?P<open><!-- table: (?P<name>\S+) (?P<path>\S+) -->\n)"
    r"(?P<body>.*?)(?P<close><!-- end table -->)",
    re.DOTALL,
)


def host_work_table(report: dict) -> str:
    """``benchmarks/host_work.py``'s rows: a caption line with the run's machine and sizes, then
    per row its median microseconds and its exact counts."""
    args = report["args"]
    dtype = "bfloat16" if report["device"].startswith("cuda") else "float32"
    lines = [
        f"{report['device']}, torch {report['torch']}, seq {args['seq']}, {args['docs']} "
        f"documents, {args['heads']} heads of {args['head_dim']}, {dtype}, kernels stubbed; "
        f"median of {args['repeat']} interleaved rounds after {args['warmup']}:",
        "",
        "| row | us / call | aten ops | launches | reads |",
        "|---|---|---|---|---|",
    ]
    for row in report["rows"]:
        lines.append(
            f"| {row['row']} | {row['us']:.0f} | {row['aten_ops']} | {row['launches']} | "
            f"{row['reads']} |"
        )
    return "\n".join(lines) + "\n"


#: benchmark name (a script in benchmarks/) -> its report as a Markdown table
RENDERERS: dict[str, Callable[[dict], str]] = {"host_work": host_work_table}


def markdown_files(root: str) -> Iterator[str]:
    """The Markdown files that may hold marked tables: README.md and docs/*.md."""
    readme = os.path.join(root, "README.md")
    if os.path.exists(readme):
        yield readme
    docs = os.path.join(root, "docs")
    if os.path.isdir(docs):
        for name in sorted(os.listdir(docs)):
            if name.endswith(".md"):
                yield os.path.join(docs, name)


def rendered(text: str, root: str) -> tuple[str, list[str]]:
    """``text`` with every marked table made anew from its JSON, and the names
    (``NAME PATH``) of those that changed. Raises ValueError for a benchmark without a
    renderer and FileNotFoundError for a missing JSON."""
    changed: list[str] = []

    def table(match: re.Match) -> str:
        name, path = match["name"], match["path"]
        if name not in RENDERERS:
            raise ValueError(
                f"a table marked '{name}' has no renderer in benchmarks/tables.py RENDERERS "
                f"(known: {sorted(RENDERERS)})"
            )
        with open(os.path.join(root, path)) as f:
            body = RENDERERS[name](json.load(f))
        if body != match["body"]:
            changed.append(f"{name} {path}")
        return match["open"] + body + match["close"]

    return MARKED.sub(table, text), changed


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--check", action="store_true", help="change nothing; exit 1 if a table is out of date"
    )
    parser.add_argument("--root", default=ROOT, help="the repository root (default: this one)")
    args = parser.parse_args(argv)
    stale = []
    for path in markdown_files(args.root):
        with open(path) as f:
            text = f.read()
        new, changed = rendered(text, args.root)
        relative = os.path.relpath(path, args.root)
        stale += [f"{relative}: {name}" for name in changed]
        if changed and not args.check:
            with open(path, "w") as f:
                f.write(new)
    for line in stale:
        print(("out of date: " if args.check else "rewritten: ") + line)
    if stale and args.check:
        print("run `python benchmarks/tables.py` to make them from their JSON", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
