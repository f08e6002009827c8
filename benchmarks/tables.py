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
script (a GPU run: ``ci/gpu_check.py`` writes ``bench_cuda_masks.json``, ``bench_cuda_ops.json``
and ``bench_host_work.json`` under its ``--out``; copy them under ``docs/results/``).
``RENDERERS`` holds how each benchmark's report becomes a table; a table whose benchmark has none
is an error, so every marker has a renderer.
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


def cuda_masks_table(report: dict) -> str:
    """``benchmarks/cuda_masks.py``'s rows: per family and length, each row's median
    milliseconds, its ratio to the family's first row (the kernel called directly), and the
    profiled call's launches, reads and GPU busy share (its GPU time over the timed call's
    wall time); a row that failed shows its error."""
    lines = [
        f"{report['device']}, torch {report['torch']}, CUDA {report['cuda']}; {report['dtype']}, "
        f"batch 1, {report['heads']} heads, head_dim {report['head_dim']}, window "
        f"{report['window']}; forward + backward, median of {report['repeat']} after "
        f"{report['warmup']} warm-ups; the ring at W=1 on NCCL:",
        "",
        "| family | seq | documents | row | ms | ratio | launches | reads | GPU busy |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for row in report["rows"]:
        head = f"| {row['mask']} | {row['seq']} | {row['documents'] or ''} | {row['row']} |"
        if "error" in row:
            lines.append(f"{head} error: {row['error']} |||||")
            continue
        ratio = "" if row["ratio"] is None else f"{row['ratio']:.2f}x"
        busy = row["gpu_busy_ms"] / row["ms"] if row["ms"] else float("nan")
        lines.append(
            f"{head} {row['ms']:.2f} | {ratio} | {row['launches']} | {row['items']} | {busy:.2f} |"
        )
    return "\n".join(lines) + "\n"


def cuda_ops_table(report: dict) -> str:
    """``benchmarks/cuda_ops.py``'s rows: the unmasked ring at W=1 against the bare kernel, time
    and peak memory above the inputs."""
    lines = [
        f"{report['device']}, torch {report['torch']}:",
        "",
        "| op | seq | causal | bare ms | ring ms | ring / bare | bare peak MiB | ring peak MiB "
        "| ring / bare peak |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for row in report["rows"]:
        peak = row["ring_peak_mib"] / max(row["bare_peak_mib"], 2**-20)
        lines.append(
            f"| {row['op']} | {row['seq']} | {row['causal']} | {row['bare_ms']:.2f} | "
            f"{row['ring_ms']:.2f} | {row['ring_ms'] / row['bare_ms']:.3f}x | "
            f"{row['bare_peak_mib']:.0f} | {row['ring_peak_mib']:.0f} | {peak:.2f}x |"
        )
    return "\n".join(lines) + "\n"


#: benchmark name (a script in benchmarks/) -> its report as a Markdown table
RENDERERS: dict[str, Callable[[dict], str]] = {
    "cuda_masks": cuda_masks_table,
    "cuda_ops": cuda_ops_table,
    "host_work": host_work_table,
}


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
