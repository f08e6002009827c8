"""Files of a repository checkout that some suite cases run (the examples), when there is one.

The installed package ships the suites without the repository's ``examples/``; a case that needs
such a file skips there, saying so, instead of failing on a missing path.
"""

from __future__ import annotations

from pathlib import Path

import pytest

__all__ = ["ROOT", "checkout_file"]

#: The repository root when the suites run from a checkout (site-packages when installed).
ROOT = Path(__file__).resolve().parents[1]


def checkout_file(*parts: str) -> Path:
    """``ROOT/<parts>``; skips the calling test when it is not there (installed suites)."""
    path = ROOT.joinpath(*parts)
    if not path.is_file():
        pytest.skip(
            f"needs {'/'.join(parts)} of the repository, which the installed package does not "
            "ship: run the suites from a checkout of the repository to include this case"
        )
    return path
