"""Ring attention (context-parallel attention) for PyTorch.

Public API::

    ring_attention(query, key, value, *, group=None, is_causal=False, scale=None,
                   rotate_method=None, op=None, layout="contiguous", return_lse=False,
                   head_chunks=1, strategy="ring")   # or "ulysses", "hybrid": ring_impl.strategies
    set_rotate_method(name)            # "allgather" (default), "alltoall", "p2p"
    shard / unshard                    # layouts "contiguous" and "head_tail"
    context_parallel / context_parallel_unshard / ContextParallel
    register_op / available_ops / AttentionOp / OpCapabilities
    collective_schedule                # the collectives a call issues, per phase
"""

from __future__ import annotations

from .api import bind, get_rotate_method, ring_attention, set_rotate_method
from .comm import ROTATE_METHODS
from .context_parallel import ContextParallelError, context_parallel, context_parallel_unshard
from .layout import LAYOUTS, shard, unshard
from .ops import AttentionOp, OpCapabilities, available_ops, get_op, register_op
from .parallel_style import ContextParallel
from .ring import RingAttention
from .schedule import collective_schedule
from .strategies import STRATEGIES
from .validate import InputError

__all__ = [
    "LAYOUTS",
    "ROTATE_METHODS",
    "STRATEGIES",
    "AttentionOp",
    "ContextParallel",
    "ContextParallelError",
    "InputError",
    "OpCapabilities",
    "RingAttention",
    "available_ops",
    "bind",
    "collective_schedule",
    "context_parallel",
    "context_parallel_unshard",
    "get_op",
    "get_rotate_method",
    "register_op",
    "ring_attention",
    "set_rotate_method",
    "shard",
    "unshard",
]
