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

from .heads import check_head_chunks
from .ops import accumulation_dtype
from .transports import get_transport
from .validate import exchange_nbytes

__all__ = ["collective_schedule"]

Schedule = dict[str, dict[str, dict[str, int]]]


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
        from .strategies.schedule import strategy_schedule

        mesh_shape = (world_size, 1) if mesh_shape is None and strategy == "ulysses" else mesh_shape
        if mesh_shape is None or heads is None or seq_q is None:
            raise ValueError(f"collective_schedule: strategy {strategy!r} needs mesh_shape, heads and seq_q")
        if mesh_shape[0] * mesh_shape[1] != world_size:
            raise ValueError(f"collective_schedule: mesh_shape {tuple(mesh_shape)} does not hold {world_size} ranks")
        return strategy_schedule(strategy, (mesh_shape[0], mesh_shape[1]), rotate_method, batch=batch, heads=heads, heads_kv=heads_kv,
                                 seq_q=seq_q, seq_kv=seq_kv, head_dim=head_dim, dtype=dtype, compiled=compiled,
                                 head_chunks=head_chunks, return_lse=return_lse)
    transport = get_transport(rotate_method)
    sizes = {"world_size": world_size, "batch": batch, "heads_kv": heads_kv, "seq_kv": seq_kv, "head_dim": head_dim}
    for name, value in sizes.items():
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"collective_schedule: {name} must be an int >= 1, got {value!r}")
    if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
        raise ValueError(f"collective_schedule: dtype must be a floating-point torch.dtype, got {dtype!r}")
    if not isinstance(compiled, bool):
        raise ValueError(f"collective_schedule: compiled must be a bool, got {compiled!r}")
    problem = check_head_chunks(head_chunks, heads_kv)
    if problem is not None:
        raise ValueError(f"collective_schedule: {problem}")
    fwd: dict[str, dict[str, int]] = {}
    bwd: dict[str, dict[str, int]] = {}
    if world_size > 1:
        elems = 2 * batch * heads_kv * seq_kv * head_dim
        kv = elems * dtype.itemsize
        dkv = elems * accumulation_dtype(dtype).itemsize
        if not compiled:
            fwd["all_reduce"] = {"calls": 1, "bytes": exchange_nbytes(world_size)}
        ring = transport.schedule(world_size, kv_bytes=kv, dkv_bytes=dkv, compiled=compiled)
        for phase, into in (("forward", fwd), ("backward", bwd)):
            for kind, entry in ring.get(phase, {}).items():
                into[kind] = {"calls": head_chunks * entry["calls"], "bytes": entry["bytes"]}
    return {"forward": fwd, "backward": bwd}
