"""The hybrid under ``context_parallel``: buffers sharded in the hybrid's global layout.

``context_parallel`` shards buffers over one process group in a ring_impl layout. For the hybrid
that group is the 2-D mesh flattened (its ranks in the mesh's row-major order), and the layout
is the hybrid's (:func:`ring_impl.planning.mesh_layout.position_ranges`) registered under a name
that records the mesh's shape and dim order, so shard, unshard and the gradients of buffers
follow it exactly as for the ring.
"""

from __future__ import annotations

import torch.distributed as dist

from ..exchanges.mesh_groups import DIM_NAMES
from ..layout import Layout, layouts, register_layout
from ..planning.mesh_layout import position_ranges, sequence_divisor

__all__ = ["hybrid_sharding"]


def hybrid_sharding(mesh, layout: str) -> tuple[dist.ProcessGroup, str]:
    """(the flattened mesh's process group, the registered layout of the hybrid's shards).

    ``mesh``: a 2-D DeviceMesh with dims named "ulysses" and "ring"; ValueError otherwise (the
    same on every rank passing the same kind of mesh). Flattening is a collective: every rank of
    the mesh calls this with the same mesh."""
    from torch.distributed.device_mesh import DeviceMesh

    names = tuple(getattr(mesh, "mesh_dim_names", None) or ())
    if not isinstance(mesh, DeviceMesh) or mesh.ndim != 2 or sorted(names) != sorted(DIM_NAMES):
        raise ValueError(
            "strategy='hybrid' under context parallel needs a 2-D DeviceMesh with dims named "
            "'ring' and 'ulysses' (e.g. init_device_mesh(device, (ring_degree, ulysses_degree), "
            "mesh_dim_names=('ring', 'ulysses')))"
        )
    shape = dict(zip(names, mesh.mesh.shape))
    u_size, r_size = int(shape["ulysses"]), int(shape["ring"])
    dims = tuple(int(n) for n in mesh.mesh.shape)
    name = f"hybrid({layout},{'x'.join(f'{n}={s}' for n, s in zip(names, dims))})"
    if name not in layouts():

        def coords(flat: int) -> tuple[int, int]:
            # row-major over the mesh's own dim order (what _flatten gives)
            idx = {names[1]: flat % dims[1], names[0]: flat // dims[1]}
            return idx["ulysses"], idx["ring"]

        def runs(seq_len: int, world: int, rank: int):
            return tuple(position_ranges("hybrid", layout, (u_size, r_size), coords(rank), seq_len))

        register_layout(
            Layout(name, runs, lambda world: sequence_divisor("hybrid", layout, (u_size, r_size)))
        )
    return mesh._flatten().get_group(), name
