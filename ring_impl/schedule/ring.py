"""The ring's own collective schedule (one ring, any transport): what ``collective_schedule``
declares for ``strategy="ring"`` and the hybrid's ring dimension. Conventions in
:mod:`ring_impl.schedule`."""

from __future__ import annotations

import torch

from ..checks.inputs import exchange_nbytes
from ..exchanges.heads import check_head_chunks
from ..ops import accumulation_dtype
from ..transports import get_transport

__all__ = ["Schedule", "ring_schedule"]

Schedule = dict[str, dict[str, dict[str, int]]]


def ring_schedule(
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
    head_dim_v: int | None = None,
) -> Schedule:
    """``{phase: {kind: {"calls": n, "bytes": b}}}`` of one ring call (forward and backward);
    ``head_dim_v``: value's head dim (None: ``head_dim``). ValueError for sizes that are not
    ints >= 1 or a dtype that is not floating point."""
    transport = get_transport(rotate_method)
    head_dim_v = head_dim if head_dim_v is None else head_dim_v
    sizes = {
        "world_size": world_size,
        "batch": batch,
        "heads_kv": heads_kv,
        "seq_kv": seq_kv,
        "head_dim": head_dim,
        "head_dim_v": head_dim_v,
    }
    for name, value in sizes.items():
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"collective_schedule: {name} must be an int >= 1, got {value!r}")
    if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
        raise ValueError(
            f"collective_schedule: dtype must be a floating-point torch.dtype, got {dtype!r}"
        )
    if not isinstance(compiled, bool):
        raise ValueError(f"collective_schedule: compiled must be a bool, got {compiled!r}")
    problem = check_head_chunks(head_chunks, heads_kv)
    if problem is not None:
        raise ValueError(f"collective_schedule: {problem}")
    fwd: dict[str, dict[str, int]] = {}
    bwd: dict[str, dict[str, int]] = {}
    if world_size > 1:
        elems = batch * heads_kv * seq_kv * (head_dim + head_dim_v)
        kv = elems * dtype.itemsize
        dkv = elems * accumulation_dtype(dtype).itemsize
        # The cross-rank input check, eager and compiled (ring_impl.compiled.checks).
        fwd["all_reduce"] = {"calls": 1, "bytes": exchange_nbytes(world_size)}
        ring = transport.schedule(world_size, kv_bytes=kv, dkv_bytes=dkv, compiled=compiled)
        for phase, into in (("forward", fwd), ("backward", bwd)):
            for kind, entry in ring.get(phase, {}).items():
                into[kind] = {"calls": head_chunks * entry["calls"], "bytes": entry["bytes"]}
    return {"forward": fwd, "backward": bwd}
