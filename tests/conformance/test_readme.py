"""The README's quickstart and .ci/run stay the same commands (CI runs what the README says)."""

from __future__ import annotations

import re
import shlex
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def _quickstart_commands() -> list[str]:
    text = (ROOT / "README.md").read_text()
    section = text.split("## Quickstart", 1)[1].split("\n## ", 1)[0]
    block = re.search(r"```bash\n(.*?)```", section, re.S)
    assert block, "README.md: the Quickstart section has no ```bash block"
    commands = []
    for line in block.group(1).splitlines():
        line = line.split("#", 1)[0].strip()
        commands += [c.strip() for c in line.split("&&") if c.strip()]
    return commands


def _ci_commands() -> list[str]:
    lines = (ROOT / ".ci" / "run").read_text().splitlines()
    return [ln.split("#", 1)[0].strip() for ln in lines if ln.strip().startswith("python")]


def test_ci_runs_the_readme_test_command() -> None:
    readme, ci = _quickstart_commands(), _ci_commands()
    assert ci, ".ci/run runs no python command"
    assert ci[-1] in readme, (
        f".ci/run's test command {ci[-1]!r} is not in README.md's quickstart {readme}"
    )


def test_ci_installs_what_the_quickstart_installs() -> None:
    readme_install = next(c for c in _quickstart_commands() if c.startswith("pip install"))
    wanted = {a for a in shlex.split(readme_install)[2:]}
    ci_args: set[str] = set()
    for c in _ci_commands():
        if " pip install " in f" {c} ":
            ci_args |= {
                a
                for a in shlex.split(c)
                if not a.startswith("--") and a not in ("python", "-m", "pip", "install")
            }
    assert wanted <= ci_args, (
        f".ci/run does not install {sorted(wanted - ci_args)} that README.md's quickstart installs"
    )
