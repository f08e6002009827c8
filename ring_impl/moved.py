"""Module paths that ring_impl's rooms replaced, still importable, with a ``DeprecationWarning``.

``import ring_impl.plan`` (or ``from ring_impl.validate import InputError``) gives the module
that now lives at :data:`MOVED`'s value: the same module object, so a patch applied through
either name is seen through both. Public names are re-exported by ``ring_impl`` itself and need
none of this; the table serves code written against the flat layout.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import sys
import warnings
from types import ModuleType

__all__ = ["MOVED", "install"]

#: old module path -> the module that holds its code
MOVED = {
    "ring_impl.balance": "ring_impl.planning.balance",
    "ring_impl.compiled_checks": "ring_impl.compiled.checks",
    "ring_impl.compiled_masks": "ring_impl.compiled.masked_call",
    "ring_impl.flex_route": "ring_impl.torch_api.flex_route",
    "ring_impl.halo": "ring_impl.exchanges.halo",
    "ring_impl.heads": "ring_impl.exchanges.heads",
    "ring_impl.kv_gather": "ring_impl.exchanges.kv_gather",
    "ring_impl.lse": "ring_impl.numerics.lse",
    "ring_impl.mask_table": "ring_impl.planning.mask_table",
    "ring_impl.max_logit": "ring_impl.numerics.max_logit",
    "ring_impl.merge": "ring_impl.numerics.merge",
    "ring_impl.nonfinite": "ring_impl.numerics.nonfinite",
    "ring_impl.packed": "ring_impl.planning.packed",
    "ring_impl.parallel_style": "ring_impl.torch_api.parallel_style",
    "ring_impl.plan": "ring_impl.planning.plan",
    "ring_impl.ring": "ring_impl.exchanges.ring",
    "ring_impl.ring_schedule": "ring_impl.schedule.ring",
    "ring_impl.row_bounds": "ring_impl.planning.row_bounds",
    "ring_impl.sdpa_route": "ring_impl.torch_api.sdpa_route",
    "ring_impl.strategies": "ring_impl.exchanges",
    "ring_impl.strategies.alltoall": "ring_impl.exchanges.head_alltoall",
    "ring_impl.strategies.api": "ring_impl.exchanges.head_parallel",
    "ring_impl.strategies.cp": "ring_impl.torch_api.hybrid_cp",
    "ring_impl.strategies.groups": "ring_impl.exchanges.mesh_groups",
    "ring_impl.strategies.hybrid": "ring_impl.exchanges.hybrid",
    "ring_impl.strategies.layout": "ring_impl.planning.mesh_layout",
    "ring_impl.strategies.schedule": "ring_impl.schedule.head_parallel",
    "ring_impl.strategies.ulysses": "ring_impl.exchanges.ulysses",
    "ring_impl.strategies.validate": "ring_impl.checks.mesh",
    "ring_impl.tiling": "ring_impl.planning.tiling",
    "ring_impl.uneven": "ring_impl.planning.uneven",
    "ring_impl.validate": "ring_impl.checks.inputs",
    # (ring_impl.context_parallel is the function of that name; its module moved to
    # ring_impl.torch_api.context_parallel and is reached by that path)
}


def _warn(old: str) -> None:
    warnings.warn(
        f"{old} is now {MOVED[old]}: import it from there", DeprecationWarning, stacklevel=3
    )


class _MovedFinder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Finds an old path in :data:`MOVED` and loads it as the module at its new path."""

    def find_spec(self, fullname, path=None, target=None):
        if fullname not in MOVED:
            return None
        # a package's old path keeps serving its submodules' old paths
        package = any(old.startswith(fullname + ".") for old in MOVED)
        return importlib.machinery.ModuleSpec(fullname, self, is_package=package)

    def create_module(self, spec):
        _warn(spec.name)
        module = importlib.import_module(MOVED[spec.name])
        self._spec = module.__spec__  # import machinery overwrites it with the old name's spec
        return module

    def exec_module(self, module: ModuleType) -> None:
        module.__spec__ = self._spec


def module_getattr(name: str) -> ModuleType:
    """``ring_impl.<old name>`` as an attribute (``ring_impl.__getattr__``)."""
    old = f"ring_impl.{name}"
    if old not in MOVED:
        raise AttributeError(f"module 'ring_impl' has no attribute {name!r}")
    if old not in sys.modules:
        importlib.import_module(old)
    return sys.modules[old]


def install() -> None:
    """Put the finder on ``sys.meta_path``, once per process."""
    # first: the path finder would otherwise load ring_impl.strategies.ulysses a second time,
    # from the moved package's folder, as a module of its own
    if not any(isinstance(f, _MovedFinder) for f in sys.meta_path):
        sys.meta_path.insert(0, _MovedFinder())
