"""``context_parallel``: shard buffers in place and route SDPA to ring attention.

Semantics follow PyTorch's ``torch.distributed.tensor.experimental.context_parallel`` (the
"Introduction to Context Parallel" tutorial ports by changing the import), on plain tensors,
CPU + gloo included:

- on entry, every tensor in ``buffers`` is replaced in place by this rank's shard of it along
  its ``buffer_seq_dims`` entry, in ``layout`` (default ``head_tail``, PyTorch's load-balanced
  layout). A tensor listed more than once (``buffers=[x, x, x]`` for ``q = k = v = x``) is
  sharded once; listing it with two different sequence dims is an error. A buffer that an
  enclosing ``context_parallel`` already sharded is an error too (it would be sharded again);
  list it in the outer context only.
- while active, SDPA runs as ring attention over the mesh (see
  :mod:`ring_impl.torch_api.sdpa_route`: ``F.scaled_dot_product_attention``,
  ``nn.MultiheadAttention`` with ``need_weights=False``, direct calls of the builtin, and code
  compiled with ``torch.compile``). ``nn.MultiheadAttention`` with ``need_weights=True`` (its
  default) raises: that path never calls SDPA and would attend to the local shard only.
- on exit, SDPA is restored and every buffer not in ``no_restore_buffers`` gets its global
  contents back.

Gradients of buffers that require grad (an ``nn.Parameter`` such as a learned position
table): run backward inside the context. On entry a buffer's ``.grad`` is set aside (a global
gradient cannot accumulate into a shard). On a normal exit its ``.grad`` becomes the global
gradient: the shard gradients of every rank gathered in layout order (one all-gather per such
buffer), added to the gradient it had on entry, so an optimizer step after the context sees a
gradient shaped like the parameter. On an exit by exception no collective runs (the other
ranks may not be exiting the same way), the shard gradients are discarded and ``.grad`` is
what it was on entry. Buffers in ``no_restore_buffers`` stay sharded, and so does their
``.grad`` (the entry gradient is sharded with the data).

Every argument is checked on entry, before anything is sharded, and the ranks agree on the
outcome (one small all-reduce): bad arguments on any rank raise on every rank.

``context_parallel_unshard`` gathers sharded outputs back into global tensors.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist

from ..checks.mesh import ulysses_head_chunks_problem
from ..exchanges.heads import check_head_chunks
from ..group import resolve_group
from ..layout import check_layout, layout_divisor, shard, unshard
from ..ops import AttentionOp, get_op, resolve_op
from ..transports import check_rotate_method
from .sdpa_route import Route, routing, sdpa_routed_to_ring

__all__ = [
    "DEFAULT_CP_LAYOUT",
    "ContextParallelError",
    "RouteOptions",
    "ShardedBuffers",
    "context_parallel",
    "context_parallel_unshard",
    "sdpa_routed_to_ring",
    "sharded_and_routed",
]

#: Layout of ``context_parallel`` when none is given: load balanced, as PyTorch's default.
DEFAULT_CP_LAYOUT = "head_tail"


class ContextParallelError(ValueError):
    """Bad arguments to ``context_parallel`` / ``ContextParallel``; raised on every rank."""


#: Strategies the context-parallel API routes SDPA to: both shard the sequence over one group in
#: a ring layout (Ulysses over U ranks uses the ring's layouts over U,
#: ring_impl.planning.mesh_layout). The hybrid needs a 2-D mesh and its own sharding:
#: ring_attention(strategy="hybrid").
CP_STRATEGIES = ("ring", "ulysses", "hybrid")


@dataclass(frozen=True)
class RouteOptions:
    """How routed SDPA calls run: the options ``context_parallel`` and ``ContextParallel`` take.

    layout: a ring_impl layout; rotate_method: None (the process default) or a rotation
    method; op: None / "auto", a registered op name or an AttentionOp object; head_chunks: a
    positive int; strategy: one of ``CP_STRATEGIES``; replicated_kv: the routed calls' key and
    value are whole on every rank (a cross-attention module's; ``ContextParallel`` only).
    """

    layout: str = DEFAULT_CP_LAYOUT
    rotate_method: str | None = None
    op: str | AttentionOp | None = None
    head_chunks: int = 1
    strategy: str = "ring"
    replicated_kv: bool = False

    def problem(self) -> str | None:
        """The problem with these options, or None. Never raises."""
        if not isinstance(self.strategy, str) or self.strategy not in CP_STRATEGIES:
            return (
                f"unknown strategy {self.strategy!r}; context parallel routes SDPA to one of "
                f"{CP_STRATEGIES}"
            )
        try:
            check_layout(self.layout)
            if self.rotate_method is not None:
                check_rotate_method(self.rotate_method)
            if isinstance(self.op, str) and self.op != "auto":
                get_op(self.op)
            elif self.op is not None and not isinstance(self.op, str):
                # checks the op object's interface
                resolve_op(self.op, torch.device("cpu"), torch.float32, 1)
        except (TypeError, ValueError) as exc:
            return str(exc)
        if not isinstance(self.replicated_kv, bool):
            return f"replicated_kv must be True or False, got {self.replicated_kv!r}"
        if self.replicated_kv and self.strategy != "ring":
            return (
                "replicated_kv=True moves no key/value, so it takes no "
                f"strategy={self.strategy!r}: pass strategy='ring' (each rank attends its query "
                "rows to the key/value it holds)"
            )
        if self.strategy == "ulysses":
            return ulysses_head_chunks_problem(self.head_chunks)
        return check_head_chunks(self.head_chunks, None)

    def route(self, group: dist.ProcessGroup, mesh=None) -> Route:
        """The route of these options over ``group`` (``mesh``: the 2-D DeviceMesh of the
        hybrid, whose flattened group ``group`` is)."""
        return Route(
            group,
            self.layout,
            self.rotate_method,
            self.op,
            self.head_chunks,
            self.strategy,
            self.replicated_kv,
            mesh=mesh,
        )


# Buffers sharded by an active context_parallel: id -> tensor (held so the id stays unique).
_SHARDED: dict[int, torch.Tensor] = {}


class ShardedBuffers:
    """The buffers of one ``context_parallel``: checked, sharded on entry, restored on exit."""

    def __init__(self, group: dist.ProcessGroup, layout: str, buffers, dims, keep):
        self.group, self.layout = group, layout
        self.world, self.rank = dist.get_world_size(group), dist.get_rank(group)
        self.problem: str | None = None
        self.entries: list[
            tuple[torch.Tensor, int, bool]
        ] = []  # (buffer, seq dim, restore on exit)
        self.originals: list[torch.Tensor | None] = []
        self.entry_grads: list[torch.Tensor | None] = []
        try:
            self.entries = self._distinct(list(buffers or ()), list(dims or ()), list(keep or ()))
        except ContextParallelError as exc:
            self.problem = str(exc)

    def _distinct(
        self, buffers: list, dims: list, keep: list
    ) -> list[tuple[torch.Tensor, int, bool]]:
        """One entry per distinct buffer; raises ContextParallelError for bad buffers."""
        if len(buffers) != len(dims):
            raise ContextParallelError(
                f"{len(buffers)} buffers but {len(dims)} buffer_seq_dims; give one sequence dim "
                "per buffer"
            )
        divisor = layout_divisor(self.layout, self.world)
        entries: list[tuple[torch.Tensor, int, bool]] = []
        for i, (b, d) in enumerate(zip(buffers, dims)):
            if not isinstance(b, torch.Tensor):
                raise ContextParallelError(f"buffers[{i}] is a {type(b).__name__}, not a tensor")
            if isinstance(d, bool) or not isinstance(d, int):
                raise ContextParallelError(f"buffer_seq_dims[{i}] must be an int, got {d!r}")
            if not -b.dim() <= d < b.dim():
                raise ContextParallelError(
                    f"buffer_seq_dims[{i}]={d} is out of range for a {b.dim()}-D buffer"
                )
            d %= b.dim()
            earlier = self._listed_before(entries, b)
            if earlier is not None:
                if earlier[1] != d:
                    raise ContextParallelError(
                        f"buffers[{i}] is the same tensor as an earlier buffer but with sequence "
                        f"dim {d} instead of {earlier[1]}; a tensor has one sequence dim: list it "
                        "once"
                    )
                continue  # listed again (q = k = v = x): sharded once
            if self._sharded_by_enclosing(b):
                raise ContextParallelError(
                    f"buffers[{i}] is already sharded by an enclosing context_parallel; nesting "
                    "would shard it again: list it in the outer context only"
                )
            if b.shape[d] % divisor:
                raise ContextParallelError(
                    f"buffers[{i}] has sequence length {b.shape[d]} on dim {d}, not a multiple of "
                    f"{divisor} (layout {self.layout!r}, {self.world} ranks); pad the sequence"
                )
            entries.append((b, d, all(k is not b for k in keep)))
        for k in keep:
            if all(k is not b for b in buffers):
                raise ContextParallelError(
                    "every tensor in no_restore_buffers must also be in buffers"
                )
        return entries

    @staticmethod
    def _listed_before(
        entries: list[tuple[torch.Tensor, int, bool]], b: torch.Tensor
    ) -> tuple | None:
        """The entry of ``b`` if it is already listed (the same tensor object), else None."""
        return next((e for e in entries if e[0] is b), None)

    @staticmethod
    def _sharded_by_enclosing(b: torch.Tensor) -> bool:
        return _SHARDED.get(id(b)) is b

    @staticmethod
    def _tracks_grad(b: torch.Tensor) -> bool:
        return b.is_leaf and b.requires_grad

    def shard(self) -> None:
        for b, d, restore in self.entries:
            entry_grad = b.grad if self._tracks_grad(b) else None
            self.originals.append(b.data if restore else None)
            self.entry_grads.append(entry_grad)
            if entry_grad is not None:
                b.grad = None  # a global gradient cannot accumulate into a shard
            _set_data(b, shard(b.detach(), self.world, self.rank, layout=self.layout, dim=d))
            if entry_grad is not None and not restore:
                b.grad = shard(entry_grad, self.world, self.rank, layout=self.layout, dim=d)
            _SHARDED[id(b)] = b

    def restore(self, *, normal_exit: bool) -> None:
        """Global data back (last sharded first); on a normal exit the global gradients too
        (collectives)."""
        shard_grads: list[torch.Tensor | None] = [None] * len(self.entries)
        for i in reversed(range(len(self.originals))):  # the buffers shard() got to
            b, _, restore = self.entries[i]
            _SHARDED.pop(id(b), None)
            if not restore:
                continue
            local = b.grad if self._tracks_grad(b) else None
            shard_grads[i] = local
            if local is not None:
                b.grad = None
            original = self.originals[i]
            assert original is not None
            _set_data(b, original)
            if local is not None or self.entry_grads[i] is not None:
                b.grad = self.entry_grads[i]
        if normal_exit:
            self._add_global_grads(shard_grads)

    def _add_global_grads(self, shard_grads: list[torch.Tensor | None]) -> None:
        """``.grad += unshard(shard gradients)`` for every restored buffer that tracks grad.

        Every rank issues the same collectives: the ranks first agree on which buffers got a
        gradient on any rank (a rank without one contributes zeros).
        """
        candidates = [
            i for i, (b, _, restore) in enumerate(self.entries) if restore and self._tracks_grad(b)
        ]
        if not candidates:
            return
        have = torch.tensor(
            [int(shard_grads[i] is not None) for i in candidates], dtype=torch.int64
        )
        device = self.entries[candidates[0]][0].device
        if self.world > 1:
            have = have.to(_collective_device(self.group, device))
            dist.all_reduce(have, op=dist.ReduceOp.MAX, group=self.group)
        for i, flag in zip(candidates, have.tolist()):
            if not flag:
                continue
            b, d, _ = self.entries[i]
            local = shard_grads[i]
            if local is None:
                local = torch.zeros(
                    shard(b.detach(), self.world, self.rank, layout=self.layout, dim=d).shape,
                    dtype=b.dtype,
                    device=b.device,
                )
            full = local if self.world == 1 else _gather_global(local, d, self.group, self.layout)
            b.grad = full if b.grad is None else b.grad + full


def _collective_device(group: dist.ProcessGroup, device: torch.device) -> torch.device:
    # gloo reduces CPU tensors; NCCL needs them on the GPU.
    return torch.device("cpu") if str(dist.get_backend(group)).lower() == "gloo" else device


def _gather_global(
    local: torch.Tensor, dim: int, group: dist.ProcessGroup, layout: str
) -> torch.Tensor:
    """The global tensor from every rank's ``local`` shard (no autograd)."""
    world = dist.get_world_size(group)
    staged = local.detach().movedim(dim, 0).contiguous()
    parts = [torch.empty_like(staged) for _ in range(world)]
    dist.all_gather(parts, staged, group=group)
    return unshard(parts, layout=layout, dim=0).movedim(0, dim)


def _agree(problem: str | None, group: dist.ProcessGroup, device: torch.device, what: str) -> None:
    """Raise ContextParallelError on every rank if any rank has a problem (one all-reduce)."""
    world, rank = dist.get_world_size(group), dist.get_rank(group)
    if world == 1 or torch.compiler.is_compiling():
        if problem is not None:
            raise ContextParallelError(f"{what}: {problem}")
        return
    flags = torch.zeros(world, dtype=torch.int64)
    flags[rank] = int(problem is not None)
    flags = flags.to(_collective_device(group, device))
    dist.all_reduce(flags, op=dist.ReduceOp.MAX, group=group)
    bad = [r for r, f in enumerate(flags.tolist()) if f]
    if problem is not None:
        raise ContextParallelError(f"{what} (rank {rank}): {problem}")
    if bad:
        raise ContextParallelError(
            f"{what} (rank {rank}): rank(s) {bad} rejected their arguments (see the error on "
            "those ranks); every rank raises so none is left waiting in a collective"
        )


def _set_data(t: torch.Tensor, new: torch.Tensor) -> None:
    # .data assignment swaps the storage, size and stride in place, also for leaves that
    # require grad (resize_ refuses those), so every holder of `t` sees the shard.
    with torch.no_grad():
        t.data = new


def _default_device(group: dist.ProcessGroup, buffers) -> torch.device:
    for b in buffers or ():
        if isinstance(b, torch.Tensor):
            return b.device
    if "nccl" in str(dist.get_backend(group)).lower():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


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
    strategy: str = "ring",
) -> contextlib.AbstractContextManager[None]:
    """Shard ``buffers`` in place and route SDPA to ring (or Ulysses) attention over ``mesh``.

    Args:
        mesh: a 1-D DeviceMesh (or ProcessGroup) of the context-parallel ranks.
        buffers: global tensors (identical on every rank) to shard along their sequence dim;
            a tensor listed more than once is sharded once.
        buffer_seq_dims: the sequence dim of each buffer, same order as ``buffers``.
        no_restore_buffers: buffers left sharded on exit (e.g. inputs not needed afterwards).
        layout: "head_tail" (default, load balanced) or "contiguous".
        rotate_method / op / head_chunks: as for ``ring_attention`` (op default: from the
            ``torch.nn.attention.sdpa_kernel`` choice active on entry, else the device's default).
        strategy: "ring" (default) or "ulysses" (heads over the ranks by all-to-all: query heads
            and key/value heads as ``ring_attention(strategy="ulysses")`` needs); the buffers are
            sharded the same way for both.

    Raises:
        ContextParallelError (a ValueError) on every rank, before anything is sharded, for bad
        arguments on any rank.
    """
    return sharded_and_routed(
        ShardedBuffers,
        routing,
        mesh,
        buffers=buffers,
        buffer_seq_dims=buffer_seq_dims,
        no_restore_buffers=no_restore_buffers,
        layout=layout,
        rotate_method=rotate_method,
        op=op,
        head_chunks=head_chunks,
        strategy=strategy,
    )


@contextlib.contextmanager
def sharded_and_routed(
    sharding: type[ShardedBuffers],
    route_ctx,
    mesh,
    *,
    buffers=None,
    buffer_seq_dims=None,
    no_restore_buffers=None,
    layout=None,
    rotate_method=None,
    op=None,
    head_chunks=1,
    strategy: str = "ring",
) -> Iterator[None]:
    """``context_parallel`` with its two parts given: the buffer handling and the routing (the
    options, and their defaults, as :func:`context_parallel`'s)."""
    options = RouteOptions(
        DEFAULT_CP_LAYOUT if layout is None else layout, rotate_method, op, head_chunks, strategy
    )
    problem = options.problem()
    # The ranks agree over a group that depends on the mesh alone, not on the options they may
    # disagree on: a rank with a bad option still joins the all-reduce the others wait in.
    agree_group = agreement_group(mesh)
    sharded = None
    if problem is None:
        try:
            group, shard_layout, route_mesh = cp_sharding(mesh, options.layout, strategy)
        except (TypeError, ValueError) as exc:  # a mesh the strategy cannot take
            problem = str(exc)
        else:
            sharded = sharding(group, shard_layout, buffers, buffer_seq_dims, no_restore_buffers)
            problem = sharded.problem
    _agree(problem, agree_group, _default_device(agree_group, buffers), "context_parallel")
    assert sharded is not None
    try:
        sharded.shard()
        with route_ctx(options.route(group, route_mesh)):
            yield
    except BaseException:
        sharded.restore(normal_exit=False)
        raise
    sharded.restore(normal_exit=True)


def agreement_group(mesh) -> dist.ProcessGroup:
    """The group every rank of a ``context_parallel`` call checks its arguments over: ``mesh``'s
    group, or a 2-D mesh flattened (the hybrid's group; flattening is a collective every rank of
    the mesh takes, whatever its other arguments). ContextParallelError for a ``mesh`` that is
    neither (the same on every rank passing the same kind of argument)."""
    from torch.distributed.device_mesh import DeviceMesh

    try:
        if isinstance(mesh, DeviceMesh) and mesh.ndim == 2:
            return mesh._flatten().get_group()
        return resolve_group(mesh)
    except (TypeError, ValueError) as exc:
        raise ContextParallelError(f"context_parallel: {exc}") from None


def cp_sharding(mesh, layout: str, strategy: str):
    """(process group the buffers are sharded over, the layout they are sharded in, the mesh the
    routed calls take or None). ``strategy="hybrid"``: the mesh flattened and the hybrid's layout
    (ring_impl.torch_api.hybrid_cp); otherwise ``mesh``'s group and ``layout``. Raises
    ContextParallelError for a mesh the strategy cannot take (the same on every rank)."""
    if strategy != "hybrid":
        return resolve_group(mesh), layout, None
    from .hybrid_cp import hybrid_sharding

    try:
        group, name = hybrid_sharding(mesh, layout)
    except ValueError as exc:
        raise ContextParallelError(str(exc)) from None
    return group, name, mesh


def context_parallel_unshard(
    mesh,
    buffers: Sequence[torch.Tensor],
    seq_dims: Sequence[int],
    *,
    layout: str | None = None,
    strategy: str = "ring",
) -> list[torch.Tensor]:
    """Global tensors from the local shards (differentiable: gradients go back to the shards)."""
    import torch.distributed._functional_collectives as funcol

    # all_gather_single_autograd is the newer name (torch >= 2.10); the older one warns there.
    gather = (
        getattr(funcol, "all_gather_single_autograd", None) or funcol.all_gather_tensor_autograd
    )
    layout = DEFAULT_CP_LAYOUT if layout is None else layout
    check_layout(layout)
    group, layout, _ = cp_sharding(mesh, layout, strategy)
    if len(buffers) != len(seq_dims):
        raise ValueError(
            f"context_parallel_unshard: {len(buffers)} buffers but {len(seq_dims)} seq_dims"
        )
    world = dist.get_world_size(group)
    divisor = layout_divisor(layout, world)
    # gloo's functional collectives do not take CUDA tensors (the process dies): gather host copies,
    # as the ring's own transfers do (RingGroup.stage_on_host). .to() is differentiable both ways.
    gloo = str(dist.get_backend(group)).lower() == "gloo"
    result = []
    for t, d in zip(buffers, seq_dims):
        d = d % t.dim()
        if (t.shape[d] * world) % divisor:
            raise ValueError(
                f"context_parallel_unshard: local length {t.shape[d]} x {world} ranks is not a "
                f"multiple of {divisor}, so these are not shards of layout {layout!r}"
            )
        local = t.movedim(d, 0).contiguous()
        host = gloo and local.device.type != "cpu"
        gathered = gather(local.cpu() if host else local, 0, group)
        gathered = gathered.to(local.device) if host else gathered
        result.append(unshard(gathered.chunk(world, dim=0), layout=layout, dim=0).movedim(0, d))
    return result
