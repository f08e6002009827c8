"""Exact counts of what a call does: aten ops dispatched (host work; ``aten._local_scalar_dense``
is a device-to-host read, a full sync on a GPU) and calls of the varlen kernel's CPU emulation."""

from __future__ import annotations

import collections
import contextlib

from torch.utils._python_dispatch import TorchDispatchMode


class AtenOps(TorchDispatchMode):
    """Counts every aten op dispatched inside it by overload packet (``ops["aten.stack"]``)."""

    def __init__(self):
        super().__init__()
        self.ops: collections.Counter[str] = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops[str(func.overloadpacket)] += 1
        return func(*args, **(kwargs or {}))


@contextlib.contextmanager
def varlen_kernel_calls():
    """Counts the emulated varlen kernel's calls (``cpu_flash_varlen_layout``) inside it:
    ``{"forward": n, "backward": m}``."""
    from ring_impl.ops.cpu import CpuFlashVarlenLayoutOp

    calls: collections.Counter[str] = collections.Counter()
    forward, backward = (
        CpuFlashVarlenLayoutOp.kernel_forward,
        CpuFlashVarlenLayoutOp.kernel_backward,
    )

    def counted_forward(self, *args, **kwargs):
        calls["forward"] += 1
        return forward(self, *args, **kwargs)

    def counted_backward(self, *args, **kwargs):
        calls["backward"] += 1
        return backward(self, *args, **kwargs)

    CpuFlashVarlenLayoutOp.kernel_forward, CpuFlashVarlenLayoutOp.kernel_backward = (
        counted_forward,
        counted_backward,
    )
    try:
        yield calls
    finally:
        CpuFlashVarlenLayoutOp.kernel_forward, CpuFlashVarlenLayoutOp.kernel_backward = (
            forward,
            backward,
        )
