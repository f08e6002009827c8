"""``context_parallel``: shard buffers in place and route SDPA to ring attention.

Semantics follow PyTorch's ``torch.distributed.tensor.experimental.context_parallel`` (the
"Introduction to Context Parallel" tutorial ports by changing the import), on plain tensors,
CPU + gloo included:

- on entry, every tensor in ``buffers`` is replaced in place by this rank's shard of it along
  its ``buffer_seq_dims`` entry, in ``layout`` (default ``head_tail``, PyTorch's load-balanced
  layout);
- while active, ``torch.nn.functional.scaled_dot_product_attention`` runs as ring attention
  over the mesh (calls through the ``torch.nn.functional`` attribute, as ``nn.MultiheadAttention``
  makes, and direct calls of the builtin);
- on exit, also on an exception, SDPA is restored and every buffer not in
  ``no_restore_buffers`` gets its original (global) contents back.

``context_parallel_unshard`` gathers sharded outputs back into global tensors.

Routing is done twice on purpose: the ``torch.nn.functional`` attribute is patched (the SDPA
call inside ``F.multi_head_attention_forward`` is nested in another torch-function dispatch,
where a mode would be switched off), and a TorchFunctionMode catches callers holding the
builtin itself. The mode also makes ``has_torch_function`` true, which keeps
``nn.MultiheadAttention``'s fused inference fast path (that never calls SDPA) out of the way.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

from . import api
from .comm import resolve_group
from .layout import check_layout, chunk_ids, layout_divisor, shard, unshard
from .ops import AttentionOp

__all__ = ["DEFAULT_CP_LAYOUT", "context_parallel", "context_parallel_unshard", "sdpa_routed_to_ring"]

#: Layout of ``context_parallel`` when none is given: load balanced, as PyTorch's default.
DEFAULT_CP_LAYOUT = "head_tail"

_BUILTIN_SDPA = torch._C._nn.scaled_dot_product_attention


def _op_from_sdpa_kernel(device: torch.device) -> str:
    """Honour an active ``torch.nn.attention.sdpa_kernel`` choice when picking the ring's op."""
    backends = torch.backends.cuda
    if device.type == "cpu":
        only_math = backends.math_sdp_enabled() and not (
            backends.flash_sdp_enabled() or backends.mem_efficient_sdp_enabled() or backends.cudnn_sdp_enabled()
        )
        return "math" if only_math else "cpu_flash"
    for enabled, name in (
        (backends.flash_sdp_enabled(), "cuda_flash"),
        (backends.cudnn_sdp_enabled(), "cudnn"),
        (backends.mem_efficient_sdp_enabled(), "cuda_efficient"),
    ):
        if enabled:
            return name
    return "math"


class _RingSDPA:
    """A drop-in ``scaled_dot_product_attention`` that runs ring attention over ``group``."""

    def __init__(self, group: dist.ProcessGroup, layout: str, rotate_method: str | None, op: str | AttentionOp | None,
                 head_chunks: int = 1):
        self.group, self.layout, self.rotate_method, self.op = group, layout, rotate_method, op
        self.head_chunks = head_chunks

    def __call__(
        self, query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False
    ) -> torch.Tensor:
        problem = None
        if attn_mask is not None:
            problem = (
                "attn_mask is not supported under context parallel (a mask over the global sequence "
                "cannot be applied per shard); use is_causal=True or no mask"
            )
        elif dropout_p:
            problem = f"dropout_p={dropout_p} is not supported under context parallel; set attention dropout to 0"
        elif isinstance(query, torch.Tensor) and isinstance(key, torch.Tensor) and query.dim() == key.dim() and query.dim() >= 3:
            if query.shape[-3] != key.shape[-3] and not enable_gqa:
                problem = (
                    f"query has {query.shape[-3]} heads but key/value have {key.shape[-3]}; "
                    "pass enable_gqa=True for grouped-query attention"
                )
        squeeze = isinstance(query, torch.Tensor) and query.dim() == 3
        if squeeze:  # (heads, seq, dim): the unbatched form SDPA accepts
            query, key, value = query.unsqueeze(0), key.unsqueeze(0), value.unsqueeze(0)
        op = self.op
        if op is None and isinstance(query, torch.Tensor):
            op = _op_from_sdpa_kernel(query.device)
        out = api._ring_attention(
            api._DEFAULT_IMPL, query, key, value, group=self.group, is_causal=is_causal, scale=scale,
            rotate_method=self.rotate_method, op=op, layout=self.layout, head_chunks=self.head_chunks,
            extra_problem=problem,
        )
        return out.squeeze(0) if squeeze else out


class _BuiltinSDPAMode(TorchFunctionMode):
    """Routes direct calls of the SDPA builtin; everything else passes through."""

    def __init__(self, ring_sdpa: _RingSDPA):
        super().__init__()
        self._ring_sdpa = ring_sdpa

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is _BUILTIN_SDPA:
            return self._ring_sdpa(*args, **kwargs)
        return func(*args, **kwargs)


@contextlib.contextmanager
def sdpa_routed_to_ring(
    group, *, layout: str = DEFAULT_CP_LAYOUT, rotate_method: str | None = None, op: str | AttentionOp | None = None,
    head_chunks: int = 1,
) -> Iterator[None]:
    """While active, SDPA calls run as ring attention over ``group`` (no buffer sharding)."""
    check_layout(layout)
    ring_sdpa = _RingSDPA(resolve_group(group), layout, rotate_method, op, head_chunks)
    previous = F.scaled_dot_product_attention
    F.scaled_dot_product_attention = ring_sdpa
    try:
        with _BuiltinSDPAMode(ring_sdpa):
            yield
    finally:
        F.scaled_dot_product_attention = previous


def _set_data(t: torch.Tensor, new: torch.Tensor) -> None:
    # .data assignment swaps the storage, size and stride in place, also for leaves that
    # require grad (resize_ refuses those), so every holder of `t` sees the shard.
    with torch.no_grad():
        t.data = new


@contextlib.contextmanager
def context_parallel(
    mesh,
    *,
    buffers: Sequence[torch.Tensor] | None = None,
    buffer_seq_dims: Sequence[int] | None = None,
    no_restore_buffers: set[torch.Tensor] | Sequence[torch.Tensor] | None = None,
    layout: str | None = None,
    rotate_method: str | None = None,
    op: str | AttentionOp | None = None,
    head_chunks: int = 1,
) -> Iterator[None]:
    """Shard ``buffers`` in place and route SDPA to ring attention over ``mesh``.

    Args:
        mesh: a 1-D DeviceMesh (or ProcessGroup) of the context-parallel ranks.
        buffers: global tensors (identical on every rank) to shard along their sequence dim.
        buffer_seq_dims: the sequence dim of each buffer, same order as ``buffers``.
        no_restore_buffers: buffers left sharded on exit (e.g. inputs not needed afterwards).
        layout: "head_tail" (default, load balanced) or "contiguous".
        rotate_method / op / head_chunks: as for ``ring_attention`` (op default: from the
            active ``sdpa_kernel`` choice, else the device's default).
    """
    group = resolve_group(mesh)
    layout = DEFAULT_CP_LAYOUT if layout is None else layout
    check_layout(layout)
    buffers = list(buffers or ())
    dims = list(buffer_seq_dims or ())
    if len(buffers) != len(dims):
        raise ValueError(
            f"context_parallel: {len(buffers)} buffers but {len(dims)} buffer_seq_dims; give one sequence dim per buffer"
        )
    keep = list(no_restore_buffers or ())
    if any(all(k is not b for b in buffers) for k in keep):
        raise ValueError("context_parallel: every tensor in no_restore_buffers must also be in buffers")
    world, rank = dist.get_world_size(group), dist.get_rank(group)
    divisor = layout_divisor(layout, world)
    # Check every buffer before touching any, so an error leaves nothing half-sharded.
    for i, (b, d) in enumerate(zip(buffers, dims)):
        if not isinstance(b, torch.Tensor):
            raise TypeError(f"context_parallel: buffers[{i}] is a {type(b).__name__}, not a tensor")
        if not -b.dim() <= d < b.dim():
            raise ValueError(f"context_parallel: buffer_seq_dims[{i}]={d} is out of range for a {b.dim()}-D buffer")
        if b.shape[d] % divisor:
            raise ValueError(
                f"context_parallel: buffers[{i}] has sequence length {b.shape[d]} on dim {d}, not a multiple of "
                f"{divisor} (layout {layout!r}, {world} ranks); pad the sequence"
            )
    originals = [None if any(k is b for k in keep) else b.detach().clone() for b in buffers]
    for b, d in zip(buffers, dims):
        _set_data(b, shard(b.detach(), world, rank, layout=layout, dim=d % b.dim()))
    try:
        with sdpa_routed_to_ring(group, layout=layout, rotate_method=rotate_method, op=op, head_chunks=head_chunks):
            yield
    finally:
        for b, original in zip(buffers, originals):
            if original is not None:
                _set_data(b, original)


def context_parallel_unshard(
    mesh, buffers: Sequence[torch.Tensor], seq_dims: Sequence[int], *, layout: str | None = None
) -> list[torch.Tensor]:
    """Global tensors from the local shards (differentiable: gradients go back to the shards)."""
    import torch.distributed._functional_collectives as funcol

    # all_gather_single_autograd is the newer name (torch >= 2.10); the older one warns there.
    gather = getattr(funcol, "all_gather_single_autograd", None) or funcol.all_gather_tensor_autograd
    group = resolve_group(mesh)
    layout = DEFAULT_CP_LAYOUT if layout is None else layout
    check_layout(layout)
    if len(buffers) != len(seq_dims):
        raise ValueError(f"context_parallel_unshard: {len(buffers)} buffers but {len(seq_dims)} seq_dims")
    world = dist.get_world_size(group)
    per_rank = len(chunk_ids(layout, world, 0))
    result = []
    for t, d in zip(buffers, seq_dims):
        d = d % t.dim()
        if t.shape[d] % per_rank:
            raise ValueError(f"context_parallel_unshard: local length {t.shape[d]} is not a multiple of {per_rank} (layout {layout!r})")
        gathered = gather(t.movedim(d, 0).contiguous(), 0, group)
        result.append(unshard(gathered.chunk(world, dim=0), layout=layout, dim=0).movedim(0, d))
    return result
