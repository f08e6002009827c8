"""Deliberately broken ring implementations: one per bug class of shared/bug-classes.md.

Each is ring_impl's :class:`RingAttention` with one seam overridden the way a real
implementation got it wrong, wrapped as an implementation under test
(``--impl meta_tests.broken:<NAME>``). ``meta_tests/test_suite_catches_bugs.py`` runs the
conformance suites against each and requires a failure whose message points at the cause.

Every bug keeps the collectives uniform across ranks unless the bug *is* a collective mismatch,
so a broken implementation fails on its numbers rather than by accident.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from harness.adapters.ring_impl import RingImplAdapter
from ring_impl import RingAttention
from ring_impl.api import _ring_attention
from ring_impl.comm import make_grad_rotation
from ring_impl.ops import call_backward, call_forward, default_scale

__all__ = ["BROKEN", "Broken"]


# ------------------------------------------------------------------------ causal handling


class SkippedStepComputed(RingAttention):
    """Causal, contiguous: a key/value block from a later rank is computed in full, not skipped."""

    def plan(self, cfg, seq_q, seq_kv):
        return [replace(p, kind="full") if p.kind == "skip" else p for p in super().plan(cfg, seq_q, seq_kv)]


class NeededStepSkipped(RingAttention):
    """The last ring step is skipped although its keys are visible."""

    def plan(self, cfg, seq_q, seq_kv):
        last = cfg.group.world_size - 1
        return [replace(p, kind="skip") if p.step == last and last > 0 else p for p in super().plan(cfg, seq_q, seq_kv)]


class CausalMaskOnFullStep(RingAttention):
    """Steps after the first are computed with the causal mask, as if every block were diagonal."""

    def plan(self, cfg, seq_q, seq_kv):
        return [replace(p, kind="causal") if p.kind == "full" and p.step > 0 and seq_q == seq_kv else p
                for p in super().plan(cfg, seq_q, seq_kv)]


class HeadTailWrongPairing(RingAttention):
    """head_tail: blocks from earlier ranks pair the queries with the key/value *tail* chunk."""

    def plan(self, cfg, seq_q, seq_kv):
        n = seq_kv // 2
        return [replace(p, kv_rows=(n, 2 * n)) if p.kv_rows == (0, n) and p.kind == "full" else p
                for p in super().plan(cfg, seq_q, seq_kv)]


class LoadBalanceAssumesCausal(RingAttention):
    """head_tail treated as causal-only: non-causal attention gets the causal plan."""

    def plan(self, cfg, seq_q, seq_kv):
        if cfg.layout == "head_tail" and not cfg.is_causal and seq_q == seq_kv:
            cfg = replace(cfg, is_causal=True)
        return super().plan(cfg, seq_q, seq_kv)


# ------------------------------------------------------------------------ LSE layout


class PaddedLseTrimmedFromTheEnd(RingAttention):
    """Memory-efficient layout: keeps the *last* seq_q LSE entries, garbage padding included."""

    def block_forward(self, cfg, q, k, v, plan):
        out, lse = call_forward(cfg.op, q, k, v, is_causal=plan.is_causal, scale=cfg.scale)
        rows = q.shape[2]
        if cfg.op.capabilities.lse_layout == "bhs_padded32":
            return out, lse[..., -rows:].contiguous()
        if cfg.op.capabilities.lse_layout == "bhs1":
            return out, lse.squeeze(-1)
        return out, lse


class CudnnLseMisread(RingAttention):
    """cuDNN layout (b, h, s, 1) read as if it were (b, s, h)."""

    def block_forward(self, cfg, q, k, v, plan):
        out, lse = call_forward(cfg.op, q, k, v, is_causal=plan.is_causal, scale=cfg.scale)
        b, h, s, _ = q.shape
        if cfg.op.capabilities.lse_layout == "bhs1":
            return out, lse.reshape(b, s, h).transpose(1, 2).contiguous()
        if cfg.op.capabilities.lse_layout == "bhs_padded32":
            return out, lse[..., :s].contiguous()
        return out, lse


# ------------------------------------------------------------------------ merge and dtypes


class NaiveExpMerge(RingAttention):
    """The textbook merge: exp of the LSE, which overflows for large logits."""

    def merge(self, out_acc, lse_acc, block_out, block_lse):
        a, b = torch.exp(lse_acc), torch.exp(block_lse.to(lse_acc.dtype))
        total = a + b
        out_acc.copy_((a.unsqueeze(-1) * out_acc + b.unsqueeze(-1) * block_out.to(out_acc.dtype)) / total.unsqueeze(-1))
        lse_acc.copy_(torch.log(total))


class PartialsInInputDtype(RingAttention):
    """Accumulators and dK/dV in flight kept in the input dtype (bf16 partials)."""

    def accumulation_dtype(self, dtype):
        return dtype


class GradCastToBf16(RingAttention):
    """dQ/dK/dV cast to a hard-coded bfloat16 on the way out, whatever the input dtype."""

    def backward(self, cfg, *args):
        return tuple(g.to(torch.bfloat16).to(g.dtype) for g in super().backward(cfg, *args))


class Float64ComputedInFloat32(RingAttention):
    """The local kernel runs in float32 for float64 inputs, silently."""

    def block_forward(self, cfg, q, k, v, plan):
        if q.dtype == torch.float64:
            out, lse = super().block_forward(cfg, q.float(), k.float(), v.float(), plan)
            return out.double(), lse.double()
        return super().block_forward(cfg, q, k, v, plan)

    def block_backward(self, cfg, grad_out, q, k, v, out, lse, plan):
        if q.dtype == torch.float64:
            grads = super().block_backward(cfg, grad_out.float(), q.float(), k.float(), v.float(), out.float(), lse.float(), plan)
            return tuple(g.double() for g in grads)
        return super().block_backward(cfg, grad_out, q, k, v, out, lse, plan)


class NoncontiguousMisread(RingAttention):
    """Inputs read through their storage as if contiguous (a kernel that ignores strides)."""

    def forward(self, cfg, query, key, value):
        def misread(t):
            # What a kernel that assumes (b, h, s, d) contiguity reads from a transposed
            # (b, s, h, d) buffer: the memory in storage order, viewed with the wrong shape.
            return t if t.is_contiguous() else t.transpose(1, 2).contiguous().view(t.shape)

        return super().forward(cfg, misread(query), misread(key), misread(value))


# ------------------------------------------------------------------------ stale state, rotation


class BackwardReusesStepZeroKV(RingAttention):
    """Backward computes every step with the step-0 (local) key/value block."""

    def backward(self, cfg, grad_out, query, key, value, out, lse):
        impl = self

        class Stale:
            def __init__(self, inner, kv):
                self.inner, self.kv = inner, kv

            def block(self, step):
                self.inner.block(step)  # keep the transfers, so no rank waits in vain
                return self.kv

        self.kv_rotation = lambda cfg, kv, link=None: Stale(RingAttention.kv_rotation(impl, cfg, kv, link), kv)  # type: ignore[method-assign]
        try:
            return super().backward(cfg, grad_out, query, key, value, out, lse)
        finally:
            del self.kv_rotation


class WrongNeighbour(RingAttention):
    """Ring methods send each block to rank - 1 instead of rank + 1, while the steps still assume
    it came from rank - s: every step after the first computes with the wrong block."""

    def kv_rotation(self, cfg, kv, link=None):
        if cfg.rotate_method == "allgather" or cfg.group.world_size < 3:
            return super().kv_rotation(cfg, kv, link)
        return _BackwardsRing(kv, cfg.group)


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
        current = self.kv if step == 0 else torch.ops._c10d_functional.wait_tensor(self.pending).view(self.kv.shape)
        if step < self.g.world_size - 1:
            self.pending = self._shift(current)
        return current


class GradsNotReturnedHome(RingAttention):
    """dK/dV: the last hop home is missing, so each rank keeps its neighbour's block gradient."""

    def grad_rotation(self, cfg, shape, dtype, device, link=None):
        inner = make_grad_rotation(shape, dtype, device, cfg.group, cfg.rotate_method, link)
        return inner if cfg.group.world_size == 1 else _NoLastHop(inner, cfg.group.world_size)


class _NoLastHop:
    """Keeps the accumulator of step W-1 (the neighbour's block) instead of sending it home."""

    def __init__(self, inner, world_size):
        self.inner, self.world_size, self.kept = inner, world_size, None

    def add(self, step, kv_rank, contribution):
        if step < self.world_size - 1:
            return self.inner.add(step, kv_rank, contribution)
        acc = self.inner._zeros() if step == 1 else self.inner._link.take("grad")
        self.inner._accumulate(acc, contribution)
        self.kept = acc

    def result(self):
        return self.kept


class ScaleDroppedAfterStepZero(RingAttention):
    """The softmax scale reaches step 0 only; later steps use the default 1/sqrt(head_dim)."""

    def block_forward(self, cfg, q, k, v, plan):
        if plan.step > 0:
            cfg = replace(cfg, scale=default_scale(q.shape[-1]))
        return super().block_forward(cfg, q, k, v, plan)

    def block_backward(self, cfg, grad_out, q, k, v, out, lse, plan):
        if plan.step > 0:
            cfg = replace(cfg, scale=default_scale(q.shape[-1]))
        return super().block_backward(cfg, grad_out, q, k, v, out, lse, plan)


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

    def block_backward(self, cfg, grad_out, q, k, v, out, lse, plan):
        hkv = k.shape[1]
        if plan.step > 0 and hkv != q.shape[1]:
            dq, dk, dv = call_backward(cfg.op, grad_out, q, self._tile(k, q.shape[1]), self._tile(v, q.shape[1]), out, lse,
                                       is_causal=plan.is_causal, scale=cfg.scale)
            b, h, s, d = dk.shape
            return dq, dk.reshape(b, h // hkv, hkv, s, d).sum(1), dv.reshape(b, h // hkv, hkv, s, d).sum(1)
        return super().block_backward(cfg, grad_out, q, k, v, out, lse, plan)


# ------------------------------------------------------------------------ hangs


class LastRankSkipsGradHop(RingAttention):
    """The last rank skips its final dK/dV send: its neighbour waits for it forever."""

    def grad_rotation(self, cfg, shape, dtype, device, link=None):
        inner = make_grad_rotation(shape, dtype, device, cfg.group, cfg.rotate_method, link)
        if cfg.group.rank != cfg.group.world_size - 1 or cfg.group.world_size == 1 or cfg.rotate_method == "allgather":
            return inner
        return _NoLastHop(inner, cfg.group.world_size)


class RaisesOnOneRankOnly:
    """Input checks that raise on the rank that sees the problem only, without telling the
    others, which then block in the first ring collective."""

    def __call__(self, query, key, value, *, group=None, is_causal=False, scale=None, rotate_method=None,
                 op=None, layout="contiguous", return_lse=False):
        from ring_impl.api import get_rotate_method
        from ring_impl.comm import RingGroup, resolve_group
        from ring_impl.ops import resolve_op
        from ring_impl.ring import RingConfig, ring_attention_fn

        if query.dtype != key.dtype or query.dtype != value.dtype:
            raise ValueError(f"query/key/value dtypes differ: {query.dtype}, {key.dtype}, {value.dtype}")
        if is_causal and query.shape[2] != key.shape[2]:
            raise ValueError("causal attention needs equal query and key lengths")
        cfg = RingConfig(
            group=RingGroup.of(resolve_group(group), query.device), is_causal=is_causal,
            scale=scale if scale is not None else default_scale(query.shape[-1]), layout=layout,
            rotate_method=rotate_method or get_rotate_method(),
            op=resolve_op(op, query.device, query.dtype, query.shape[-1]),
        )
        out, lse = ring_attention_fn(query, key, value, cfg)
        return (out, lse) if return_lse else out


# ------------------------------------------------------------------------ autograd, compile


class ValueGradientDropped:
    """value is detached inside the call: no gradient reaches it."""

    def __call__(self, query, key, value, **kwargs):
        return _ring_attention(_DEFAULT, query, key, value.detach(), **kwargs)


class GraphBreakInLoop(RingAttention):
    """A data-dependent Python branch in the ring loop: fullgraph compilation fails."""

    def merge(self, out_acc, lse_acc, block_out, block_lse):
        if float(block_lse.max()) > float("inf"):  # never true, but forces a .item()
            raise AssertionError
        super().merge(out_acc, lse_acc, block_out, block_lse)


class WrongOnlyWhenCompiled(RingAttention):
    """Correct eagerly; under torch.compile the later steps use a slightly wrong scale."""

    def block_forward(self, cfg, q, k, v, plan):
        if torch.compiler.is_compiling() and plan.step > 0:
            cfg = replace(cfg, scale=cfg.scale * 1.05)
        return super().block_forward(cfg, q, k, v, plan)


_DEFAULT = RingAttention()


# ------------------------------------------------------------------------ registry


@dataclass(frozen=True)
class Broken:
    """A broken implementation, the bug class it stands for, and what the failure must say."""

    name: str
    bug_class: str
    expect: str  # regex the suite's failure output must match (points at the cause)
    impl: object


def _adapter(name: str, ring: RingAttention) -> RingImplAdapter:
    return RingImplAdapter(ring, name=name)


def _wrapped(name: str, fn) -> RingImplAdapter:
    adapter = RingImplAdapter(name=name)
    adapter.ring_attention = fn
    return adapter


BROKEN: dict[str, Broken] = {b.name: b for b in [
    Broken("skipped_step_computed", "causal: a step computed that must be skipped",
           r"step|work per rank", _adapter("skipped_step_computed", SkippedStepComputed())),
    Broken("needed_step_skipped", "causal: a step skipped that was needed",
           r"skipped|step", _adapter("needed_step_skipped", NeededStepSkipped())),
    Broken("causal_mask_on_full_step", "causal: a step computed with the wrong mask",
           r"step|causal", _adapter("causal_mask_on_full_step", CausalMaskOnFullStep())),
    Broken("head_tail_wrong_pairing", "head_tail: wrong chunk pairing",
           r"step|kv|block", _adapter("head_tail_wrong_pairing", HeadTailWrongPairing())),
    Broken("load_balance_assumes_causal", "head_tail: load balancing used with non-causal attention",
           r"head_tail.*full|full.*head_tail|step", _adapter("load_balance_assumes_causal", LoadBalanceAssumesCausal())),
    Broken("padded_lse_untrimmed", "LSE: memory-efficient padding not trimmed",
           r"lse|efficient", _adapter("padded_lse_untrimmed", PaddedLseTrimmedFromTheEnd())),
    Broken("cudnn_lse_misread", "LSE: cuDNN trailing-dim layout misread",
           r"lse|cudnn", _adapter("cudnn_lse_misread", CudnnLseMisread())),
    Broken("naive_exp_merge", "unstable merge: exp of large LSE overflows",
           r"nan|inf|x300|x30", _adapter("naive_exp_merge", NaiveExpMerge())),
    Broken("partials_in_input_dtype", "accumulation dtype: partials kept in bf16/fp16",
           r"lse|bf16|f16", _adapter("partials_in_input_dtype", PartialsInInputDtype())),
    Broken("grad_cast_to_bf16", "accumulation dtype: gradient cast to a hard-coded dtype",
           r"d[qkv]", _adapter("grad_cast_to_bf16", GradCastToBf16())),
    Broken("float64_computed_in_float32", "accumulation dtype: float64 silently computed in float32",
           r"float64|f64", _adapter("float64_computed_in_float32", Float64ComputedInFloat32())),
    Broken("noncontiguous_misread", "non-contiguous inputs passed to a kernel as if contiguous",
           r"noncontig|bshd-views|non-contiguous", _adapter("noncontiguous_misread", NoncontiguousMisread())),
    Broken("backward_reuses_step0_kv", "stale per-step state: backward reuses step-0 keys/values",
           r"d[qkv]", _adapter("backward_reuses_step0_kv", BackwardReusesStepZeroKV())),
    Broken("wrong_neighbour", "rotation: sending to the wrong neighbour",
           r"alltoall|p2p|step|kv", _adapter("wrong_neighbour", WrongNeighbour())),
    Broken("grads_not_returned_home", "rotation: dK/dV not returned to the owning rank (last hop missing)",
           r"d[kv]", _adapter("grads_not_returned_home", GradsNotReturnedHome())),
    Broken("scale_dropped_after_step0", "scale not passed through to every step",
           r"scale|step", _adapter("scale_dropped_after_step0", ScaleDroppedAfterStepZero())),
    Broken("gqa_heads_tiled", "GQA head mapping wrong for some steps",
           r"gqa|kv|d[qkv]", _adapter("gqa_heads_tiled", GqaHeadsTiledOnLaterSteps())),
    Broken("last_rank_skips_grad_hop", "hang: a collective skipped on one rank only",
           r"timed out|Timeout|hang|stack|collectives differ", _adapter("last_rank_skips_grad_hop", LastRankSkipsGradHop())),
    Broken("raises_on_one_rank_only", "hang: an exception on one rank leaving the others blocked",
           r"dtype_on_one_rank|not every rank raised|timed out|Timeout", _wrapped("raises_on_one_rank_only", RaisesOnOneRankOnly())),
    Broken("value_gradient_dropped", "autograd: gradients not flowing to inputs that need them",
           r"no result for dv|gradient did not reach", _wrapped("value_gradient_dropped", ValueGradientDropped())),
    Broken("graph_break_in_loop", "torch.compile: graph break in the ring loop",
           r"test_compile|compile|graph", _adapter("graph_break_in_loop", GraphBreakInLoop())),
    Broken("wrong_only_when_compiled", "torch.compile: wrong results only when compiled",
           r"test_compile|compiled", _adapter("wrong_only_when_compiled", WrongOnlyWhenCompiled())),
]}

# Module attributes, so each is loadable as --impl meta_tests.broken:<name>.
globals().update({name: b.impl for name, b in BROKEN.items()})
