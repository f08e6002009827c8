"""Flex attention (``torch.nn.attention.flex_attention``) as the ring's local kernel.

The forward is flex attention with the block's visibility as its ``mask_mod``; the backward is
the math op's formula. What torch 2.13 on CPU allows decided both:

- Compiled flex on CPU (inductor's C++ template) cannot return the LSE, which the ring's merge
  needs: it raises ``NotImplementedError: torch.compile on CPU only supports inference and
  `return_lse` is not supported yet``; with ``dynamic=True`` its C++ does not even build
  (``'cur_kvSplitSize3' was not declared``). So the forward runs flex attention uncompiled, which
  on CPU is flex's own dense implementation (the scores materialised, the ``mask_mod``
  evaluated on every (b, h, q, kv)).
- Under torch.compile (of an unmasked ring: masked calls run eagerly anyway) the flex call is
  one opaque custom op, :func:`flex_forward`, so a compiled ring has no graph break
  (fullgraph=True, aot_eager and inductor). Traced as flex attention instead, inductor lowers it
  to that CPU template and raises, and dynamo 2.13 loses attribute writes made after it to
  objects created in the graph (the allgather rotation's gathered blocks come back None); a
  ``torch.compiler.disable`` around it is a graph break that fullgraph=True refuses.
- Flex attention has no backward on CPU (``FlexAttention does not support backward on CPU``).
  The backward is :class:`~ring_impl.ops.math.MathOp`'s on every device: flex's CUDA backward
  was never run here, so it is not used.

Forward cost per call against the math op (float32, batch 1, 8 heads, head_dim 64; one thread,
the 2 cores being shared; min over >= 5 calls and >= 1 s of ``time.perf_counter`` around
``op.forward`` on the tile, after a warm-up call; causal through ``is_causal``, the band a bool
``attn_mask`` with keys i-127..i; cpu_flash, the ``"auto"`` op on CPU, for scale; repeated
runs differ by up to 15%)::

    tile                 math     flex (this op)   cpu_flash   compiled flex, out only (no LSE)
    64 x 64              0.17 ms  1.55 ms  8.9x    0.12 ms     0.12 ms  0.69x
    256 x 256            2.18 ms  5.20 ms  2.4x    1.49 ms     1.63 ms  0.74x
    1024 x 1024          110 ms   140 ms   1.27x   22.7 ms     26.6 ms  0.25x
    1024 x 1024 causal   149 ms   155 ms   1.04x   17.9 ms
    1024 x 1024 band     165 ms   203 ms   1.23x   24.5 ms     7.4 ms   0.05x (block-sparse)

``torch.compile(flex_attention)`` (static shapes) on a cold inductor cache took 9.2 s for the
first shape and about 3 s for each further one. The uncompiled flex ignores a block mask's
sparsity, so the op lists every tile as partial rather than calling ``create_block_mask``,
which would evaluate the mask once more (+33 ms causal, +70 ms band on the 1024 x 1024 tile).

Capabilities, as measured: float64, float32, bfloat16 and float16 (float64 computed in float64,
the others in float32 with the probabilities rounded to the input dtype before ``@ value``, as
flex does); any head dim (flex only checks that query and key agree; 1..1024 checked); any
sequence lengths; a value head dim other than query's (``value_head_dim``); native GQA
(``enable_gqa``). Devices: CPU only; the same code would run
flex's dense implementation on CUDA, but nothing here ran on a GPU.
"""

from __future__ import annotations

import warnings

import torch

# flex_attention bound at import: ring_impl.torch_api.flex_route swaps the module's flex_attention
# for its router while a route is active, and the router would send this kernel's call back into the
# ring.
from torch.nn.attention.flex_attention import AuxRequest, BlockMask
from torch.nn.attention.flex_attention import flex_attention as _builtin_flex

from .contract import ALL_DTYPES, OpCapabilities, accumulation_dtype
from .math import MathOp

__all__ = ["FlexOp", "flex_forward"]

_MATH = MathOp()
#: flex's default tile (``_DEFAULT_SPARSE_BLOCK_SIZE``); any size is right for an all-partial mask.
_TILE = 128


def _mask_mod(is_causal: bool, attn_mask: torch.Tensor | None, batch: int, heads: int):
    """flex's ``mask_mod(b, h, q_idx, kv_idx) -> bool`` for a block's visibility, or None when
    every query sees every key.

    attn_mask: bool (batch or 1, heads or 1, rows, cols) or (rows, cols), True where the query
    sees the key; is_causal: top-left aligned (key j visible to query i iff j <= i).
    """
    if attn_mask is None:
        return (lambda b, h, q_idx, kv_idx: kv_idx <= q_idx) if is_causal else None
    m = attn_mask if attn_mask.dim() == 4 else attn_mask.view(1, 1, *attn_mask.shape[-2:])
    m = m.expand(batch, heads, *m.shape[-2:])  # stride 0 where it broadcasts: no copy
    if is_causal:
        return lambda b, h, q_idx, kv_idx: m[b, h, q_idx, kv_idx] & (kv_idx <= q_idx)
    return lambda b, h, q_idx, kv_idx: m[b, h, q_idx, kv_idx]


def _all_partial_block_mask(mask_mod, seq_q: int, seq_k: int, device: torch.device):
    """A block mask (broadcast over batch and heads) that lists every tile as partial, so
    ``mask_mod`` decides every (query, key) pair and nothing is evaluated to find empty tiles."""
    rows, cols = -(-seq_q // _TILE), -(-seq_k // _TILE)
    num = torch.full((1, 1, rows), cols, dtype=torch.int32, device=device)
    idx = torch.arange(cols, dtype=torch.int32, device=device).expand(1, 1, rows, cols).contiguous()
    return BlockMask.from_kv_blocks(
        num, idx, BLOCK_SIZE=_TILE, mask_mod=mask_mod, seq_lengths=(seq_q, seq_k)
    )


def _flex_call(query, key, value, attn_mask, is_causal: bool, scale: float):
    """Uncompiled flex attention: (out (batch, heads, seq_q, head_dim) in the input dtype, LSE
    (batch, heads, seq_q) in natural log, float32 or float64); arguments as FlexOp.forward's."""
    b, h, sq, _ = query.shape
    mod = _mask_mod(is_causal, attn_mask, b, h)
    block_mask = (
        None if mod is None else _all_partial_block_mask(mod, sq, key.shape[2], query.device)
    )
    with warnings.catch_warnings():
        # Its advice, torch.compile, is what cannot return the LSE on CPU (module docstring).
        warnings.filterwarnings("ignore", message="flex_attention called without torch.compile")
        out, aux = _builtin_flex(
            query,
            key,
            value,
            block_mask=block_mask,
            scale=scale,
            enable_gqa=key.shape[1] != query.shape[1],
            return_aux=AuxRequest(lse=True),
        )
    return out, aux.lse


_KEYS = torch._C.DispatchKey
#: The dispatch keys vmap needs; a TorchDispatchMode runs the ops it intercepts with them excluded.
_FUNCTORCH_KEYS = (
    _KEYS.FuncTorchBatched,
    _KEYS.FuncTorchVmapMode,
    _KEYS.FuncTorchDynamicLayerFrontMode,
    _KEYS.FuncTorchDynamicLayerBackMode,
)


@torch.library.custom_op("ring_impl::flex_forward", mutates_args=())
def flex_forward(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attn_mask: torch.Tensor | None,
    is_causal: bool,
    scale: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`_flex_call` as one opaque op (module docstring): out contiguous, LSE contiguous
    (batch, heads, seq_q) in the accumulation dtype."""
    # Under a dispatch mode (AOT autograd's first-call aliasing check of a compiled graph) this
    # body runs with functorch's keys excluded, and flex's vmap of the mask_mod fails ("Cannot
    # access storage of BatchedTensorImpl"); nothing here needs the mode, so vmap gets them back.
    exclude = torch._C._dispatch_tls_local_exclude_set()
    for k in _FUNCTORCH_KEYS:
        exclude = exclude.remove(k)
    with torch._C._ForceDispatchKeyGuard(torch._C._dispatch_tls_local_include_set(), exclude):
        # detach again: under inductor the graph's detach is dropped and the inputs reach here
        # requiring grad, which flex refuses on CPU.
        out, lse = _flex_call(
            query.detach(), key.detach(), value.detach(), attn_mask, is_causal, scale
        )
    return out.contiguous(), lse.to(accumulation_dtype(query.dtype)).contiguous()


@flex_forward.register_fake
def _(query, key, value, attn_mask, is_causal, scale):
    b, h, sq, _ = query.shape
    return (
        query.new_empty((b, h, sq, value.shape[-1])),
        query.new_empty((b, h, sq), dtype=accumulation_dtype(query.dtype)),
    )


class FlexOp:
    """Flex attention's forward with the math op's backward (see the module docstring).

    Shapes as the op contract: query (batch, heads, seq_q, head_dim), key/value (batch,
    heads_kv, seq_k, head_dim) with heads % heads_kv == 0; ``attn_mask`` bool (batch or 1,
    heads or 1, seq_q, seq_k), True where a query sees a key. LSE (batch, heads, seq_q).
    """

    name = "flex"
    capabilities = OpCapabilities(
        devices=frozenset({"cpu"}),
        dtypes=ALL_DTYPES,
        gqa=True,
        lse_grad=True,
        masks=True,
        value_head_dim=True,
    )

    def forward(self, query, key, value, *, is_causal, scale, attn_mask=None):
        """out (batch, heads, seq_q, head_dim_v) in the input dtype, LSE (batch, heads, seq_q) in
        natural log, float32 (float64 for float64). Rows that see no key come back with out 0
        and LSE -inf (flex's safe softmax), never NaN."""
        # detach: flex refuses CPU inputs that require grad, and the op has no autograd: the
        # ring differentiates the block itself (backward below).
        return flex_forward(
            query.detach(), key.detach(), value.detach(), attn_mask, bool(is_causal), float(scale)
        )

    def backward(self, grad_out, query, key, value, out, lse, **options):
        """The math op's backward with the same visibility (flex has none on CPU); ``options``:
        the contract's keywords (``is_causal``, ``scale``, ``grad_lse``, ``attn_mask``)."""
        return _MATH.backward(grad_out, query, key, value, out, lse, **options)
