"""The messages between the pool (parent) and its rank processes, and how they are encoded.

Every message is ``pickle.dumps(obj, protocol=5)`` sent with ``Connection.send_bytes``; never
multiprocessing's ForkingPickler, which would share tensor storage through file descriptors
instead of copying it (a rank's result must not alias memory that the rank rewrites next case).

A case travels in two layers: the outer message carries the case id, seed and label, the inner
bytes carry ``(fn, args, kwargs)``. A rank that cannot unpickle the inner layer (the function's
module does not import there) can still report the failure against the right case.

Parent -> rank: ``("case", case_id, seed, label, inner_bytes)``, ``("probe", case_id)``,
``("stop",)``.
Rank -> parent: ``("hello", rank, pid, info)``, ``("start_error", rank, pid, traceback)``,
``("result", case_id, rank, ok, value_bytes, exc_type, exc_message, traceback, duration_s)``,
``("probe_ok", case_id, rank, ok)``.
"""

from __future__ import annotations

import io
import pickle
from typing import Any

PROTOCOL = 5


def dumps(obj: Any) -> bytes:
    """Pickle ``obj`` with protocol 5 (tensors are copied into the bytes)."""
    return pickle.dumps(obj, protocol=PROTOCOL)


def loads(data: bytes) -> Any:
    return pickle.loads(data)


class _HostPickler(pickle.Pickler):
    """Pickler that moves device tensors to host memory.

    A CUDA tensor pickled as-is would be rebuilt on the GPU in the parent, initialising CUDA in the
    pytest process and pinning memory on a GPU the ranks use; results are compared on the host.
    """

    def reducer_override(self, obj: Any) -> Any:
        torch = _torch_if_loaded()
        if (
            torch is not None
            and isinstance(obj, torch.Tensor)
            and obj.device.type not in ("cpu", "meta")
        ):
            return obj.detach().cpu().__reduce_ex__(PROTOCOL)
        return NotImplemented


def dumps_to_host(obj: Any) -> bytes:
    """Like :func:`dumps`, but device tensors are copied to the host first (rank results)."""
    buf = io.BytesIO()
    _HostPickler(buf, protocol=PROTOCOL).dump(obj)
    return buf.getvalue()


def _torch_if_loaded() -> Any:
    import sys

    return sys.modules.get("torch")


def qualified_name(obj: Any) -> str:
    """``module.qualname`` of a function or class, for messages."""
    module = getattr(obj, "__module__", None) or "?"
    name = getattr(obj, "__qualname__", None) or getattr(obj, "__name__", None) or repr(obj)
    return name if module == "builtins" else f"{module}.{name}"


def exception_type_name(exc: BaseException) -> str:
    """``ValueError`` for builtins, ``package.module.Error`` otherwise."""
    return qualified_name(type(exc))
