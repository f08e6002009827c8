"""Collective accounting: which collectives a rank issues, how often and how many bytes, per phase.

:class:`CollectiveLog` is a ``TorchDispatchMode`` used on a rank::

    with CollectiveLog() as log:
        with log.phase("forward"):
            out = ring_attention(q, k, v)
        with log.phase("backward"):
            out.sum().backward()
    log.summary()   # {"forward": {"all_to_all": {"calls": 3, "bytes": 98304}}, "backward": {...}}

It sees functional collectives (``_c10d_functional.*``, including those inside
``batch_p2p_ops``), their autograd variants and the eager c10d ops (``c10d.allreduce_``,
``c10d.send`` ... which ``dist.batch_isend_irecv`` also issues), and the collectives autograd runs
in backward (the mode is propagated to the autograd engine's threads).

Normalised kinds: ``all_gather``, ``all_to_all``, ``reduce_scatter``, ``all_reduce``,
``broadcast``, ``send``, ``recv``, ``barrier``, and ``other:<op>`` for any other c10d op (say
``other:c10d::reduce_``). ``wait_tensor`` and ``_wrap_tensor_autograd`` are bookkeeping, not
collectives, and are not counted.

Bytes of a call: the total ``nbytes`` of the tensors this rank passes as input (for ``recv`` the
receive buffer; for ``all_to_all_single`` the whole input tensor; ``barrier`` counts 0). Each
``isend`` / ``irecv`` inside one batched p2p call counts as one ``send`` / ``recv``.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

DEFAULT_PHASE = "default"
KINDS = (
    "all_gather",
    "all_to_all",
    "reduce_scatter",
    "all_reduce",
    "broadcast",
    "send",
    "recv",
    "barrier",
)

_COLLECTIVE_NAMESPACES = ("c10d", "_c10d_functional", "_c10d_functional_autograd")
_IGNORED = frozenset({"wait_tensor", "_wrap_tensor_autograd", "check_for_nan"})

# op name (without namespace and overload) -> (kind,
# index of the argument holding the input tensors)
_FUNCTIONAL: dict[str, tuple[str, int]] = {
    "all_reduce": ("all_reduce", 0),
    "all_reduce_": ("all_reduce", 0),
    "all_reduce_coalesced": ("all_reduce", 0),
    "all_reduce_coalesced_": ("all_reduce", 0),
    "all_gather_into_tensor": ("all_gather", 0),
    "all_gather_into_tensor_out": ("all_gather", 0),
    "all_gather_into_tensor_coalesced": ("all_gather", 0),
    "reduce_scatter_tensor": ("reduce_scatter", 0),
    "reduce_scatter_tensor_out": ("reduce_scatter", 0),
    "reduce_scatter_tensor_coalesced": ("reduce_scatter", 0),
    "all_to_all_single": ("all_to_all", 0),
    "broadcast": ("broadcast", 0),
    "broadcast_": ("broadcast", 0),
    "isend": ("send", 0),
    "irecv": ("recv", 0),
}
_EAGER: dict[str, tuple[str, int]] = {
    "allreduce_": ("all_reduce", 0),
    "allreduce_coalesced_": ("all_reduce", 0),
    "_allgather_base_": ("all_gather", 1),
    "allgather_": ("all_gather", 1),
    "allgather_coalesced_": ("all_gather", 1),
    "allgather_into_tensor_coalesced_": ("all_gather", 1),
    "alltoall_base_": ("all_to_all", 1),
    "alltoall_": ("all_to_all", 1),
    "_reduce_scatter_base_": ("reduce_scatter", 1),
    "reduce_scatter_": ("reduce_scatter", 1),
    "reduce_scatter_tensor_coalesced_": ("reduce_scatter", 1),
    "broadcast_": ("broadcast", 0),
    "send": ("send", 0),
    "recv_": ("recv", 0),
    "recv_any_source_": ("recv", 0),
    "barrier": ("barrier", -1),
    "monitored_barrier_": ("barrier", -1),
}


def _nbytes(obj: Any) -> int:
    """Total bytes of the tensors in ``obj`` (a tensor or nested lists of tensors)."""
    if isinstance(obj, torch.Tensor):
        return obj.numel() * obj.element_size()
    if isinstance(obj, (list, tuple)):
        return sum(_nbytes(item) for item in obj)
    return 0


@dataclass(frozen=True)
class CollectiveCall:
    """One recorded collective: phase, normalised kind, the op that issued it,
    bytes, and peer for p2p."""

    phase: str
    kind: str
    op: str
    bytes: int
    peer: int | None = None


def classify(op_name: str, args: tuple[Any, ...]) -> list[tuple[str, int, int | None]]:
    """(kind, bytes, peer) for each collective one dispatcher call stands for; [] if none.

    ``op_name`` is the schema name, e.g. ``"c10d::allreduce_"``. Exposed for tests and for
    implementations that want to account collectives they issue another way.
    """
    namespace, _, name = op_name.partition("::")
    if namespace not in _COLLECTIVE_NAMESPACES or name in _IGNORED:
        return []
    if namespace != "c10d" and name == "batch_p2p_ops":
        op_list, peer_list, _tags, tensors = args[0], args[1], args[2], args[3]
        return [
            (
                "send" if op == "isend" else "recv" if op == "irecv" else f"other:{op_name}.{op}",
                _nbytes(tensor),
                int(peer),
            )
            for op, peer, tensor in zip(op_list, peer_list, tensors, strict=False)
        ]
    table = _EAGER if namespace == "c10d" else _FUNCTIONAL
    if name not in table:
        return [(f"other:{op_name}", 0, None)]
    kind, index = table[name]
    nbytes = _nbytes(args[index]) if 0 <= index < len(args) else 0
    peer = None
    if kind in ("send", "recv"):
        peer_index = 2 if namespace == "c10d" else 1
        if len(args) > peer_index and isinstance(args[peer_index], int):
            peer = args[peer_index]
    return [(kind, nbytes, peer)]


class CollectiveLog(TorchDispatchMode):
    """Records every collective this rank issues while active; see the module docstring.

    Thread-safe: backward collectives may be recorded from autograd's threads. ``calls`` is the
    ordered list of :class:`CollectiveCall`; :meth:`summary` aggregates it.
    """

    def __init__(self) -> None:
        super().__init__()
        self.calls: list[CollectiveCall] = []
        self._phase = DEFAULT_PHASE
        self._lock = threading.Lock()

    @contextlib.contextmanager
    def phase(self, name: str) -> Iterator[None]:
        """Attribute the collectives issued inside the block to phase ``name`` (blocks may nest)."""
        previous, self._phase = self._phase, name
        try:
            yield
        finally:
            self._phase = previous

    def __torch_dispatch__(
        self,
        func: Any,
        types: Any,
        args: tuple[Any, ...] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> Any:
        if func.namespace in _COLLECTIVE_NAMESPACES:
            self.note(func._schema.name, tuple(args), op=str(func))
        return func(*args, **(kwargs or {}))

    def note(self, op_name: str, args: tuple[Any, ...], *, op: str = "") -> None:
        """Record one call of the c10d op ``op_name`` (e.g. ``"c10d::allreduce_"``) with the
        op's arguments. The dispatcher path above uses it; so does a process group written in
        Python (harness.simulated_group), whose eager calls never reach the dispatcher."""
        found = classify(op_name, args)
        if found:
            with self._lock:
                for kind, nbytes, peer in found:
                    self.calls.append(
                        CollectiveCall(self._phase, kind, op or op_name, nbytes, peer)
                    )

    def summary(self) -> dict[str, dict[str, dict[str, int]]]:
        """``{phase: {kind: {"calls": n, "bytes": b}}}`` as plain, picklable data."""
        out: dict[str, dict[str, dict[str, int]]] = {}
        with self._lock:
            calls = list(self.calls)
        for call in calls:
            entry = out.setdefault(call.phase, {}).setdefault(call.kind, {"calls": 0, "bytes": 0})
            entry["calls"] += 1
            entry["bytes"] += call.bytes
        return out

    def clear(self) -> None:
        """Forget everything recorded so far (e.g. after a warm-up iteration)."""
        with self._lock:
            self.calls.clear()
