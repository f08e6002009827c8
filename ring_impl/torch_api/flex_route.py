"""Routing ``flex_attention(q, k, v, block_mask=...)`` to ring attention while a route is active.

Under ``context_parallel`` (or ``sdpa_routed_to_ring``) a flex-attention call on local shards,
with a ``BlockMask`` built on the *global* sequence (``create_block_mask(mask_mod, B, H, L, L)``
with L the global length), runs as ``ring_attention(..., mask=MaskMod(block_mask.mask_mod))``:
the mask_mod is evaluated on global positions, per ring step, for the rows and columns each
block holds. The ring's kernels run it (forward and backward, on CPU too, where flex attention
itself has no backward in torch 2.13), judged like any masked ring call.

What is routed: ``torch.nn.attention.flex_attention.flex_attention`` as looked up at call time
(the module attribute is replaced while a route is active, like ``F.scaled_dot_product_attention``),
and :func:`flex_attention` of this module, which callers holding an early reference can call
instead. Outside any route :func:`flex_attention` is flex attention itself.

Not routed, each refused on every rank with the reason: a ``score_mod`` (``ring_attention(...,
score_mod=)`` takes one, on the math op and eagerly under torch.compile, where this route runs
fullgraph), ``kernel_options`` (they tune flex's own kernel, which does not
run), ``return_aux`` asking for max scores, and a block mask built for other lengths than the
global ones. Under ``torch.compile`` the routed call runs in the graph, ``fullgraph=True`` included:
the mask_mod is traced and evaluated on the global grid into a table of bits
(:mod:`ring_impl.planning.mask_table`) that the ring's custom ops take
(:mod:`ring_impl.compiled.masked_call`).
"""

from __future__ import annotations

import torch

from .. import api
from ..masks import MaskMod

__all__ = ["flex_attention", "flex_problem"]

try:
    import torch.nn.attention.flex_attention as _flex_module

    _BUILTIN_FLEX = _flex_module.flex_attention
except ImportError:  # pragma: no cover - torch without flex attention
    # (mypy types these names as the module and its function, and has no type for "this module
    # or None"; only a torch older than the supported 2.11 lands here)
    _flex_module = None  # type: ignore[assignment]
    _BUILTIN_FLEX = None  # type: ignore[assignment]


def flex_problem(
    query, key, *, score_mod, block_mask, enable_gqa, kernel_options, return_aux, world_size: int
) -> str | None:
    """Why a flex-attention call on local shards cannot run as ring attention, or None.

    query (batch, heads, seq_local, head_dim), key (batch, heads_kv, seq_kv_local, head_dim)."""
    if score_mod is not None:
        return (
            "score_mod is not supported under context parallel's flex route; express visibility "
            "as the block_mask's mask_mod, and call ring_impl.ring_attention(..., score_mod=fn, "
            "mask=ring_impl.masks.MaskMod(mask_mod)) on the shards for a score_mod"
        )
    if kernel_options:
        return (
            f"kernel_options {sorted(kernel_options)} tune flex attention's own kernel, which "
            "does not run under context parallel (the ring runs its kernels); drop them"
        )
    if return_aux is not None and getattr(return_aux, "max_scores", False):
        return (
            "return_aux with max_scores is not supported under context parallel (only the LSE is)"
        )
    if not (
        isinstance(query, torch.Tensor)
        and isinstance(key, torch.Tensor)
        and query.dim() == 4
        and key.dim() == 4
    ):
        return None  # the ring's input checks report shape problems
    if query.shape[1] != key.shape[1] and not enable_gqa:
        return (
            f"query has {query.shape[1]} heads but key/value have {key.shape[1]}; pass "
            "enable_gqa=True for grouped-query attention"
        )
    if block_mask is not None:
        want = (query.shape[2] * world_size, key.shape[2] * world_size)
        got = tuple(int(n) for n in getattr(block_mask, "seq_lengths", ()))
        if got != want:
            return (
                f"block_mask was built for (query, key) lengths {got}, but the global sequence is "
                f"{want} ({world_size} ranks x local lengths): build it on the global sequence, "
                f"create_block_mask(mask_mod, B, H, {want[0]}, {want[1]})"
            )
        if getattr(block_mask, "mask_mod", None) is None:
            return "block_mask has no mask_mod: build it with create_block_mask(mask_mod, ...)"
    return None


def flex_attention(
    query,
    key,
    value,
    score_mod=None,
    block_mask=None,
    scale=None,
    enable_gqa=False,
    return_lse=False,
    kernel_options=None,
    *,
    return_aux=None,
):
    """``torch.nn.attention.flex_attention.flex_attention``; ring attention while a route is active.

    query (batch, heads, seq_local, head_dim), key/value (batch, heads_kv, seq_local, head_dim),
    sharded in the route's layout; ``block_mask`` built on the global sequence. Returns ``out``
    (batch, heads, seq_local, head_dim), with ``return_lse`` ``(out, lse)``, with ``return_aux``
    ``(out, AuxOutput(lse=lse))``; lse (batch, heads, seq_local) in float32, natural log.
    """
    route = _active_route()
    if route is None:
        if _BUILTIN_FLEX is None:
            raise RuntimeError(
                "flex_attention needs torch.nn.attention.flex_attention (torch >= 2.5)"
            )
        kwargs = {} if return_aux is None else {"return_aux": return_aux}
        if return_lse:
            kwargs["return_lse"] = True
        return _BUILTIN_FLEX(
            query,
            key,
            value,
            score_mod=score_mod,
            block_mask=block_mask,
            scale=scale,
            enable_gqa=enable_gqa,
            kernel_options=kernel_options,
            **kwargs,
        )
    world = torch.distributed.get_world_size(route.group)
    problem = flex_problem(
        query,
        key,
        score_mod=score_mod,
        block_mask=block_mask,
        enable_gqa=enable_gqa,
        kernel_options=kernel_options,
        return_aux=return_aux,
        world_size=world,
    )
    mask = MaskMod(block_mask.mask_mod) if problem is None and block_mask is not None else None
    want_lse = bool(return_lse) or (
        return_aux is not None and bool(getattr(return_aux, "lse", False))
    )
    op = route.op_for(query, scale, False, value) if isinstance(query, torch.Tensor) else route.op
    # Refusals name the function called, compiled too (routed_from).
    call = route.call(
        scale=scale,
        op=op,
        mask=mask,
        return_lse=want_lse,
        problem=problem,
        routed_from="flex_attention",
    )
    result = api.attend(api.ring_attention.bound, call, query, key, value)
    if return_aux is not None:
        out, lse = result
        return out, _flex_module.AuxOutput(
            lse=lse if getattr(return_aux, "lse", False) else None, max_scores=None
        )
    return result


def _no_route():
    return None


#: The innermost active route (ring_impl.torch_api.sdpa_route hands its getter over in install()).
_active_route = _no_route


def install(active_route) -> None:
    """Route flex calls (entering the outermost route): ``active_route()`` is the route a call
    takes; calls that look flex attention up at call time reach :func:`flex_attention`."""
    global _active_route
    _active_route = active_route
    if _flex_module is not None:
        _flex_module.flex_attention = flex_attention


def uninstall() -> None:
    """Put flex attention back (leaving the outermost route)."""
    global _active_route
    _active_route = _no_route
    if _flex_module is not None:
        _flex_module.flex_attention = _BUILTIN_FLEX
