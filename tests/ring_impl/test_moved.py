"""The flat module paths of ``ring_impl`` still import, as the modules that hold their code now
(``ring_impl.moved``): the same objects, so a patch through either name is seen through both,
with a ``DeprecationWarning`` that names the new path."""

from __future__ import annotations

import importlib
import subprocess
import sys

import pytest

from ring_impl.moved import MOVED


@pytest.mark.parametrize("old", sorted(MOVED))
def test_an_old_path_is_the_new_module_with_a_warning(old: str) -> None:
    new = importlib.import_module(MOVED[old])
    sys.modules.pop(old, None)  # so the import below goes through the finder again
    with pytest.warns(DeprecationWarning, match=MOVED[old].replace(".", r"\.")):
        module = importlib.import_module(old)
    assert module is new, f"{old} imported {module.__name__}, not {MOVED[old]}"
    assert module.__spec__.name == MOVED[old], "the module's own spec was replaced"


def test_old_names_serve_from_imports_and_attributes() -> None:
    """In a fresh interpreter: what code written against the flat layout does."""
    code = (
        "import warnings; warnings.simplefilter('ignore')\n"
        "import ring_impl\n"
        "from ring_impl.strategies import Ulysses, shard\n"
        "from ring_impl.strategies.layout import local_shard\n"
        "from ring_impl.validate import InputError\n"
        "from ring_impl.exchanges.ulysses import Ulysses as U\n"
        "from ring_impl.planning.mesh_layout import local_shard as ls, shard as sh\n"
        "assert Ulysses is U and local_shard is ls and shard is sh\n"
        "assert InputError is ring_impl.InputError\n"
        "from ring_impl import context_parallel\n"
        "assert callable(context_parallel), 'ring_impl.context_parallel is the function'\n"
        "assert ring_impl.plan is __import__('ring_impl.planning.plan').planning.plan\n"
        "try:\n"
        "    ring_impl.no_such_module\n"
        "except AttributeError:\n"
        "    pass\n"
        "else:\n"
        "    raise SystemExit('an unknown attribute was served')\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
