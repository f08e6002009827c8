"""The ring's own collective schedule (one ring, any transport): what ``collective_schedule``
declares for ``strategy="ring"`` and the hybrid's ring dimension, and :class:`KVShards`, the
key/value sizes every path's bytes follow from. Conventions in :mod:`ring_impl.schedule`."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..checks.inputs import exchange_nbytes
from ..exchanges.heads import check_head_chunks
from ..ops import accumulation_dtype
from ..transports import get_transport

__all__ = ["KVShards", "Schedule", "ring_schedule"]

Schedule = dict[str, dict[str, dict[str, int]]]


@dataclass(frozen=True)
class KVShards:
    """One rank's key/value shards: key (batch, heads_kv, seq_kv, head_dim) and value
    (batch, heads_kv, seq_kv, head_dim_v) in ``dtype``. Every path moves whole packed rows of
    them (one position's key and value over every batch and head), so its bytes follow from
    :attr:`row` and the item sizes. Build it with :meth:`of`, which checks the sizes."""

    batch: int
    heads_kv: int
    seq_kv: int
    head_dim: int
    dtype: torch.dtype
    head_dim_v: int

    @classmethod
    def of(
        cls,
        *,
        batch: int,
        heads_kv: int,
        seq_kv: int,
        head_dim: int,
        dtype: torch.dtype,
        head_dim_v: int | None = None,
        who: str = "collective_schedule",
    ) -> KVShards:
        """The shards of these sizes (``head_dim_v`` None: ``head_dim``); ValueError, naming
        ``who``, for a size that is not an int >= 1 or a dtype that is not floating point."""
        head_dim_v = head_dim if head_dim_v is None else head_dim_v
        for name, value in (
            ("batch", batch),
            ("heads_kv", heads_kv),
            ("seq_kv", seq_kv),
            ("head_dim", head_dim),
            ("head_dim_v", head_dim_v),
        ):
            check_size(who, name, value)
        if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
            raise ValueError(f"{who}: dtype must be a floating-point torch.dtype, got {dtype!r}")
        return cls(batch, heads_kv, seq_kv, head_dim, dtype, head_dim_v)

    @property
    def row(self) -> int:
        """Elements of one packed key/value row: ``batch * heads_kv * (head_dim + head_dim_v)``."""
        return self.batch * self.heads_kv * (self.head_dim + self.head_dim_v)

    @property
    def acc_itemsize(self) -> int:
        """Bytes of one element of the dK/dV accumulators (the accumulation dtype)."""
        return accumulation_dtype(self.dtype).itemsize


def check_size(who: str, name: str, value: object) -> None:
    """ValueError, naming ``who`` and ``name``, unless ``value`` is an int >= 1 (not a bool)."""
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{who}: {name} must be an int >= 1, got {value!r}")


def ring_schedule(
    world_size: int,
    rotate_method: str,
    kv: KVShards,
    *,
    compiled: bool = False,
    head_chunks: int = 1,
) -> Schedule:
    """``{phase: {kind: {"calls": n, "bytes": b}}}`` of one ring call (forward and backward)
    over ``world_size`` ranks holding ``kv`` each. ValueError for a bad world size, transport,
    ``compiled`` or ``head_chunks``."""
    transport = get_transport(rotate_method)
    check_size("collective_schedule", "world_size", world_size)
    if not isinstance(compiled, bool):
        raise ValueError(f"collective_schedule: compiled must be a bool, got {compiled!r}")
    problem = check_head_chunks(head_chunks, kv.heads_kv)
    if problem is not None:
        raise ValueError(f"collective_schedule: {problem}")
    fwd: dict[str, dict[str, int]] = {}
    bwd: dict[str, dict[str, int]] = {}
    if world_size > 1:
        elems = kv.row * kv.seq_kv
        # The cross-rank input check, eager and compiled (ring_impl.compiled.checks).
        fwd["all_reduce"] = {"calls": 1, "bytes": exchange_nbytes(world_size)}
        ring = transport.schedule(
            world_size,
            kv_bytes=elems * kv.dtype.itemsize,
            dkv_bytes=elems * kv.acc_itemsize,
            compiled=compiled,
        )
        for phase, into in (("forward", fwd), ("backward", bwd)):
            for kind, entry in ring.get(phase, {}).items():
                into[kind] = {"calls": head_chunks * entry["calls"], "bytes": entry["bytes"]}
    return {"forward": fwd, "backward": bwd}
