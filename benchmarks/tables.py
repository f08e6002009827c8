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


def _span(xs: list[float], fmt: str = "{:.2f}x") -> str:
    """``lo .. hi`` of ``xs`` (one value alone when they agree to the format)."""
    lo, hi = fmt.format(min(xs)), fmt.format(max(xs))
    return lo if lo == hi else f"{lo} .. {hi}"


def _verdict(aims: list[dict], bound: str) -> str:
    """``bound``, then "met" when every one of ``aims`` (a benchmark's own aim records:
    ``aim``, ``measured``, ``met``) is met, else each missed one with what it measured."""
    if not aims:
        return ""
    missed = [a for a in aims if not a["met"]]
    if not missed:
        return f"{bound}: met"
    return (
        f"{bound}: **not met** ("
        + "; ".join(f"{a['aim'].split(':')[0]} {a['measured']}" for a in missed)
        + ")"
    )


def _cpu_caption(cores: int, torch: str, load: str | None) -> str:
    load_text = f" (load average {load})" if load else ""
    return f"{cores} CPU cores{load_text}, torch {torch}"


def _sizes(bench: dict) -> str:
    return (
        f"batch {bench['batch']}, {bench['heads']} heads, head_dim {bench['head_dim']}, "
        f"{bench['dtype']}"
    )


def _per_world(caption: str, worlds: list[int], rows: list) -> str:
    """``caption``, then a table of one column per world size and an aim column: ``rows`` are
    ``(label, cells (one per world size), aim)``."""
    lines = [
        caption,
        "",
        "| | " + " | ".join(f"W={w}" for w in worlds) + " | aim |",
        "|---|" + "---|" * len(worlds) + "---|",
    ]
    lines += [f"| {label} | " + " | ".join(cells) + f" | {aim} |" for label, cells, aim in rows]
    return "\n".join(lines) + "\n"


def ring_table(report: dict) -> str:
    """``benchmarks/ring.py``'s speed, balance, memory and traffic summary: per world size the
    ring against single-process SDPA (ranges over the rotation methods; ``hcN``: the ring over
    N head groups), against PyTorch's ring with the same kernel, the causal balance, the
    per-rank peak memory at the longest sequence and the bytes sent against the minimum, each
    with the benchmark's aim and whether the run met it."""
    from benchmarks.ring import AIM_CAUSAL, AIM_FULL, AIM_MEMORY

    bench, env, a = report["bench"], report["env"], report["analysis"]
    worlds = list(bench["world_sizes"])
    speed = {(r["W"], r["name"]): r for r in a["speed"]}
    hc = f" hc{bench['lean_head_chunks']}" if bench["lean_head_chunks"] > 1 else ""

    def ring_ratio(world: int, kind: str) -> str:
        plain = [speed[(world, f"ring {kind} {rot}")]["vs_sdpa"] for rot in bench["ring_rotations"]]
        text = _span(plain)
        lean = [
            speed[(world, f"ring {kind} {rot}{hc}")]["vs_sdpa"]
            for rot in bench["lean_rotations"]
            if hc and (world, f"ring {kind} {rot}{hc}") in speed
        ]
        return text + (f" ({hc.strip()} {_span(lean)})" if lean else "")

    def aims(*words: str) -> list[dict]:
        return [x for x in a["aims"] if all(w in x["aim"] for w in words)]

    rows = [
        (
            "non-causal ring / SDPA",
            [ring_ratio(w, "full contiguous") for w in worlds],
            _verdict(aims("non-causal ring <="), f"<= {AIM_FULL}x"),
        ),
        (
            "causal `head_tail` ring / SDPA",
            [ring_ratio(w, "causal head_tail") for w in worlds],
            _verdict(aims("causal head_tail ring <="), f"<= {AIM_CAUSAL}x"),
        ),
        (
            "causal `contiguous` ring / SDPA",
            [ring_ratio(w, "causal contiguous") for w in worlds],
            "",
        ),
    ]
    versus = {
        w: [
            r["vs_torch_same_rotation"]
            for r in a["speed"]
            if r["W"] == w and r["impl"] == "ring" and r.get("vs_torch_same_rotation") is not None
        ]
        for w in worlds
    }
    if any(versus.values()):
        parity = aims("<= PyTorch's ring")
        rows.append(
            (
                "ring / PyTorch's ring, same inputs, kernel and rotation",
                [_span(versus[w]) if versus[w] else "" for w in worlds],
                f"parity: at or below in {sum(x['met'] for x in parity)} of {len(parity)} "
                "configurations",
            )
        )
    balance = {}
    for w in worlds:
        parts = []
        for layout in ("head_tail", "contiguous"):
            xs = [
                r["max_over_mean"]
                for r in a["balance"]
                if r["W"] == w and r["impl"] == "ring" and r["layout"] == layout
            ]
            if xs:
                parts.append(f"`{layout}` {_span(xs, '{:.2f}')}")
        balance[w] = ", ".join(parts)
    rows.append(
        ("balance, causal: max / mean kernel time per rank", [balance[w] for w in worlds], "")
    )
    longest = max((m["seq"] for m in a["memory"]), default=None)
    if longest is not None:
        memory = {
            w: ", ".join(
                f"{m['name'].split(' ', 2)[2]} {m['vs_single']:.2f}x"
                for m in a["memory"]
                if m["seq"] == longest
                and m["W"] == w
                and " ring " in f" {m['name']} "
                and m["vs_single"] is not None
            )
            for w in worlds
        }
        # (an aim reads "seq=N W=4 ring <configuration>: per-rank peak <= ...")
        met = [
            "`" + x["aim"].split(":")[0].split(" ring ", 1)[1] + "`"
            for x in aims("per-rank peak")
            if x["met"]
        ]
        rows.append(
            (
                f"per-rank peak memory / one process (seq {longest})",
                [memory[w] for w in worlds],
                f"<= {AIM_MEMORY}x at W=4: "
                + (f"met by {', '.join(met)}" if met else "**not met**"),
            )
        )
    sent = {
        w: [t["ratio"] for t in a["traffic"] if t["W"] == w and t["impl"] == "ring"] for w in worlds
    }
    if any(sent.values()):
        torch_bwd = {
            w: [
                t["ratio"]
                for t in a["traffic"]
                if t["W"] == w and t["impl"] == "torch" and t["phase"] == "backward"
            ]
            for w in worlds
        }
        theirs = "; ".join(f"W={w} {_span(torch_bwd[w], '{:.2f}')}" for w in worlds if torch_bwd[w])
        rows.append(
            (
                "bytes sent / minimum, forward and backward",
                [_span(sent[w], "{:.2f}") if sent[w] else "" for w in worlds],
                _verdict(aims("traffic = minimum"), "= 1")
                + (f" (PyTorch's backward: {theirs})" if theirs else ""),
            )
        )
    caption = (
        f"{_cpu_caption(bench['cores'], env['torch'], env.get('load_after'))}; {_sizes(bench)}, "
        f"seq {bench['seq']}, fastest of {bench['repeat']}, forward + backward of the slowest "
        "rank; ranges over the rotation methods:"
    )
    return _per_world(caption, worlds, rows)


def masks_table(report: dict) -> str:
    """``benchmarks/masks.py``'s summary: packed documents per layout against one process
    running the same kernel per document (the varlen floor; against the faster of W and the
    machine's cores threads) and over the full mask, the core-per-rank estimate, the layouts'
    balance, and the sliding window against the banded single process with its bytes against
    the halo minimum; each with its aim and whether the run met it."""
    from benchmarks.masks import AIM_TIME, AIM_WORK

    bench, env, a = report["bench"], report["env"], report["analysis"]
    worlds = list(bench["world_sizes"])
    docs = {(d["W"], d["layout"]): d for d in a["documents"]}
    window = {w["W"]: w for w in a["window"]}
    sparse, ring = "work_balanced + sparse_kv", "work_balanced"

    def values(layouts: tuple[str, ...], key: str) -> list[list[float]]:
        """Per world size, ``key`` of each of ``layouts``' rows (those the run has)."""
        return [
            [docs[(w, x)][key] for x in layouts if docs.get((w, x), {}).get(key) is not None]
            for w in worlds
        ]

    def row(label: str, per_world: list[list[float]], fmt: str, bound: float | None = None):
        """A table row: per world size its values in ``fmt``, and the aim: every value at most
        ``bound`` (none: no aim)."""
        cells = [" / ".join(fmt.format(x) for x in xs) for xs in per_world]
        if bound is None or not any(per_world):
            return label, cells, ""
        unit = "x" if fmt.endswith("x") else ""
        missed = [f"W={w}" for w, xs in zip(worlds, per_world) if xs and max(xs) > bound]
        verdict = "met" if not missed else f"**not met** at {', '.join(missed)}"
        return label, cells, f"<= {bound:g}{unit}: {verdict}"

    per_doc = "vs_single_per_document_best_threads"
    estimate = "core_per_rank_estimate_vs_single_per_document"
    rows = [
        row(
            "work-aware, sparse gather / single per document",
            values((sparse,), per_doc),
            "{:.2f}x",
            AIM_TIME,
        ),
        row("work-aware ring / single per document", values((ring,), per_doc), "{:.2f}x", AIM_TIME),
        row(
            "core-per-rank estimate: sparse gather / ring",
            values((sparse, ring), estimate),
            "{:.2f}x",
            AIM_TIME,
        ),
        row(
            "`head_tail` / `contiguous` ring / single per document",
            values(("head_tail", "contiguous"), per_doc),
            "{:.2f}x",
        ),
        row(
            "work-aware ring / sparse gather / single full mask",
            values((ring, sparse), "vs_single_full_mask"),
            "{:.2f}x",
            AIM_TIME,
        ),
        row(
            "`rank_work` max / mean: work-aware layout",
            values((ring,), "work_max_over_mean"),
            "{:.3f}",
            AIM_WORK,
        ),
        row(
            "`rank_work` max / mean: `head_tail` / `contiguous`",
            values(("head_tail", "contiguous"), "work_max_over_mean"),
            "{:.3f}",
        ),
    ]
    if window:
        banded = [
            [window[w]["vs_single_banded_best_threads"]] if w in window else [] for w in worlds
        ]
        sent = [
            [window[w]["forward_ratio"], window[w]["backward_ratio"]] if w in window else []
            for w in worlds
        ]
        rows.append(
            row(
                f"window {bench['window']}, `contiguous`: ring / single banded",
                banded,
                "{:.2f}x",
                AIM_TIME,
            )
        )
        rows.append(
            row(
                f"window {bench['window']}: bytes sent / halo minimum, forward / backward",
                sent,
                "{:.2f}",
                1.0,
            )
        )
    visible = next(iter(a["documents"]), {}).get("visible_over_s2")
    shown = f" ({visible:.1%} of S² visible)" if visible is not None else ""
    caption = (
        f"{_cpu_caption(bench['cores'], env['torch'], env.get('load_after'))}; {_sizes(bench)}, "
        f"documents over seq {bench['seq']}{shown}, fastest of {bench['repeat']}; single per "
        f"document: against the faster of W and {bench['cores']} threads:"
    )
    return _per_world(caption, worlds, rows)


def strategies_table(report: dict) -> str:
    """``benchmarks/strategies.py``'s grid: per heads and sequence, non-causal / causal, each
    strategy's time over single-process SDPA, the fastest, and the bytes each strategy sends
    per rank against its minimum."""
    from benchmarks.strategies import STRATEGIES

    bench, rows = report["bench"], report["rows"]
    u, r = bench["mesh"]
    names = {"ring": "ring", "ulysses": "Ulysses", "hybrid": f"hybrid {u}x{r}"}
    lines = [
        f"{_cpu_caption(bench['cores'], report.get('torch', '?'), report.get('load'))}; W="
        f"{bench['world']} as {bench['world']} single-threaded ranks, float32, batch "
        f"{bench['batch']}, head_dim {bench['head_dim']}; forward + backward of the slowest rank, "
        f"fastest of {bench['repeat']}, against one process's SDPA on {bench['world']} threads "
        "(non-causal / causal):",
        "",
        "| heads | seq | " + " | ".join(f"{names[s]} / SDPA" for s in STRATEGIES) + " | fastest |",
        "|---|---|" + "---|" * len(STRATEGIES) + "---|",
    ]
    by_point = {(x["heads"], x["seq"], x["causal"]): x for x in rows}
    for heads, seq in sorted({(x["heads"], x["seq"]) for x in rows}):
        pair = [by_point.get((heads, seq, c)) for c in (False, True)]
        ratios = [
            " / ".join(f"{p[s + '_ratio']:.2f}x" if p else "-" for p in pair) for s in STRATEGIES
        ]
        fastest = " / ".join(names[p["winner"]] if p else "-" for p in pair)
        lines.append(f"| {heads} | {seq} | " + " | ".join(ratios) + f" | {fastest} |")
    sent = {s: max(max(x[f"{s}_bytes_ratio"].values()) for x in rows) for s in STRATEGIES}
    heads, seq = min(x["heads"] for x in rows), max(x["seq"] for x in rows)
    point = by_point.get((heads, seq, False)) or by_point[(heads, seq, True)]
    mib = {s: sum(point[f"{s}_bytes"].values()) / 2**20 for s in STRATEGIES}
    lines += [
        "",
        "Bytes sent per rank / the strategy's minimum, the largest over the grid and both phases: "
        + ", ".join(f"{names[s]} {sent[s]:.2f}" for s in STRATEGIES)
        + f"; sent per rank, forward + backward, at {heads} heads x {seq}: "
        + ", ".join(f"{names[s]} {mib[s]:.0f} MiB" for s in STRATEGIES)
        + ".",
    ]
    return "\n".join(lines) + "\n"


def score_mod_table(report: dict) -> str:
    """``benchmarks/ring.py --score-mod``: per world size the plain call on CPU flash and on the
    math op, the soft-capped call (math), and the soft-capped call's ratios to both."""
    bench = report["bench"]
    lines = [
        f"{_cpu_caption(bench['cores'], report.get('torch', '?'), report.get('load'))}; causal "
        f"`head_tail`, `alltoall`, {bench['dtype']}, batch {bench['batch']}, {bench['heads']} "
        f"heads, head_dim {bench['head_dim']}, seq {bench['seq']}; forward + backward of the "
        f"slowest rank, fastest of {bench['repeat']}:",
        "",
        "| W | plain CPU flash | plain math | softcap (math) | softcap / plain math "
        "| softcap / plain CPU flash |",
        "|---|---|---|---|---|---|",
    ]
    for row in report["rows"]:
        lines.append(
            f"| {row['world']} | {row['plain cpu_flash']:.2f} s | {row['plain math']:.2f} s | "
            f"{row['softcap math']:.2f} s | {row['softcap / plain math']:.2f}x | "
            f"{row['softcap / plain cpu_flash']:.2f}x |"
        )
    return "\n".join(lines) + "\n"


#: benchmark name (a script in benchmarks/) -> its report as a Markdown table
RENDERERS: dict[str, Callable[[dict], str]] = {
    "cuda_masks": cuda_masks_table,
    "cuda_ops": cuda_ops_table,
    "host_work": host_work_table,
    "masks": masks_table,
    "ring": ring_table,
    "score_mod": score_mod_table,
    "strategies": strategies_table,
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
    if ROOT not in sys.path:  # (the renderers import their benchmark's aims)
        sys.path.insert(0, ROOT)
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
