"""ci/vendor/torch_cp.txt, the expected failures of PyTorch's context parallel, stays true to the
suites and to its causes: every line names a collected test and a known cause, every cause has
its standalone reproduction, and each reproduction still shows its defect on the torch the file
was written for (the day PyTorch fixes one, this fails: regenerate the file)."""

from __future__ import annotations

import re
import sys
from pathlib import Path

import pytest
import torch

from conformance.report_plugin import parse_vendor_file
from harness.procs import pytest_command, run_tree

ROOT = Path(__file__).resolve().parents[2]
VENDOR = ROOT / "ci" / "vendor"
FILE = VENDOR / "torch_cp.txt"
TORCH_CP = "conformance.adapters.torch_cp:IMPLEMENTATION"

sys.path.insert(0, str(VENDOR))

from torch_cp_expectations import CAUSES  # noqa: E402


def _written_for() -> str:
    match = re.search(r"^# torch (\S+),", FILE.read_text(), re.M)
    assert match, (
        f"{FILE}: its header names no torch version (regenerate it with "
        "ci/vendor/torch_cp_expectations.py)"
    )
    return match.group(1)


def _written_on() -> str | None:
    """The CPU capability (``torch.backends.cpu.get_cpu_capability()``) the file was written on,
    or None where its header names none."""
    match = re.search(r"^# torch \S+, CPU capability (\S+),", FILE.read_text(), re.M)
    return match.group(1) if match else None


def test_every_line_names_a_known_cause_with_its_reproduction() -> None:
    entries = parse_vendor_file(FILE)
    assert entries, f"{FILE} lists no expected failure"
    for e in entries:
        tag = re.match(r"\[([a-z0-9-]+)\]", e.reason)
        assert tag and tag.group(1) in CAUSES, (
            f"{FILE}:{e.line}: no known [cause] in {e.reason!r} (known: {sorted(CAUSES)})"
        )
    for name, (_, _, script) in CAUSES.items():
        assert (VENDOR / "torch_repro" / script).is_file(), (
            f"cause {name}: its reproduction {script} is missing"
        )


def test_every_line_matches_a_collected_test() -> None:
    """Collection only (no case runs): a line whose test was renamed or dropped fails here."""
    done = run_tree(
        pytest_command(
            "suites",
            "--collect-only",
            "--impl",
            TORCH_CP,
            "--vendor-file",
            str(FILE),
            "--report-dir",
            "none",
        ),
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    stale = [
        line
        for line in (done.stdout + done.stderr).splitlines()
        if "matches no collected test" in line
    ]
    assert not stale, "vendor file lines that match no collected test:\n" + "\n".join(stale)


@pytest.mark.parametrize("cause", sorted(CAUSES))
def test_each_cause_still_reproduces(cause: str) -> None:
    version = _written_for()
    if torch.__version__.split("+")[0] != version:
        pytest.skip(
            f"{FILE.name} was written for torch {version}, this is {torch.__version__}: "
            "run ci/vendor/torch_cp_expectations.py on this torch to judge it"
        )
    script = VENDOR / "torch_repro" / CAUSES[cause][2]
    done = run_tree(
        [sys.executable, str(script)], cwd=ROOT, capture_output=True, text=True, timeout=120
    )
    here = torch.backends.cpu.get_cpu_capability()
    if done.returncode == 0 and _written_on() != here:
        # The CPU kernels' NaN and rounding behaviour differs by vector ISA (the flash kernel
        # hides NaN on some CPUs and not on an AVX2 one): a defect absent here is judged only on
        # the capability the file was written on.
        pytest.skip(
            f"{script.name} shows no defect on this CPU ({here}); {FILE.name} was written on "
            f"{_written_on() or 'a CPU its header does not name'}: run "
            "ci/vendor/torch_cp_expectations.py here to judge it"
        )
    assert done.returncode == 1, (
        f"{script.name} exits {done.returncode}: the defect behind [{cause}] no longer reproduces "
        f"on torch {torch.__version__} (fixed upstream?). Rerun the torch_cp suite and regenerate "
        f"{FILE.name}.\n" + done.stdout[-2000:] + done.stderr[-2000:]
    )
