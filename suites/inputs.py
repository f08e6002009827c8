"""Deterministic global inputs, generated identically in the pytest process and on every rank.

The suite owns the global tensors: each side regenerates them from an :class:`InputSpec`
(seeded CPU generator, so no tensor crosses a process boundary on the way in), shards them
with the reference's own layout code and never with the implementation's.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

import torch

from reference.layout import shard

__all__ = ["DTYPES", "InputSpec", "Inputs", "local_inputs", "make_inputs", "nan_position"]

DTYPES: dict[str, torch.dtype] = {
    "float64": torch.float64,
    "float32": torch.float32,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
}
SHORT = {"float64": "f64", "float32": "f32", "bfloat16": "bf16", "float16": "f16"}


@dataclass(frozen=True)
class InputSpec:
    """Shapes are global: ``seq_q``/``seq_kv`` are whole sequences, sharded by the case's layout."""

    batch: int = 2
    heads: int = 4
    heads_kv: int = 4
    seq_q: int = 16
    seq_kv: int = 16
    head_dim: int = 16
    dtype: str = "float32"
    #: value's head dim (out's and grad_out's too); None: ``head_dim``. Another value is multi-head
    #: latent attention's (d_v != d_qk), which an implementation claims unless it declares
    #: ``capabilities.value_head_dim=False``
    head_dim_v: int | None = None
    seed: int = 0
    magnitude: float = 1.0  # scales query and key: 1e2 pushes logits far beyond exp overflow
    noncontiguous: bool = False  # local shards are transposed views of (batch, seq, heads, dim)
    #: local shards are every other element of a buffer twice as wide on the head dim
    #: (``x[..., ::2]``, NaN between): a kernel that reads the head dim as contiguous reads NaN
    strided_head_dim: bool = False
    scale: float | None = None
    lse_grad: bool = False  # the loss also uses the LSE: grad_lse (batch, heads, seq_q) is drawn
    nan_in: str | None = None  # "query", "key" or "value": one element is NaN (see make_inputs)

    @property
    def torch_dtype(self) -> torch.dtype:
        return DTYPES[self.dtype]

    @property
    def value_head_dim(self) -> int:
        """Value's head dim: ``head_dim_v``, or ``head_dim`` when it is None."""
        return self.head_dim if self.head_dim_v is None else self.head_dim_v

    def with_(self, **changes) -> InputSpec:
        return replace(self, **changes)

    @classmethod
    def per_rank(cls, world_size: int, rows: int = 8, **fields: Any) -> InputSpec:
        """Self-attention inputs of ``rows`` query and key rows per rank over ``world_size``
        ranks (``seq_q = seq_kv = rows * world_size``), the other fields as given (the
        defaults otherwise: batch 2, 4 heads, 4 key/value heads, head_dim 16, float32)."""
        return cls(seq_q=rows * world_size, seq_kv=rows * world_size, **fields)


@dataclass(frozen=True)
class Inputs:
    """Global tensors: query (b, h, sq, d), key (b, hkv, skv, d), value (b, hkv, skv, dv),
    grad_out (b, h, sq, dv) (``dv``: the spec's value head dim), grad_lse (b, h, sq) when the
    spec's loss uses the LSE, else None."""

    query: torch.Tensor
    key: torch.Tensor
    value: torch.Tensor
    grad_out: torch.Tensor
    grad_lse: torch.Tensor | None = None


def nan_position(spec: InputSpec) -> tuple[int, int, int, int]:
    """Where ``spec.nan_in`` puts its NaN: batch 0, head 0, a third into the sequence, feature 1
    (a position that later rows see under causal attention and that is not a shard's first)."""
    seq = spec.seq_q if spec.nan_in == "query" else spec.seq_kv
    return (0, 0, seq // 3, min(1, spec.head_dim - 1))


def make_inputs(spec: InputSpec) -> Inputs:
    """Global inputs in ``spec.dtype``: drawn in float64 from a seeded CPU generator, then
    rounded once to the dtype (the float64 reference sees the same rounded values)."""
    gen = torch.Generator(device="cpu").manual_seed(spec.seed)

    def draw(*shape: int, magnitude: float = 1.0) -> torch.Tensor:
        return (torch.randn(*shape, generator=gen, dtype=torch.float64) * magnitude).to(
            spec.torch_dtype
        )

    b, h, hkv, d, dv = spec.batch, spec.heads, spec.heads_kv, spec.head_dim, spec.value_head_dim
    inputs = Inputs(
        query=draw(b, h, spec.seq_q, d, magnitude=spec.magnitude),
        key=draw(b, hkv, spec.seq_kv, d, magnitude=spec.magnitude),
        value=draw(b, hkv, spec.seq_kv, dv),
        grad_out=draw(b, h, spec.seq_q, dv),
        grad_lse=draw(b, h, spec.seq_q) if spec.lse_grad else None,
    )
    if spec.nan_in is not None:
        if spec.nan_in not in ("query", "key", "value"):
            raise ValueError(
                f"InputSpec.nan_in must be 'query', 'key' or 'value', not {spec.nan_in!r}"
            )
        getattr(inputs, spec.nan_in)[nan_position(spec)] = float("nan")
    return inputs


def _local(
    t: torch.Tensor, layout: str, world_size: int, rank: int, spec: InputSpec, device
) -> torch.Tensor:
    return in_memory(shard(t, layout, world_size, rank, dim=2).to(device), spec)


def in_memory(local: torch.Tensor, spec: InputSpec) -> torch.Tensor:
    """A (batch, heads, seq, dim) shard in the memory
    ``spec`` asks for (a view when not contiguous)."""
    if spec.noncontiguous:
        # The shard a (batch, seq, heads, dim) model hands over: a transposed, non-contiguous view.
        local = local.transpose(1, 2).contiguous().transpose(1, 2)
        assert not local.is_contiguous() or min(local.shape[1], local.shape[2]) == 1
    if spec.strided_head_dim:
        local = torch.stack([local, torch.full_like(local, float("nan"))], dim=-1)[..., 0]
    return local


def local_inputs(
    spec: InputSpec, layout: str, world_size: int, rank: int, device: torch.device | str
) -> Inputs:
    """This rank's shards; query/key/value are leaves that require grad."""
    g = make_inputs(spec)
    q, k, v = (
        _local(t, layout, world_size, rank, spec, device).detach().requires_grad_()
        for t in (g.query, g.key, g.value)
    )
    grad_lse = None
    if g.grad_lse is not None:
        grad_lse = (
            shard(g.grad_lse.unsqueeze(-1), layout, world_size, rank, dim=2).squeeze(-1).to(device)
        )
    return Inputs(q, k, v, _local(g.grad_out, layout, world_size, rank, spec, device), grad_lse)
