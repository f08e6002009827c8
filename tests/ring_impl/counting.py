"""Exact counts of what a call does: aten ops dispatched (host work; ``aten._local_scalar_dense``
is a device-to-host read, a full sync on a GPU), reads of tensors standing for device tensors,
and calls of the varlen kernel's CPU emulation."""

from __future__ import annotations

import collections
import contextlib
import traceback

import torch
import torch.utils._pytree as pytree
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode


class AtenOps(TorchDispatchMode):
    """Counts every aten op dispatched inside it by overload packet (``ops["aten.stack"]``);
    for the packets in ``traced``, ``where[packet]`` lists the ``ring_impl`` lines that made each
    call (innermost first), for failure messages."""

    def __init__(self, traced: tuple[str, ...] = ()):
        super().__init__()
        self.ops: collections.Counter[str] = collections.Counter()
        self.traced = frozenset(traced)
        self.where: dict[str, list[str]] = collections.defaultdict(list)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        packet = str(func.overloadpacket)
        self.ops[packet] += 1
        if packet in self.traced:
            frames = traceback.extract_stack()
            inside = [
                f"{f.filename.rsplit('/ring_impl/', 1)[-1]}:{f.lineno}"
                for f in frames
                if "/ring_impl/" in f.filename and "/tests/" not in f.filename
            ]
            self.where[packet].append(" <- ".join(reversed(inside[-4:])))
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


class DeviceReads(TorchFunctionMode):
    """Counts device-to-host reads as a GPU would make them, on CPU tensors: ``on_device``
    stand for tensors on the device, and so does every tensor a torch function computes from
    one of them; a read (``.cpu()``, ``.item()``, ``.tolist()``, ``.numpy()``, ``bool``, ``int``,
    ``float``, an index) of such a tensor is counted in ``reads``. What ``.cpu()`` returns is a
    host copy (a clone here, since on CPU it returns the tensor itself): reading it is free.
    ``direct`` counts the reads of the ``on_device`` tensors themselves (a copy of them to the
    host), apart from those of what is computed from them."""

    READS = frozenset(
        {"cpu", "item", "tolist", "numpy", "__bool__", "__int__", "__float__", "__index__"}
    )

    def __init__(self, *on_device: torch.Tensor):
        super().__init__()
        self.reads = 0
        self.direct = 0
        self._given = {id(t) for t in on_device}
        self._device = set(self._given)
        self._held = list(on_device)  # (the ids above stay theirs while counted)

    def _on_device(self, tree) -> bool:
        return any(
            isinstance(x, torch.Tensor) and id(x) in self._device for x in pytree.tree_leaves(tree)
        )

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        on_device = self._on_device((args, kwargs))
        name = getattr(func, "__name__", "")
        if on_device and name in self.READS:
            self.reads += 1
            self.direct += any(
                isinstance(x, torch.Tensor) and id(x) in self._given
                for x in pytree.tree_leaves((args, kwargs))
            )
        result = func(*args, **kwargs)
        if name == "cpu":
            with torch._C.DisableTorchFunction():
                return result.clone()
        if on_device:
            for x in pytree.tree_leaves(result):
                if isinstance(x, torch.Tensor):
                    self._device.add(id(x))
                    self._held.append(x)
        return result
