"""Planning: what each rank computes, derived from the mask, the layout and the lengths.

- :mod:`.plan`: the per-step plan of the ring (which local query rows see which key rows).
- :mod:`.tiling`: one step's visibility cut into kernel calls.
- :mod:`.row_bounds`: a mask as one interval of keys per query row.
- :mod:`.mask_table`: a mask as a table of bits on the global grid (compiled ``MaskMod``).
- :mod:`.balance`: each rank's work under a mask, and the balancers.
- :mod:`.uneven`: uneven shards (``shard_lengths=``).
- :mod:`.packed`: packed THD inputs (``cu_seqlens=``).
- :mod:`.mesh_layout`: the global sequence layout each parallel strategy implies.
"""
