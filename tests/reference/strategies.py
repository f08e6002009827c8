"""Hypothesis strategies shared by the reference's tests: small attention problems, every draw
labelled so a failure prints the shape that broke."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from hypothesis import settings
from hypothesis import strategies as st

from reference.simulate import RingSimulation, simulate_ring

# The oracle is tested harder than the code under test, and its cases are cheap: at least 50
# examples per property, more when the active profile (dev/ci/nightly, chosen by the root
# conftest before this module is imported) asks for more.
REFERENCE_SETTINGS = settings(deadline=None, max_examples=max(50, settings().max_examples))


@dataclass(frozen=True)
class Problem:
    """query (batch, heads, seq_q, head_dim); key/value (batch, heads_kv, seq_k, head_dim)."""

    query: torch.Tensor
    key: torch.Tensor
    value: torch.Tensor
    is_causal: bool
    scale: float | None

    @property
    def groups(self) -> int:
        return self.query.shape[1] // self.key.shape[1]


def make_problem(
    seed: int,
    *,
    seq_q: int,
    head_dim: int,
    seq_k: int | None = None,
    batch: int = 1,
    heads_kv: int = 1,
    groups: int = 1,
    is_causal: bool = False,
    scale: float | None = None,
    magnitude: float = 1.0,
    head_dim_v: int | None = None,
) -> Problem:
    """``seq_k``: the keys' length (None: ``seq_q``); ``head_dim_v``: value's head dim (None:
    ``head_dim``); ``magnitude`` scales query and key (logits grow by its square)."""
    seq_k = seq_q if seq_k is None else seq_k
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(batch, heads_kv * groups, seq_q, head_dim, generator=gen, dtype=torch.float64)
    k = torch.randn(batch, heads_kv, seq_k, head_dim, generator=gen, dtype=torch.float64)
    v = torch.randn(
        batch,
        heads_kv,
        seq_k,
        head_dim if head_dim_v is None else head_dim_v,
        generator=gen,
        dtype=torch.float64,
    )
    return Problem(q * magnitude, k * magnitude, v, is_causal, scale)


def simulate(p: Problem, world_size: int, layout: str) -> RingSimulation:
    """The chunked single-process ring simulation of ``p`` on ``world_size`` ranks."""
    options = dict(is_causal=p.is_causal, scale=p.scale)
    return simulate_ring(p.query, p.key, p.value, world_size=world_size, layout=layout, **options)


def draw_problem(
    data: st.DataObject,
    *,
    max_seq: int = 10,
    cross: bool = True,
    causal: bool | None = None,
    magnitude: float = 1.0,
) -> Problem:
    """Draw a small problem. cross: allow seq_k != seq_q when not causal. causal: fix is_causal
    (None: draw it)."""
    is_causal = data.draw(st.booleans(), label="is_causal") if causal is None else causal
    seq_q = data.draw(st.integers(1, max_seq), label="seq_q")
    seq_k = seq_q
    if cross and not is_causal:
        seq_k = data.draw(st.integers(1, max_seq), label="seq_k")
    scale = data.draw(st.one_of(st.none(), st.floats(0.05, 2.0)), label="scale")
    return make_problem(
        seed=data.draw(st.integers(0, 2**31 - 1), label="seed"),
        batch=data.draw(st.integers(1, 2), label="batch"),
        heads_kv=data.draw(st.integers(1, 2), label="heads_kv"),
        groups=data.draw(st.integers(1, 3), label="gqa_groups"),
        seq_q=seq_q,
        seq_k=seq_k,
        head_dim=data.draw(st.integers(1, 8), label="head_dim"),
        is_causal=is_causal,
        scale=scale,
        magnitude=magnitude,
    )
