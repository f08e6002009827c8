"""The conformance layer: what an implementation under test is, and how its verdicts are reported.

- :mod:`conformance.implementation`: the protocol an implementation follows (``ring_attention``,
  :class:`Capabilities`, ``collective_schedule``, ``record_steps``, ``api_module``) and
  loading one from ``--impl`` / ``RING_IMPL`` (or an attention op from ``--op`` / ``RING_OP``).
- :mod:`conformance.adapters`: the implementations shipped with the project (``ring_impl``, the
  default, and PyTorch's own context parallel).
- :mod:`conformance.report`: the report matrix (capability x rotation x dtype) and its files.
- :mod:`conformance.pytest_plugin` and :mod:`conformance.report_plugin`: their pytest glue
  (options, N/A, tier markers, vendor files, report files), loaded through ``pytest11`` entry
  points when the package is installed and through the root ``conftest.py`` in a checkout.

A vendor's adapter needs only::

    from conformance import Capabilities

Importing this package imports neither torch nor an implementation.
"""

from __future__ import annotations

from conformance.implementation import (
    DEFAULT_IMPL_SPEC,
    Capabilities,
    Implementation,
    ImplSpecError,
    ProtocolError,
    load_implementation,
    load_op,
)

__all__ = [
    "DEFAULT_IMPL_SPEC",
    "Capabilities",
    "ImplSpecError",
    "Implementation",
    "ProtocolError",
    "load_implementation",
    "load_op",
]
