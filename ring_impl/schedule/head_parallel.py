"""The collectives a head-parallel call issues, per phase, so a suite can assert them exactly.

Accounting convention as :mod:`ring_impl.schedule` (one entry per call a rank issues; the bytes
of an ``all_to_all`` are its whole input, this rank's own part included). Per rank, with local
lengths ``s_q``, ``s_kv``, ``it`` the input dtype's item size and ``acc`` the accumulation
dtype's, ``hkv' = heads_kv * e`` key/value heads after replication (``e = U / gcd(heads_kv, U)``,
see :mod:`ring_impl.exchanges.ulysses`), and ``U`` the Ulysses degree:

=========  ===================================================  =================================================
phase      all_to_all over the Ulysses group (U > 1)            the ring over the ring group (hybrid, R > 1)
=========  ===================================================  =================================================
forward    1 call, q + k + v:                                   ``ring_impl.collective_schedule(R, ...)`` of the
           ``b*((h*s_q + hkv'*s_kv)*d + hkv'*s_kv*dv)*it``;     ring shard: ``heads_kv = hkv'/U``, ``seq_kv =
           1 call, out (+ LSE): ``b*h*s_q*(dv*it [+ acc])``      U*s_kv``, without its input check
backward   1 call, dO (+ dLSE): ``b*h*s_q*(dv*it [+ acc])``;
           1 call, dQ + dK + dV: as the forward's first
=========  ===================================================  =================================================

``d``: query's and key's head dim, ``dv``: value's (``head_dim_v``, default ``d``). ``[+ acc]``:
only with ``return_lse`` (the LSE and its gradient then travel with the output).
The forward's input check adds ``all_reduce``: one call per mesh dim of size > 1 (eager, and
compiled through :mod:`ring_impl.compiled.checks`), each of :func:`ring_impl.checks.inputs.exchange_nbytes` bytes.
A rank's all-to-all bytes are the minimum for the two exchanges: every rank needs the whole sequence
of its heads; only ``e > 1`` with ``heads_kv`` not dividing ``U`` sends a key/value head to a rank
twice.
"""  # noqa: E501

from __future__ import annotations

from dataclasses import replace

from ..checks.mesh import exchange_calls, exchange_nbytes
from ..exchanges.ulysses import kv_replication
from ..planning.mesh_layout import check_strategy
from .ring import KVShards, check_size, ring_schedule

__all__ = ["strategy_schedule"]

Schedule = dict[str, dict[str, dict[str, int]]]


def _add(into: dict[str, dict[str, int]], kind: str, calls: int, nbytes: int) -> None:
    entry = into.setdefault(kind, {"calls": 0, "bytes": 0})
    entry["calls"] += calls
    entry["bytes"] += nbytes


def strategy_schedule(
    strategy: str,
    mesh_shape: tuple[int, int],
    rotate_method: str,
    kv: KVShards,
    *,
    heads: int,
    seq_q: int,
    compiled: bool = False,
    head_chunks: int = 1,
    return_lse: bool = True,
) -> Schedule:
    """``{phase: {kind: {"calls": n, "bytes": b}}}`` of one forward and one backward call of
    ``strategy`` ("ulysses" on a ``(U, 1)`` mesh, "hybrid" on ``(U, R)``) on ranks holding the
    shards ``kv`` and ``seq_q`` local query positions of ``heads`` heads. ValueError for bad
    sizes."""
    check_strategy(strategy)
    if strategy == "ring":
        raise ValueError("strategy_schedule: use ring_impl.collective_schedule for the ring")
    check_size("strategy_schedule", "heads", heads)
    check_size("strategy_schedule", "seq_q", seq_q)
    batch, heads_kv, seq_kv, head_dim = kv.batch, kv.heads_kv, kv.seq_kv, kv.head_dim
    u, r = (int(n) for n in mesh_shape)
    if strategy == "ulysses" and r != 1:
        raise ValueError(f"strategy_schedule: Ulysses runs on a (U, 1) mesh, got {mesh_shape!r}")
    if heads % u or heads % heads_kv:
        raise ValueError(
            f"strategy_schedule: heads {heads} must be divisible by the Ulysses degree {u} and by "
            f"heads_kv {heads_kv}"
        )
    fwd: dict[str, dict[str, int]] = {}
    bwd: dict[str, dict[str, int]] = {}
    it, acc = kv.dtype.itemsize, kv.acc_itemsize
    hkv = heads_kv * kv_replication(heads_kv, u)
    if exchange_calls(
        (u, r)
    ):  # the cross-rank input check, eager and compiled (ring_impl.compiled.checks)
        _add(
            fwd,
            "all_reduce",
            exchange_calls((u, r)),
            exchange_calls((u, r)) * exchange_nbytes(u * r),
        )
    if u > 1:
        qkv = (
            batch * ((heads * seq_q + hkv * seq_kv) * head_dim + hkv * seq_kv * kv.head_dim_v) * it
        )
        back = batch * heads * seq_q * (kv.head_dim_v * it + (acc if return_lse else 0))
        _add(fwd, "all_to_all", 2, qkv + back)
        _add(bwd, "all_to_all", 2, back + qkv)
    if strategy == "hybrid" and r > 1:
        # the ring of a row shard: the replicated heads split over U, U times the positions
        row_shard = replace(kv, heads_kv=hkv // u, seq_kv=u * seq_kv)
        ring = ring_schedule(
            r, rotate_method, row_shard, compiled=bool(compiled), head_chunks=head_chunks
        )
        ring["forward"].pop("all_reduce", None)  # the hybrid checks its input once, on the mesh
        for phase, into in (("forward", fwd), ("backward", bwd)):
            for kind, entry in ring[phase].items():
                _add(into, kind, entry["calls"], entry["bytes"])
    return {"forward": fwd, "backward": bwd}
