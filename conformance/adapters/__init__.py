"""Implementations shipped with the project, in the protocol of :mod:`harness.implementation`.

- ``harness.adapters.ring_impl:IMPLEMENTATION``: this project's ring (the default).
- ``harness.adapters.torch_cp:IMPLEMENTATION``: PyTorch's own context parallel.
"""
