"""The registered markers select what their help says: -m quick, -m nightly, -m compile,
-m "not compile", -m "world_size(n=2)", -m gpu (collection only, nothing runs)."""

from __future__ import annotations

import os
from pathlib import Path

from harness.procs import pytest_command, run_tree  # the command's process tree dies with the test

ROOT = Path(__file__).resolve().parents[2]


def collected(*args: str) -> list[str]:
    """Test ids ``pytest --collect-only`` selects with ``args`` (no cases run)."""
    env = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith(("PYTEST_XDIST", "PYTEST_CURRENT", "RING_"))
    }
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")])
    proc = run_tree(
        pytest_command("-p", "no:xdist", "--co", "--report-dir", "none", *args),
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode in (0, 5), proc.stdout[-3000:] + proc.stderr[-3000:]
    return [line for line in proc.stdout.splitlines() if "::" in line and not line.startswith(" ")]


def test_quick_selects_every_suite_case_of_the_default_tier_and_no_project_test() -> None:
    everything = collected("suites", "tests/ring_impl/test_head_chunks.py")
    quick = collected("suites", "tests/ring_impl/test_head_chunks.py", "-m", "quick")
    suites = [t for t in everything if t.startswith("suites/")]
    assert quick == suites and len(quick) > 700
    assert collected("suites", "-m", "nightly") == []  # the quick tier has no nightly-only case


def test_nightly_tier_marks_the_cases_the_quick_tier_lacks() -> None:
    quick_tier = set(collected("suites/test_lse_layouts.py", "suites/test_compile.py"))
    nightly_tier = collected(
        "suites/test_lse_layouts.py", "suites/test_compile.py", "--tier", "nightly"
    )
    nightly_only = collected(
        "suites/test_lse_layouts.py", "suites/test_compile.py", "--tier", "nightly", "-m", "nightly"
    )
    also_quick = collected(
        "suites/test_lse_layouts.py", "suites/test_compile.py", "--tier", "nightly", "-m", "quick"
    )
    assert sorted(nightly_only + also_quick) == sorted(nightly_tier) and nightly_only and also_quick
    # the quick tier's cases are the same cases in the nightly tier (same ids, same parameters)
    assert set(also_quick) == quick_tier
    assert not set(nightly_only) & quick_tier
    # forward_backward's nightly cases are larger (seq, head_dim): none is a quick-tier case
    assert (
        collected(
            "suites/test_forward_backward.py",
            "--tier",
            "nightly",
            "--world-sizes",
            "2",
            "-m",
            "quick",
        )
        == []
    )


def test_compile_marks_every_compiled_case_and_not_compile_leaves_them_out() -> None:
    paths = (
        "suites/test_compile.py",
        "suites/test_forward_backward.py",
        "tests/ring_impl/test_head_chunks.py",
    )
    compiled = collected(*paths, "-m", "compile")
    assert compiled and all("aot_eager" in t or "inductor" in t for t in compiled)
    assert len([t for t in compiled if t.startswith("suites/test_compile.py")]) == len(
        collected("suites/test_compile.py")
    )
    assert any("test_chunked_ring_compiles_in_one_order" in t for t in compiled)
    rest = collected(*paths, "-m", "not compile")
    assert not set(rest) & set(compiled) and len(rest) + len(compiled) == len(collected(*paths))


def test_world_size_and_gpu_select_by_the_case() -> None:
    w2 = collected(
        "suites/test_forward_backward.py", "suites/test_bad_input.py", "-m", "world_size(n=2)"
    )
    assert w2 and all("[W2-" in t or "-W2-" in t or "[W2]" in t for t in w2), w2[:5]
    gpu = collected("suites/test_bad_input.py", "-m", "gpu")
    assert gpu and all("device_mismatch" in t for t in gpu)
