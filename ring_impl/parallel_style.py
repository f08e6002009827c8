"""``ContextParallel``: a parallel style that runs a module's attention as ring attention.

    from torch.distributed.tensor.parallel import parallelize_module
    parallelize_module(layer, mesh, ContextParallel())            # a whole layer
    parallelize_module(model, mesh, {"layers.0.attn": ContextParallel(layout="contiguous")})

While the parallelised module runs forward, every ``scaled_dot_product_attention`` call inside
it (``nn.MultiheadAttention`` in training mode, ``nn.TransformerEncoderLayer``, any custom
attention module that calls SDPA) runs as ring attention over the mesh. The module's inputs
must already be this rank's sequence shard in the same layout (shard them, and position
buffers such as RoPE tables, with ``context_parallel`` or ``ring_impl.shard``).

Apply the style to the layer rather than to its ``self_attn`` when the layer is an
``nn.TransformerEncoderLayer``: in inference mode that layer may take a fused fast path that
never calls SDPA; with the style on the layer the routing is active when that decision is
made and the fast path is declined.
"""

from __future__ import annotations

import torch.nn as nn
from torch.distributed.tensor.parallel.style import ParallelStyle

from .context_parallel import DEFAULT_CP_LAYOUT, sdpa_routed_to_ring
from .layout import check_layout
from .ops import AttentionOp

__all__ = ["ContextParallel"]


class ContextParallel(ParallelStyle):
    """Route SDPA inside the module to ring attention over the (1-D) device mesh."""

    def __init__(self, *, layout: str = DEFAULT_CP_LAYOUT, rotate_method: str | None = None,
                 op: str | AttentionOp | None = None, head_chunks: int = 1):
        super().__init__()
        check_layout(layout)
        self.layout, self.rotate_method, self.op, self.head_chunks = layout, rotate_method, op, head_chunks

    def _apply(self, module: nn.Module, device_mesh) -> nn.Module:
        active: list = []

        def enter(mod, args):
            ctx = sdpa_routed_to_ring(device_mesh, layout=self.layout, rotate_method=self.rotate_method, op=self.op,
                                      head_chunks=self.head_chunks)
            ctx.__enter__()
            active.append(ctx)

        def leave(mod, args, output):
            active.pop().__exit__(None, None, None)

        module.register_forward_pre_hook(enter)
        # always_call: the routing is undone even when forward raises.
        module.register_forward_hook(leave, always_call=True)
        return module
