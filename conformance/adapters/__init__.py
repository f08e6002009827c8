"""Implementations shipped with the project, in the protocol of :mod:`conformance.implementation`.

- ``conformance.adapters.ring_impl:IMPLEMENTATION``: this project's ring (the default; ``--impl
  ring_impl`` names it too).
- ``conformance.adapters.torch_cp:IMPLEMENTATION``: PyTorch's own context parallel.
"""
