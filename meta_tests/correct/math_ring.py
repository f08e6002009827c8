"""math_ring: ring attention in plain torch math, written from the textbook algorithm.

Per ring step: scores in float32 (float64 for float64 inputs), masked by global positions, and
the classic online-softmax merge (running row max ``m``, running sum ``l``, an unnormalised
float32 accumulator; normalised once at the end). Backward is explicit and recomputes every
step's probabilities from the float32 final LSE, as flash kernels do:
``dS = P * (dP - rowsum(dO * O))``, with ``O`` the output as returned (input dtype).

Rotations (every rank issues the same collectives in the same order, whatever it computes):

- ``p2p`` / ``alltoall``: the key/value block moves to ``rank + 1`` after every step (W-1 hops,
  by ``batch_isend_irecv`` or by an ``all_to_all_single`` permutation). In backward the block
  travels again with its dK/dV accumulator, which starts at the owner and goes the whole way
  round (W hops of dK/dV, W-1 of key/value).
- ``allgather``: one all-gather of every block in forward, kept for backward; every rank's
  dK/dV contributions go to their owners in one ``all_to_all_single``.

A block no query of this rank sees (causal, or under the mask) is not computed; a block some
queries see is computed with the mask from global positions.

With ``op=`` an attention-op object (ring_impl/ops/contract.py's contract, what the suites pass
to count or record kernel calls), a block runs as that op's calls on its pieces: one per (run of
consecutive query positions, run of key positions) that holds a visible pair, without a mask
when all of it is visible, ``is_causal`` when it is exactly top-left causal, else with its
visibility as ``attn_mask`` (this ring's own math for an op without ``masks``). Every visible
pair is computed once, no hidden one, and no call computes nothing. The pieces' normalised
partials join the same online softmax; backward gives the op the final output and LSE.

Layouts: ``contiguous``, ``head_tail``, and the balancers' (:func:`balanced_layout`, for one
mask or a model's weighted masks): ``document_head_tail``, head_tail within every document, and
``work_aware``, equal chunks dealt to the ranks by the visible pairs of their rows; each is
registered on the process under a name equal calls share.

Masks, sinks and score_mods come as the conformance protocol hands them (conformance/specs.py)
and are read only through it: ``mask.visible(b, h, q_idx, kv_idx)`` is evaluated once per call
on every global (batch row, head, query, key) and each block takes its rows and columns of
that; a sink is a key of logit ``sinks[h]`` and no value, the state every row's online softmax
starts from; a score_mod changes each block's scaled logits before the mask, at global positions
and query heads, and backward reaches the logits through its autograd derivative. The ranks
compare digests of the whole mask, the sinks and the score_mod's values on a probe of scores in
the input check, so a rank holding another one raises with the rest. Packed (THD) shards with
``cu_seqlens`` run as one batch row under their documents' mask.

Replicated key/value (``replicated_kv=True``: key and value the whole sequence, equal on every
rank, a cross-attention's text tokens): nothing rotates. Each rank attends its own query rows to
the key/value it holds, as one block of the same online softmax (non-causal; a mask reads key
indices 0..seq_kv-1), and its backward returns dQ of its rows and its rows' contribution to
dK/dV, which the caller sums over the group; the only collective is the input check's
all-gather.

The max logit (``return_max_logit=True``): each computed block's masked scores give their
per-head maximum, kept as a running maximum over the steps (``torch.maximum``, which keeps a
NaN); the ranks' maxima are all-gathered and their maximum taken (``amax``, which keeps a NaN
too): one ``all_gather`` of ``heads`` accumulation-dtype values.

NaN in the inputs flows through the arithmetic itself (±inf inputs are made NaN first): a NaN score
makes the row's running max, sum and accumulator NaN, and the row is told apart from a row that saw
no key by its running max (still -inf only there). In backward, masked entries of P and dS are set
to 0 rather than left to ``exp(-inf - NaN)`` and ``0 * NaN``, so a NaN reaches only the keys and
rows that see it (and, through the matmul with values, the other rows of its own batch entry and
head group).
"""

from __future__ import annotations

import itertools
import zlib

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
    correct_capabilities,
    digest,
    group_rank,
    local_positions,
    normalized_lse,
    op_problem,
    record_step,
    record_steps,
    recording,
    register_runs_layout,
    widened,
)

__all__ = ["MathRing", "math_ring"]


# ----------------------------------------------------------------------------- transport


class _Hop:
    """Moves a tensor from every rank to ``rank + 1`` (receives from ``rank - 1``)."""

    def __init__(self, setup: RingSetup, method: str):
        self.setup, self.method = setup, method

    def __call__(self, t: torch.Tensor) -> torch.Tensor:
        s = self.setup
        t = t.contiguous()
        got = torch.empty_like(t)
        nxt, prv = (s.rank + 1) % s.world_size, (s.rank - 1) % s.world_size
        if self.method == "p2p":
            ops = [
                dist.P2POp(dist.isend, t, s.peer(nxt), s.group),
                dist.P2POp(dist.irecv, got, s.peer(prv), s.group),
            ]
            for work in dist.batch_isend_irecv(ops):
                work.wait()
            return got
        send = [0] * s.world_size
        recv = [0] * s.world_size
        send[nxt], recv[prv] = t.numel(), t.numel()
        dist.all_to_all_single(
            got.view(-1), t.view(-1), output_split_sizes=recv, input_split_sizes=send, group=s.group
        )
        return got


# ----------------------------------------------------------------------------------- math


def _grouped(t: torch.Tensor, heads_kv: int) -> torch.Tensor:
    """(b, h, s, d) -> (b, heads_kv, h // heads_kv, s, d):
    query head i uses key/value head i // group."""
    b, h, s, d = t.shape
    return t.reshape(b, heads_kv, h // heads_kv, s, d)


def _scores(
    q5: torch.Tensor,
    k: torch.Tensor,
    scale: float,
    visible: torch.Tensor | None,
    modify=None,
) -> torch.Tensor:
    """q5 (b, hkv, g, sq, d), k (b, hkv, sk, d) in the accumulation dtype -> (b, hkv, g, sq, sk):
    the scaled logits, changed by ``modify`` (a block's score_mod) when given, then -inf where
    ``visible`` ((sq, sk) or (b, hkv, g, sq, sk) bool) is False."""
    s = torch.matmul(q5, k.unsqueeze(2).transpose(-1, -2)) * scale
    if modify is not None:
        s = modify(s)
    if visible is not None:
        s = s.masked_fill(~visible, float("-inf"))
    return s


def _uneven_rows(layout: str, lengths: tuple[int, ...], rank: int, rows: int) -> torch.Tensor:
    """(rows,) int64: the global position of each of a rank's ``rows`` padded rows when rank r
    holds ``lengths[r]`` tokens, -1 for its padding rows (after its real ones). contiguous: the
    next lengths[r] positions; head_tail: chunks r and 2W-1-r of 2W cut as tensor_split cuts."""
    world = len(lengths)
    if layout == "contiguous":
        start = sum(lengths[:rank])
        real = torch.arange(start, start + lengths[rank])
    else:
        chunks = torch.arange(sum(lengths)).tensor_split(2 * world)
        real = torch.cat([chunks[rank], chunks[2 * world - 1 - rank]])
    return torch.cat([real, torch.full((rows - real.numel(),), -1, dtype=torch.int64)])


def _grid(batch: int, heads: int, seq_q: int, seq_kv: int) -> tuple[torch.Tensor, ...]:
    """flex attention's broadcasting index tensors b, h, q_idx, kv_idx over every (batch row,
    head, query position, key position)."""
    return (
        torch.arange(batch).view(-1, 1, 1, 1),
        torch.arange(heads).view(1, -1, 1, 1),
        torch.arange(seq_q).view(1, 1, -1, 1),
        torch.arange(seq_kv).view(1, 1, 1, -1),
    )


def _global_lengths(query, key, group, lengths, replicated: bool) -> tuple[int, int]:
    """(seq_q, seq_kv) of the call's global sequence: the shards' sum with ``lengths``, the whole
    key/value with ``replicated``, else W equal shards of each."""
    if lengths is not None:
        return sum(lengths), sum(lengths)
    world = group_rank(group)[0]
    return query.shape[2] * world, key.shape[2] * (1 if replicated else world)


def _mask_visibility(mask, batch: int, heads: int, seq_q: int, seq_kv: int) -> torch.Tensor:
    """(batch, heads, seq_q, seq_kv) bool: ``mask.visible`` (conformance.specs.MaskSpec) at every
    global (batch row, head, query position, key position)."""
    visible = torch.as_tensor(mask.visible(*_grid(batch, heads, seq_q, seq_kv)))
    if visible.dtype != torch.bool:
        raise TypeError(f"mask.visible returned {visible.dtype}, not torch.bool")
    return visible.expand(batch, heads, seq_q, seq_kv)


class _Blocks:
    """Which keys each of this rank's query rows sees in the block of ``kv_rank``: causality, the
    call's mask and uneven shards' padding, all on global positions.

    ``mask``: the whole call's (batch, heads, seq_q, seq_kv) visibility, or None; ``lengths``:
    uneven shards padded to the longest (the padding sees and is seen by nothing);
    ``replicated``: the key/value block is the whole key/value (positions 0..seq_kv-1)."""

    def __init__(
        self,
        setup: RingSetup,
        layout: str,
        is_causal: bool,
        heads_kv: int,
        lengths: tuple[int, ...] | None = None,
        mask: torch.Tensor | None = None,
        replicated: bool = False,
        score_mod=None,
    ):
        self.setup, self.layout, self.is_causal = setup, layout, is_causal
        self.heads_kv, self.lengths, self.mask, self.replicated = (
            heads_kv,
            lengths,
            mask,
            replicated,
        )
        self.score_mod = score_mod

    def _positions(self, rank: int, rows: int) -> torch.Tensor:
        if self.lengths is not None:
            return _uneven_rows(self.layout, self.lengths, rank, rows)
        return local_positions(self.layout, self.setup.world_size, rank, rows)

    def positions(self, kv_rank: int, sq: int, sk: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(sq,) and (sk,) int64: the global positions of this rank's query rows and of the
        block's keys (-1 for an uneven shard's padding)."""
        qpos = self._positions(self.setup.rank, sq)
        return qpos, torch.arange(sk) if self.replicated else self._positions(kv_rank, sk)

    def modifier(self, kv_rank: int, sq: int, sk: int):
        """The block's score change, (b, hkv, g, sq, sk) -> the same: the call's ``score_mod``
        at the global query heads and the rows' and keys' global positions; None without one."""
        if self.score_mod is None:
            return None
        qpos = self._positions(self.setup.rank, sq).clamp(min=0)  # padding: masked anyway
        kpos = self._positions(kv_rank, sk).clamp(min=0)

        def modify(s5: torch.Tensor) -> torch.Tensor:
            b, hkv, g = s5.shape[:3]
            index = (
                torch.arange(b).view(-1, 1, 1, 1),
                torch.arange(hkv * g).view(1, -1, 1, 1),
                qpos.view(1, 1, -1, 1),
                kpos.view(1, 1, 1, -1),
            )
            out = self.score_mod(s5.reshape(b, hkv * g, sq, sk), *index)
            return out.expand(b, hkv * g, sq, sk).reshape(s5.shape)

        return modify

    def visibility(self, kv_rank: int, sq: int, sk: int):
        """(kind, mask): kind "full" (mask None), "skip" or "masked" with a (sq, sk) or
        (b, hkv, g, sq, sk) bool mask."""
        if self.lengths is None and self.mask is None and not self.is_causal:
            return "full", None
        qpos, kpos = self.positions(kv_rank, sq, sk)
        visible = (qpos[:, None] >= 0) & (kpos[None, :] >= 0)
        if self.is_causal:
            visible = visible & (kpos[None, :] <= qpos[:, None])
        if self.mask is not None:
            rows = self.mask[:, :, qpos.clamp(min=0)][:, :, :, kpos.clamp(min=0)]
            b, h = rows.shape[:2]
            visible = (visible & rows).reshape(b, self.heads_kv, h // self.heads_kv, sq, sk)
        if bool(visible.all()):
            return "full", None
        if not bool(visible.any()):
            return "skip", None
        return "masked", visible


class _Online:
    """Online-softmax state of one rank's queries: running max m, sum l, accumulator acc. With
    sink logits (1, hkv, g, 1) the state starts from the sink, a key of weight exp(sink) and no
    value."""

    def __init__(self, q5: torch.Tensor, sink5: torch.Tensor | None = None):
        b, hkv, g, sq, _ = q5.shape
        if sink5 is None:
            self.m = torch.full((b, hkv, g, sq), float("-inf"), dtype=q5.dtype)
            self.l = torch.zeros((b, hkv, g, sq), dtype=q5.dtype)
        else:
            self.m = sink5.expand(b, hkv, g, sq).clone()
            self.l = torch.ones((b, hkv, g, sq), dtype=q5.dtype)
        self.acc = torch.zeros_like(q5)

    def add(self, s: torch.Tensor, v: torch.Tensor, rows: slice = slice(None)) -> None:
        """Fold in one block: scores s (b, hkv, g, n, sk) of the rows ``rows`` (-inf where
        masked), v (b, hkv, sk, d)."""
        self._fold(rows, s.amax(-1), lambda shift: torch.exp(s - shift.unsqueeze(-1)), v)

    def add_partial(self, out5: torch.Tensor, lse5: torch.Tensor, rows: slice = slice(None)):
        """Fold in a normalised partial of the rows ``rows``: out5 (b, hkv, g, n, d) and lse5
        (b, hkv, g, n), the softmax over some keys and its log-sum-exp (-inf: no key seen, and
        then out5 is not read)."""
        out5 = torch.where((lse5 == float("-inf")).unsqueeze(-1), 0.0, out5)
        self._fold(rows, lse5, lambda shift: torch.exp(lse5 - shift), out5)

    def _fold(self, rows: slice, peak: torch.Tensor, weights, values: torch.Tensor) -> None:
        """The online-softmax step on ``rows``: ``peak`` (b, hkv, g, n) the new terms' largest
        log-weight, ``weights(shift)`` their weights exp(. - shift), ``values`` the vectors they
        weigh ((b, hkv, sk, d) for scores, (b, hkv, g, n, d) for one normalised partial)."""
        m = self.m[..., rows]
        m_new = torch.maximum(m, peak)
        # Rows that have seen no key yet keep m = -inf; shift by 0 there so exp gives 0, not NaN.
        shift = torch.where(torch.isinf(m_new), torch.zeros_like(m_new), m_new)
        p = weights(shift)
        alpha = torch.exp(m - shift)
        if p.dim() == 5:  # scores: p (b, hkv, g, n, sk) weighs the block's value rows
            total, weighted = p.sum(-1), torch.matmul(p, values.unsqueeze(2))
        else:  # a partial: one weight per row for its output
            total, weighted = p, p.unsqueeze(-1) * values
        self.l[..., rows] = self.l[..., rows] * alpha + total
        self.acc[..., rows, :] = self.acc[..., rows, :] * alpha.unsqueeze(-1) + weighted
        self.m[..., rows] = m_new

    def result(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(out (b, hkv, g, sq, d), lse (b, hkv, g, sq)); rows that saw nothing: out 0, lse -inf
        (the sink logit with a sink).

        A row saw nothing exactly when its running max is still -inf. A NaN input makes the max
        (and so l and acc) NaN in every row it reaches: those rows must come back NaN, so they
        are not taken for rows that saw nothing (``l > 0`` would be False for them)."""
        seen = self.m != float("-inf")
        out = torch.where(
            seen.unsqueeze(-1), self.acc / torch.where(seen, self.l, 1.0).unsqueeze(-1), 0.0
        )
        lse = torch.where(seen, self.m + torch.log(self.l), float("-inf"))
        return out, lse


def _sink_logits(sinks: torch.Tensor | None, heads_kv: int, acc: torch.dtype):
    """(heads,) sink logits -> (1, hkv, g, 1) in ``acc``, or None."""
    if sinks is None:
        return None
    return sinks.detach().to(acc).reshape(1, heads_kv, -1, 1)


def _record(setup: RingSetup, step: int, kv_rank: int, s: torch.Tensor, v: torch.Tensor) -> None:
    """This step's own partial (normalised over its visible keys), for diagnosis."""
    lse = torch.logsumexp(s, dim=-1)
    seen = torch.isfinite(lse)
    p = torch.exp(s - torch.where(seen, lse, 0.0).unsqueeze(-1))
    out = torch.matmul(p, v.unsqueeze(2))
    b, hkv, g, sq, d = out.shape
    record_step(
        rank=setup.rank,
        step=step,
        kv_rank=kv_rank,
        q_rows=(0, sq),
        out=out.reshape(b, hkv * g, sq, d),
        lse=lse.reshape(b, hkv * g, sq),
    )


def _row_terms(query, key, out, lse, grad_out, grad_lse):
    """A backward's per-row inputs, grouped by key/value head in the accumulation dtype: query,
    dO, the LSE and the row term delta = rowsum(dO * O) of the final output (an LSE gradient adds
    P * dLSE to dS, i.e. lowers the row term)."""
    acc, hkv = accumulation_dtype(query.dtype), key.shape[1]
    q5 = _grouped(widened(query, acc), hkv)
    do5 = _grouped(widened(grad_out, acc), hkv)
    lse5 = _grouped(lse.to(acc).unsqueeze(-1), hkv).squeeze(-1)
    delta = (do5 * _grouped(out.to(acc), hkv)).sum(-1)
    if grad_lse is not None:
        delta = delta - _grouped(widened(grad_lse, acc).unsqueeze(-1), hkv).squeeze(-1)
    return q5, do5, lse5, delta


def _sinks_grad(sinks, lse5: torch.Tensor, delta: torch.Tensor, heads_kv: int):
    """The gradient of this rank's rows' loss in the (heads,) sink logits, or None: the sink is a
    key of logit ``sink`` and value 0, so its probability p = exp(sink - LSE) gives
    dsink = -sum over rows of p * delta (delta lowered by the LSE gradient, as for any key)."""
    if sinks is None:
        return None
    p = torch.exp(_sink_logits(sinks, heads_kv, lse5.dtype) - lse5)
    return (-(p * delta).sum(dim=(0, 3))).reshape(-1).to(sinks.dtype)


# ------------------------------------------------------------------------- attention ops


def _runs(pos: list[int]) -> list[slice]:
    """Local ranges of consecutive global positions (a shard's padding, -1, is a range of its
    own): the pieces a layout cuts a shard into (head_tail: its two chunks)."""
    starts = [
        i
        for i in range(len(pos))
        if i == 0 or (pos[i] < 0) != (pos[i - 1] < 0) or (pos[i] >= 0 and pos[i] != pos[i - 1] + 1)
    ]
    return [slice(a, b) for a, b in zip(starts, [*starts[1:], len(pos)])]


def _pieces(kind: str, visible, qpos: torch.Tensor, kpos: torch.Tensor, sq: int, sk: int):
    """The kernel calls of one block, (rows, cols, is_causal, mask): the whole block when it is
    all visible, else one call per (run of query rows, run of keys) with a visible pair, all
    visible (no mask), exactly top-left causal (``is_causal``), or with its visibility ((n, m)
    or (b, hkv, g, n, m) bool). Each visible pair is computed once and no hidden one is."""
    if kind == "full":
        return [(slice(0, sq), slice(0, sk), False, None)]
    pieces = []
    for rows in _runs(qpos.tolist()):
        for cols in _runs(kpos.tolist()):
            vis = visible[..., rows, cols]
            if not bool(vis.any()):
                continue
            n, m = vis.shape[-2:]
            if bool(vis.all()):
                pieces.append((rows, cols, False, None))
            elif n == m and bool((vis == torch.ones(n, n, dtype=torch.bool).tril()).all()):
                pieces.append((rows, cols, True, None))
            else:
                pieces.append((rows, cols, False, vis))
    return pieces


class _Op:
    """An attention-op object given as ``op=`` (ring_impl/ops/contract.py's contract): a block's
    pieces (:func:`_pieces`) run through its ``forward`` and ``backward``, the ones its
    ``capabilities`` cannot express (a mask, for an op without ``masks``) through this ring's own
    math. Its LSE comes in its declared layout (:func:`normalized_lse`); key/value heads are
    expanded for an op without ``gqa``; an LSE gradient goes in as ``grad_lse=`` to an op with
    ``lse_grad``, else folded into two extra head-dim columns (zero for query, key and the output,
    one for value, the LSE gradient for dO: dP, and so dS, gains P * dLSE)."""

    def __init__(self, op):
        self.op = op
        caps = op.capabilities
        self.masks, self.gqa = bool(getattr(caps, "masks", False)), bool(caps.gqa)
        self.lse_grad = bool(getattr(caps, "lse_grad", False))

    def takes(self, mask) -> bool:
        return mask is None or self.masks

    def _heads(self, t: torch.Tensor, heads: int) -> torch.Tensor:
        return t if self.gqa else t.repeat_interleave(heads // t.shape[1], dim=1)

    @staticmethod
    def _keywords(causal: bool, mask, scale: float) -> dict:
        kw: dict = {"is_causal": causal, "scale": scale}
        if mask is not None:  # (n, m) or (b, hkv, g, n, m) -> the kernel's (b | 1, h | 1, n, m)
            b, hkv, g = mask.shape[:3] if mask.dim() == 5 else (1, 1, 1)
            kw["attn_mask"] = mask.reshape(b, hkv * g, *mask.shape[-2:])
        return kw

    def forward(self, q, k, v, causal: bool, mask, scale: float, acc: torch.dtype):
        """q (b, h, n, d), k/v (b, hkv, m, d) in the input dtype -> out (b, hkv, g, n, d) and
        lse (b, hkv, g, n) in ``acc``; rows that see nothing here: LSE -inf."""
        b, h, n = q.shape[:3]
        hkv = k.shape[1]
        args = (q.contiguous(), self._heads(k, h).contiguous(), self._heads(v, h).contiguous())
        out, lse = self.op.forward(*args, **self._keywords(causal, mask, scale))
        lse = normalized_lse(self.op, lse, b, h, n).to(acc)
        out5, lse5 = _grouped(out.to(acc), hkv), lse.reshape(b, hkv, h // hkv, n)
        if mask is not None:
            lse5 = torch.where(mask.any(-1), lse5, float("-inf"))
        return out5, lse5

    def backward(self, grad_out, q, k, v, out, lse, grad_lse, causal, mask, scale, acc):
        """grad_out/out (b, h, n, d) in the input dtype, lse/grad_lse (b, h, n) (grad_lse may be
        None) -> dq (b, h, n, d), dk/dv (b, hkv, m, d) in ``acc``. Rows that see no key at all
        (LSE -inf) contribute nothing: they go in with LSE 0 and a zero output gradient."""
        h, hkv, d = q.shape[1], k.shape[1], q.shape[-1]
        unseen = lse == float("-inf")
        lse = torch.where(unseen, 0.0, lse)
        grad_out = torch.where(unseen.unsqueeze(-1), 0, grad_out)
        k, v = self._heads(k, h), self._heads(v, h)
        kw = self._keywords(causal, mask, scale)
        if grad_lse is not None:
            grad_lse = torch.where(unseen, 0.0, grad_lse)
            if self.lse_grad:
                kw["grad_lse"] = grad_lse
            else:
                # The LSE gradient in two columns of dO, its input-dtype rounding and what that
                # leaves, so that a 16-bit input carries it to about twice its precision.
                high = grad_lse.to(grad_out.dtype)
                low = (grad_lse - high.to(grad_lse.dtype)).to(grad_out.dtype)
                q, k, out = (torch.nn.functional.pad(t, (0, 2)) for t in (q, k, out))
                v = torch.nn.functional.pad(v, (0, 2), value=1.0)
                grad_out = torch.cat([grad_out, high.unsqueeze(-1), low.unsqueeze(-1)], -1)
        args = (grad_out, q, k, v, out)
        dq, dk, dv = self.op.backward(*(t.contiguous() for t in args), lse.contiguous(), **kw)
        dq, dk, dv = (t[..., :d].to(acc) for t in (dq, dk, dv))
        if not self.gqa:
            dk, dv = (t.reshape(t.shape[0], hkv, h // hkv, *t.shape[2:]).sum(2) for t in (dk, dv))
        return dq, dk, dv


def _op_step(op: _Op, query, q5, block, kind: str, visible, qpos, kpos, scale: float):
    """One ring step's partial over all of this rank's rows, (out (b, hkv, g, sq, d), lse
    (b, hkv, g, sq)) in the accumulation dtype, from the op's calls on the block's pieces."""
    acc, k, v = q5.dtype, block[0], block[1]
    step = _Online(q5)
    for rows, cols, causal, mask in _pieces(kind, visible, qpos, kpos, q5.shape[3], k.shape[2]):
        if op.takes(mask):
            out5, lse5 = op.forward(
                query[:, :, rows], k[:, :, cols], v[:, :, cols], causal, mask, scale, acc
            )
            step.add_partial(out5, lse5, rows)
        else:  # a mask the op cannot take: this ring's own math on the piece
            s = _scores(q5[..., rows, :], widened(k[:, :, cols], acc), scale, mask)
            step.add(s, widened(v[:, :, cols], acc), rows)
    return step.result()


def _math_grads(q5, do5, lse5, delta, k, v, scale: float, visible, modify):
    """Gradients of one block from this ring's own math: q5/do5 (b, hkv, g, n, d), lse5/delta
    (b, hkv, g, n), k/v (b, hkv, m, d), all in the accumulation dtype, ``visible`` the block's
    visibility or None, ``modify`` its score change or None -> (dq5, dk, dv)."""
    if modify is None:
        s = _scores(q5, k, scale, visible)
    else:  # dS reaches the scaled logits through the score_mod's own derivative
        with torch.enable_grad():
            raw = _scores(q5, k, scale, None).requires_grad_()
            modified = modify(raw)
        s = modified.detach()
        if visible is not None:
            s = s.masked_fill(~visible, float("-inf"))
    p = torch.exp(s - lse5.unsqueeze(-1))  # masked scores are -inf: p = 0 there ...
    if visible is not None:
        # ... unless the row's LSE is NaN (a NaN input reaches the row): exp(-inf - NaN)
        # is NaN, which would reach the dK/dV of keys the row does not see.
        p = p.masked_fill(~visible, 0.0)
    dv = torch.matmul(p.transpose(-1, -2), do5).sum(2)
    dp = torch.matmul(do5, v.unsqueeze(2).transpose(-1, -2))
    ds = p * (dp - delta.unsqueeze(-1))
    if visible is not None:  # p = 0 times a NaN of dP (a NaN value the row does not see)
        ds = ds.masked_fill(~visible, 0.0)
    if modify is not None:
        ds = torch.autograd.grad(modified, raw, ds)[0]
    dq5 = torch.matmul(ds, k.unsqueeze(2)) * scale
    dk = torch.matmul(ds.transpose(-1, -2), q5).sum(2) * scale
    return dq5, dk, dv


class _MathRingFn(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx,
        query,
        key,
        value,
        sinks,
        setup: RingSetup,
        blocks: _Blocks,
        method: str,
        with_max_logit: bool = False,
        op: _Op | None = None,
    ):
        ctx.set_materialize_grads(False)
        acc = accumulation_dtype(query.dtype)
        b, h, sq, d = query.shape
        hkv, sk = key.shape[1], key.shape[2]
        w, r = setup.world_size, setup.rank
        # Replicated key/value: one block, the whole key/value this rank holds; nothing rotates.
        steps = 1 if blocks.replicated else w
        q5 = _grouped(widened(query, acc), hkv)
        kv = torch.stack([key, value])  # (2, b, hkv, sk, d): one transfer per hop
        gathered = None
        if method == "allgather" and steps > 1:
            gathered = torch.empty((w, *kv.shape), dtype=kv.dtype)
            all_gather(gathered.view(-1), kv.contiguous().view(-1), group=setup.group)
        hop = _Hop(setup, method)
        state = _Online(q5, _sink_logits(sinks, hkv, acc))
        best = torch.full((h,), float("-inf"), dtype=acc) if with_max_logit else None
        for step in range(steps):
            kv_rank = (r - step) % w
            block = gathered[kv_rank] if gathered is not None else kv
            kind, visible = blocks.visibility(kv_rank, sq, sk)
            if kind != "skip" and op is not None:
                qpos, kpos = blocks.positions(kv_rank, sq, sk)
                out5, lse5 = _op_step(op, query, q5, block, kind, visible, qpos, kpos, setup.scale)
                state.add_partial(out5, lse5)
                if recording():
                    q_rows, flat = (0, sq), (b, h, sq)
                    out_s, lse_s = out5.reshape(*flat, d), lse5.reshape(flat)
                    record_step(
                        rank=r, step=step, kv_rank=kv_rank, q_rows=q_rows, out=out_s, lse=lse_s
                    )
            elif kind != "skip":
                k, v = widened(block[0], acc), widened(block[1], acc)
                s = _scores(q5, k, setup.scale, visible, blocks.modifier(kv_rank, sq, sk))
                if best is not None:  # s (b, hkv, g, sq, sk): head kv * g + j
                    best = torch.maximum(best, s.amax(dim=(0, 3, 4)).reshape(h))
                state.add(s, v)
                if recording():
                    _record(setup, step, kv_rank, s, v)
            if gathered is None and step < steps - 1:
                kv = hop(kv)
        out5, lse5 = state.result()
        out = out5.reshape(b, h, sq, d).to(query.dtype)
        lse = lse5.reshape(b, h, sq)
        ctx.save_for_backward(
            query,
            key,
            value,
            out,
            lse,
            gathered if gathered is not None else torch.empty(0),
            sinks,
        )
        ctx.setup, ctx.blocks, ctx.method, ctx.steps, ctx.op = setup, blocks, method, steps, op
        ctx.gathered = gathered is not None
        if best is None:
            return out, lse
        if w > 1:
            every = torch.empty((w, h), dtype=acc)
            all_gather(every.view(-1), best, group=setup.group)
            best = every.amax(0)
        ctx.mark_non_differentiable(best)
        return out, lse, best

    @staticmethod
    def backward(ctx, grad_out, grad_lse, _grad_max_logit=None):
        query, key, value, out, lse, gathered, sinks = ctx.saved_tensors
        setup, blocks, method, steps, op = ctx.setup, ctx.blocks, ctx.method, ctx.steps, ctx.op
        acc = accumulation_dtype(query.dtype)
        b, h, sq, d = query.shape
        hkv, sk = key.shape[1], key.shape[2]
        w, r = setup.world_size, setup.rank
        if grad_out is None:  # a loss of the LSE alone
            grad_out = torch.zeros_like(out)
        q5, do5, lse5, delta = _row_terms(query, key, out, lse, grad_out, grad_lse)
        dq5 = torch.zeros_like(q5)

        def block_grads(block: torch.Tensor, kv_rank: int) -> torch.Tensor | None:
            """(2, b, hkv, sk, d) dK/dV contribution of
            this rank's queries to one block, or None."""
            kind, visible = blocks.visibility(kv_rank, sq, sk)
            if kind == "skip":
                return None
            if op is None:
                k, v = widened(block[0], acc), widened(block[1], acc)
                modify = blocks.modifier(kv_rank, sq, sk)
                dq, dk, dv = _math_grads(q5, do5, lse5, delta, k, v, setup.scale, visible, modify)
                dq5.add_(dq)
                return torch.stack([dk, dv])
            dkv = torch.zeros((2, b, hkv, sk, d), dtype=acc)
            qpos, kpos = blocks.positions(kv_rank, sq, sk)
            for rows, cols, causal, mask in _pieces(kind, visible, qpos, kpos, sq, sk):
                if op.takes(mask):
                    dlse = None if grad_lse is None else grad_lse[:, :, rows]
                    q_part = (grad_out[:, :, rows], query[:, :, rows])
                    kv_part = (block[0][:, :, cols], block[1][:, :, cols])
                    row_part = (out[:, :, rows], lse[:, :, rows], dlse)
                    dq, dk, dv = op.backward(
                        *q_part, *kv_part, *row_part, causal, mask, setup.scale, acc
                    )
                    dq = _grouped(dq, hkv)
                else:  # as in forward: this ring's own math on a piece the op cannot take
                    at = (slice(None),) * 3 + (rows,)
                    dq, dk, dv = _math_grads(
                        q5[at],
                        do5[at],
                        lse5[at],
                        delta[at],
                        widened(block[0][:, :, cols], acc),
                        widened(block[1][:, :, cols], acc),
                        setup.scale,
                        mask,
                        None,
                    )
                dq5[..., rows, :] += dq
                dkv[0][:, :, cols] += dk
                dkv[1][:, :, cols] += dv
            return dkv

        if ctx.gathered:
            contributions = torch.zeros((w, 2, b, hkv, sk, d), dtype=acc)
            for step in range(w):
                kv_rank = (r - step) % w
                g = block_grads(gathered[kv_rank], kv_rank)
                if g is not None:
                    contributions[kv_rank] = g
            # Row j goes to rank j; rank r receives every rank's contribution to its own block.
            received = torch.empty_like(contributions)
            dist.all_to_all_single(received, contributions, group=setup.group)
            dkv = received.sum(0)
        else:
            hop = _Hop(setup, method)
            kv = torch.stack([key, value])
            dkv = torch.zeros((2, b, hkv, sk, d), dtype=acc)
            for step in range(steps):
                kv_rank = (r - step) % w
                g = block_grads(kv, kv_rank)
                if g is not None:
                    dkv = dkv + g
                if steps > 1:
                    if step < steps - 1:
                        kv = hop(kv)
                    # The accumulator travels with its block;
                    # after W hops it is back with its owner.
                    dkv = hop(dkv)
        dq = dq5.reshape(b, h, sq, d).to(query.dtype)
        dsinks = _sinks_grad(sinks, lse5, delta, hkv)
        grads = (dq, dkv[0].to(key.dtype), dkv[1].to(value.dtype), dsinks)
        return (*grads, None, None, None, None, None)


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
    return_max_logit=False,
    shard_lengths=None,
    replicated_kv=False,
    mask=None,
    sinks=None,
    score_mod=None,
    cu_seqlens=None,
):
    """Ring attention over ``group``; differentiable in query, key and value (and through the LSE).

    query (batch, heads, seq_q_local, head_dim), key/value (batch, heads_kv, seq_kv_local,
    head_dim), sharded on dim 2 in ``layout``. Returns the local output (input dtype) and, with
    ``return_lse``, the LSE (batch, heads, seq_q_local) in float32 (float64 for float64), and
    with ``return_max_logit`` the group's per-head max logit (heads,) last, in the same dtype.

    ``shard_lengths`` (one int per rank, equal on every rank): rank r holds ``shard_lengths[r]``
    rows of query, key and value (contiguous: any split; head_tail: 2W chunks cut as
    ``torch.tensor_split`` cuts). Every shard is padded with zero rows to the longest and the
    padding is masked out of every block (it sees and is seen by nothing); the result is cut
    back to the rank's own rows.

    ``replicated_kv=True``: key/value (batch, heads_kv, seq_kv, head_dim) are the whole sequence,
    equal on every rank, any ``seq_kv``; the rank's queries attend to them once (non-causal, no
    rotation). dK/dV are this rank's rows' contribution: their sum over the ranks is the gradient.

    ``mask``: a :class:`conformance.specs.MaskSpec` on global positions (with ``replicated_kv``,
    key indices 0..seq_kv-1), and-ed with ``is_causal``; every rank evaluates it on the whole
    call once, and the ranks compare digests of it in the input check. ``sinks``: (heads,)
    per-head sink logits, a key of that logit and no value in every row's softmax; this rank's
    rows' share of their gradient comes back in ``sinks.grad``. Rows that see nothing: out 0,
    LSE -inf (the sink logit with sinks).

    ``score_mod``: flex attention's ``score_mod(score, b, h, q_idx, kv_idx)`` on every block's
    scaled logits before the mask, at the global query head and global positions; backward goes
    through its own derivative (autograd of the callable). The ranks compare digests of its
    values on a probe of the whole call's scores.

    ``cu_seqlens`` (a list of ints or a 1-D integer tensor, equal on every rank): packed (THD)
    shards, query/key/value (tokens_local, heads, head_dim) in ``layout`` on dim 0, attending
    within the documents ``[cu_seqlens[i], cu_seqlens[i + 1])`` of the global packed sequence
    (causally with ``is_causal``); tokens past ``cu_seqlens[-1]`` are padding (out 0, LSE -inf).
    They run as a (1, heads, tokens_local, head_dim) call under the documents' mask; out comes
    back (tokens_local, heads, head_dim), the LSE (heads, tokens_local).
    """
    packed = cu_seqlens is not None
    cu_problem = None
    if packed:
        query, key, value = (
            t.transpose(0, 1).unsqueeze(0) if isinstance(t, torch.Tensor) and t.dim() == 3 else t
            for t in (query, key, value)
        )
        mask, cu_problem = _packed_documents(
            cu_seqlens, query, group, mask, shard_lengths or replicated_kv
        )
    rotate_method = "p2p" if rotate_method is None else rotate_method
    problem = op_problem(
        op, query, scale=scale, is_causal=is_causal, ring="math_ring", fallback="its own math"
    )
    if problem is None and op is not None and (score_mod is not None or return_max_logit):
        problem = (
            "math_ring runs a score_mod and takes the max logit from its own scores, not an op's: "
            "pass op=None with score_mod= or return_max_logit=True"
        )
    lengths = None
    check_layout = layout
    replicated = bool(replicated_kv)
    replicated_problem = None
    if replicated and shard_lengths is not None:
        replicated_problem = (
            "replicated_kv=True takes the whole key/value on every rank and no shard_lengths"
        )
    elif replicated and return_max_logit:
        replicated_problem = "math_ring returns no max logit with replicated_kv=True"
    elif replicated and score_mod is not None:
        replicated_problem = "replicated_kv=True takes no score_mod (its call is plain attention)"
    if shard_lengths is not None and not replicated:
        lengths = tuple(int(n) for n in shard_lengths)
        problem = problem or _uneven_problem(query, key, value, lengths, group, layout)
        if problem is None:  # equal padded shards: the input check compares them across ranks
            rows = max(lengths)
            query, key, value = (
                torch.nn.functional.pad(t, (0, 0, 0, rows - t.shape[2]))
                for t in (query, key, value)
            )
            check_layout = "contiguous"  # the rows' positions are _uneven_rows', not chunks
    visibility, mask_digest, mask_problem = _call_mask(mask, query, key, group, lengths, replicated)
    mask_problem = cu_problem or mask_problem
    sinks_digest, sinks_problem = _call_sinks(sinks, query)
    score_digest, score_problem = _call_score_mod(score_mod, query, key, group, lengths)
    if score_problem is None and score_mod is not None and return_max_logit:
        score_problem = "math_ring returns no max logit with a score_mod: pass one or the other"
    setup = check_inputs(
        query,
        key,
        value,
        group=group,
        is_causal=is_causal,
        scale=scale,
        layout=check_layout,
        rotate_method=rotate_method,
        rotate_methods=ROTATE_METHODS,
        op_problem=problem,
        replicated_kv=replicated,
        replicated_problem=replicated_problem,
        mask_problem=mask_problem,
        sinks_problem=sinks_problem,
        score_mod_problem=score_problem,
        digests=(mask_digest, sinks_digest, score_digest),
        packed=packed,
    )
    blocks = _Blocks(
        setup, layout, is_causal, key.shape[1], lengths, visibility, replicated, score_mod
    )
    kernel = None if op is None else _Op(op)
    args = (query, key, value, sinks, setup, blocks, rotate_method, bool(return_max_logit), kernel)
    out, lse, *max_logit = _MathRingFn.apply(*args)
    if lengths is not None:
        n = lengths[setup.rank]
        out, lse = out[:, :, :n], lse[:, :, :n]
    if packed:
        out, lse = out[0].transpose(0, 1), lse[0]
    return (out, *((lse,) if return_lse else ()), *max_logit) if return_lse or max_logit else out


class _Documents:
    """The documents of packed shards' ``cu_seqlens`` as a mask, on global positions: a query sees
    the keys of its own document; padding (past ``cu_seqlens[-1]``) sees and is seen by nothing."""

    def __init__(self, bounds: list[int], tokens: int):
        positions = torch.arange(tokens)
        ids = torch.searchsorted(torch.tensor(bounds[1:], dtype=torch.int64), positions, right=True)
        self.ids = torch.where(positions < bounds[-1], ids, -1)

    def visible(self, b, h, q_idx, kv_idx):
        doc = self.ids[q_idx]
        return (doc == self.ids[kv_idx]) & (doc >= 0)


def _packed_documents(cu_seqlens, query, group, mask, other_shards):
    """(mask, problem) of a packed call: its documents as a mask over the global packed sequence
    of ``tokens_local * W`` tokens, or what is wrong with ``cu_seqlens`` (raised on every rank by
    the input check). ``other_shards``: shard_lengths or replicated_kv given too."""
    if mask is not None or other_shards:
        return None, (
            "cu_seqlens is the packed call's mask over equal shards: pass no mask=, "
            "shard_lengths= or replicated_kv= with it"
        )
    if isinstance(cu_seqlens, torch.Tensor):
        if cu_seqlens.dim() != 1 or cu_seqlens.is_floating_point():
            return None, (
                "cu_seqlens must be a 1-D integer tensor or a list of ints, got "
                f"{cu_seqlens.dtype} of shape {tuple(cu_seqlens.shape)}"
            )
        bounds = cu_seqlens.tolist()
    else:
        bounds = list(cu_seqlens)
    if not isinstance(query, torch.Tensor) or query.dim() != 4:
        return None, None  # the input check says what is wrong with the tensors
    tokens = query.shape[2] * group_rank(group)[0]
    if (
        not bounds
        or not all(isinstance(x, int) and not isinstance(x, bool) for x in bounds)
        or bounds[0] != 0
        or any(b < a for a, b in itertools.pairwise(bounds))
        or bounds[-1] > tokens
    ):
        return None, (
            f"cu_seqlens {bounds} must be ints rising from 0 to at most the {tokens} packed tokens "
            "of the global sequence"
        )
    return _Documents(bounds, tokens), None


def _call_mask(mask, query, key, group, lengths, replicated: bool):
    """(visibility, digest, problem) of a call's ``mask``: its (batch, heads, seq_q, seq_kv) bool
    visibility on the call's global positions and the digest the ranks compare, or (None, 0,
    what is wrong) for a mask this ring cannot take (raised on every rank by the input check)."""
    if mask is None:
        return None, 0, None
    if not callable(getattr(mask, "visible", None)):
        return (
            None,
            0,
            (
                "mask must be a conformance.specs.MaskSpec (plain mask data with .visible(b, h, "
                f"q_idx, kv_idx)), got {type(mask).__name__}"
            ),
        )
    if not all(isinstance(t, torch.Tensor) and t.dim() == 4 for t in (query, key)):
        return None, 0, None  # the input check says what is wrong with the tensors
    batch, heads = query.shape[:2]
    seq_q, seq_kv = _global_lengths(query, key, group, lengths, replicated)
    try:
        visibility = _mask_visibility(mask, batch, heads, seq_q, seq_kv)
    except Exception as exc:  # a mask_mod that cannot run here fails on every rank, not this one
        return (
            None,
            0,
            (
                f"mask.visible could not be evaluated on the call's {seq_q} x {seq_kv} global "
                f"positions ({type(exc).__name__}: {exc})"
            ),
        )
    return visibility, digest(visibility), None


def _call_score_mod(score_mod, query, key, group, lengths) -> tuple[int, str | None]:
    """(digest, problem) of a call's ``score_mod``: a callable, whose digest is that of its values
    on a fixed probe of scores over every global (batch row, head, query, key)."""
    if score_mod is None:
        return 0, None
    if not callable(score_mod):
        return (
            0,
            "score_mod must be a callable score_mod(score, b, h, q_idx, kv_idx), got "
            f"{score_mod!r}",
        )
    if not all(isinstance(t, torch.Tensor) and t.dim() == 4 for t in (query, key)):
        return 0, None  # the input check says what is wrong with the tensors
    batch, heads = query.shape[:2]
    seq_q, seq_kv = _global_lengths(query, key, group, lengths, False)
    acc = accumulation_dtype(query.dtype)
    probe = torch.linspace(-4.0, 4.0, seq_q * seq_kv, dtype=acc).reshape(1, 1, seq_q, seq_kv)
    try:
        index = _grid(batch, heads, seq_q, seq_kv)
        values = score_mod(probe.expand(batch, heads, seq_q, seq_kv), *index)
        return digest(torch.as_tensor(values).expand(batch, heads, seq_q, seq_kv)), None
    except Exception as exc:  # raised on every rank by the input check, not on this one
        return 0, (
            f"score_mod could not be evaluated on the call's {seq_q} x {seq_kv} global positions "
            f"({type(exc).__name__}: {exc})"
        )


def _call_sinks(sinks, query) -> tuple[int, str | None]:
    """(digest, problem) of a call's ``sinks``: (heads,) floating-point logits."""
    if sinks is None:
        return 0, None
    heads = query.shape[1] if isinstance(query, torch.Tensor) and query.dim() == 4 else None
    if (
        not isinstance(sinks, torch.Tensor)
        or not sinks.is_floating_point()
        or (heads is not None and tuple(sinks.shape) != (heads,))
    ):
        what = (
            f"{sinks.dtype} of shape {tuple(sinks.shape)}"
            if isinstance(sinks, torch.Tensor)
            else type(sinks).__name__
        )
        return 0, f"sinks must be a floating-point (heads,) = ({heads},) tensor, got {what}"
    return digest(sinks), None


def _uneven_problem(query, key, value, lengths, group, layout) -> str | None:
    """What is wrong with ``shard_lengths`` on this rank, or None (raised on every rank by the
    input check)."""
    world, rank = group_rank(group)
    if len(lengths) != world or min(lengths) < 0 or sum(lengths) < 1:
        return f"shard_lengths must hold {world} ints >= 0 with a positive sum, got {list(lengths)}"
    if layout not in ("contiguous", "head_tail"):
        return (
            f"math_ring takes shard_lengths with layout 'contiguous' or 'head_tail', not {layout!r}"
        )
    if layout == "head_tail":
        chunks = [len(c) for c in torch.arange(sum(lengths)).tensor_split(2 * world)]
        own = tuple(chunks[r] + chunks[2 * world - 1 - r] for r in range(world))
        if lengths != own:
            return (
                f"layout 'head_tail' splits {sum(lengths)} tokens as {list(own)}, not "
                f"{list(lengths)}"
            )
    for name, t in (("query", query), ("key", key), ("value", value)):
        if t.dim() != 4 or t.shape[2] != lengths[rank]:
            return f"{name} must hold shard_lengths[{rank}] = {lengths[rank]} rows on rank {rank}"
    return None


# ------------------------------------------------------------------------------- balancer


def _document_spans(mask, seq_len: int) -> list[tuple[int, int]]:
    """The documents of a mask's plain data (conformance.specs.MaskSpec, ``"document"`` nodes
    anywhere under ``"and"``/``"or"``) as consecutive (start, stop) spans covering the sequence;
    padding (id -1, or past the last ``cu_seqlens`` boundary) is a span like any other, and a
    mask without documents is one document."""
    found: list[list[tuple[int, int]]] = []

    def walk(node) -> None:
        if node["kind"] in ("and", "or"):
            for inner in node["masks"]:
                walk(inner)
        elif node["kind"] == "document":
            if "cu_seqlens" in node:
                bounds = [int(x) for x in node["cu_seqlens"]]
                ends = [*bounds[1:], *([seq_len] if bounds[-1] < seq_len else [])]
                found.append([(a, b) for a, b in zip(bounds, ends) if b > a])
                return
            ids = torch.as_tensor(node["doc_ids"]).reshape(-1).tolist()
            if len(ids) != seq_len:
                raise ValueError(f"doc_ids hold {len(ids)} ids for a sequence of {seq_len}")
            starts = [i for i in range(seq_len) if i == 0 or ids[i] != ids[i - 1]]
            found.append(list(zip(starts, [*starts[1:], seq_len])))

    walk(mask)
    if any(spans != found[0] for spans in found):
        raise ValueError("the mask's document nodes disagree on the documents")
    return found[0] if found else [(0, seq_len)]


def _document_head_tail(spans: list[tuple[int, int]], world: int) -> list[list[tuple[int, int]]]:
    """Every rank's runs: head_tail within each document (2W chunks, rank r taking chunks r and
    2W-1-r), the ``L mod 2W`` tokens a document of L leaves over dealt one per rank in turn (the
    turn going on from document to document), to the heads first, then the tails. Over a sequence
    of a multiple of W tokens every rank gets the same count."""
    runs: list[list[tuple[int, int]]] = [[] for _ in range(world)]
    turn = 0
    for start, stop in spans:
        base, left_over = divmod(stop - start, 2 * world)
        head, tail = [base] * world, [base] * world
        for i in range(left_over):
            (head if i < world else tail)[(turn + i) % world] += 1
        turn = (turn + left_over) % world
        at = start
        for rank, size in [*enumerate(head), *reversed(list(enumerate(tail)))]:
            if size:
                runs[rank].append((at, at + size))
            at += size
    return [_merged(rank_runs) for rank_runs in runs]


def _work_aware(weights: list[float], world: int, per_rank: int) -> list[list[int]]:
    """Every rank's chunks (ascending), ``per_rank`` each, dealt by their ``weights`` (the work
    of each chunk's rows): heaviest first, each to the least loaded rank with room; then, while
    some swap of a chunk of the most loaded rank with one of another rank lowers the larger of
    the two ranks' loads below the most loaded one's, the best such swap."""
    held: list[list[int]] = [[] for _ in range(world)]
    load = [0.0] * world
    for c in sorted(range(len(weights)), key=lambda c: (-weights[c], c)):
        r = min((r for r in range(world) if len(held[r]) < per_rank), key=lambda r: (load[r], r))
        held[r].append(c)
        load[r] += weights[c]
    for _ in range(4 * len(weights)):  # each swap lowers the sorted loads: a bound, not a limit
        top = max(range(world), key=lambda r: (load[r], -r))
        best = None
        for r in range(world):
            for i, c in enumerate(held[top]):
                for j, e in enumerate(held[r]):
                    shift = weights[c] - weights[e]
                    worse = max(load[top] - shift, load[r] + shift)
                    if r != top and worse < load[top] - 1e-9 and (best is None or worse < best[0]):
                        best = (worse, r, i, j, shift)
        if best is None:
            break
        _, r, i, j, shift = best
        held[top][i], held[r][j] = held[r][j], held[top][i]
        load[top], load[r] = load[top] - shift, load[r] + shift
    return [sorted(chunks) for chunks in held]


def balanced_layout(balancer, masks, seq_len, world_size):
    """(layout name, every rank's runs) of ``balancer`` for ``masks`` (one MaskSpec, or
    ``[(mask, weight), ...]``: a model's masks and how many of its layers run each), registered
    on this process under a name that equal calls on every rank share.

    ``"document_head_tail"``: head_tail within every document (:func:`_document_head_tail`; the
    masks must agree on the documents). ``"work_aware"``: the sequence cut into 8 equal chunks per
    rank (fewer where the shard does not divide), each weighed by the visible (query, key) pairs
    of its rows (at batch row 0 and head 0) summed over the masks times their weights, dealt by
    :func:`_work_aware`."""
    pairs = [(masks, 1.0)] if hasattr(masks, "visible") else [(m, float(w)) for m, w in masks]
    if not pairs or seq_len % world_size:
        raise ValueError(
            f"balanced_layout takes a mask or (mask, weight) pairs and a sequence of a multiple "
            f"of {world_size} tokens, got {len(pairs)} masks and {seq_len} tokens"
        )
    if balancer == "document_head_tail":
        spans = [_document_spans(mask, seq_len) for mask, _ in pairs]
        if any(s != spans[0] for s in spans):
            raise ValueError("document_head_tail needs masks that agree on the documents")
        runs = _document_head_tail(spans[0], world_size)
    elif balancer == "work_aware":
        per_rank = next(c for c in (8, 4, 2, 1) if (seq_len // world_size) % c == 0)
        size = seq_len // (world_size * per_rank)
        seen = sum(
            w * _mask_visibility(m, 1, 1, seq_len, seq_len)[0, 0].sum(1).double() for m, w in pairs
        )
        weights = seen.reshape(-1, size).sum(1).tolist()
        runs = [
            [(c * size, (c + 1) * size) for c in chunks]
            for chunks in _work_aware(weights, world_size, per_rank)
        ]
        runs = [_merged(rank_runs) for rank_runs in runs]
    else:
        raise ValueError(
            f"math_ring has the balancers 'document_head_tail' and 'work_aware', not {balancer!r}"
        )
    sizes = {sum(b - a for a, b in rank_runs) for rank_runs in runs}
    if len(sizes) != 1:
        raise ValueError(
            f"{balancer} gives the ranks {sorted(sizes)} tokens: a sequence of {seq_len} does not "
            f"split into {world_size} equal shares"
        )
    name = f"{balancer}-{seq_len}x{world_size}-{zlib.crc32(repr(runs).encode()):08x}"
    return register_runs_layout(name, runs), runs


def _merged(runs: list[tuple[int, int]]) -> list[tuple[int, int]]:
    """Ascending runs with touching ones joined."""
    out: list[tuple[int, int]] = []
    for a, b in runs:
        if out and out[-1][1] == a:
            out[-1] = (out[-1][0], b)
        else:
            out.append((a, b))
    return out


def collective_schedule(
    world_size,
    rotate_method,
    *,
    batch,
    heads_kv,
    seq_kv,
    head_dim,
    dtype,
    compiled=False,
    heads=None,
    return_max_logit=False,
    replicated_kv=False,
    **_,
):
    """``{phase: {kind: {"calls", "bytes"}}}`` of one forward and one backward
    (seq_kv: local length).

    kv = 2*batch*heads_kv*seq_kv*head_dim elements in the input dtype, dkv the same elements in
    the accumulation dtype. Forward adds the input check's all-gather, and with
    ``return_max_logit`` an all-gather of ``heads`` maxima. W = 1 issues nothing.
    ``replicated_kv=True`` (nothing rotates, ``rotate_method`` may be None): the input check only.
    """
    if replicated_kv:
        check_schedule_request("math_ring", rotate_method or ROTATE_METHODS[0], compiled)
        forward = {"all_gather": {"calls": 1, "bytes": check_bytes()}}
        return {"forward": forward if world_size > 1 else {}, "backward": {}}
    check_schedule_request("math_ring", rotate_method, compiled)
    w = world_size
    if w == 1:
        return {"forward": {}, "backward": {}}
    kv, dkv = block_bytes(
        batch=batch, heads_kv=heads_kv, seq_kv=seq_kv, head_dim=head_dim, dtype=dtype
    )
    extra = heads * accumulation_dtype(dtype).itemsize if return_max_logit else 0
    fwd = {"all_gather": {"calls": 1 + bool(return_max_logit), "bytes": check_bytes() + extra}}
    if rotate_method == "allgather":
        fwd["all_gather"] = {
            "calls": 2 + bool(return_max_logit),
            "bytes": check_bytes() + kv + extra,
        }
        return {"forward": fwd, "backward": {"all_to_all": {"calls": 1, "bytes": w * dkv}}}
    kinds = ("send", "recv") if rotate_method == "p2p" else ("all_to_all",)
    for kind in kinds:
        fwd[kind] = {"calls": w - 1, "bytes": (w - 1) * kv}
    bwd = {kind: {"calls": 2 * w - 1, "bytes": (w - 1) * kv + w * dkv} for kind in kinds}
    return {"forward": fwd, "backward": bwd}


class MathRing:
    """math_ring as an implementation under test (``--impl meta_tests.correct:math_ring``)."""

    name = "math_ring"
    baseline_op = "math"
    capabilities = correct_capabilities(
        ops=frozenset({"*"}),  # attention-op objects (names are not resolved; an error says so)
        value_head_dim=False,  # its hops carry key and value stacked: one head dim
        input_errors=True,
        strategies=frozenset({"ring"}),
        balancers=frozenset({"document_head_tail", "work_aware"}),
        multi_mask_layouts=True,
        replicated_kv=True,  # its rows against the whole key/value it holds, nothing rotated
    )
    ring_attention = staticmethod(ring_attention)
    collective_schedule = staticmethod(collective_schedule)
    record_steps = staticmethod(record_steps)
    balanced_layout = staticmethod(balanced_layout)


math_ring = MathRing()
