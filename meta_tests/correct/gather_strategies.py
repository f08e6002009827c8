"""gather_strategies: Ulysses and the hybrid by the plainest correct means, written without
ring_impl: every rank all-gathers the whole key/value sequence and attends its own query rows.

The false-failure side of the strategy axis (``suites/meshes.py``' cases): a result that is
right by construction, reached by a different road from any head-parallel implementation (no
all-to-all, no head shards, no inner ring), so a suite that fails it judges a correct result
wrongly.

The sharding is the strategies' (design.md, "Parallel strategies"), restated from the layout
definition: on a ``(ulysses, ring)`` mesh of shape ``(U, R)`` rank ``(u, r)``, mesh rank
``r * U + u``, holds

- ``ulysses`` (a process group of ``U`` ranks): the layout's shard ``u`` of ``U``;
- ``hybrid`` (a 2-D DeviceMesh with dims ``ring`` and ``ulysses``): the layout's shard ``r`` of
  ``R`` (row ``r``'s shard), cut into ``U`` contiguous pieces, piece ``u``.

Forward: key and value, widened to the accumulation dtype (float64 for float64, float32
otherwise), are all-gathered over the Ulysses group and then over the ring group, which puts the
shards in mesh-rank order; the global position of every gathered row and of every local query row
follows from the layout. Scores, softmax and the output are plain torch math in the accumulation
dtype on this rank's query rows and every key (query head ``h`` reads key/value head
``h // (heads / heads_kv)``); the output is rounded once to the input dtype, the LSE
``(batch, heads, seq_local)`` stays in the accumulation dtype. Backward is autograd through that
math and through the gathers, whose backward sends each rank's gradient of every gathered block
to the block's owner (one ``all_to_all_single``) and sums what arrives, in the accumulation dtype.

The hybrid's ``rotate_method`` is accepted (all three) and changes nothing: the key/value blocks
always travel by one all-gather per mesh dim, and the result does not depend on the transport.

Declared honestly (:class:`conformance.Capabilities`): no op objects (it runs its own math), no
masks, sinks or score_mod, no torch.compile, no input checks across ranks (bad input is not
promised to raise on every rank), no collective schedule, no ``strategy="ring"``.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from meta_tests.correct.common import (
    LAYOUTS,
    ROTATE_METHODS,
    accumulation_dtype,
    all_gather,
    correct_capabilities,
    local_positions,
)

__all__ = ["IMPLEMENTATION", "GatherStrategies", "gather_strategies"]

STRATEGIES = ("ulysses", "hybrid")


class _Gather(torch.autograd.Function):
    """(…) on every rank of ``group`` -> (group size, …): block ``j`` from group rank ``j``.
    Backward: block ``j``'s gradient goes to rank ``j``; each rank sums what it receives."""

    @staticmethod
    def forward(ctx, t: torch.Tensor, group) -> torch.Tensor:
        ctx.group = group
        w = dist.get_world_size(group)
        t = t.contiguous()
        out = t.new_empty((w, *t.shape))
        all_gather(out.view(-1), t.view(-1), group=group)
        return out

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        grad = grad.contiguous()
        received = torch.empty_like(grad)
        dist.all_to_all_single(received, grad, group=ctx.group)
        return received.sum(0), None


def _mesh(strategy: str, group):
    """(ulysses group, ring group or None, U, R, u, r) of ``group=``."""
    from torch.distributed.device_mesh import DeviceMesh

    if strategy == "ulysses":
        if isinstance(group, DeviceMesh):
            if group.ndim != 1:
                raise ValueError(
                    f"strategy='ulysses' takes a process group or a 1-D DeviceMesh, "
                    f"got a {group.ndim}-D mesh; pass its Ulysses dim "
                    "(mesh['ulysses']) or use strategy='hybrid'"
                )
            group = group.get_group()
        return group, None, dist.get_world_size(group), 1, dist.get_rank(group), 0
    if (
        not isinstance(group, DeviceMesh)
        or group.ndim != 2
        or sorted(group.mesh_dim_names or ()) != ["ring", "ulysses"]
    ):
        raise TypeError(
            "strategy='hybrid' needs a 2-D DeviceMesh with dims named 'ring' and "
            "'ulysses', e.g. init_device_mesh(device, (ring_degree, ulysses_degree), "
            "mesh_dim_names=('ring', 'ulysses'))"
        )
    ug, rg = group.get_group("ulysses"), group.get_group("ring")
    return (
        ug,
        rg,
        dist.get_world_size(ug),
        dist.get_world_size(rg),
        group.get_local_rank("ulysses"),
        group.get_local_rank("ring"),
    )


def _positions(
    strategy: str, layout: str, u_size: int, r_size: int, u: int, r: int, n: int
) -> torch.Tensor:
    """(n,) int64: the global positions of the ``n`` local rows of mesh rank ``(u, r)``."""
    if strategy == "ulysses":
        return local_positions(layout, u_size, u, n)
    row = local_positions(layout, r_size, r, n * u_size)  # row r's shard, cut into U pieces
    return row[u * n : (u + 1) * n]


def ring_attention(
    query,
    key,
    value,
    *,
    group=None,
    strategy="ulysses",
    is_causal=False,
    scale=None,
    rotate_method=None,
    layout="contiguous",
    return_lse=False,
    op=None,
):
    """Ulysses or the hybrid (``strategy``) on ``group``; differentiable in query, key, value
    (and through the LSE).

    query (batch, heads, seq_q_local, head_dim), key (batch, heads_kv, seq_kv_local, head_dim),
    value (batch, heads_kv, seq_kv_local, head_dim_v), sharded by the strategy's layout (module
    docstring). Returns out (batch, heads, seq_q_local, head_dim_v) in the input dtype and, with
    ``return_lse``, the LSE (batch, heads, seq_q_local) in float32 (float64 for float64 inputs).
    """
    if strategy not in STRATEGIES:
        raise ValueError(f"unknown strategy {strategy!r}; gather_strategies runs {STRATEGIES}")
    if layout not in LAYOUTS:
        raise ValueError(f"unknown layout {layout!r}; expected one of {LAYOUTS}")
    if rotate_method is not None and rotate_method not in ROTATE_METHODS:
        raise ValueError(
            f"unknown rotate_method {rotate_method!r}; expected one of {ROTATE_METHODS}"
        )
    if op is not None:
        raise ValueError(
            f"op={op!r} given, but gather_strategies runs its own math "
            "(capabilities.ops is empty); leave op=None"
        )
    _, h, sq, d = query.shape
    hkv, skv = key.shape[1], key.shape[2]
    if h % hkv:
        raise ValueError(f"query heads {h} are not a multiple of key/value heads {hkv}")
    if is_causal and sq != skv:
        raise ValueError(
            f"causal attention needs equal query and key/value lengths, got {sq} and {skv}"
        )
    ug, rg, u_size, r_size, u, r = _mesh(strategy, group)
    if h % u_size:
        raise ValueError(f"query heads {h} are not divisible by the Ulysses degree {u_size}")
    acc = accumulation_dtype(query.dtype)
    scale = d**-0.5 if scale is None else scale

    def gathered(t: torch.Tensor) -> torch.Tensor:
        """(b, hkv, s, f) local -> (b, hkv, U*R*s, f): every rank's shard, mesh-rank order."""
        g = _Gather.apply(t.to(acc), ug)  # (U, b, hkv, s, f)
        if rg is not None:
            g = _Gather.apply(g, rg)  # (R, U, b, hkv, s, f)
        g = g.reshape(-1, *t.shape)  # (U*R, b, hkv, s, f), block m = mesh rank m
        return torch.cat(list(g.unbind(0)), dim=2)

    k_all, v_all = gathered(key), gathered(value)
    kv_pos = torch.cat(
        [
            _positions(strategy, layout, u_size, r_size, m % u_size, m // u_size, skv)
            for m in range(u_size * r_size)
        ]
    )
    group_size = h // hkv
    # query head i reads key/value head i // group_size
    k_all = k_all.repeat_interleave(group_size, dim=1)
    v_all = v_all.repeat_interleave(group_size, dim=1)
    scores = torch.matmul(query.to(acc), k_all.transpose(-1, -2)) * scale  # (b, h, sq, U*R*skv)
    if is_causal:
        q_pos = _positions(strategy, layout, u_size, r_size, u, r, sq)
        visible = (kv_pos[None, :] <= q_pos[:, None]).to(scores.device)
        scores = scores.masked_fill(~visible, float("-inf"))
    lse = torch.logsumexp(scores, dim=-1)  # (b, h, sq)
    seen = torch.isfinite(lse) | torch.isnan(lse)
    probs = torch.exp(scores - torch.where(seen, lse, torch.zeros((), dtype=acc)).unsqueeze(-1))
    out = torch.matmul(probs, v_all).to(query.dtype)
    return (out, lse) if return_lse else out


class GatherStrategies:
    """gather_strategies as an implementation under test
    (``--impl meta_tests.correct.gather_strategies:IMPLEMENTATION``)."""

    name = "gather_strategies"
    baseline_op = "math"
    capabilities = correct_capabilities(
        ops=frozenset(),
        lse_grad=True,
        value_head_dim=True,
        input_errors=False,
        collective_schedule=False,
        record_steps=False,
        strategies=frozenset(STRATEGIES),
        masks=frozenset(),
        sinks=False,
        score_mod=False,
        uneven_shards=False,  # Ulysses and the hybrid here cut equal shards
        balancers=frozenset(),
        max_logit=False,
        packed=False,  # (batch, heads, seq, dim) shards only: no cu_seqlens
        replicated_kv=False,  # key/value are sequence shards, gathered over the mesh
    )
    ring_attention = staticmethod(ring_attention)


gather_strategies = GatherStrategies()
IMPLEMENTATION = gather_strategies
