"""The collective schedule ring_impl declares, so a suite can assert it exactly.

Per phase (forward, backward) and collective kind, the calls and bytes one rank issues for one
call of ``ring_attention`` and its backward. The ring's collectives come from the transport
(``rotate_method``; each declares its own in :mod:`ring_impl.transports`), with packed key/value
bytes ``kv = 2*batch*heads_kv*seq_kv*head_dim*itemsize`` and dK/dV accumulator bytes ``dkv`` (the
same elements in the accumulation dtype, float32 or float64):

============  ==========================================  =============================================
method        forward                                     backward
============  ==========================================  =============================================
allgather     all_gather: 1 call, kv                      all_gather: 1 call, kv; all_to_all: W-1, (W-1)*dkv
alltoall      all_to_all: W-1 calls, (W-1)*kv             all_to_all: T calls, (W-1)*(kv + dkv)
p2p           send, recv: W-1 calls each, (W-1)*kv each   send, recv: T each, (W-1)*(kv + dkv) each
============  ==========================================  =============================================

``T = 2W - 2`` eager; compiled ``T = 2`` at ``W = 2`` and ``W + 1`` from ``W = 3`` on (see
:mod:`ring_impl.transports.neighbour`); compiled p2p hops count as ``all_to_all``. Every figure is
the minimum of a ring.

With ``head_chunks = c`` the ring runs ``c`` times over groups of heads (:mod:`ring_impl.heads`):
every ring call count is multiplied by ``c`` and the bytes are unchanged (the chunks split
``heads_kv``). Eager adds the forward's cross-rank input check: all_reduce, 1 call (see
:mod:`ring_impl.validate`). ``W == 1`` issues no collective at all.
"""

from __future__ import annotations

import torch

from .ring_schedule import Schedule, ring_schedule
from .strategies.schedule import strategy_schedule

__all__ = ["collective_schedule"]


def collective_schedule(
    world_size: int,
    rotate_method: str,
    *,
    batch: int,
    heads_kv: int,
    seq_kv: int,
    head_dim: int,
    dtype: torch.dtype,
    compiled: bool = False,
    head_chunks: int = 1,
    strategy: str = "ring",
    mesh_shape: tuple[int, int] | None = None,
    heads: int | None = None,
    seq_q: int | None = None,
    return_lse: bool = True,
) -> Schedule:
    """``{phase: {kind: {"calls": n, "bytes": b}}}`` for one forward and one backward call.

    ``seq_kv`` is the local key/value length per rank. Sizes must be ints >= 1 and ``dtype`` a
    floating-point dtype (ValueError otherwise). ``strategy="ulysses"`` / ``"hybrid"`` also take
    ``mesh_shape`` (ulysses degree, ring degree; product ``world_size``), ``heads``, ``seq_q``
    (local) and ``return_lse``: see :mod:`ring_impl.strategies.schedule`.
    """
    if strategy != "ring":
        mesh_shape = (world_size, 1) if mesh_shape is None and strategy == "ulysses" else mesh_shape
        if mesh_shape is None or heads is None or seq_q is None:
            raise ValueError(f"collective_schedule: strategy {strategy!r} needs mesh_shape, heads and seq_q")
        if mesh_shape[0] * mesh_shape[1] != world_size:
            raise ValueError(f"collective_schedule: mesh_shape {tuple(mesh_shape)} does not hold {world_size} ranks")
        return strategy_schedule(strategy, (mesh_shape[0], mesh_shape[1]), rotate_method, batch=batch, heads=heads, heads_kv=heads_kv,
                                 seq_q=seq_q, seq_kv=seq_kv, head_dim=head_dim, dtype=dtype, compiled=compiled,
                                 head_chunks=head_chunks, return_lse=return_lse)
    return ring_schedule(world_size, rotate_method, batch=batch, heads_kv=heads_kv, seq_kv=seq_kv, head_dim=head_dim,
                         dtype=dtype, compiled=compiled, head_chunks=head_chunks)
