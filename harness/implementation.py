"""The implementation-under-test protocol, and loading one from ``--impl`` / ``RING_IMPL``.

An implementation is any object (a module works too) with:

``ring_attention(query, key, value, *, group, is_causal, scale, rotate_method, op, layout, return_lse)``
    Same signature and semantics as :func:`ring_impl.ring_attention`: local shards
    ``(batch, heads, seq_local, head_dim)`` in ``layout`` in, the local output out (and the local
    LSE ``(batch, heads, seq_local)`` with ``return_lse=True``), differentiable in query, key and
    value. The suite shards and unshards the global tensors itself.

and optionally:

``capabilities``
    A :class:`Capabilities` (or a dict of its fields). A field left ``None`` is *undeclared*:
    the cases that need it are reported N/A, neither failed nor silently skipped.
``collective_schedule(world_size, rotate_method, *, batch, heads_kv, seq_kv, head_dim, dtype, compiled)``
    ``{phase: {kind: {"calls": n, "bytes": b}}}`` for one forward and one backward call, in the
    accounting convention of :mod:`harness.accounting`; the suite asserts it exactly.
``record_steps()``
    A context manager yielding an object with ``records`` (see :mod:`ring_impl.debug`), so a
    failure can be pinned to a ring step.
``baseline_op``
    The name of the :mod:`ring_impl.ops` kernel that matches the implementation's own local
    kernel; the single-device baseline of the numerics policy runs it (default: ``"auto"``).

``op`` is passed only when the implementation declares ``capabilities.ops``; a kernel the suite
is told to use (``--op``) is given as an op object (:class:`ring_impl.ops.AttentionOp`).
"""

from __future__ import annotations

import dataclasses
import importlib
import os
from dataclasses import dataclass
from typing import Any

__all__ = ["DEFAULT_IMPL_SPEC", "Capabilities", "ImplSpecError", "Implementation", "load_implementation", "load_op"]

DEFAULT_IMPL_SPEC = "harness.adapters.ring_impl:IMPLEMENTATION"


class ImplSpecError(ValueError):
    """A ``--impl`` / ``--op`` value that cannot be loaded; the message names the fix."""


@dataclass(frozen=True)
class Capabilities:
    """What an implementation claims. ``None`` means undeclared (cases report N/A)."""

    layouts: frozenset[str] | None = None
    rotate_methods: frozenset[str] | None = None
    dtypes: frozenset[str] | None = None  # "float64", "float32", "bfloat16", "float16"
    devices: frozenset[str] | None = None  # "cpu", "cuda"
    ops: frozenset[str] | None = None  # op names accepted by op=; "*" accepts op objects too
    backward: bool | None = None
    lse: bool | None = None  # return_lse=True supported
    gqa: bool | None = None
    cross_attention: bool | None = None  # non-causal with seq_kv != seq_q
    compile: bool | None = None  # works under torch.compile(fullgraph=True)
    input_errors: bool | None = None  # raises on every rank for bad input, never hangs
    context_parallel: bool | None = None  # offers context_parallel / ContextParallel (ring_impl API)

    @staticmethod
    def of(obj: Any) -> Capabilities:
        raw = getattr(obj, "capabilities", None)
        if raw is None:
            return Capabilities()
        if isinstance(raw, Capabilities):
            return raw
        if isinstance(raw, dict):
            known = {f.name for f in dataclasses.fields(Capabilities)}
            unknown = sorted(set(raw) - known)
            if unknown:
                raise ImplSpecError(f"capabilities has unknown fields {unknown}; known fields: {sorted(known)}")
            fields: dict[str, Any] = {k: frozenset(v) if isinstance(v, (list, tuple, set)) else v for k, v in raw.items()}
            return Capabilities(**fields)
        raise ImplSpecError(f"capabilities must be a harness.implementation.Capabilities or a dict, not {type(raw).__name__}")

    def declares(self, name: str, value: Any = True) -> bool | None:
        """True/False if the field is declared and contains/equals value, None if undeclared."""
        field = getattr(self, name)
        if field is None:
            return None
        if isinstance(field, frozenset):
            return value in field or "*" in field
        return bool(field) == bool(value)


@dataclass(frozen=True)
class Implementation:
    """A loaded implementation under test and the spec it came from (picklable by spec)."""

    spec: str
    obj: Any

    @property
    def name(self) -> str:
        return str(getattr(self.obj, "name", self.spec))

    @property
    def capabilities(self) -> Capabilities:
        return Capabilities.of(self.obj)

    def __reduce__(self):
        return (load_implementation, (self.spec,))


def _import_object(spec: str, what: str, option: str, env: str) -> Any:
    module_name, _, attr = spec.partition(":")
    if not module_name:
        raise ImplSpecError(f"{option}={spec!r}: expected 'package.module:object' or 'package.module' (or set {env})")
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise ImplSpecError(
            f"{option}={spec!r}: cannot import module {module_name!r} ({exc}); make it importable "
            f"(pip install it, or run pytest from the directory that contains it) or fix {env}"
        ) from exc
    if not attr:
        return module
    obj = module
    for part in attr.split("."):
        if not hasattr(obj, part):
            raise ImplSpecError(f"{option}={spec!r}: {module_name} has no attribute {attr!r}")
        obj = getattr(obj, part)
    return obj


_CACHE: dict[str, Implementation] = {}


def load_implementation(spec: str | None = None) -> Implementation:
    """Load ``package.module:object`` (default: ``RING_IMPL`` or ring_impl's adapter)."""
    spec = spec or os.environ.get("RING_IMPL") or DEFAULT_IMPL_SPEC
    if spec not in _CACHE:
        obj = _import_object(spec, "implementation", "--impl", "RING_IMPL")
        if not callable(getattr(obj, "ring_attention", None)):
            raise ImplSpecError(
                f"--impl={spec!r}: {obj!r} has no callable ring_attention; see harness/implementation.py for the protocol"
            )
        Capabilities.of(obj)  # validate now, at start, not in the middle of a run
        _CACHE[spec] = Implementation(spec, obj)
    return _CACHE[spec]


def load_op(spec: str):
    """An attention op object from ``package.module:object`` (``--op`` / ``RING_OP``) or a registered name."""
    from ring_impl import ops

    if ":" not in spec and "." not in spec:
        return ops.get_op(spec)
    obj = _import_object(spec, "attention op", "--op", "RING_OP")
    if isinstance(obj, type):
        obj = obj()
    missing = ops.missing_members(obj)
    if missing:
        raise ImplSpecError(f"--op={spec!r}: {obj!r} lacks {missing}; see ring_impl/ops.py (AttentionOp) for the contract")
    return obj
