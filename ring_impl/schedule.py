"""The collective schedule ring_impl declares, so a suite can assert it exactly.

Accounting convention (shared with ``harness.accounting``): one entry per collective call a
rank issues; the bytes of a call are the bytes of the tensors the rank passes in (for a recv,
the receive buffer). Batched p2p counts one ``send`` and one ``recv`` per hop.

Per phase, for ``W > 1`` and packed key/value bytes ``kv = 2*batch*heads_kv*seq_kv*head_dim*itemsize``
and gradient bytes ``dkv`` (the same elements in the accumulation dtype, float32 or float64):

============  ==========================================  =============================================
method        forward                                     backward
============  ==========================================  =============================================
allgather     all_gather: 1 call, kv                      all_gather: 1 call, kv; all_to_all: W-1, (W-1)*dkv
alltoall      all_to_all: W-1 calls, (W-1)*kv             all_to_all: T calls, (W-1)*(kv + dkv)
p2p           send, recv: W-1 calls each, (W-1)*kv each   send, recv: T each, (W-1)*(kv + dkv) each
============  ==========================================  =============================================

Every figure is the minimum of a ring: each pass needs every other rank's key/value once
(``W-1`` blocks), and every block's partial dK/dV must reach its owner, which in a ring takes
``W-1`` hops of ``dkv`` (a block's accumulator starts on the rank after its owner; the owner's
own contribution never leaves). ``allgather`` moves the accumulators the same way (see
:mod:`ring_impl.comm` for why not by reduce-scatter).

The backward's ``T`` transfers: eager, one per hop, ``T = 2W-2``. Compiled, a step's dK/dV
hop travels packed with the next key/value hop in one transfer (:class:`ring_impl.comm.Link`),
so ``W-1`` key/value hops and ``W-1`` dK/dV hops take ``T = 2`` transfers at ``W = 2`` and
``T = W + 1`` from ``W = 3`` on (the first two carry key/value only, the last two dK/dV only).

With ``head_chunks = c`` the ring runs ``c`` times over groups of heads (:mod:`ring_impl.heads`):
every ring call count is multiplied by ``c`` and the bytes are unchanged (the chunks split
``heads_kv``); the input check stays one all_reduce.

Compiled (``compiled=True``), ``p2p`` hops are ``all_to_all`` calls, counted as ``alltoall``'s
(see :func:`ring_impl.comm.shift`). Eager adds the forward's cross-rank input check:
all_reduce, 1 call (see :mod:`ring_impl.validate`). ``W == 1`` issues no collective at all.
"""

from __future__ import annotations

import torch

from .comm import check_rotate_method
from .heads import check_head_chunks
from .ops import accumulation_dtype
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
    check_rotate_method(rotate_method)
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
    c = head_chunks
    fwd: dict[str, dict[str, int]] = {}
    bwd: dict[str, dict[str, int]] = {}
    if world_size > 1:
        elems = 2 * batch * heads_kv * seq_kv * head_dim
        kv = elems * dtype.itemsize
        dkv = elems * accumulation_dtype(dtype).itemsize
        w = world_size
        if not compiled:
            fwd["all_reduce"] = {"calls": 1, "bytes": exchange_nbytes(w)}
        if rotate_method == "allgather":
            fwd["all_gather"] = {"calls": c, "bytes": kv}
            bwd["all_gather"] = {"calls": c, "bytes": kv}
            bwd["all_to_all"] = {"calls": c * (w - 1), "bytes": (w - 1) * dkv}
        else:
            # Compiled p2p hops are all-to-all permutations (see ring_impl.comm.shift).
            kinds = ("all_to_all",) if rotate_method == "alltoall" or compiled else ("send", "recv")
            for kind in kinds:
                fwd[kind] = {"calls": c * (w - 1), "bytes": (w - 1) * kv}
                bwd[kind] = {"calls": c * backward_transfers(w, compiled), "bytes": (w - 1) * (kv + dkv)}
    return {"forward": fwd, "backward": bwd}


def backward_transfers(world_size: int, compiled: bool = False) -> int:
    """Transfers of a ring method's backward: ``W - 1`` key/value and ``W - 1`` dK/dV hops;
    compiled, the two kinds share a transfer on steps ``2 .. W - 2`` (see the module docstring)."""
    hops = 2 * (world_size - 1)
    return min(hops, world_size + 1) if compiled and world_size > 1 else hops
