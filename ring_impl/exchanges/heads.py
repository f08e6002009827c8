"""Running the ring over groups of heads one after another (``head_chunks``), to bound memory.

Attention is independent per head, so a call can run ``c`` complete rings, each over a group of
key/value heads and the query heads that attend to them, instead of one ring over all heads.
Everything a ring holds beyond its inputs and outputs then shrinks by ``c``: the key/value block
in use and the one arriving, the dK/dV accumulators leaving and arriving, the kernel's step
results (dQ, dK, dV) and the accumulators of the chunk. Measured with ``benchmarks/ring.py``
(W=4, seq 16384, causal head_tail, alltoall): see docs/benchmarks.md.

What it costs: ``c`` times as many collectives, each ``1/c`` of the bytes (the bytes each rank
sends are unchanged, still the minimum), and the first key/value hop of each chunk's backward
waits for nothing to overlap it. Key/value heads are split as evenly as possible (chunk sizes
differ by at most one); a grouped-query chunk takes the query heads of its key/value heads (query
head ``i`` attends key/value head ``i // (heads // heads_kv)``, as SDPA's ``enable_gqa``).

Under ``torch.compile`` each chunk's first transfer is tied to the previous chunk's result with
:func:`ring_impl.transports.after` (a copy of the chunk's keys, compiled only), so the chunks'
collectives are posted in one order on every rank. The chunks' rings are independent in the
graph, and nothing obliges a compiler to keep independent collectives in program order; the
ranks' graphs differ (their causal plans do), so two ranks could interleave the rings
differently, and equal-sized hops of different chunks would then pair up silently. torch 2.13's
inductor kept program order in every case tried without the tie (W 3 and 4, 4 chunks, causal,
every rotation and layout), so the tie is a guarantee, not a measured fix.
"""

from __future__ import annotations

import itertools
from dataclasses import replace

import torch

from .. import debug
from ..transports import after

__all__ = ["check_head_chunks", "head_spans", "plan_chunks", "run_backward", "run_forward"]


def check_head_chunks(head_chunks, heads_kv: int | None) -> str | None:
    """The problem with ``head_chunks`` for ``heads_kv`` key/value heads, or None."""
    if isinstance(head_chunks, bool) or not isinstance(head_chunks, int) or head_chunks < 1:
        return f"head_chunks must be a positive int, got {head_chunks!r}"
    if heads_kv is not None and head_chunks > heads_kv:
        return (
            f"head_chunks={head_chunks} exceeds the {heads_kv} key/value heads; chunks split "
            f"key/value heads, so use at most {heads_kv}"
        )
    return None


def head_spans(heads: int, heads_kv: int, chunks: int) -> list[tuple[slice, slice]]:
    """(query heads, key/value heads) of each chunk, in order; ``chunks <= heads_kv``."""
    group = heads // heads_kv
    bounds = [(i * heads_kv) // chunks for i in range(chunks + 1)]
    return [(slice(a * group, b * group), slice(a, b)) for a, b in itertools.pairwise(bounds)]


def _chunk(t: torch.Tensor, heads: slice) -> torch.Tensor:
    # Contiguous once per chunk (a no-op for batch 1), not once per ring step.
    return t[:, heads].contiguous()


def _keys_after(key: torch.Tensor, heads: slice, token: torch.Tensor | None) -> torch.Tensor:
    """The chunk's keys; compiled, tied to ``token`` (the previous chunk's result) so this
    chunk's ring starts after the previous one ended."""
    k = _chunk(key, heads)
    if token is not None and torch.compiler.is_compiling():
        k = after(k, token)
    return k


def _for_heads(cfg, heads: slice):
    """The config of the ring over query heads ``heads`` (of the ring's own, which start at head
    ``cfg.mask_heads[0]`` of the mask's when the ring runs a slice of them: the hybrid's). A
    score_mod reads the same global head indices (ALiBi's slope of each head)."""
    if cfg.mask is None and getattr(cfg, "score_mod", None) is None:
        return cfg
    base = cfg.mask_heads[0] if cfg.mask_heads is not None else 0
    return replace(cfg, mask_heads=(base + heads.start, base + heads.stop))


def plan_chunks(impl, cfg, heads: int, heads_kv: int, seq_q: int, seq_kv: int) -> None:
    """Make the plans :func:`run_forward` will ask ``impl`` for (one per head chunk), ahead of the
    call: a mask known only by evaluating it keeps them in ``cfg.plan_memo``."""
    spans = head_spans(heads, heads_kv, cfg.head_chunks)
    for hq, _ in spans:
        impl.plan(cfg if len(spans) == 1 else _for_heads(cfg, hq), seq_q, seq_kv)


def run_forward(impl, cfg, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor):
    """``impl.forward`` over ``cfg.head_chunks`` head groups: (out, lse) as one ring call's, and
    with ``cfg.max_logit`` the local max logit (heads,) third, each chunk's heads from its ring."""
    spans = head_spans(query.shape[1], key.shape[1], cfg.head_chunks)
    if len(spans) == 1:
        return impl.forward(cfg, query, key, value)
    out: torch.Tensor | None = None
    lse: torch.Tensor | None = None
    max_logit: torch.Tensor | None = None
    recorder = debug.active_recorder()
    first_record = len(recorder.records) if recorder is not None else 0
    token: torch.Tensor | None = None
    for hq, hkv in spans:
        out_c, lse_c, *max_c = impl.forward(
            _for_heads(cfg, hq), _chunk(query, hq), _keys_after(key, hkv, token), _chunk(value, hkv)
        )
        if out is None or lse is None:
            out = query.new_empty((*query.shape[:3], value.shape[-1]), dtype=out_c.dtype)
            lse = lse_c.new_empty(query.shape[:3])
            max_logit = lse_c.new_empty(query.shape[1:2]) if max_c else None
        out[:, hq] = out_c
        lse[:, hq] = lse_c
        if max_logit is not None:
            max_logit[hq] = max_c[0]
        token = out_c
        del out_c, lse_c, max_c
    if recorder is not None:
        debug.join_head_chunks(recorder, first_record, len(spans))
    return (out, lse) if max_logit is None else (out, lse, max_logit)


def run_backward(impl, cfg, grad_out, query, key, value, out, lse, grad_lse=None):
    """``impl.backward`` over ``cfg.head_chunks`` head groups: (dq, dk, dv) as one ring call's.

    grad_lse (batch, heads, seq_q) or None: passed on only when given (variants may override
    ``backward`` without it)."""
    spans = head_spans(query.shape[1], key.shape[1], cfg.head_chunks)

    def lse_grad(hq: slice | None = None) -> dict:
        if grad_lse is None:
            return {}
        return {"grad_lse": grad_lse if hq is None else _chunk(grad_lse, hq)}

    if len(spans) == 1:
        return impl.backward(cfg, grad_out, query, key, value, out, lse, **lse_grad())
    dq, dk, dv = torch.empty_like(query), torch.empty_like(key), torch.empty_like(value)
    token: torch.Tensor | None = None
    for hq, hkv in spans:
        dq_c, dk_c, dv_c = impl.backward(
            _for_heads(cfg, hq),
            _chunk(grad_out, hq),
            _chunk(query, hq),
            _keys_after(key, hkv, token),
            _chunk(value, hkv),
            _chunk(out, hq),
            _chunk(lse, hq),
            **lse_grad(hq),
        )
        dq[:, hq], dk[:, hkv], dv[:, hkv] = dq_c, dk_c, dv_c
        token = dv_c  # the chunk's last result: its dK/dV came home with its ring's last hop
        del dq_c, dk_c, dv_c
    return dq, dk, dv
