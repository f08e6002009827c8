"""Device placement as a GPU sees it, checked on CPU tensors.

On a GPU, a torch op given a CUDA tensor and a CPU tensor of more than one element raises
("Expected all tensors to be on the same device"); on CPU every tensor is on one device, so a
tensor made without ``device=`` beside the inputs passes CI and fails on the first GPU run.
:class:`DevicePlacement` keeps apart what would be on the device and what on the host:

- on the device: the tensors it is given, everything a torch function computes from one of
  them, factory results given ``device=`` a device object read off a device tensor
  (``q.device``), and ``.to(<a device tensor or such a device>)``;
- on the host: factory results without ``device=`` (or with another device), ``.cpu()``,
  ``.to(<any other device>)``.

A torch function taking both a device tensor and a host tensor of more than one element is a
*mix*, recorded with the ``ring_impl`` frames that made it. Indexing with a host index is not one
(CUDA takes CPU indices). Python ``autograd.Function`` backwards run inside the check too, their
incoming gradients on the device. Views and saved tensors share their storage, so a tensor whose
storage is a device tensor's is on the device. A tensor made before the check began (a plan
cached by an earlier call) is neither: it is never part of a mix, so a check sees what is made
inside it, which a first call of its kind is.
"""

from __future__ import annotations

import collections
import contextlib
import os
import traceback

import torch
import torch.utils._pytree as pytree
from torch.overrides import TorchFunctionMode

import ring_impl

#: where the frames of a mix are reported from
_PACKAGE = os.path.dirname(os.path.abspath(ring_impl.__file__))

#: functions that take a host index or value beside a device tensor on CUDA
_TAKES_HOST = frozenset({"__getitem__", "__setitem__", "to", "copy_", "__repr__", "__format__"})

#: factories: their result is on the host unless ``device=`` names the device
_FACTORIES = frozenset(
    {
        "tensor",
        "as_tensor",
        "arange",
        "zeros",
        "ones",
        "empty",
        "full",
        "randn",
        "rand",
        "linspace",
        "eye",
    }
)

#: host copies (made here, as on CPU these return their input itself)
_TO_HOST = frozenset({"cpu", "tolist", "numpy", "item"})


def _storage(t: torch.Tensor) -> int | None:
    """The address of ``t``'s storage; None for a tensor without one of its own (a wrapper
    subclass, such as a functional collective's result: neither on the device nor the host)."""
    try:
        return t.untyped_storage().data_ptr()
    except RuntimeError:
        return None


class DevicePlacement(TorchFunctionMode):
    """Records the mixes of device and host tensors (module docstring) inside it, in ``mixes``:
    ``{(function name, ring_impl frames): count}``."""

    def __init__(self, *on_device: torch.Tensor):
        super().__init__()
        self._tensors: dict[int, torch.Tensor] = {}
        self._storages: set[int] = set()
        self._host: set[int] = set()
        self._devices: dict[int, torch.device] = {}
        self.mixes: collections.Counter[tuple[str, tuple[str, ...]]] = collections.Counter()
        for t in on_device:
            self.mark(t)

    def mark(self, t: torch.Tensor) -> None:
        """Put ``t`` (and whatever shares its storage) on the device."""
        self._tensors[id(t)] = t
        ptr = _storage(t)
        if ptr:
            self._storages.add(ptr)

    def on_device(self, t: torch.Tensor) -> bool:
        if self._tensors.get(id(t)) is t:
            return True
        return _storage(t) in self._storages

    def on_host(self, t: torch.Tensor) -> bool:
        """Made on the host inside the check (and not on the device)."""
        return not self.on_device(t) and _storage(t) in self._host

    def _device_object(self, x) -> bool:
        return isinstance(x, torch.device) and self._devices.get(id(x)) is x

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = getattr(func, "__name__", str(func))
        tensors = [x for x in pytree.tree_leaves((args, kwargs)) if isinstance(x, torch.Tensor)]
        from_device = any(self.on_device(x) for x in tensors)
        if from_device and name not in _TAKES_HOST:
            if any(self.on_host(x) and x.dim() > 0 and x.numel() > 1 for x in tensors):
                frames = [
                    f"{os.path.relpath(f.filename, os.path.dirname(_PACKAGE))}:{f.lineno}"
                    for f in traceback.extract_stack()[:-1]
                    if f.filename.startswith(_PACKAGE)
                ]
                self.mixes[(name, tuple(frames[-4:]))] += 1
        result = func(*args, **kwargs)
        # (an input returned as it is, or a view of it, keeps the input's place: a tensor made
        # before the check stays neither, whatever no-op conversion it goes through)
        inputs = {_storage(x) for x in tensors}
        if name in _TO_HOST:
            return self._host_copy(result, inputs)
        if name == "__get__" and from_device and isinstance(result, torch.device):
            self._devices[id(result)] = result  # q.device: a device object of the device
            return result
        placed = from_device
        if name == "to":
            targets = [*args[1:], *kwargs.values()]
            to_device = any(
                self._device_object(x) or (isinstance(x, torch.Tensor) and self.on_device(x))
                for x in targets
            )
            if to_device:
                placed = True
            elif any(isinstance(x, (str, torch.device)) for x in targets):
                return self._host_copy(result, inputs)
        if name in _FACTORIES or (name.endswith("_like") and not from_device):
            placed = self._device_object(kwargs.get("device"))
        for x in pytree.tree_leaves(result):
            if isinstance(x, torch.Tensor):
                if placed:
                    self.mark(x)
                elif _storage(x) not in inputs:
                    self._mark_host(x)
        return result

    def _mark_host(self, t: torch.Tensor) -> None:
        ptr = _storage(t)
        if ptr and not self.on_device(t):
            self._host.add(ptr)

    def _host_copy(self, result, inputs: set[int | None]):
        """``result`` of a copy to the host, made a host tensor of its own where on CPU it is
        its input itself (a device tensor's, or one made before the check began)."""
        if isinstance(result, torch.Tensor):
            if self.on_device(result) or _storage(result) in inputs:
                with torch._C.DisableTorchFunction():
                    result = result.clone()
            self._mark_host(result)
        return result


@contextlib.contextmanager
def backwards_checked(check: DevicePlacement):
    """Run Python ``autograd.Function`` backwards inside ``check`` (the autograd engine does not
    carry torch-function modes into them), their incoming gradients on the device."""
    apply = torch.autograd.function.BackwardCFunction.apply

    def checked(node, *grads):
        for g in grads:
            if isinstance(g, torch.Tensor):
                check.mark(g)
        with check:
            return apply(node, *grads)

    torch.autograd.function.BackwardCFunction.apply = checked  # type: ignore[method-assign]
    try:
        yield check
    finally:
        torch.autograd.function.BackwardCFunction.apply = apply  # type: ignore[method-assign]
