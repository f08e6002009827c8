"""Deliberately broken ring implementations: one per bug class of shared/bug-classes.md.

Each is ring_impl's :class:`RingAttention` with one seam overridden the way a real
implementation got it wrong (or ring_impl's result altered on the way out), wrapped as an
implementation under test (``--impl meta_tests.broken:<NAME>``).
``meta_tests/test_suite_catches_bugs.py`` runs the conformance suites against each and requires a
failure whose message matches the ring's own ``expect`` pattern and no other ring's: the message
names the cause, not just a symptom every bug shares.

Every bug keeps the collectives uniform across ranks unless the bug *is* a collective mismatch,
so a broken implementation fails on its numbers rather than by accident.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

import torch

import ring_impl
from conformance.adapters.ring_impl import RingImplAdapter, ring_impl_mask, speaking_specs
from ring_impl import RingAttention, debug
from ring_impl.ops import call_backward, call_forward, default_scale
from ring_impl.planning.plan import Block

__all__ = ["BROKEN", "Broken", "by_name", "function_adapter", "ring_adapter"]


# ------------------------------------------------------------------------ causal handling


def _with_blocks(plans, change):
    """Plans with each step's blocks replaced by ``change(step_plan)`` (a tuple of blocks)."""
    return [replace(p, blocks=tuple(change(p))) for p in plans]


class SkippedStepComputed(RingAttention):
    """Causal, contiguous: a key/value block from a later rank is computed in full, not skipped."""

    def plan(self, cfg, seq_q, seq_kv):
        return _with_blocks(
            super().plan(cfg, seq_q, seq_kv),
            lambda p: p.blocks or (Block(p.step, p.kv_rank, "full", (0, seq_q), (0, seq_kv)),),
        )


class NeededStepSkipped(RingAttention):
    """The last ring step is skipped although its keys are visible."""

    def plan(self, cfg, seq_q, seq_kv):
        last = cfg.group.world_size - 1
        return _with_blocks(
            super().plan(cfg, seq_q, seq_kv),
            lambda p: () if p.step == last and last > 0 else p.blocks,
        )


class CausalMaskOnFullStep(RingAttention):
    """Steps after the first are computed with the causal mask, as if every block were diagonal."""

    def plan(self, cfg, seq_q, seq_kv):
        return _with_blocks(
            super().plan(cfg, seq_q, seq_kv),
            lambda p: (
                replace(b, kind="causal")
                if b.kind == "full" and p.step > 0 and seq_q == seq_kv
                else b
                for b in p.blocks
            ),
        )


class HeadTailWrongPairing(RingAttention):
    """head_tail: blocks from earlier ranks pair the queries with the key/value *tail* chunk."""

    def plan(self, cfg, seq_q, seq_kv):
        n = seq_kv // 2
        return _with_blocks(
            super().plan(cfg, seq_q, seq_kv),
            lambda p: (
                replace(b, kv_rows=(n, 2 * n)) if b.kv_rows == (0, n) and b.kind == "full" else b
                for b in p.blocks
            ),
        )


class LoadBalanceAssumesCausal(RingAttention):
    """head_tail treated as causal-only: non-causal attention gets the causal plan."""

    def plan(self, cfg, seq_q, seq_kv):
        if cfg.layout == "head_tail" and not cfg.is_causal and seq_q == seq_kv:
            cfg = replace(cfg, is_causal=True)
        return super().plan(cfg, seq_q, seq_kv)


# ------------------------------------------------------------------------ LSE layout


class _LseLayoutMisread(RingAttention):
    """The kernel's LSE brought from its declared layout to (batch, heads, seq_q) wrongly, by
    :meth:`misread`. Masked blocks run as ring_impl runs them: the bug is the LSE layout only."""

    def block_forward(self, cfg, q, k, v, plan):
        if plan.visible is not None:
            return super().block_forward(cfg, q, k, v, plan)
        out, lse = call_forward(cfg.op, q, k, v, is_causal=plan.is_causal, scale=cfg.scale)
        return out, self.misread(lse, q.shape, cfg.op.capabilities.lse_layout)

    def misread(self, lse: torch.Tensor, q_shape: torch.Size, layout: str) -> torch.Tensor:
        """The kernel's ``lse`` in ``layout`` (``bhs``, ``bhs1`` or ``bhs_padded32``) for a
        query block of ``q_shape`` (b, h, s, d) -> what the ring merges as its (b, h, s) LSE."""
        raise NotImplementedError


class PaddedLseTrimmedFromTheEnd(_LseLayoutMisread):
    """Memory-efficient layout: keeps the *last* seq_q LSE entries, garbage padding included."""

    def misread(self, lse, q_shape, layout):
        rows = q_shape[2]
        if layout == "bhs_padded32":
            return lse[..., -rows:].contiguous()
        if layout == "bhs1":
            return lse.squeeze(-1)
        return lse


class CudnnLseMisread(_LseLayoutMisread):
    """cuDNN layout (b, h, s, 1) read as if it were (b, s, h)."""

    def misread(self, lse, q_shape, layout):
        b, h, s, _ = q_shape
        if layout == "bhs1":
            return lse.reshape(b, s, h).transpose(1, 2).contiguous()
        if layout == "bhs_padded32":
            return lse[..., :s].contiguous()
        return lse


# ------------------------------------------------------------------------ merge and dtypes


class NaiveExpMerge(RingAttention):
    """The textbook merge: exp of the LSE, which overflows for large logits."""

    def merge(self, out_acc, lse_acc, block_out, block_lse):
        a, b = torch.exp(lse_acc), torch.exp(block_lse.to(lse_acc.dtype))
        total = a + b
        out_acc.copy_(
            (a.unsqueeze(-1) * out_acc + b.unsqueeze(-1) * block_out.to(out_acc.dtype))
            / total.unsqueeze(-1)
        )
        lse_acc.copy_(torch.log(total))


class PartialsInInputDtype(RingAttention):
    """Accumulators and dK/dV in flight kept in the input dtype (bf16 partials)."""

    def accumulation_dtype(self, dtype):
        return dtype


class GradCastToBf16(RingAttention):
    """dQ/dK/dV cast to a hard-coded bfloat16 on the way out, whatever the input dtype."""

    def backward(self, cfg, *args, **kwargs):
        return tuple(
            g.to(torch.bfloat16).to(g.dtype) for g in super().backward(cfg, *args, **kwargs)
        )


class Float64ComputedInFloat32(RingAttention):
    """The local kernel runs in float32 for float64 inputs, silently."""

    def block_forward(self, cfg, q, k, v, plan):
        if q.dtype == torch.float64:
            out, lse = super().block_forward(cfg, q.float(), k.float(), v.float(), plan)
            return out.double(), lse.double()
        return super().block_forward(cfg, q, k, v, plan)

    def block_backward(self, cfg, grad_out, q, k, v, out, lse, plan, grad_lse=None):
        if q.dtype == torch.float64:
            grad_lse = None if grad_lse is None else grad_lse.float()
            grads = super().block_backward(
                cfg,
                grad_out.float(),
                q.float(),
                k.float(),
                v.float(),
                out.float(),
                lse.float(),
                plan,
                grad_lse,
            )
            return tuple(g.double() for g in grads)
        return super().block_backward(cfg, grad_out, q, k, v, out, lse, plan, grad_lse)


class NoncontiguousMisread(RingAttention):
    """Inputs read through their storage as if contiguous (a kernel that ignores strides)."""

    def forward(self, cfg, query, key, value):
        def misread(t):
            # What a kernel that assumes (b, h, s, d) contiguity reads from a transposed
            # (b, s, h, d) buffer: the memory in storage order, viewed with the wrong shape.
            return t if t.is_contiguous() else t.transpose(1, 2).contiguous().view(t.shape)

        return super().forward(cfg, misread(query), misread(key), misread(value))


class HeadDimStrideIgnored(RingAttention):
    """Inputs whose head dim has a stride other than 1 read as if it were 1 (what aten's CPU flash
    kernel does in torch 2.13 with an ``x[..., ::2]`` view)."""

    def forward(self, cfg, query, key, value):
        def misread(t):
            if t.stride(-1) == 1:
                return t
            return t.as_strided(t.shape, (*t.stride()[:-1], 1), t.storage_offset())

        return super().forward(cfg, misread(query), misread(key), misread(value))


# ------------------------------------------------------------------------ stale state, rotation


class BackwardReusesStepZeroKV(RingAttention):
    """Backward computes every step with the step-0 (local) key/value block."""

    def backward(self, cfg, grad_out, query, key, value, out, lse, grad_lse=None):
        impl = self

        class Stale:
            def __init__(self, inner, kv):
                self.inner, self.kv = inner, kv

            def block(self, step):
                self.inner.block(step)  # keep the transfers, so no rank waits in vain
                return self.kv

        self.kv_rotation = lambda cfg, kv, link=None: Stale(
            RingAttention.kv_rotation(impl, cfg, kv, link), kv
        )  # type: ignore[method-assign]
        try:
            return super().backward(cfg, grad_out, query, key, value, out, lse, grad_lse)
        finally:
            del self.kv_rotation


class ValueBufferSizedByKey(RingAttention):
    """The key/value buffer that travels sized by key's head dim, as if value's were the same
    (d_v assumed equal to d_qk): value's columns past d_qk dropped, or zeros where d_v < d_qk.
    Equal head dims, and one rank (nothing packed), run as ring_impl does."""

    def pack_kv(self, key, value):
        buf = key.new_zeros((2, *key.shape))
        buf[0] = key
        n = min(key.shape[-1], value.shape[-1])
        buf[1, ..., :n] = value[..., :n]
        return buf


class BackwardUsesBlockOutput(RingAttention):
    """The backward's ``dO . O`` row term taken from each block's own partial output (saved per
    step, as a per-step kernel call leaves it) instead of the merged output of all steps; the LSE
    is the merged one."""

    def block_backward(self, cfg, grad_out, q, k, v, out, lse, plan, grad_lse=None):
        own_out, _ = self.block_forward(cfg, q, k, v, plan)
        return super().block_backward(
            cfg, grad_out, q, k, v, own_out.to(out.dtype), lse, plan, grad_lse
        )


class WrongNeighbour(RingAttention):
    """Ring methods send each block to rank - 1 instead of rank + 1, while the steps still assume
    it came from rank - s: every step after the first computes with the wrong block."""

    def transport(self, cfg):
        inner = super().transport(cfg)
        if cfg.rotate_method == "allgather" or cfg.group.world_size < 3:
            return inner
        return _BackwardsTransport(inner)


class _BackwardsTransport:
    """A neighbour transport whose key/value hops go the wrong way, outside the backward's link
    (so the dK/dV accumulators flush on their own, every rank posting in one order)."""

    kv_hops_share_link = False

    def __init__(self, inner):
        self.name, self.grad_hop, self._inner = inner.name, inner.grad_hop, inner

    def kv_blocks(self, kv, g, link):
        return _BackwardsRing(kv, g)

    def own_block_first(self, world_size):
        return self._inner.own_block_first(world_size)


class _BackwardsRing:
    def __init__(self, kv, g):
        self.kv, self.g, self.pending = kv, g, None

    def _shift(self, t):
        g = self.g
        flat = t.reshape(-1)
        send, recv = [0] * g.world_size, [0] * g.world_size
        send[(g.rank - 1) % g.world_size] = flat.numel()  # the bug: the wrong neighbour
        recv[(g.rank + 1) % g.world_size] = flat.numel()
        return torch.ops._c10d_functional.all_to_all_single(flat, recv, send, g.group_name)

    def block(self, step):
        current = (
            self.kv
            if step == 0
            else torch.ops._c10d_functional.wait_tensor(self.pending).view(self.kv.shape)
        )
        if step < self.g.world_size - 1:
            self.pending = self._shift(current)
        return current


class GradsNotReturnedHome(RingAttention):
    """dK/dV: the last hop home is missing, so each rank keeps its neighbour's block gradient."""

    def pass_grads(self, cfg, link, step, acc):
        if step == cfg.group.world_size - 1:  # the bug: keep the neighbour's accumulator
            self._kept = acc
            return
        super().pass_grads(cfg, link, step, acc)

    def grads_home(self, cfg, link, like):
        if cfg.group.world_size == 1:
            return super().grads_home(cfg, link, like)
        kept, self._kept = self._kept, None
        return kept


class ScaleDroppedAfterStepZero(RingAttention):
    """The softmax scale reaches step 0 only; later steps use the default 1/sqrt(head_dim)."""

    def block_forward(self, cfg, q, k, v, plan):
        if plan.step > 0:
            cfg = replace(cfg, scale=default_scale(q.shape[-1]))
        return super().block_forward(cfg, q, k, v, plan)

    def block_backward(self, cfg, grad_out, q, k, v, out, lse, plan, grad_lse=None):
        if plan.step > 0:
            cfg = replace(cfg, scale=default_scale(q.shape[-1]))
        return super().block_backward(cfg, grad_out, q, k, v, out, lse, plan, grad_lse)


class GqaHeadsTiledOnLaterSteps(RingAttention):
    """GQA: on steps > 0 key/value heads are tiled (head h -> kv head h % heads_kv) instead of
    repeated (h -> h // group)."""

    @staticmethod
    def _tile(t, heads):
        return t.repeat(1, heads // t.shape[1], 1, 1)

    def block_forward(self, cfg, q, k, v, plan):
        if plan.step > 0 and k.shape[1] != q.shape[1]:
            k, v = self._tile(k, q.shape[1]), self._tile(v, q.shape[1])
        return super().block_forward(cfg, q, k, v, plan)

    def block_backward(self, cfg, grad_out, q, k, v, out, lse, plan, grad_lse=None):
        hkv = k.shape[1]
        if plan.step > 0 and hkv != q.shape[1]:
            dq, dk, dv = call_backward(
                cfg.op,
                grad_out,
                q,
                self._tile(k, q.shape[1]),
                self._tile(v, q.shape[1]),
                out,
                lse,
                is_causal=plan.is_causal,
                scale=cfg.scale,
                grad_lse=grad_lse,
            )
            b, h, s, d = dk.shape
            return (
                dq,
                dk.reshape(b, h // hkv, hkv, s, d).sum(1),
                dv.reshape(b, h // hkv, hkv, s, d).sum(1),
            )
        return super().block_backward(cfg, grad_out, q, k, v, out, lse, plan, grad_lse)


# ------------------------------------------------------------------------ hangs


class LastRankSkipsGradHop(RingAttention):
    """The last rank skips the final dK/dV hop (it keeps its own accumulator as if it were home):
    its neighbour waits for that hop forever."""

    @staticmethod
    def _skips(cfg, step) -> bool:
        g = cfg.group
        return (
            g.rank == g.world_size - 1
            and step == g.world_size - 1
            and cfg.rotate_method != "allgather"
        )

    def pass_grads(self, cfg, link, step, acc):
        if self._skips(cfg, step):
            self._kept = acc  # the bug: the last hop home is never exchanged
            return
        super().pass_grads(cfg, link, step, acc)

    def grads_home(self, cfg, link, like):
        kept = getattr(self, "_kept", None)
        if kept is not None and self._skips(cfg, cfg.group.world_size - 1):
            self._kept = None
            return kept
        return super().grads_home(cfg, link, like)


class RaisesOnOneRankOnly:
    """ring_impl's own local input checks, raised on the rank that sees the problem without the
    cross-rank agreement: a problem on one rank only leaves the others blocked in the first
    ring collective."""

    def __call__(self, query, key, value, **options):
        from ring_impl.api import get_rotate_method
        from ring_impl.checks.inputs import LocalCall, local_problem
        from ring_impl.ops import resolve_op

        if options.get("cu_seqlens") is not None:  # packed (THD) input: checked as usual
            return _RING(query, key, value, **options)
        op_obj, op_error = None, None
        try:
            op_obj = resolve_op(
                options.get("op"),
                query.device,
                query.dtype,
                query.shape[-1],
                head_dim_v=value.shape[-1],
            )
        except (TypeError, ValueError, AttributeError, IndexError) as exc:
            op_error = str(exc)
        # the options ring_impl.ring_attention checks on this rank, at its defaults
        local = LocalCall(
            query=query,
            key=key,
            value=value,
            is_causal=options.get("is_causal", False),
            scale=options.get("scale"),
            layout=options.get("layout", "contiguous"),
            rotate_method=options.get("rotate_method") or get_rotate_method(),
            head_chunks=1,
            return_lse=options.get("return_lse", False),
            op=op_obj,
            effective_scale=None,  # (local_problem derives it)
            op_error=op_error,
        )
        problem = local_problem(local)
        if problem is not None:
            raise ValueError(f"ring_attention: {problem}")
        return _RING(query, key, value, **options)


# ------------------------------------------------------------------------ autograd, compile


class ValueGradientDropped:
    """value is detached inside the call: no gradient reaches it."""

    def __call__(self, query, key, value, **kwargs):
        return _RING(query, key, value.detach(), **kwargs)


class GraphBreakInLoop(RingAttention):
    """A data-dependent Python branch in the ring loop: fullgraph compilation fails."""

    def merge(self, out_acc, lse_acc, block_out, block_lse):
        if block_lse.max() > 1e30:  # never true, but branches on a tensor's value: a graph break
            block_lse = block_lse.clamp(max=1e30)
        super().merge(out_acc, lse_acc, block_out, block_lse)


class WrongOnlyWhenCompiled(RingAttention):
    """Correct eagerly; under torch.compile the later steps use a slightly wrong scale."""

    def block_forward(self, cfg, q, k, v, plan):
        if torch.compiler.is_compiling() and plan.step > 0:
            cfg = replace(cfg, scale=cfg.scale * 1.05)
        return super().block_forward(cfg, q, k, v, plan)


class NanHidden(RingAttention):
    """Block results taken as the kernel returns them: a kernel that drops NaN (the CPU flash
    kernel returns a NaN query row as out 0, LSE 0) hides it."""

    def nonfinite_forward(self, out, lse, q, k, v, plan):
        return out, lse

    def nonfinite_backward(self, dq, dk, dv, q, k, v, out, lse, grad_out, plan, grad_lse=None):
        return dq, dk, dv

    def nonfinite_gradients(self, dq, dk, dv, flags, plan):
        return dq, dk, dv


class _OwnScaleOp:
    """The rank's own scale inside the kernel while the checks see scale=None on every rank."""

    def __init__(self, inner, scale: float):
        self.inner, self.scale = inner, scale
        self.name, self.capabilities = inner.name, inner.capabilities

    def forward(self, query, key, value, *, is_causal, scale):
        return self.inner.forward(query, key, value, is_causal=is_causal, scale=self.scale)

    def backward(self, grad_out, query, key, value, out, lse, *, is_causal, scale, **kwargs):
        return self.inner.backward(
            grad_out, query, key, value, out, lse, is_causal=is_causal, scale=self.scale, **kwargs
        )


class ScaleNotAgreed:
    """The scale left out of the cross-rank agreement: ranks given different scales compute
    silently with their own (output error 0.85 in the wild)."""

    def __call__(self, query, key, value, *, scale=None, op=None, **kwargs):
        import math

        from ring_impl.ops import default_scale, resolve_op

        if scale is None or not isinstance(scale, (int, float)) or not math.isfinite(scale):
            return _RING(query, key, value, scale=scale, op=op, **kwargs)  # checked as usual
        inner = resolve_op(
            op,
            query.device,
            query.dtype,
            query.shape[-1],
            scale=scale,
            is_causal=bool(kwargs.get("is_causal", False)),
            head_dim_v=value.shape[-1],
        )
        own = (
            _OwnScaleOp(inner, float(scale))
            if float(scale) != default_scale(query.shape[-1])
            else inner
        )
        return _RING(query, key, value, op=own, **kwargs)


class MaskNotAgreed:
    """The mask, sinks and score_mod left out of the cross-rank check (packed lengths shared in one
    process group but not in the context-parallel one): each rank attends silently under its own
    documents, window, sinks or soft-cap."""

    def __call__(self, query, key, value, *, mask=None, **kwargs):
        from ring_impl import api

        checked = api.mask_code
        api.mask_code = lambda *args, **kw: 0  # every rank reports "no mask"
        try:
            return _RING(query, key, value, mask=ring_impl_mask(mask), **kwargs)
        finally:
            api.mask_code = checked


class LseNotDifferentiable:
    """The LSE returned detached: a loss that uses it gets no gradient through it."""

    def __call__(self, query, key, value, *, return_lse=False, **kwargs):
        res = _RING(query, key, value, return_lse=return_lse, **kwargs)
        return (res[0], res[1].detach()) if return_lse else res


_DEFAULT = RingAttention()
_RING = ring_impl.bind(_DEFAULT)  # ring_impl's ring_attention, a variant's own binding


# ------------------------------------------------------------------------ contracts of the result


def _lse_in_base_2(query, key, value, **kwargs):
    """The LSE returned in base 2 (a kernel's log2 LSE passed on as if natural)."""
    res = _RING(query, key, value, **kwargs)
    if not kwargs.get("return_lse"):
        return res
    out, lse = res
    return out, lse / math.log(2)


def _float32_output_for_half(query, key, value, **kwargs):
    """bfloat16/float16 inputs, float32 output (the accumulator returned without the final cast)."""
    res = _RING(query, key, value, **kwargs)
    out, lse = res if kwargs.get("return_lse") else (res, None)
    if query.dtype in (torch.bfloat16, torch.float16):
        out = out.float()
    return (out, lse) if kwargs.get("return_lse") else out


def _lse_offset_in_bf16(query, key, value, **kwargs):
    """bfloat16 inputs: the LSE 4e-3 too large (below a bfloat16 floor, far above float32's)."""
    res = _RING(query, key, value, **kwargs)
    if not kwargs.get("return_lse") or query.dtype != torch.bfloat16:
        return res
    out, lse = res
    return out, lse + 4e-3


class DeclaresNothing:
    """An implementation with every protocol piece but no ``capabilities``:
    everything is claimed."""

    api_module = "ring_impl"
    baseline_op = "auto"

    def __init__(self, name: str, fn):
        self.name = name
        self.ring_attention = speaking_specs(fn)

    @staticmethod
    def collective_schedule(world_size, rotate_method, **kwargs):
        return RingImplAdapter.collective_schedule(world_size, rotate_method, **kwargs)

    @staticmethod
    def record_steps():
        return debug.record_steps()

    @staticmethod
    def balanced_layout(balancer, mask, seq_len, world_size):
        return RingImplAdapter.balanced_layout(balancer, mask, seq_len, world_size)


# ------------------------------------------------------------------------ max logit


class MaxLogitLastStepOnly(RingAttention):
    """The max logit taken from the last ring step's blocks only: a per-step value returned as
    if it held for all steps, instead of a running maximum across them."""

    def block_max_logit(self, cfg, q, k, plan):
        found = super().block_max_logit(cfg, q, k, plan)
        if plan.step != cfg.group.world_size - 1:
            return torch.full_like(found, float("-inf"))
        return found


class MaxLogitNotReduced(RingAttention):
    """Each rank returns the max logit of its own query rows: the all-reduce over the group is
    missing (the collective is still issued, so the schedule holds and no rank waits)."""

    def reduce_max_logit(self, cfg, local):
        super().reduce_max_logit(cfg, local.clone())
        return local


# ------------------------------------------------------------------------ registry


# ------------------------------------------------------------------------ masks and sinks


class MaskedRowsKeepKernelLse(RingAttention):
    """A masked block's rows that see nothing are merged as the CPU kernel returns them (out 0,
    LSE 0) instead of as nothing (LSE -inf)."""

    def block_forward(self, cfg, q, k, v, plan):
        if plan.visible is None:
            return super().block_forward(cfg, q, k, v, plan)
        out, lse = call_forward(
            cfg.op, q, k, v, is_causal=False, scale=cfg.scale, visible=plan.visible
        )
        dead = ~plan.visible.any(-1).expand(lse.shape)
        return out, torch.where(
            dead,
            torch.zeros((), dtype=lse.dtype),
            lse.to(torch.float32 if lse.dtype != torch.float64 else lse.dtype),
        )


def _sinks_dropped_on_last_rank(
    query, key, value, *, group=None, sinks=None, return_lse=False, **kwargs
):
    """The sink term applied on every rank but the last (its copy of the logits never used)."""
    import torch.distributed as dist

    from ring_impl.group import resolve_group
    from ring_impl.sinks import with_sinks

    pg = resolve_group(group)
    out, lse = ring_impl.ring_attention(query, key, value, group=group, return_lse=True, **kwargs)
    if sinks is not None and dist.get_rank(pg) != dist.get_world_size(pg) - 1:
        out, lse = with_sinks(out, lse, sinks)
    elif sinks is not None:
        out = out + 0 * sinks.sum()  # the logits get a (zero) gradient, as if they were used
    return (out, lse) if return_lse else out


@dataclass(frozen=True)
class Broken:
    """A broken implementation, the bug class it stands for, and what the failure must say.

    ``expect``: a regex the failure must match and no other broken ring's failure may (it names
    this cause). ``pending``: the suite check that catches it when that check is not in this
    tree yet; the proof then reports the ring as an expected failure while the suites pass it.
    ``suites``: the suite path the proof runs, by default the whole tree; a proof whose bug the
    tree catches only in a later module names that module (the whole tree, stopped at its first
    failure, would run every module before it, minutes on a 2-core machine that prove nothing
    more); ``select``: more
    pytest arguments narrowing the run to the cases that exercise the bug (``("-k", "refilled")``);
    ``min_failures``: when set, the selected cases run to the end and at least this many must fail,
    every one naming the bug (a bug class caught by one case only is one case from escaping).
    """

    name: str
    bug_class: str
    expect: str
    impl: object
    pending: str = ""
    suites: str = "suites"
    select: tuple[str, ...] = ()
    min_failures: int = 0


def by_name(*entries: Broken) -> dict[str, Broken]:
    """``{entry.name: entry}`` in the order given: a module's table of broken implementations. A
    name given twice raises (the later entry would hide the earlier one from the meta-tests)."""
    table: dict[str, Broken] = {}
    for entry in entries:
        if entry.name in table:
            raise ValueError(f"two broken implementations are named {entry.name!r}")
        table[entry.name] = entry
    return table


def ring_adapter(name: str, ring: RingAttention) -> RingImplAdapter:
    """The implementation under test ``name``: ring_impl's adapter around the broken ``ring``."""
    return RingImplAdapter(ring, name=name)


def function_adapter(name: str, ring_attention) -> RingImplAdapter:
    """The implementation under test ``name``: ring_impl's adapter whose ``ring_attention`` is the
    broken function ``ring_attention`` (query, key, value, **options), in place of ring_impl's."""
    adapter = RingImplAdapter(name=name)
    adapter.ring_attention = ring_attention
    return adapter


BROKEN: dict[str, Broken] = by_name(
    Broken(
        "nan_hidden",
        "NaN in the inputs hidden by a kernel that drops it",
        r"the NaN was hidden",
        ring_adapter("nan_hidden", NanHidden()),
        suites="suites/test_edge_values.py",
    ),
    Broken(
        "scale_not_agreed",
        "per-rank option disagreement: scale not part of the cross-rank check",
        r"scale_differs_between_ranks: no rank raised",
        function_adapter("scale_not_agreed", ScaleNotAgreed()),
    ),
    Broken(
        "mask_not_agreed",
        "per-rank option disagreement: mask, sinks and score_mod not in the cross-rank check",
        r"(documents|window|sinks|softcap|cu_seqlens)_differs?_between_ranks: no rank raised",
        function_adapter("mask_not_agreed", MaskNotAgreed()),
        suites="suites/test_bad_input.py",
        select=(
            "-k",
            "documents or window_differs or sinks_differ or softcap or cu_seqlens_differ",
        ),
        min_failures=5,
    ),
    Broken(
        "lse_not_differentiable",
        "autograd: the LSE returned without a gradient",
        r"does not require grad while query, key and value do",
        function_adapter("lse_not_differentiable", LseNotDifferentiable()),
        suites="suites/test_lse_gradient.py",
    ),
    Broken(
        "skipped_step_computed",
        "causal: a step computed that must be skipped",
        r"computed, but no query of this rank sees any key of that block",
        ring_adapter("skipped_step_computed", SkippedStepComputed()),
    ),
    Broken(
        "needed_step_skipped",
        "causal: a step skipped that was needed",
        r"skipped, but \d+ query-key pairs are visible",
        ring_adapter("needed_step_skipped", NeededStepSkipped()),
    ),
    Broken(
        "causal_mask_on_full_step",
        "causal: a step computed with the wrong mask",
        r"computed with a causal \(diagonal\) mask, though this block is full",
        ring_adapter("causal_mask_on_full_step", CausalMaskOnFullStep()),
    ),
    Broken(
        "head_tail_wrong_pairing",
        "head_tail: wrong chunk pairing",
        r"wrong key/value chunk of the head_tail pair",
        ring_adapter("head_tail_wrong_pairing", HeadTailWrongPairing()),
    ),
    Broken(
        "load_balance_assumes_causal",
        "head_tail: load balancing used with non-causal attention",
        r"causal mask of these positions, though attention is not causal",
        ring_adapter("load_balance_assumes_causal", LoadBalanceAssumesCausal()),
    ),
    Broken(
        "padded_lse_untrimmed",
        "LSE: memory-efficient padding not trimmed",
        r"(?s)^(?=.*cpu_efficient_layout).*its LSE does not: the kernel's LSE was misread",
        ring_adapter("padded_lse_untrimmed", PaddedLseTrimmedFromTheEnd()),
        suites="suites/test_lse_layouts.py",
    ),
    Broken(
        "cudnn_lse_misread",
        "LSE: cuDNN trailing-dim layout misread",
        r"(?s)^(?=.*cpu_cudnn_layout).*its LSE does not: the kernel's LSE was misread",
        ring_adapter("cudnn_lse_misread", CudnnLseMisread()),
        suites="suites/test_lse_layouts.py",
    ),
    Broken(
        "naive_exp_merge",
        "unstable merge: exp of large LSE overflows",
        r"an exp of the LSE \(or of raw scores\) overflowed",
        ring_adapter("naive_exp_merge", NaiveExpMerge()),
        suites="suites/test_shapes.py",
    ),
    Broken(
        "partials_in_input_dtype",
        "accumulation dtype: partials kept in bf16/fp16",
        r"contract: lse must be float32[^\n]*returned (bfloat16|float16)|lse on rank "
        r"[-\d, ]+: every value of the float32 result is a bfloat16 number",
        ring_adapter("partials_in_input_dtype", PartialsInInputDtype()),
        suites="suites/test_forward_backward.py",
    ),
    Broken(
        "grad_cast_to_bf16",
        "accumulation dtype: gradient cast to a hard-coded dtype",
        r"d[qkv] on rank [-\d, ]+: every value of the float64 result is a bfloat16 number",
        ring_adapter("grad_cast_to_bf16", GradCastToBf16()),
    ),
    Broken(
        "float64_computed_in_float32",
        "accumulation dtype: float64 silently computed in float32",
        r"(partial of this float64 ring|float64 result) is a float32 number",
        ring_adapter("float64_computed_in_float32", Float64ComputedInFloat32()),
        suites="suites/test_forward_backward.py",
    ),
    Broken(
        "noncontiguous_misread",
        "non-contiguous inputs passed to a kernel as if contiguous",
        r"wrong only with non-contiguous inputs",
        ring_adapter("noncontiguous_misread", NoncontiguousMisread()),
        suites="suites/test_packed.py",
    ),
    Broken(
        "head_dim_stride_ignored",
        "inputs with a strided head dim passed to a kernel as if its stride were 1",
        r"wrong only with a strided head dim",
        ring_adapter("head_dim_stride_ignored", HeadDimStrideIgnored()),
        suites="suites/test_shapes.py",
    ),
    Broken(
        "backward_reuses_step0_kv",
        "stale per-step state: backward reuses step-0 keys/values",
        r"the backward used each rank's own key/value block at every ring step",
        ring_adapter("backward_reuses_step0_kv", BackwardReusesStepZeroKV()),
    ),
    Broken(
        "backward_uses_block_output",
        "backward: each chunk's own output instead of the merged output in the dO.O term",
        r"each ring step's own partial output",
        ring_adapter("backward_uses_block_output", BackwardUsesBlockOutput()),
    ),
    Broken(
        "value_buffer_sized_by_key",
        "MLA: d_v assumed equal to d_qk in a buffer",
        r"wrong only when d_v != d_qk",
        ring_adapter("value_buffer_sized_by_key", ValueBufferSizedByKey()),
        suites="suites/test_forward_backward.py",
        select=("-k", "value_head_dim"),
    ),
    Broken(
        "wrong_neighbour",
        "rotation: sending to the wrong neighbour",
        r"used the key/value block of rank \d+ instead of rank \d+",
        ring_adapter("wrong_neighbour", WrongNeighbour()),
    ),
    Broken(
        "grads_not_returned_home",
        "rotation: dK/dV not returned to the owning rank (last hop missing)",
        r"dq matches on every rank, but [^\n]*dK/dV accumulators",
        ring_adapter("grads_not_returned_home", GradsNotReturnedHome()),
    ),
    Broken(
        "scale_dropped_after_step0",
        "scale not passed through to every step",
        r"used scale -?[\d.]+ instead of -?[\d.]+",
        ring_adapter("scale_dropped_after_step0", ScaleDroppedAfterStepZero()),
        suites="suites/test_edge_values.py",
    ),
    Broken(
        "gqa_heads_tiled",
        "GQA head mapping wrong for some steps",
        r"tiled the key/value heads",
        ring_adapter("gqa_heads_tiled", GqaHeadsTiledOnLaterSteps()),
    ),
    Broken(
        "last_rank_skips_grad_hop",
        "hang: a collective skipped on one rank only",
        r"did not finish within [\d.]+ s|collectives differ from the declared schedule",
        ring_adapter("last_rank_skips_grad_hop", LastRankSkipsGradHop()),
        suites="suites/test_collectives.py",
    ),
    Broken(
        "raises_on_one_rank_only",
        "hang: an exception on one rank leaving the others blocked",
        r"the ranks hung \([^\n]*\)[^\n]*: a rank that rejected its input left the others "
        r"waiting",
        function_adapter("raises_on_one_rank_only", RaisesOnOneRankOnly()),
    ),
    Broken(
        "value_gradient_dropped",
        "autograd: gradients not flowing to inputs that need them",
        r"no result for dv\[rank=\d+\]|gradient did not reach",
        function_adapter("value_gradient_dropped", ValueGradientDropped()),
    ),
    Broken(
        "graph_break_in_loop",
        "torch.compile: graph break in the ring loop",
        r"fails only under torch\.compile",
        ring_adapter("graph_break_in_loop", GraphBreakInLoop()),
        suites="suites/test_compile.py",
    ),
    Broken(
        "wrong_only_when_compiled",
        "torch.compile: wrong results only when compiled",
        r"wrong only when compiled",
        ring_adapter("wrong_only_when_compiled", WrongOnlyWhenCompiled()),
        suites="suites/test_compile.py",
    ),
    Broken(
        "declares_nothing_lse_base_2",
        "undeclared capabilities: an implementation that declares nothing, with a bug",
        r"is in base 2, the contract",
        DeclaresNothing("declares_nothing_lse_base_2", _lse_in_base_2),
    ),
    Broken(
        "float32_output_for_half",
        "contract: output dtype differs from the input dtype (float32 out for bf16/fp16)",
        r"\bout\b[^\n]{0,120}\bdtype\b[^\n]{0,120}float32|output dtype",
        function_adapter("float32_output_for_half", _float32_output_for_half),
        suites="suites/test_forward_backward.py",
    ),
    Broken(
        "lse_offset_in_bf16",
        "numerics: LSE off by 4e-3 in bfloat16 (judged with the float32 floor of the LSE)",
        r"lse is shifted by a constant on every row",
        function_adapter("lse_offset_in_bf16", _lse_offset_in_bf16),
    ),
    Broken(
        "masked_rows_keep_kernel_lse",
        "masks: a row the mask hides completely merged with the kernel's LSE 0",
        r"rows that see no key must have LSE -inf|rows a masked block hides must merge as "
        r"nothing",
        ring_adapter("masked_rows_keep_kernel_lse", MaskedRowsKeepKernelLse()),
        suites="suites/test_masks.py",
    ),
    Broken(
        "max_logit_last_step_only",
        "stale per-step state: the max logit of the last ring step returned as the call's",
        r"running maximum across ring steps\s+was not kept",
        ring_adapter("max_logit_last_step_only", MaxLogitLastStepOnly()),
        suites="suites/test_max_logit.py",
    ),
    Broken(
        "max_logit_not_reduced",
        "max logit: each rank's own maximum returned, not reduced over the group",
        r"per-rank maxima\s+were not reduced over the group",
        ring_adapter("max_logit_not_reduced", MaxLogitNotReduced()),
        suites="suites/test_max_logit.py",
    ),
    Broken(
        "sinks_dropped_on_one_rank",
        "sinks: the sink term applied on some ranks only",
        r"the sinks were not applied on those ranks",
        function_adapter("sinks_dropped_on_one_rank", _sinks_dropped_on_last_rank),
        suites="suites/test_masks.py",
    ),
)

# Module attributes, so each is loadable as --impl meta_tests.broken:<name>.
globals().update({name: b.impl for name, b in BROKEN.items()})

#: The control of ``declares_nothing_lse_base_2``: the same object around a correct ring. It
#: declares nothing, so every case of the quick tier runs (none is N/A) and passes.
DECLARES_NOTHING_CORRECT = DeclaresNothing("declares_nothing_correct", ring_impl.ring_attention)
