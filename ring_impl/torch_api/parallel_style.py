"""``ContextParallel``: a parallel style that runs a module's attention as ring attention.

    from torch.distributed.tensor.parallel import parallelize_module
    parallelize_module(layer, mesh, ContextParallel())            # a whole layer
    parallelize_module(model, mesh, {"layers.0.attn": ContextParallel(layout="contiguous")})

While the parallelised module runs forward, every ``scaled_dot_product_attention`` call inside
it (``nn.TransformerEncoderLayer``, ``nn.MultiheadAttention`` called with
``need_weights=False``, any custom attention module that calls SDPA) runs as ring attention
over the mesh. ``nn.MultiheadAttention`` with ``need_weights=True`` (its default) raises on
every rank: that path computes the weights with bmm + softmax, never calls SDPA, and would
attend to the local shard only. The module's inputs must already be this rank's sequence shard
in the same layout (shard them, and position buffers such as RoPE tables, with
``context_parallel`` or ``ring_impl.shard``).

``torch.compile`` of a parallelised module (or of a model containing one) runs ring attention
too: the routing hooks run outside the compiled graph (dynamo is told to skip them: one graph
break before and one after the module's forward) and the forward in between is compiled with
the routing active, the ring inside its graph (see :mod:`ring_impl.torch_api.sdpa_route`). Were the
hooks traced, dynamo would replay their effect on ``F.scaled_dot_product_attention`` only inside its
own trace, while ``F.multi_head_attention_forward`` stays a single node of its graph that
looks SDPA up when it runs (eager backend) or is traced (AOT backends), after the routing has
been undone: local attention, silently. ``fullgraph=True`` on the parallelised module itself
is therefore refused by dynamo; compile with the default ``fullgraph=False``.

Apply the style to the layer rather than to its ``self_attn`` when the layer is an
``nn.TransformerEncoderLayer``: in inference mode that layer may take a fused fast path that
never calls SDPA; with the style on the layer the routing is active when that decision is
made and the fast path is declined.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn as nn
from torch.distributed.tensor.parallel.style import ParallelStyle

from ..ops import AttentionOp
from .context_parallel import DEFAULT_CP_LAYOUT, ContextParallelError, RouteOptions, cp_sharding
from .sdpa_route import routing

__all__ = ["ContextParallel"]


class ContextParallel(ParallelStyle):
    """Route SDPA inside the module to ring attention over the (1-D) device mesh.

    Args (checked here, at construction):
        layout: "head_tail" (default, load balanced) or "contiguous".
        rotate_method: None (the process default), "allgather", "alltoall" or "p2p".
        op: None (from the ``torch.nn.attention.sdpa_kernel`` choice active when forward
            starts, else the device's default), "auto", a registered op name or an AttentionOp
            object.
        head_chunks: a positive int (see ``ring_attention``).
        strategy: "ring" (default) or "ulysses" (see ``ring_attention``).
        replicated_kv: True for a cross-attention module whose key and value every rank holds
            whole (a text encoder's output; computed from tensors that are not sharded): its
            SDPA calls run as ``ring_attention(replicated_kv=True)``, each rank's query rows
            against all of them, nothing exchanged. Without it they are taken for shards and
            every query attends W copies. Strategy "ring" only.
    """

    def __init__(
        self,
        *,
        layout: str = DEFAULT_CP_LAYOUT,
        rotate_method: str | None = None,
        op: str | AttentionOp | None = None,
        head_chunks: int = 1,
        strategy: str = "ring",
        replicated_kv: bool = False,
    ):
        super().__init__()
        self.options = RouteOptions(layout, rotate_method, op, head_chunks, strategy, replicated_kv)
        problem = self.options.problem()
        if problem is not None:
            raise ContextParallelError(f"ContextParallel: {problem}")

    #: The routing context entered around each forward (see ring_impl.torch_api.sdpa_route).
    route_ctx = staticmethod(routing)

    def routing_hooks(self, device_mesh) -> tuple[Callable, Callable]:
        """The forward pre-hook that enters the routing and the forward hook that leaves it."""
        # One route object per module: compiled code guards on the route's fields, which stay equal.
        group, _, mesh = cp_sharding(device_mesh, self.options.layout, self.options.strategy)
        route = self.options.route(group, mesh)
        active: list = []

        def enter(mod, args):
            ctx = self.route_ctx(route)
            ctx.__enter__()
            active.append(ctx)

        def leave(mod, args, output):
            active.pop().__exit__(None, None, None)

        return enter, leave

    def _apply(self, module: nn.Module, device_mesh) -> nn.Module:
        enter, leave = self.routing_hooks(device_mesh)
        # Outside any compiled graph, always: see the module docstring.
        skip = "ContextParallel routes SDPA outside the compiled graph"
        module.register_forward_pre_hook(torch._dynamo.disable(enter, reason=skip))
        # always_call: the routing is undone even when forward raises.
        module.register_forward_hook(torch._dynamo.disable(leave, reason=skip), always_call=True)
        return module
