"""Input checks that fail on every rank, before any collective, never with a hang.

- :mod:`.inputs`: one call's arguments, and the agreement across ranks (``InputError``).
- :mod:`.mesh`: the head-parallel strategies' checks on every rank of the mesh.
"""
