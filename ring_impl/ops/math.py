"""A pure-torch attention op: every dtype and device, native GQA, the LSE's gradient.

The reference kernel of the ring for dtypes and devices no fused kernel covers, and the one that
makes a float64 ring possible.
"""

from __future__ import annotations

import torch

from .contract import OpCapabilities, accumulation_dtype

__all__ = ["MathOp"]


def _causal_mask(seq_q: int, seq_k: int, device: torch.device) -> torch.Tensor:
    """(seq_q, seq_k) bool, True where query i may see key j (top-left aligned: j <= i)."""
    return torch.ones(seq_q, seq_k, dtype=torch.bool, device=device).tril()


class MathOp:
    """Attention in plain torch ops, computed in the accumulation dtype (float64 for float64).

    The reference kernel of the ring for dtypes and devices no fused kernel covers, and the one
    that makes a float64 ring possible. Memory is O(seq_q * seq_k) per block.
    """

    name = "math"
    capabilities = OpCapabilities(
        devices=frozenset({"cpu", "cuda"}),
        gqa=True,
        lse_grad=True,
        masks=True,
        row_views=True,  # einsum over any strides
        score_mod=True,  # the scores are explicit
        value_head_dim=True,
    )

    @staticmethod
    def _raw_scores(query: torch.Tensor, key: torch.Tensor, scale: float) -> torch.Tensor:
        # query (b, h, sq, d) viewed as (b, hkv, g, sq, d): query head h uses kv head h // g.
        b, h, sq, d = query.shape
        hkv = key.shape[1]
        acc = accumulation_dtype(query.dtype)
        q = query.to(acc).reshape(b, hkv, h // hkv, sq, d)
        return torch.einsum("bngqd,bnkd->bngqk", q, key.to(acc)) * scale  # (b, hkv, g, sq, sk)

    @staticmethod
    def _scores(
        query: torch.Tensor,
        key: torch.Tensor,
        is_causal: bool,
        scale: float,
        attn_mask: torch.Tensor | None = None,
        score_mod=None,
        raw: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """The scaled scores (b, hkv, g, sq, sk), modified by ``score_mod`` (a
        ring_impl.score_mods.BlockScores, on the (b, heads, sq, sk) view), then masked."""
        b, h, sq, _ = query.shape
        hkv, sk = key.shape[1], key.shape[2]
        s = MathOp._raw_scores(query, key, scale) if raw is None else raw
        if score_mod is not None:
            s = score_mod.apply(s.reshape(b, h, sq, sk)).reshape(b, hkv, h // hkv, sq, sk)
        if is_causal:
            s = s.masked_fill(~_causal_mask(sq, sk, query.device), float("-inf"))
        if attn_mask is not None:  # (B or 1, h or 1, sq, sk) -> the grouped head layout
            m = attn_mask if attn_mask.dim() == 4 else attn_mask.view(1, 1, *attn_mask.shape[-2:])
            m = m.reshape(m.shape[0], hkv, h // hkv, sq, sk) if m.shape[1] == h else m.unsqueeze(1)
            s = s.masked_fill(~m, float("-inf"))
        return s  # (b, hkv, g, sq, sk)

    def forward(self, query, key, value, *, is_causal, scale, attn_mask=None, score_mod=None):
        b, h, sq, _ = query.shape
        s = self._scores(query, key, is_causal, scale, attn_mask, score_mod)
        lse = torch.logsumexp(s, dim=-1)  # (b, hkv, g, sq)
        p = torch.exp(s - lse.unsqueeze(-1))
        out = torch.einsum("bngqk,bnkd->bngqd", p, value.to(s.dtype))
        return out.reshape(b, h, sq, value.shape[-1]).to(query.dtype), lse.reshape(b, h, sq)

    def backward(
        self,
        grad_out,
        query,
        key,
        value,
        out,
        lse,
        *,
        is_causal,
        scale,
        grad_lse=None,
        attn_mask=None,
        score_mod=None,
    ):
        b, h, sq, d = query.shape
        hkv, sk, dv = key.shape[1], key.shape[2], value.shape[-1]
        g = h // hkv
        raw = self._raw_scores(query, key, scale) if score_mod is not None else None
        s = self._scores(query, key, is_causal, scale, attn_mask, score_mod, raw)
        acc = s.dtype
        p = torch.exp(s - lse.to(acc).reshape(b, hkv, g, sq, 1))
        do = grad_out.to(acc).reshape(b, hkv, g, sq, dv)
        o = out.to(acc).reshape(b, hkv, g, sq, dv)
        dv = torch.einsum("bngqk,bngqd->bnkd", p, do)
        dp = torch.einsum("bngqd,bnkd->bngqk", do, value.to(acc))
        delta = (do * o).sum(-1, keepdim=True)  # rowsum(dO * O) of the *final* output
        if grad_lse is not None:  # d lse_i / d s_ij = p_ij
            delta = delta - grad_lse.to(acc).reshape(b, hkv, g, sq, 1)
        ds = p * (dp - delta)
        if score_mod is not None:  # back through the score_mod to the scaled scores (masked: ds 0)
            ds = score_mod.grad(raw.reshape(b, h, sq, sk), ds.reshape(b, h, sq, sk))
            ds = ds.reshape(b, hkv, g, sq, sk)
        dq = torch.einsum("bngqk,bnkd->bngqd", ds, key.to(acc)) * scale
        dk = torch.einsum("bngqk,bngqd->bnkd", ds, query.to(acc).reshape(b, hkv, g, sq, d)) * scale
        return dq.reshape(b, h, sq, d).to(query.dtype), dk.to(key.dtype), dv.to(value.dtype)
