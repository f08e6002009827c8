"""Tables in the docs are made from benchmarks' JSON by ``benchmarks/tables.py``: every marked
table in this repository equals what its JSON renders, a stale one is found and rewritten, and a
marker naming a benchmark without a renderer is refused."""

from __future__ import annotations

import json
import os
import sys

import pytest

from harness.procs import run_tree

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

REPORT = {
    "device": "cpu",
    "torch": "9.9.9",
    "args": {"seq": 64, "docs": 3, "heads": 2, "head_dim": 8, "repeat": 7, "warmup": 2},
    "rows": [
        {"row": "documents forward", "us": 123.4, "aten_ops": 17, "launches": 6, "reads": 1},
        {"row": "window forward", "us": 98.6, "aten_ops": 16, "launches": 5, "reads": 1},
    ],
}


def _tables(*args: str) -> tuple[int, str]:
    done = run_tree(
        [sys.executable, os.path.join(ROOT, "benchmarks", "tables.py"), *args],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    return done.returncode, done.stdout + done.stderr


def test_the_repositorys_tables_are_their_json() -> None:
    code, said = _tables("--check")
    assert code == 0, said


def test_marked_tables_exist() -> None:
    """(The check above cannot fail on a repository without markers.)"""
    from benchmarks.tables import MARKED, markdown_files

    found = [m["name"] for path in markdown_files(ROOT) for m in MARKED.finditer(open(path).read())]
    assert "host_work" in found, found


def _repo(tmp_path, body: str) -> str:
    (tmp_path / "docs" / "results").mkdir(parents=True)
    (tmp_path / "docs" / "results" / "hw.json").write_text(json.dumps(REPORT))
    (tmp_path / "docs" / "bench.md").write_text(
        "before\n<!-- table: host_work docs/results/hw.json -->\n"
        + body
        + "<!-- end table -->\nafter\n"
    )
    return str(tmp_path)


def test_a_stale_table_is_found_and_made_from_its_json(tmp_path) -> None:
    root = _repo(tmp_path, "| row | hand-edited |\n")
    code, said = _tables("--check", "--root", root)
    assert code == 1 and "docs/bench.md: host_work docs/results/hw.json" in said, said
    code, said = _tables("--root", root)
    assert code == 0, said
    text = (tmp_path / "docs" / "bench.md").read_text()
    assert text.startswith("before\n<!-- table: host_work docs/results/hw.json -->\n")
    assert text.endswith("<!-- end table -->\nafter\n")
    assert "| documents forward | 123 | 17 | 6 | 1 |" in text
    assert "| window forward | 99 | 16 | 5 | 1 |" in text
    assert "torch 9.9.9, seq 64, 3 documents, 2 heads of 8, float32" in text
    assert "hand-edited" not in text
    code, said = _tables("--check", "--root", root)
    assert code == 0, said


def test_a_table_without_a_renderer_is_refused(tmp_path) -> None:
    from benchmarks.tables import rendered

    with pytest.raises(ValueError, match="'nonesuch' has no renderer"):
        rendered("<!-- table: nonesuch docs/results/hw.json -->\nx\n<!-- end table -->", ROOT)


def test_the_gpu_benchmarks_reports_render() -> None:
    """The reports of benchmarks/cuda_masks.py and cuda_ops.py (their JSON's keys, as those
    scripts write them) become tables; a failed row shows its error."""
    from benchmarks.tables import RENDERERS

    masks = {
        "device": "NVIDIA H200",
        "torch": "2.11.0",
        "cuda": "13.0",
        "dtype": "bfloat16",
        "heads": 16,
        "head_dim": 128,
        "window": 1024,
        "warmup": 2,
        "repeat": 5,
        "rows": [
            {
                "mask": "documents",
                "seq": 16384,
                "documents": 16,
                "row": "varlen",
                "ms": 2.5,
                "ratio": 1.0,
                "launches": 4,
                "syncs": 0,
                "items": 0,
                "copies_to_host": 0,
                "profiled_wall_ms": 2.6,
                "gpu_busy_ms": 2.45,
            },
            {"mask": "documents", "seq": 16384, "documents": 16, "row": "flex", "error": "E: x"},
        ],
    }
    table = RENDERERS["cuda_masks"](masks)
    assert "| documents | 16384 | 16 | varlen | 2.50 | 1.00x | 4 | 0 | 0.98 |" in table
    assert "| documents | 16384 | 16 | flex | error: E: x |" in table
    ops = {
        "device": "NVIDIA H200",
        "torch": "2.11.0",
        "rows": [
            {
                "op": "cuda_flash",
                "seq": 16384,
                "causal": True,
                "bare_ms": 2.0,
                "ring_ms": 2.1,
                "bare_peak_mib": 100.0,
                "ring_peak_mib": 125.0,
            }
        ],
    }
    assert "| cuda_flash | 16384 | True | 2.00 | 2.10 | 1.050x | 100 | 125 | 1.25x |" in (
        RENDERERS["cuda_ops"](ops)
    )


def _stored(name: str) -> dict:
    with open(os.path.join(ROOT, "docs", "results", name)) as f:
        return json.load(f)


def _row(table: str, label: str) -> str:
    (line,) = [x for x in table.splitlines() if x.startswith(f"| {label} |")]
    return line


def test_the_masks_table_says_which_aims_a_run_missed() -> None:
    """The verdicts come from the figures: a ratio above the aim at one world size is named as
    missed there, and the same row with every ratio within the aim reads met."""
    from benchmarks.masks import AIM_TIME
    from benchmarks.tables import RENDERERS

    report = _stored("masks_cpu.json")
    label = "work-aware, sparse gather / single per document"
    rows = [d for d in report["analysis"]["documents"] if d["layout"].endswith("sparse_kv")]
    worlds = sorted(d["W"] for d in rows)
    for d in rows:
        d["vs_single_per_document_best_threads"] = AIM_TIME - 0.01
    assert _row(RENDERERS["masks"](report), label).endswith(f"| <= {AIM_TIME:g}x: met |")
    rows[-1]["vs_single_per_document_best_threads"] = AIM_TIME + 0.5
    line = _row(RENDERERS["masks"](report), label)
    assert line.endswith(f"**not met** at W={rows[-1]['W']} |"), line
    assert f"{AIM_TIME + 0.5:.2f}x" in line and len(worlds) >= 2
    # A row of two configurations misses where either does.
    label = "core-per-rank estimate: sparse gather / ring"
    estimate = "core_per_rank_estimate_vs_single_per_document"
    for d in report["analysis"]["documents"]:
        d[estimate] = AIM_TIME - 0.01
    ring = next(
        d
        for d in report["analysis"]["documents"]
        if d["layout"] == "work_balanced" and d["W"] == worlds[0]
    )
    ring[estimate] = AIM_TIME + 0.2
    line = _row(RENDERERS["masks"](report), label)
    assert line.endswith(f"**not met** at W={worlds[0]} |"), line


def test_the_ring_table_takes_its_verdicts_from_the_runs_aims() -> None:
    from benchmarks.tables import RENDERERS

    report = _stored("ring_cpu.json")
    label = "non-causal ring / SDPA"
    aims = [a for a in report["analysis"]["aims"] if "non-causal ring <=" in a["aim"]]
    for a in aims:
        a["met"] = True
    assert _row(RENDERERS["ring"](report), label).endswith(": met |")
    aims[0]["met"], aims[0]["measured"] = False, "9.99x"
    line = _row(RENDERERS["ring"](report), label)
    assert "**not met**" in line and "9.99x" in line, line


def test_the_strategies_table_shows_each_cell_non_causal_then_causal() -> None:
    from benchmarks.tables import RENDERERS

    report = _stored("strategies_cpu.json")
    point = next(r for r in report["rows"] if not r["causal"])
    point["ring_ratio"], point["winner"] = 2.0, "ulysses"
    twin = next(
        r
        for r in report["rows"]
        if r["causal"] and (r["heads"], r["seq"]) == (point["heads"], point["seq"])
    )
    twin["winner"] = "ring"
    line = _row(RENDERERS["strategies"](report), f"{point['heads']} | {point['seq']}")
    assert "| 2.00x / " in line and line.endswith("| Ulysses / ring |"), line
