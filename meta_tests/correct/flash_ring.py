"""flash_ring: the CPU flash kernel per step, every block fetched at once, one merge at the end.

Per step (the key/value block of rank ``(r - step) mod W``), the kernel
``aten._scaled_dot_product_flash_attention_for_cpu`` runs on every pair of a local query chunk
and a key/value chunk that the causal plan keeps: a key chunk before the query chunk is full, the
same chunk is causal (the kernel's top-left mask), a later one is not computed. Non-causal
attention runs one call per step on the whole local queries and block. Key/value heads are
expanded per call for grouped-query attention and dK/dV summed back over each group.

Calls the kernel cannot be trusted with run in plain float64 math instead (:class:`_Exact`): a
call whose inputs hold NaN or inf (the CPU flash kernel returns a NaN query row as out 0, LSE 0
when its key block is short, and sharding makes short blocks; NaN in an input must reach every
result that depends on it), and every block of a causal ring call with a scale <= 0 (the CPU
flash kernel returns NaN there). The non-finite check is per kernel call and on its own inputs,
so the rest of the ring keeps the kernel.

With ``op=`` an attention-op object (the contract of ring_impl/ops.py, what the suites pass as
``--op``), that kernel runs per step instead, its LSE brought from its declared layout to
(batch, heads, seq); names are not resolved. An op whose capabilities reject the call (its
declared faults, e.g. causal with scale <= 0) is an input error raised on every rank.

Merge: every partial (out in the input dtype, LSE in float32/float64) is kept, and each query
chunk's partials are merged once at the end, weighted by ``exp(lse_i - logsumexp_i lse_i)``, in
float64 for every dtype. Backward calls the kernel's backward on the same pairs with the final
output and LSE and accumulates dQ/dK/dV in float64.

Rotations: not a ring. Every rank fetches every block in one exchange, and in backward fetches
them again and sends each block's dK/dV straight to its owner (sent in float32, float64 for
float64; summed in float64 there):

- ``allgather``: one all-gather; dK/dV by one reduce-scatter.
- ``alltoall``: one ``all_to_all_single`` that sends the own block to every rank; dK/dV by one
  ``all_to_all_single``.
- ``p2p``: one ``batch_isend_irecv`` of W-1 sends (the own block to every other rank) and W-1
  receives; dK/dV by W-1 direct sends to the owners.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist

from meta_tests.correct.common import (
    ROTATE_METHODS,
    RingSetup,
    accumulation_dtype,
    all_gather,
    block_bytes,
    check_bytes,
    check_inputs,
    check_schedule_request,
    chunk_rows,
    correct_capabilities,
    normalized_lse,
    op_problem,
    record_step,
    record_steps,
    recording,
    reduce_scatter,
    widened,
)

__all__ = ["FlashRing", "flash_ring"]

_flash = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
_flash_backward = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward


# ----------------------------------------------------------------------------- exchanges


def _p2p_exchange(setup: RingSetup, sends: Sequence[torch.Tensor], received: torch.Tensor) -> None:
    """One ``batch_isend_irecv`` with every other rank j: ``sends[j]`` goes to rank j and
    ``received[j]`` is filled from rank j. ``sends``: W tensors (entry r, this rank's, unused);
    ``received`` (W, ...): row j from rank j, this rank's own row left as it is."""
    r = setup.rank
    peers = [j for j in range(setup.world_size) if j != r]
    ops = [dist.P2POp(dist.isend, sends[j], setup.peer(j), setup.group) for j in peers]
    ops += [dist.P2POp(dist.irecv, received[j], setup.peer(j), setup.group) for j in peers]
    for work in dist.batch_isend_irecv(ops):
        work.wait()


def _gather_blocks(setup: RingSetup, method: str, kv: torch.Tensor) -> torch.Tensor:
    """Every rank's block: kv (2, b, hkv, s, d) -> (W, 2, b, hkv, s, d), row j from rank j."""
    w, r = setup.world_size, setup.rank
    if w == 1:
        return kv.unsqueeze(0)
    kv = kv.contiguous()
    blocks = torch.empty((w, *kv.shape), dtype=kv.dtype)
    if method == "allgather":
        all_gather(blocks.view(-1), kv.view(-1), group=setup.group)
    elif method == "alltoall":
        dist.all_to_all_single(
            blocks, kv.unsqueeze(0).expand(w, *kv.shape).contiguous(), group=setup.group
        )
    else:
        blocks[r] = kv
        _p2p_exchange(setup, [kv] * w, blocks)
    return blocks


def _return_grads(
    setup: RingSetup, method: str, grads: torch.Tensor, wire: torch.dtype
) -> torch.Tensor:
    """Send every block's dK/dV to its owner and sum what arrives.

    grads (W, 2, b, hkv, s, d) float64, row j = this rank's contribution to rank j's block; sent
    as ``wire``. Returns the sum over ranks of the contributions to this rank's block
    (2, b, hkv, s, d), float64.
    """
    w, r = setup.world_size, setup.rank
    if w == 1:
        return grads[0]
    sent = grads.to(wire).contiguous()
    if method == "allgather":
        mine = torch.empty(sent.shape[1:], dtype=wire)
        reduce_scatter(mine.view(-1), sent.view(-1), group=setup.group)
        return mine.to(torch.float64)
    received = torch.empty_like(sent)
    if method == "alltoall":
        dist.all_to_all_single(received, sent, group=setup.group)
    else:
        _p2p_exchange(setup, sent, received)
        received[r] = sent[r]
    return received.to(torch.float64).sum(0)


# ------------------------------------------------------------------------------ the plan


def _calls(setup: RingSetup, layout: str, is_causal: bool, kv_rank: int, sq: int, sk: int):
    """Kernel calls of one step: [(query rows, key rows, causal)];
    empty when the block is skipped."""
    if not is_causal:
        return [(slice(0, sq), slice(0, sk), False)]
    calls = []
    for q_chunk, q_rows in chunk_rows(layout, setup.world_size, setup.rank, sq):
        for k_chunk, k_rows in chunk_rows(layout, setup.world_size, kv_rank, sk):
            if k_chunk < q_chunk:
                calls.append((q_rows, k_rows, False))
            elif k_chunk == q_chunk:
                calls.append((q_rows, k_rows, True))
    return calls


# ------------------------------------------------------------------------------ kernels


class _CpuFlash:
    """The default kernel: ``aten._scaled_dot_product_flash_attention_for_cpu`` and its backward.
    No native GQA; LSE (b, h, s) in float32 (float64 for float64)."""

    gqa = False

    @staticmethod
    def faults(*, is_causal: bool, scale: float) -> bool:
        """Whether the kernel is known to return garbage for such a call: causal with a scale
        <= 0 comes back NaN (its mask's -inf times the scale)."""
        return is_causal and scale <= 0

    @staticmethod
    def forward(q, k, v, *, is_causal, scale):
        return _flash(q, k, v, 0.0, is_causal, scale=scale)

    @staticmethod
    def backward(do, q, k, v, o, lse, *, is_causal, scale):
        return _flash_backward(do, q, k, v, o, lse, 0.0, is_causal, scale=scale)


class _OpKernel:
    """An attention-op object given as ``op=`` (the contract of ring_impl/ops.py: ``forward`` ->
    (out, LSE in the op's declared layout), ``backward`` with the (b, h, s) LSE, ``capabilities``
    with ``gqa`` and ``lse_layout``); its LSE is brought to (b, h, s) here."""

    def __init__(self, op):
        self.op = op
        self.gqa = bool(op.capabilities.gqa)

    def forward(self, q, k, v, *, is_causal, scale):
        out, lse = self.op.forward(q, k, v, is_causal=is_causal, scale=scale)
        return out, normalized_lse(self.op, lse, *q.shape[:3])

    def backward(self, do, q, k, v, o, lse, *, is_causal, scale):
        return self.op.backward(do, q, k, v, o, lse, is_causal=is_causal, scale=scale)

    @staticmethod
    def faults(*, is_causal: bool, scale: float) -> bool:
        """An op's declared faults reject the call up front
        (:func:`meta_tests.correct.common.op_problem`)."""
        return False


class _Exact:
    """Plain attention in float64 for one kernel call, used where the kernel cannot be: a call
    whose inputs hold NaN/inf (the CPU flash kernel drops NaN for a query row on short key
    blocks, and sharding makes short blocks), and a call the kernel is known to get wrong.

    Same contract as the kernels: q (b, h, sq, d), k/v (b, hkv, sk, d) with any hkv dividing h,
    causal top-left; returns out (b, h, sq, d) and LSE (b, h, sq) in float64, and (dq, dk, dv)
    float64 with k's heads. NaN flows through the arithmetic (±inf inputs are made NaN first);
    entries the mask hides are set to 0 in P and dS (not ``exp(-inf - NaN)`` or ``0 * NaN``), so
    a NaN reaches only the rows and keys that see it, and through the matmuls with values the rest
    of its own batch entry and head."""

    @staticmethod
    def _input(t: torch.Tensor) -> torch.Tensor:
        """An input in float64, ±inf made NaN (see :func:`widened`)."""
        return widened(t, torch.float64)

    @classmethod
    def _scores(cls, q, k, *, is_causal, scale):
        b, h, sq, d = q.shape
        hkv, sk = k.shape[1], k.shape[2]
        q5 = cls._input(q).reshape(b, hkv, h // hkv, sq, d)
        s = torch.matmul(q5, cls._input(k).unsqueeze(2).transpose(-1, -2)) * scale
        visible = torch.ones(sq, sk, dtype=torch.bool).tril() if is_causal else None
        if visible is not None:
            s = s.masked_fill(~visible, float("-inf"))
        return q5, s, visible

    @staticmethod
    def _probs(s, lse5, visible):
        shift = torch.where(
            lse5 == float("-inf"), 0.0, lse5
        )  # a row that sees nothing: p = 0, not NaN
        p = torch.exp(s - shift.unsqueeze(-1))
        return p if visible is None else p.masked_fill(~visible, 0.0)

    @classmethod
    def forward(cls, q, k, v, *, is_causal, scale):
        b, h, sq, _ = q.shape
        _, s, visible = cls._scores(q, k, is_causal=is_causal, scale=scale)
        lse5 = torch.logsumexp(s, dim=-1)
        out = torch.matmul(cls._probs(s, lse5, visible), cls._input(v).unsqueeze(2))
        return out.reshape(b, h, sq, v.shape[-1]), lse5.reshape(b, h, sq)

    @classmethod
    def backward(cls, do, q, k, v, o, lse, *, is_causal, scale):
        b, h, sq, d = q.shape
        hkv = k.shape[1]
        q5, s, visible = cls._scores(q, k, is_causal=is_causal, scale=scale)
        p = cls._probs(s, lse.to(torch.float64).reshape(b, hkv, h // hkv, sq), visible)
        do5 = cls._input(do).reshape(b, hkv, h // hkv, sq, do.shape[-1])
        o5 = o.to(torch.float64).reshape(do5.shape)
        dv = torch.matmul(p.transpose(-1, -2), do5).sum(2)
        dp = torch.matmul(do5, cls._input(v).unsqueeze(2).transpose(-1, -2))
        ds = p * (dp - (do5 * o5).sum(-1, keepdim=True))
        if visible is not None:
            ds = ds.masked_fill(~visible, 0.0)
        dq = torch.matmul(ds, cls._input(k).unsqueeze(2)) * scale
        dk = torch.matmul(ds.transpose(-1, -2), q5).sum(2) * scale
        return dq.reshape(b, h, sq, d), dk, dv


def _kernel_for(kernel, *tensors: torch.Tensor, is_causal: bool, scale: float):
    """The kernel to run one kernel call on: ``kernel``, or :class:`_Exact` where its inputs hold
    a non-finite value or ``kernel`` is known to fault on the ring call (``is_causal``: the ring
    call's, not the block's: every block of a causal call with a scale <= 0 runs exact, as the
    single-device baseline runs that whole call on the math kernel, whose LSE is more exact than
    the flash kernel's on some CPUs)."""
    if kernel.faults(is_causal=is_causal, scale=scale):
        return _Exact
    if not all(bool(torch.isfinite(t).all()) for t in tensors):
        return _Exact
    return kernel


def _expand(t: torch.Tensor, heads: int) -> torch.Tensor:
    """(b, hkv, s, d) -> (b, heads, s, d): query head i uses key/value head i // (heads // hkv)."""
    group = heads // t.shape[1]
    return t if group == 1 else t.repeat_interleave(group, dim=1)


def _fold(t: torch.Tensor, heads_kv: int) -> torch.Tensor:
    """(b, h, s, d) gradient of (possibly expanded) heads
    -> (b, heads_kv, s, d) float64, summed per group."""
    b, h, s, d = t.shape
    return t.to(torch.float64).reshape(b, heads_kv, h // heads_kv, s, d).sum(2)


def _rows(t: torch.Tensor, rows: slice) -> torch.Tensor:
    return t[:, :, rows].contiguous()


def _widen(t: torch.Tensor, fill: float) -> torch.Tensor:
    """Append one column of ``fill`` to the last dim (see the LSE gradient in backward: the kernel
    then runs at head_dim + 1, which every CPU kernel supports)."""
    return torch.cat([t, torch.full((*t.shape[:-1], 1), fill, dtype=t.dtype)], dim=-1)


class _FlashRingFn(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx, query, key, value, setup: RingSetup, is_causal: bool, layout: str, method: str, kernel
    ):
        b, h, sq, _ = query.shape
        sk = key.shape[2]
        w, r = setup.world_size, setup.rank
        blocks = _gather_blocks(setup, method, torch.stack([key, value]))
        q = query.contiguous()
        partials: dict[tuple[int, int], list[tuple[torch.Tensor, torch.Tensor]]] = {}
        for step in range(w):
            kv_rank = (r - step) % w
            k, v = blocks[kv_rank][0], blocks[kv_rank][1]
            if not kernel.gqa:
                k, v = _expand(k, h), _expand(v, h)
            for q_rows, k_rows, causal in _calls(setup, layout, is_causal, kv_rank, sq, sk):
                args = _rows(q, q_rows), _rows(k, k_rows), _rows(v, k_rows)
                run = _kernel_for(kernel, *args, is_causal=is_causal, scale=setup.scale)
                o, lse = run.forward(*args, is_causal=causal, scale=setup.scale)
                span = (q_rows.start, q_rows.stop)
                partials.setdefault(span, []).append((o, lse))
                if recording():
                    record_step(rank=r, step=step, kv_rank=kv_rank, q_rows=span, out=o, lse=lse)
        lse_dtype = accumulation_dtype(query.dtype)
        out = torch.empty_like(q)
        lse = torch.empty((b, h, sq), dtype=lse_dtype)
        for (start, stop), parts in partials.items():
            # All of a chunk's partials at once: weights
            # exp(lse_i - LSE) with LSE = logsumexp_i lse_i.
            lses = torch.stack([p[1].to(torch.float64) for p in parts])
            total = torch.logsumexp(lses, dim=0)
            weights = torch.exp(lses - total).unsqueeze(-1)
            merged = (weights * torch.stack([p[0].to(torch.float64) for p in parts])).sum(0)
            out[:, :, start:stop] = merged.to(query.dtype)
            lse[:, :, start:stop] = total.to(lse_dtype)
        ctx.save_for_backward(query, key, value, out, lse)
        ctx.setup, ctx.is_causal, ctx.layout, ctx.method, ctx.kernel = (
            setup,
            is_causal,
            layout,
            method,
            kernel,
        )
        return out, lse

    @staticmethod
    def backward(ctx, grad_out, grad_lse):
        query, key, value, out, lse = ctx.saved_tensors
        setup, is_causal, layout, method, kernel = (
            ctx.setup,
            ctx.is_causal,
            ctx.layout,
            ctx.method,
            ctx.kernel,
        )
        b, h, sq, d = query.shape
        hkv, sk = key.shape[1], key.shape[2]
        w, r = setup.world_size, setup.rank
        blocks = _gather_blocks(setup, method, torch.stack([key, value]))
        q, o, do = query.contiguous(), out.contiguous(), grad_out.to(query.dtype).contiguous()
        lse = lse.contiguous()
        with_lse_grad = grad_lse is not None and bool(grad_lse.any())
        if with_lse_grad:
            # The kernel's dS = P * (dO V^T - rowsum(dO * O)) has no LSE term. Append one column:
            # query/key 0 (scores unchanged), value 1 and output 0 there, and dO = dLSE, so that
            # dO V^T gains dLSE per row and rowsum(dO * O) is unchanged: dS gains P * dLSE.
            q, o = _widen(q, 0.0), _widen(o, 0.0)
            do = torch.cat([do, grad_lse.to(query.dtype).unsqueeze(-1)], dim=-1).contiguous()
        dq = torch.zeros((b, h, sq, d), dtype=torch.float64)
        grads = torch.zeros((w, 2, b, hkv, sk, d), dtype=torch.float64)
        for step in range(w):
            kv_rank = (r - step) % w
            k, v = blocks[kv_rank][0], blocks[kv_rank][1]
            if not kernel.gqa:
                k, v = _expand(k, h), _expand(v, h)
            if with_lse_grad:
                k, v = _widen(k, 0.0), _widen(v, 1.0)
            for q_rows, k_rows, causal in _calls(setup, layout, is_causal, kv_rank, sq, sk):
                args = (
                    _rows(do, q_rows),
                    _rows(q, q_rows),
                    _rows(k, k_rows),
                    _rows(v, k_rows),
                    _rows(o, q_rows),
                    _rows(lse, q_rows),
                )
                run = _kernel_for(kernel, *args, is_causal=is_causal, scale=setup.scale)
                dq_c, dk_c, dv_c = run.backward(*args, is_causal=causal, scale=setup.scale)
                dq[:, :, q_rows] += dq_c[..., :d].to(torch.float64)
                grads[kv_rank, 0, :, :, k_rows] += _fold(dk_c[..., :d], hkv)
                grads[kv_rank, 1, :, :, k_rows] += _fold(dv_c[..., :d], hkv)
        dkv = _return_grads(setup, method, grads, accumulation_dtype(query.dtype))
        return (
            dq.to(query.dtype),
            dkv[0].to(key.dtype),
            dkv[1].to(value.dtype),
            None,
            None,
            None,
            None,
            None,
        )


def ring_attention(
    query,
    key,
    value,
    *,
    group=None,
    is_causal=False,
    scale=None,
    rotate_method=None,
    op=None,
    layout="contiguous",
    return_lse=False,
):
    """Attention over the blocks of every rank of ``group``; differentiable in query, key and
    value (and through the LSE).

    query (batch, heads, seq_q_local, head_dim), key/value (batch, heads_kv, seq_kv_local,
    head_dim), sharded on dim 2 in ``layout``. ``op``: None for the CPU flash kernel, or an
    attention-op object (ring_impl/ops.py contract) to run per step instead. Returns the local
    output (input dtype) and, with ``return_lse``, the LSE (batch, heads, seq_q_local) in float32
    (float64 for float64).
    """
    rotate_method = "allgather" if rotate_method is None else rotate_method
    setup = check_inputs(
        query,
        key,
        value,
        group=group,
        is_causal=is_causal,
        scale=scale,
        layout=layout,
        rotate_method=rotate_method,
        rotate_methods=ROTATE_METHODS,
        op_problem=op_problem(
            op,
            query,
            scale=scale,
            is_causal=is_causal,
            ring="flash_ring",
            fallback="the CPU flash kernel, which is routed around its faults",
        ),
    )
    kernel = _CpuFlash() if op is None else _OpKernel(op)
    out, lse = _FlashRingFn.apply(
        query, key, value, setup, bool(is_causal), layout, rotate_method, kernel
    )
    return (out, lse) if return_lse else out


def collective_schedule(
    world_size, rotate_method, *, batch, heads_kv, seq_kv, head_dim, dtype, compiled=False, **_
):
    """``{phase: {kind: {"calls", "bytes"}}}`` of one forward and one backward
    (seq_kv: local length).

    kv = one block (2*batch*heads_kv*seq_kv*head_dim elements) in the input dtype, dkv the same
    elements in float32 (float64 for float64). Forward adds the input check's all-gather.
    W = 1 issues nothing.
    """
    check_schedule_request("flash_ring", rotate_method, compiled)
    w = world_size
    if w == 1:
        return {"forward": {}, "backward": {}}
    kv, dkv = block_bytes(
        batch=batch, heads_kv=heads_kv, seq_kv=seq_kv, head_dim=head_dim, dtype=dtype
    )
    check = {"calls": 1, "bytes": check_bytes()}
    if rotate_method == "allgather":
        return {
            "forward": {"all_gather": {"calls": 2, "bytes": check_bytes() + kv}},
            "backward": {
                "all_gather": {"calls": 1, "bytes": kv},
                "reduce_scatter": {"calls": 1, "bytes": w * dkv},
            },
        }
    if rotate_method == "alltoall":
        return {
            "forward": {"all_gather": check, "all_to_all": {"calls": 1, "bytes": w * kv}},
            "backward": {"all_to_all": {"calls": 2, "bytes": w * (kv + dkv)}},
        }
    hops = {kind: {"calls": w - 1, "bytes": (w - 1) * kv} for kind in ("send", "recv")}
    back = {
        kind: {"calls": 2 * (w - 1), "bytes": (w - 1) * (kv + dkv)} for kind in ("send", "recv")
    }
    return {"forward": {"all_gather": check, **hops}, "backward": back}


class FlashRing:
    """flash_ring as an implementation under test (``--impl meta_tests.correct:flash_ring``)."""

    name = "flash_ring"
    #: the CPU flash kernel, and plain math where it is known to fault (causal, scale <= 0): the
    #: same routing as flash_ring's own (its per-call float64 math there is at least as exact)
    baseline_op = "auto"
    capabilities = correct_capabilities(
        ops=frozenset({"*"}),  # attention-op objects; op names are not resolved (an error says so)
        value_head_dim=False,  # the CPU flash kernel needs value's head dim equal to query's
        input_errors=True,
        strategies=frozenset({"ring"}),
        masks=frozenset(),
        sinks=False,
        score_mod=False,
        max_logit=False,  # returns no max logit (ring_attention takes no return_max_logit)
        uneven_shards=False,  # its input check requires equal shard lengths on every rank
        packed=False,  # (batch, heads, seq, dim) shards only: no cu_seqlens
        replicated_kv=False,  # key/value are sequence shards: every block travels the ring
    )
    ring_attention = staticmethod(ring_attention)
    collective_schedule = staticmethod(collective_schedule)
    record_steps = staticmethod(record_steps)


flash_ring = FlashRing()
