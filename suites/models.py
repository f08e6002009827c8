"""Small models for the integration cases: a Llama-like decoder and an encoder stack.

The Llama-like model has what breaks context parallelism in real models: rotary position
embeddings from a position table (which must be sharded with the sequence), grouped-query
attention through ``F.scaled_dot_product_attention(..., enable_gqa=True)``, RMSNorm and a
SwiGLU MLP. Shapes: tokens in as (batch, seq, dim), attention as (batch, heads, seq, head_dim).
"""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

__all__ = ["LlamaLike", "encoder_stack", "rope_tables"]


def rope_tables(
    seq: int, head_dim: int, dtype: torch.dtype, base: float = 10000.0
) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin tables (seq, head_dim // 2) for rotary embeddings at positions 0..seq-1."""
    inv = 1.0 / base ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim)
    angles = torch.arange(seq, dtype=torch.float64)[:, None] * inv[None, :]
    return angles.cos().to(dtype), angles.sin().to(dtype)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x (batch, heads, seq, head_dim); cos/sin (seq, head_dim // 2) for this rank's positions."""
    x1, x2 = x[..., 0::2], x[..., 1::2]
    return torch.stack([x1 * cos - x2 * sin, x1 * sin + x2 * cos], dim=-1).flatten(-2)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight


class Attention(nn.Module):
    def __init__(self, dim: int, heads: int, heads_kv: int):
        super().__init__()
        self.heads, self.heads_kv, self.head_dim = heads, heads_kv, dim // heads
        self.wq = nn.Linear(dim, heads * self.head_dim, bias=False)
        self.wk = nn.Linear(dim, heads_kv * self.head_dim, bias=False)
        self.wv = nn.Linear(dim, heads_kv * self.head_dim, bias=False)
        self.wo = nn.Linear(heads * self.head_dim, dim, bias=False)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        b, s, _ = x.shape
        q = self.wq(x).view(b, s, self.heads, self.head_dim).transpose(1, 2)
        k = self.wk(x).view(b, s, self.heads_kv, self.head_dim).transpose(1, 2)
        v = self.wv(x).view(b, s, self.heads_kv, self.head_dim).transpose(1, 2)
        q, k = _rotate(q, cos, sin), _rotate(k, cos, sin)
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        return self.wo(out.transpose(1, 2).reshape(b, s, -1))


class Block(nn.Module):
    def __init__(self, dim: int, heads: int, heads_kv: int, hidden: int):
        super().__init__()
        self.attn_norm, self.mlp_norm = RMSNorm(dim), RMSNorm(dim)
        self.attn = Attention(dim, heads, heads_kv)
        self.w1, self.w3 = nn.Linear(dim, hidden, bias=False), nn.Linear(dim, hidden, bias=False)
        self.w2 = nn.Linear(hidden, dim, bias=False)

    def forward(self, x, cos, sin):
        x = x + self.attn(self.attn_norm(x), cos, sin)
        h = self.mlp_norm(x)
        return x + self.w2(F.silu(self.w1(h)) * self.w3(h))


class LlamaLike(nn.Module):
    """Token ids (batch, seq) -> logits (batch, seq, vocab); RoPE tables are buffers of the global
    sequence length, to be sharded with the tokens under context parallelism."""

    def __init__(
        self,
        *,
        vocab: int = 64,
        dim: int = 32,
        heads: int = 4,
        heads_kv: int = 2,
        hidden: int = 64,
        layers: int = 2,
        max_seq: int = 64,
        dtype: torch.dtype = torch.float64,
    ):
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.blocks = nn.ModuleList(Block(dim, heads, heads_kv, hidden) for _ in range(layers))
        self.norm = RMSNorm(dim)
        self.head = nn.Linear(dim, vocab, bias=False)
        cos, sin = rope_tables(max_seq, dim // heads, dtype)
        self.register_buffer("rope_cos", cos)
        self.register_buffer("rope_sin", sin)
        self.to(dtype)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        s = tokens.shape[1]
        cos, sin = self.rope_cos[:s], self.rope_sin[:s]
        x = self.embed(tokens)
        for block in self.blocks:
            x = block(x, cos, sin)
        return self.head(self.norm(x))


def encoder_stack(
    *, dim: int = 32, heads: int = 4, hidden: int = 64, layers: int = 2, dtype=torch.float64
) -> nn.TransformerEncoder:
    """``nn.TransformerEncoder`` of ``layers`` pre-norm layers, batch first, no dropout."""
    layer = nn.TransformerEncoderLayer(
        dim, heads, hidden, dropout=0.0, batch_first=True, norm_first=True
    )
    return nn.TransformerEncoder(layer, layers, enable_nested_tensor=False).to(dtype)
