"""Conformance from an installed package: build the sdist and, from it, the wheel; install the
wheel into a fresh virtual environment; run the suites from an empty directory against a vendor's
implementation, as a vendor would::

    pip install ring_attention_conformance-*.whl
    python -m pytest --pyargs suites -n auto --impl acme.ring:IMPL

The plugins must come from the package's ``pytest11`` entry points (there is no conftest.py in an
empty directory), the reports land in the working directory, and a failure's repro command runs
as printed. The package under test is the wheel: the checkout is not on any path, and the test
checks where every package was imported from.

The fresh environment gets nothing from the one running this test: pip installs the wheel and
its dependencies into it, as a vendor's pip would, from the indexes pip is configured with (CI:
``pip install torch==<version>`` resolves to a local wheel, offline). torch is pinned to the
version running this test. ``--no-compile`` skips byte-compiling torch's sources, which is most of
an install's time on 2 cores.
"""

from __future__ import annotations

import ast
import importlib.metadata
import json
import os
import re
import shlex
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from harness.procs import run_tree  # every command's process tree dies with the test

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("ring_impl", "reference", "harness", "conformance", "suites")

VENDOR = '''
"""A vendor's ring as the suites see it: ring_impl's ring, declared for float32 and alltoall."""

import ring_impl
from conformance import Capabilities

CAPABILITIES = Capabilities(
    layouts=frozenset({"contiguous", "head_tail"}), rotate_methods=frozenset({"alltoall"}),
    dtypes=frozenset({"float32"}), devices=frozenset({"cpu"}), compile=False,
    record_steps=False, context_parallel=False, masks=frozenset(), sinks=False,
)


class AcmeRing:
    name = "acme-ring"
    capabilities = CAPABILITIES
    ring_attention = staticmethod(ring_impl.ring_attention)
    collective_schedule = staticmethod(ring_impl.collective_schedule)


class AcmeRingOffByOne(AcmeRing):
    """Adds 1e-3 to every output element: a bug the float32 policy cannot miss."""

    name = "acme-ring-off"

    @staticmethod
    def ring_attention(*args, **kwargs):
        result = ring_impl.ring_attention(*args, **kwargs)
        if isinstance(result, tuple):
            return result[0] + 1e-3, result[1]
        return result + 1e-3


IMPL = AcmeRing()
BROKEN = AcmeRingOffByOne()
'''

#: Run by the fresh environment's python in the empty directory: where each package comes from,
#: and what a case that needs a file of the repository (examples/) does without a checkout.
INSTALLED_PROBE = f"""
import json
import pytest
import {", ".join(PACKAGES)}
from suites.checkout import checkout_file
try:
    checkout_file("examples", "context_parallel_tutorial.py")
    skipped = None
except pytest.skip.Exception as exc:
    skipped = str(exc)
print(json.dumps({{"files": {{m.__name__: m.__file__ for m in ({", ".join(PACKAGES)})}}, "skipped": skipped}}))
"""  # noqa: E501

SELECTION = (
    "test_forward_backward_match_reference and (W2-f32-causal-alltoall or "
    "W2-f64-causal-alltoall-contiguous) or test_collectives and W2-f32-causal-alltoall-contiguous"
)
FAILING_CASE = "test_forward_backward_match_reference[W2-f32-causal-alltoall-contiguous]"


def _run(
    argv: list[str], *, cwd: Path, env: dict[str, str], timeout: float
) -> subprocess.CompletedProcess:
    return run_tree(argv, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)


def _ok(proc: subprocess.CompletedProcess, what: str) -> None:
    assert proc.returncode == 0, (
        f"{what} failed ({proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    )


def _copy_sources(dst: Path) -> None:
    """The files a source distribution is built from, without build outputs and caches."""
    shutil.copytree(
        ROOT,
        dst,
        ignore=shutil.ignore_patterns(
            ".git",
            "reports",
            "build",
            "dist",
            "*.egg-info",
            "__pycache__",
            ".venv",
            ".tox",
            ".*_cache",
            ".hypothesis",
        ),
    )


def test_suites_run_from_an_installed_wheel_in_an_empty_directory(tmp_path: Path) -> None:
    pytest.importorskip(
        "build", reason="building the wheel needs the 'build' package: pip install -e '.[test]'"
    )
    base_env = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith(("PYTEST_", "RING_", "PYTHON")) and k not in ("VIRTUAL_ENV",)
    }

    # 1. sdist, then the wheel built from it
    src, dist = tmp_path / "src", tmp_path / "dist"
    _copy_sources(src)
    _ok(
        _run(
            [sys.executable, "-m", "build", "--no-isolation", "--outdir", str(dist), str(src)],
            cwd=tmp_path,
            env=base_env,
            timeout=300,
        ),
        "python -m build",
    )
    wheels, sdists = sorted(dist.glob("*.whl")), sorted(dist.glob("*.tar.gz"))
    assert len(wheels) == 1 and len(sdists) == 1, sorted(p.name for p in dist.iterdir())

    # 2. a fresh environment with the wheel and the dependencies it declares
    venv = tmp_path / "venv"
    _ok(
        _run(
            [sys.executable, "-m", "venv", "--without-pip", str(venv)],
            cwd=tmp_path,
            env=base_env,
            timeout=120,
        ),
        "python -m venv",
    )
    python = venv / "bin" / "python"
    torch_version = importlib.metadata.version("torch").split("+", 1)[
        0
    ]  # the torch running this test
    install = _run(
        [
            sys.executable,
            "-m",
            "pip",
            "--python",
            str(python),
            "install",
            "--quiet",
            "--no-compile",
            f"torch=={torch_version}",
            str(wheels[0]),
        ],
        cwd=tmp_path,
        env=base_env,
        timeout=600,
    )
    assert install.returncode == 0, (
        "pip could not install the wheel and its dependencies into a fresh environment "
        f"({install.returncode}); this test needs pip configured with an index or --find-links "
        f"that has torch=={torch_version} and the test dependencies (pip config "
        f"list):\n{install.stdout[-3000:]}\n{install.stderr[-3000:]}"
    )
    site = Path(
        _run(
            [str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
            cwd=tmp_path,
            env=base_env,
            timeout=60,
        ).stdout.strip()
    )

    # 3. a vendor's package, and an empty working directory
    vendor, work = tmp_path / "vendor", tmp_path / "work"
    (vendor / "acme").mkdir(parents=True)
    (vendor / "acme" / "__init__.py").write_text("")
    (vendor / "acme" / "ring.py").write_text(textwrap.dedent(VENDOR))
    work.mkdir()
    env = {**base_env, "PYTHONPATH": str(vendor)}

    probe = _run([str(python), "-c", INSTALLED_PROBE], cwd=work, env=env, timeout=120)
    _ok(probe, "importing the installed packages")
    found = json.loads(probe.stdout)
    for module, path in found["files"].items():
        assert Path(path).is_relative_to(site), (
            f"{module} was imported from {path}, not from the installed wheel in {site}"
        )
    # the examples are not in the wheel: the case that runs one skips, saying how to include it
    assert found["skipped"] and "run the suites from a checkout" in found["skipped"], found

    # 4. the suites, from the empty directory
    run = _run(
        [
            str(python),
            "-m",
            "pytest",
            "--pyargs",
            "suites",
            "-n",
            "2",
            "-p",
            "no:cacheprovider",
            "--impl",
            "acme.ring:IMPL",
            "--world-sizes",
            "2",
            "-k",
            SELECTION,
        ],
        cwd=work,
        env=env,
        timeout=600,
    )
    _ok(run, "pytest --pyargs suites --impl acme.ring:IMPL")
    # the plugins came from the wheel's entry points: pytest names their distribution in its header
    name, version = wheels[0].name.split("-")[:2]
    dist_pattern = re.escape(name).replace("_", "[-_]") + "-" + re.escape(version)
    assert re.search(rf"^plugins: .*\b{dist_pattern}\b", run.stdout, re.M), run.stdout[:3000]
    assert (
        "ring attention conformance" in run.stdout and "acme-ring: 3/4 cases pass" in run.stdout
    ), run.stdout[-3000:]
    report = work / "reports"
    doc = json.loads((report / "conformance.json").read_text())
    outcomes = {c["nodeid"]: c["outcome"] for c in doc["cases"]}
    assert outcomes == {
        "suites/test_forward_backward.py::test_forward_backward_match_reference"
        "[W2-f32-causal-alltoall-contiguous]": "passed",
        "suites/test_forward_backward.py::test_forward_backward_match_reference"
        "[W2-f32-causal-alltoall-head_tail]": "passed",
        "suites/test_forward_backward.py::test_forward_backward_match_reference"
        "[W2-f64-causal-alltoall-contiguous]": "n/a",
        "suites/test_collectives.py::test_collectives_match_declared_schedule"
        "[W2-f32-causal-alltoall-contiguous-hkv4]": "passed",
    }, outcomes
    assert (
        (report / "conformance.md")
        .read_text()
        .startswith("## Ring attention conformance: acme-ring")
    )
    assert (report / "conformance.xml").is_file()

    # 5. a failure's repro command, run as printed from the same directory, fails the same way
    failing = _run(
        [
            str(python),
            "-m",
            "pytest",
            "--pyargs",
            "suites",
            "-p",
            "no:cacheprovider",
            "-p",
            "no:xdist",
            "--impl",
            "acme.ring:BROKEN",
            "--world-sizes",
            "2",
            "--report-dir",
            "none",
            "-k",
            f"test_forward_backward_match_reference and {FAILING_CASE.split('[')[1].rstrip(']')}",
        ],
        cwd=work,
        env=env,
        timeout=300,
    )
    assert failing.returncode == 1, failing.stdout[-3000:] + failing.stderr[-2000:]
    line = re.search(r"^repro: (.*)$", failing.stdout, re.M)
    assert line, failing.stdout[-3000:]
    words = shlex.split(line.group(1))
    assert (
        words[:2] == ["pytest", f"suites.test_forward_backward::{FAILING_CASE}"]
        and "--pyargs" in words
    ), words
    again = _run(
        [str(python), "-m", *words, "-p", "no:cacheprovider", "--report-dir", "none"],
        cwd=work,
        env=env,
        timeout=300,
    )
    assert again.returncode == 1, again.stdout[-3000:] + again.stderr[-2000:]
    assert "1 failed" in again.stdout and "out[rank=" in again.stdout, again.stdout[-3000:]


def test_entry_points_are_the_plugins_the_root_conftest_lists() -> None:
    """One name per plugin module in both places, so a checkout with the package installed
    (pip install -e .) registers each plugin once."""
    tomllib = pytest.importorskip(
        "tomllib", reason="reading pyproject.toml needs Python 3.11's tomllib"
    )
    entry_points = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["entry-points"][
        "pytest11"
    ]
    assert all(name == module for name, module in entry_points.items()), entry_points
    conftest = (ROOT / "conftest.py").read_text()
    listed = re.search(r"pytest_plugins = (\[.*?\])", conftest, re.S)
    assert listed, "conftest.py has no pytest_plugins list"
    assert sorted(entry_points) == sorted(ast.literal_eval(listed.group(1)))
