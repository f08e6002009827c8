"""Cases of the balance suite: a masked ring call whose kernel calls are recorded, and what the
pytest process makes of them.

Each rank runs the implementation under test with ``mask=`` (a mask family on global positions)
in a layout (built in, or built by one of the implementation's balancers) and an op that records
every forward kernel call (:class:`PairRecordingOp`). The inputs carry each token's global
position in channels the scores never read (key features 0 and 1 are zero; query features 0 and
1 are ``position + 1`` and ``1``, value feature 0 is the position), so a call says exactly which
(query, key) pairs it computed, whatever rows the implementation sliced. The pytest process
compares those pairs with the mask evaluated on global positions by the reference
(:mod:`reference.masks`) on the positions the layout gives each rank: nothing here reads the
implementation's own plan.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from dataclasses import dataclass
from itertools import pairwise
from typing import Any

import pytest
import torch

from conformance.implementation import ProtocolError, load_implementation, load_op
from conformance.specs import MaskSpec
from reference.layout import positions as reference_positions
from reference.masks import document_ids, visibility
from suites.cases import CountingOp, RingCase
from suites.inputs import InputSpec, make_inputs

__all__ = [
    "BALANCER_LAYOUTS",
    "FAMILIES",
    "MULTI_MASKS",
    "BalanceCase",
    "BlockFinding",
    "Bound",
    "Figures",
    "MultiMaskCase",
    "as_runs",
    "balance_case",
    "balanced_layout_problem",
    "balanced_results",
    "checked_work",
    "family_spec",
    "judge_pairs",
    "lognormal_documents",
    "multi_mask_case",
    "multi_specs",
    "runs_positions",
    "runs_problem",
    "seq_len_for",
]

#: Mask families of the balance suite.
FAMILIES = ("causal", "documents", "window", "documents_window")
#: Layouts a balancer builds (the implementation's ``balanced_layout``), beside the built-in ones.
BALANCER_LAYOUTS = ("document_head_tail", "work_aware")
#: Tokens per rank: a multiple of 8 chunks per rank for the work-aware balancer, 16 tokens each.
TOKENS_PER_RANK = 128


def seq_len_for(world_size: int) -> int:
    return TOKENS_PER_RANK * world_size


def lognormal_documents(seq: int, seed: int) -> list[int]:
    """Document ids (seq,): lognormal lengths (median 20 tokens, some under 2W, a few over a
    shard) around one long document of ``seq // 3`` tokens at a seeded place."""
    rng = random.Random(seed)
    long = seq // 3
    lengths: list[int] = []
    while sum(lengths) < seq - long:
        lengths.append(max(1, int(rng.lognormvariate(3.0, 1.0))))
    lengths[-1] -= sum(lengths) - (seq - long)
    lengths = [n for n in lengths if n > 0]
    lengths.insert(rng.randrange(len(lengths) + 1), long)
    return [d for d, n in enumerate(lengths) for _ in range(n)]


def window_left(seq: int, world_size: int) -> int:
    """The sliding window's reach back: an eighth of a shard (narrower than a shard, so most
    blocks are skipped and the window crosses every shard edge)."""
    return seq // (8 * world_size)


def family_spec(family: str, seq: int, world_size: int) -> dict[str, Any]:
    """The plain-data mask (reference.masks) of ``family`` on a global sequence of ``seq``."""
    docs = {
        "kind": "document",
        "doc_ids": lognormal_documents(seq, seed=1000 * world_size + seq),
        "causal": True,
    }
    window = {"kind": "sliding_window", "left": window_left(seq, world_size), "right": 0}
    specs = {
        "causal": {"kind": "causal"},
        "documents": docs,
        "window": window,
        "documents_window": {"kind": "and", "masks": [docs, window]},
    }
    return specs[family]


@dataclass(frozen=True)
class BalanceCase(RingCase):
    """``layout``: a built-in layout, or a balancer's name (:data:`BALANCER_LAYOUTS`)."""

    family: str = "causal"

    @property
    def balancer(self) -> str | None:
        return self.layout if self.layout in BALANCER_LAYOUTS else None

    @property
    def layout_text(self) -> str:
        """The layout as messages name it."""
        if self.balancer:
            return f"the {self.balancer} balancer's layout"
        return f"layout {self.layout!r}"

    @property
    def label(self) -> str:
        return (
            f"ring_attention(W={self.world_size}, mask={self.family}, layout={self.layout}, "
            f"rotate={self.rotate_method}, seq={self.inputs.seq_q})"
        )


def case_inputs(world_size: int, seed: int = 0) -> InputSpec:
    seq = seq_len_for(world_size)
    return InputSpec(
        batch=1, heads=1, heads_kv=1, seq_q=seq, seq_kv=seq, head_dim=8, dtype="float64", seed=seed
    )


def positioned_inputs(spec: InputSpec) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Global query, key, value with every token's position in channels the scores never read."""
    g = make_inputs(spec)
    q, k, v = g.query.clone(), g.key.clone(), g.value.clone()
    pos = torch.arange(spec.seq_q, dtype=q.dtype)
    q[..., 0], q[..., 1] = pos + 1, 1.0  # a ratio: survives an implementation that scales the query
    k[..., :2] = 0.0
    v[..., 0] = pos
    return q, k, v


class PairRecordingOp(CountingOp):
    """:class:`CountingOp` that also records, per forward call, the global positions of its
    query rows and key columns and which of their pairs it computed ((rows, cols) bool)."""

    def __init__(self, inner):
        super().__init__(inner)
        self.records: list[dict[str, torch.Tensor]] = []

    def forward(self, query, key, value, *, is_causal, scale, attn_mask=None):
        q0, q1 = query[0, 0, :, 0].double().cpu(), query[0, 0, :, 1].double().cpu()
        q_pos = torch.round(q0 / q1 - 1).to(torch.int64)
        kv_pos = torch.round(value[0, 0, :, 0].double().cpu()).to(torch.int64)
        sq, sk = q_pos.numel(), kv_pos.numel()
        computed = torch.ones(sq, sk, dtype=torch.bool)
        if is_causal:
            computed &= torch.ones(sq, sk, dtype=torch.bool).tril()
        if attn_mask is not None:
            m = attn_mask.detach().cpu()
            m = m if m.dtype == torch.bool else m > float("-inf")  # an additive mask: -inf hides
            computed &= (m if m.dim() == 2 else m.reshape(-1, sq, sk).any(0)).expand(sq, sk)
        self.records.append(
            {
                "q": q_pos,
                "kv": kv_pos,
                "computed": computed,
                "causal": bool(is_causal),
                "masked": attn_mask is not None,
            }
        )
        return super().forward(
            query, key, value, is_causal=is_causal, scale=scale, attn_mask=attn_mask
        )


def as_runs(runs) -> tuple[tuple[tuple[int, int], ...], ...]:
    """Per-rank runs (as ``balanced_layout`` returned them) as tuples of int pairs."""
    return tuple(tuple((int(a), int(b)) for a, b in rank_runs) for rank_runs in runs)


def runs_positions(rank_runs) -> torch.Tensor:
    """(n,) int64: the global positions of one rank's runs, in local order."""
    return (
        torch.cat([torch.arange(a, b) for a, b in rank_runs])
        if rank_runs
        else torch.zeros(0, dtype=torch.int64)
    )


def builtin_runs(layout: str, seq: int, world_size: int) -> tuple[tuple[tuple[int, int], ...], ...]:
    """Runs of a built-in layout from the reference's own positions."""
    out = []
    for r in range(world_size):
        pos = reference_positions(layout, world_size, r, seq).tolist()
        runs: list[tuple[int, int]] = []
        for p in pos:
            if runs and runs[-1][1] == p:
                runs[-1] = (runs[-1][0], p + 1)
            else:
                runs.append((p, p + 1))
        out.append(tuple(runs))
    return tuple(out)


def balance_case(ctx, case: BalanceCase) -> dict[str, Any]:
    """Rank side: build the layout (a balancer's on every rank), shard the positioned inputs by
    its runs, run the forward with the recording op; the calls, the work and the runs."""
    if case.world_size != ctx.world_size:
        raise ValueError(f"case is for {case.world_size} ranks but the pool has {ctx.world_size}")
    impl = load_implementation(case.impl)
    seq, w = case.inputs.seq_q, ctx.world_size
    mask = MaskSpec(family_spec(case.family, seq, w))
    if case.balancer is not None:
        layout, runs = impl.obj.balanced_layout(case.balancer, mask, seq, w)
        runs = as_runs(runs)
    else:
        layout, runs = case.layout, builtin_runs(case.layout, seq, w)
    return {
        "layout": layout,
        "runs": runs,
        **_recorded_forward(ctx, impl, case, mask, layout, runs),
    }


def _recorded_forward(ctx, impl, case: RingCase, mask, layout: str, runs) -> dict[str, Any]:
    """One masked forward on the positioned inputs in ``layout`` (this rank's ``runs``) with the
    recording op: its work and its calls."""
    mine = runs_positions(runs[ctx.rank])
    q, k, v = (t.index_select(2, mine).to(ctx.device) for t in positioned_inputs(case.inputs))
    # The math op: which blocks the ring asks for does not depend on the kernel, and it takes
    # every block's mask (a kernel without masks would have masked blocks run past the counter).
    op = PairRecordingOp(load_op("math"))
    out = _masked_call(ctx, impl, case, mask, layout, q, k, v, op=op, return_lse=False)
    return {"work": op.work, "calls": op.records, "out_finite": bool(torch.isfinite(out).all())}


def _masked_call(ctx, impl, case: RingCase, mask, layout: str, q, k, v, **options):
    """The implementation's call on ``layout`` with ``mask`` alone saying what is visible
    (``is_causal=False``, the default scale), the case's rotation and ``options``."""
    return impl.obj.ring_attention(
        q,
        k,
        v,
        group=ctx.group,
        is_causal=False,
        scale=None,
        rotate_method=case.rotate_method,
        layout=layout,
        mask=mask,
        **options,
    )


# ---------------------------------------------------------------------- several masks, one layout

#: The model of the multi-mask cases: documents in every layer, a sliding window in three of
#: every four (``(family, weight)``: weight = layers that run the mask). The windowed mask comes
#: first: its work is about even under any layout with equal shares, so a balancer that reads the
#: first mask only deals the documents' causal work out blindly.
MULTI_MASKS = (("documents_window", 3.0), ("documents", 1.0))
#: The inputs the multi-mask cases judge against the oracle (the work is counted on the
#: positioned inputs of :func:`case_inputs`).
MULTI_HEADS, MULTI_HEADS_KV = 2, 1


def multi_specs(seq: int, world_size: int) -> list[tuple[dict[str, Any], float]]:
    """The plain-data masks (reference.masks) of :data:`MULTI_MASKS` and their weights."""
    return [(family_spec(family, seq, world_size), weight) for family, weight in MULTI_MASKS]


@dataclass(frozen=True)
class MultiMaskCase(BalanceCase):
    """One layout built by ``layout`` (a balancer) for the weighted masks of :data:`MULTI_MASKS`;
    every mask runs on it: a counted forward (work, pairs) and a forward and backward of
    ``oracle_inputs`` judged against the float64 oracle."""

    family: str = "multi"
    oracle_dtype: str = "float32"

    @property
    def oracle_inputs(self) -> InputSpec:
        return self.inputs.with_(
            heads=MULTI_HEADS, heads_kv=MULTI_HEADS_KV, dtype=self.oracle_dtype
        )

    @property
    def label(self) -> str:
        masks = " + ".join(f"{weight:g} x {family}" for family, weight in MULTI_MASKS)
        return (
            f"ring_attention(W={self.world_size}, masks={masks}, balancer={self.layout}, "
            f"rotate={self.rotate_method}, seq={self.inputs.seq_q}, {self.oracle_dtype})"
        )


def multi_mask_case(ctx, case: MultiMaskCase) -> dict[str, Any]:
    """Rank side: the balancer's one layout for every weighted mask; per mask the recorded
    forward (work, calls) and the oracle inputs' out, LSE and gradients on that layout."""
    if case.world_size != ctx.world_size:
        raise ValueError(f"case is for {case.world_size} ranks but the pool has {ctx.world_size}")
    impl = load_implementation(case.impl)
    seq, w = case.inputs.seq_q, ctx.world_size
    masks = [(MaskSpec(spec), weight) for spec, weight in multi_specs(seq, w)]
    layout, runs = impl.obj.balanced_layout(case.balancer, masks, seq, w)
    runs = as_runs(runs)
    mine = runs_positions(runs[ctx.rank])
    g = make_inputs(case.oracle_inputs)
    per_mask = []
    for mask, _ in masks:
        counted = _recorded_forward(ctx, impl, case, mask, layout, runs)
        q, k, v = (
            t.index_select(2, mine).to(ctx.device).requires_grad_()
            for t in (g.query, g.key, g.value)
        )
        out, lse = _masked_call(ctx, impl, case, mask, layout, q, k, v, return_lse=True)
        out.backward(g.grad_out.index_select(2, mine).to(ctx.device))
        per_mask.append(
            {
                **counted,
                "runs": runs,
                "out": out.detach().cpu(),
                "lse": lse.detach().cpu(),
                "dq": q.grad.cpu(),
                "dk": k.grad.cpu(),
                "dv": v.grad.cpu(),
            }
        )
    return {"layout": layout, "runs": runs, "masks": per_mask}


# ---------------------------------------------------------------------- the pytest side


def runs_problem(runs, seq: int, world_size: int) -> str | None:
    """What breaks the layout rules in per-rank ``runs`` (equal shares, positions increasing in
    local order, every position held once), or None."""
    if len(runs) != world_size:
        return f"runs for {len(runs)} ranks, not {world_size}"
    held = torch.zeros(seq, dtype=torch.int64)
    for r, rank_runs in enumerate(runs):
        size = sum(b - a for a, b in rank_runs)
        if size != seq // world_size:
            return (
                f"rank {r} holds {size} positions, not {seq // world_size} (every rank holds S/W)"
            )
        for (_, b), (c, _) in pairwise(rank_runs):
            if c < b:
                return (
                    f"rank {r}'s positions do not increase along its local order "
                    f"({rank_runs[:6]}...)"
                )
        for a, b in rank_runs:
            if not 0 <= a < b <= seq:
                return f"rank {r} holds a run ({a}, {b}) outside [0, {seq})"
            held[a:b] += 1
    if bool((held != 1).any()):
        p = int((held != 1).nonzero()[0])
        return f"position {p} is held by {int(held[p])} ranks, not exactly one"
    return None


@dataclass(frozen=True)
class BlockFinding:
    """One wrong (rank, key/value rank) block: what was computed against what the mask says."""

    rank: int
    kv_rank: int
    what: str


def _pair_key(q: torch.Tensor, kv: torch.Tensor, seq: int) -> torch.Tensor:
    return q.view(-1, 1) * seq + kv.view(1, -1)


def balanced_layout_problem(results: list[dict[str, Any]], seq: int, world_size: int) -> str | None:
    """What breaks the layout rules (:func:`runs_problem`) in the ``balanced_layout`` every rank
    got (``results[rank]["runs"]``, and ``["layout"]``, its name, where kept), or that the ranks'
    differ although their calls were equal; None when nothing does."""
    runs = [r.get("runs") for r in results]
    if runs[0] is None:
        return "balanced_layout returned no runs"
    problem = runs_problem(runs[0], seq, world_size)
    layouts = sorted({str(r.get("layout")) for r in results})
    if problem is None and (len(layouts) != 1 or any(rr != runs[0] for rr in runs)):
        problem = (
            f"the ranks got different layouts ({layouts}) or runs from equal balanced_layout calls"
        )
    return problem


def balanced_results(ring, case: BalanceCase, rank_fn: Callable) -> list[dict[str, Any]]:
    """Every rank's ``rank_fn(case)``, after failing the test where the ranks' ``balanced_layout``
    breaks the layout rules (:func:`runs_problem`) or differs between ranks. A protocol error
    (``balanced_layout`` missing or returning something else) fails the test too."""
    __tracebackhide__ = True
    try:
        results = ring.rank_pool(case.world_size).run(rank_fn, case, timeout=ring.timeout_for(case))
    except ProtocolError as exc:
        pytest.fail(str(exc), pytrace=False)
    problem = balanced_layout_problem(results, case.inputs.seq_q, case.world_size)
    if problem:
        pytest.fail(
            f"{case.layout_text} breaks the layout rules: {problem} [{case.label}]\n"
            f"repro: {ring.repro()}",
            pytrace=False,
        )
    return results


def checked_work(
    ring, case: BalanceCase, per_rank: list[dict[str, Any]], spec=None, *, what: str = ""
) -> list[int]:
    """The attention work per rank (score entries counted by the op), after failing the test
    where the ranks' kernel calls do not compute exactly the pairs the mask (``spec``, default
    the case's family: :func:`judge_pairs`) shows, or the counting op's figure differs from
    them. ``what``: the mask, for the messages."""
    __tracebackhide__ = True
    findings, visible, diagnoses = judge_pairs(case, per_rank, spec)
    on = f"{what}: " if what else ""
    if findings:
        more = len(findings) - 8
        lines = [f.what for f in findings[:8]] + ([f"... {more} more blocks"] if more > 0 else [])
        pytest.fail(
            f"{on}the kernel calls do not compute exactly the pairs the mask shows on global "
            f"positions [{case.label}]:\n"
            + "\n".join(f"  {line}" for line in lines)
            + "".join(f"\n{d}" for d in diagnoses)
            + f"\nrepro: {ring.repro()}",
            pytrace=False,
        )
    work = [r["work"] for r in per_rank]
    if work != visible:
        pytest.fail(
            f"{on}attention work per rank {work} (score entries counted by the op) differs from "
            f"the visible pairs {visible} its calls computed [{case.label}]: the counting op's "
            f"figure and the calls disagree\nrepro: {ring.repro()}",
            pytrace=False,
        )
    return work


def judge_pairs(
    case: BalanceCase, results: list[dict[str, Any]], spec: dict[str, Any] | None = None
) -> tuple[list[BlockFinding], list[int], list[str]]:
    """Compare every rank's recorded kernel calls with the mask on global positions (``spec``,
    plain data; default: the case's family).

    Returns (findings per block, visible pairs per rank, diagnoses naming a known bug class).
    """
    if spec is None:
        spec = family_spec(case.family, case.inputs.seq_q, case.world_size)
    seq, w = case.inputs.seq_q, case.world_size
    runs = results[0]["runs"]
    pos = [runs_positions(rr) for rr in runs]
    owner = torch.empty(seq, dtype=torch.int64)
    for r, p in enumerate(pos):
        owner[p] = r
    findings: list[BlockFinding] = []
    visible_area: list[int] = []
    hidden_pairs: list[tuple[int, int]] = []  # (q, kv) computed although the mask hides them
    computed_all: dict[tuple[int, int], torch.Tensor] = {}
    for r, res in enumerate(results):
        expected = {
            j: visibility(spec, len(pos[r]), len(pos[j]), q_positions=pos[r], k_positions=pos[j])[
                0, 0
            ]
            for j in range(w)
        }
        visible_area.append(sum(int(e.sum()) for e in expected.values()))
        count = {j: torch.zeros_like(expected[j], dtype=torch.int64) for j in range(w)}
        calls = {j: [] for j in range(w)}
        index = torch.full((seq,), -1, dtype=torch.int64)
        for j in range(w):
            index[pos[j]] = torch.arange(len(pos[j]))
        local_q = torch.full((seq,), -1, dtype=torch.int64)
        local_q[pos[r]] = torch.arange(len(pos[r]))
        for whole in res["calls"]:
            q, kv = whole["q"], whole["kv"]
            if (
                ((q < 0) | (q >= seq)).any()
                or ((kv < 0) | (kv >= seq)).any()
                or bool((local_q[q.clamp(0, seq - 1)] < 0).any())
            ):
                findings.append(
                    BlockFinding(
                        r,
                        -1,
                        "a kernel call's query rows are not this rank's tokens (the query "
                        "or value rows were altered before the kernel)",
                    )
                )
                continue
            for j, call in _split_by_owner(whole, owner):
                _count_call(r, j, call, calls, count, expected, local_q, index, hidden_pairs)
        for j in range(w):
            computed_all[(r, j)] = count[j] > 0
            step = (r - j) % w
            where = f"rank {r}, ring step {step} (key/value of rank {j})"
            need = int(expected[j].sum())
            if not calls[j]:
                if need:
                    findings.append(
                        BlockFinding(
                            r, j, f"{where}: skipped, but {need} query-key pairs are visible"
                        )
                    )
                continue
            if not need:
                findings.append(
                    BlockFinding(
                        r,
                        j,
                        f"{where}: {len(calls[j])} kernel call(s) computed, but no query of this "
                        "rank sees any key of that block under the mask",
                    )
                )
                continue
            diag = _full_block_as_causal(calls[j], expected[j], local_q, index)
            if diag:
                findings.append(BlockFinding(r, j, f"{where}: {diag}"))
                continue
            hidden = (count[j] > 0) & ~expected[j]
            missing = expected[j] & (count[j] == 0)
            twice = count[j] > 1
            parts = []
            if bool(hidden.any()):
                parts.append(f"{int(hidden.sum())} pairs the mask hides were computed")
            if bool(missing.any()):
                parts.append(f"{int(missing.sum())} of {need} visible pairs were never computed")
            if bool(twice.any()):
                parts.append(f"{int(twice.sum())} pairs were computed more than once")
            idle = sum(
                1
                for call in calls[j]
                if not bool(
                    (call["computed"] & expected[j][local_q[call["q"]]][:, index[call["kv"]]]).any()
                )
            )
            if idle:  # an implementation may cut a block into several calls, but none for nothing
                parts.append(
                    f"{idle} of its {len(calls[j])} kernel calls computed no pair some query sees"
                )
            if parts:
                pair = _other_head_tail_chunk(calls[j], expected[j], runs[j], index)
                findings.append(
                    BlockFinding(
                        r, j, f"{where}: " + "; ".join(parts) + (f" ({pair})" if pair else "")
                    )
                )
    return (
        findings,
        visible_area,
        _diagnose(case, spec, runs, pos, hidden_pairs, computed_all, findings),
    )


def _split_by_owner(call: dict[str, Any], owner: torch.Tensor) -> list[tuple[int, dict[str, Any]]]:
    """A kernel call as one call per rank whose key/value rows it holds: a call over the keys of
    several ranks (a halo exchange runs one over its neighbours' edge rows and its own) computes
    a part of each of those ranks' blocks."""
    owners = owner[call["kv"]]
    parts = []
    for j in owners.unique().tolist():
        cols = (owners == j).nonzero().flatten()
        parts.append((j, {**call, "kv": call["kv"][cols], "computed": call["computed"][:, cols]}))
    return parts


def _count_call(r, j, call, calls, count, expected, local_q, index, hidden_pairs) -> None:
    """Record rank ``r``'s call on rank ``j``'s keys: its computed pairs,
    and those the mask hides."""
    q, kv, computed = call["q"], call["kv"], call["computed"]
    calls[j].append(call)
    rows, cols = local_q[q], index[kv]
    count[j].index_put_(
        (
            rows.view(-1, 1).expand_as(computed)[computed],
            cols.view(1, -1).expand_as(computed)[computed],
        ),
        torch.ones(int(computed.sum()), dtype=torch.int64),
        accumulate=True,
    )
    hidden = computed & ~expected[j][rows][:, cols]
    if bool(hidden.any()):
        qi, ki = hidden.nonzero().unbind(1)
        hidden_pairs += list(zip(q[qi].tolist(), kv[ki].tolist()))


def _full_block_as_causal(calls, expected, local_q, index) -> str:
    """A block every query sees whole, computed by one causal (diagonal) kernel call."""
    if len(calls) == 1 and calls[0]["causal"] and not calls[0]["masked"]:
        call = calls[0]
        if bool(expected[local_q[call["q"]]][:, index[call["kv"]]].all()):
            return (
                "computed with a causal (diagonal) mask, though this block is full: every query "
                "sees every key of it"
            )
    return ""


def _other_head_tail_chunk(calls, expected, kv_runs, index) -> str:
    """Calls that computed one run of a two-run key/value
    shard while the visible keys lie in the other."""
    if len(kv_runs) != 2:
        return ""
    seen_cols = expected.any(0)
    for call in calls:
        cols = index[call["kv"]]
        if bool(expected[:, cols].any()):
            continue
        (a, b), (c, d) = kv_runs
        first = int(b - a)
        took_tail = bool((cols >= first).all())
        other_seen = bool(seen_cols[:first].any()) if took_tail else bool(seen_cols[first:].any())
        if other_seen:
            have, want = ((c, d), (a, b)) if took_tail else ((a, b), (c, d))
            return (
                f"the kernel got keys {have[0]}..{have[1] - 1}, the wrong key/value chunk of the "
                f"head_tail pair; the queries see keys {want[0]}..{want[1] - 1}"
            )
    return ""


def _diagnose(case, spec, runs, pos, hidden_pairs, computed_all, findings) -> list[str]:
    """Known bug classes the recorded pairs match exactly."""
    if not findings:
        return []
    out = []
    window = _window_of(spec)
    if hidden_pairs and window is not None:
        edges = {a for rr in runs for a, _ in rr}
        left = window
        if all(kv == q - left - 1 for q, kv in hidden_pairs):
            # Block edges as the layout's runs show them; a ring may cut blocks finer (the middle
            # rank's two head_tail chunks are one run), so only the off-by-one is required.
            where = (
                "at a block edge"
                if all(kv in edges for _, kv in hidden_pairs)
                else "(at keys inside a run)"
            )
            out.append(
                f"sliding window off by one {where}: every pair computed that the mask hides is "
                f"the key one past the window (kv = q - {left} - 1) ({len(hidden_pairs)} pairs, "
                f"e.g. q={hidden_pairs[0][0]}, kv={hidden_pairs[0][1]})"
            )
    if _has_documents(spec):
        seq, w = case.inputs.seq_q, case.world_size
        local = torch.empty(seq, dtype=torch.int64)
        for p in pos:
            local[p] = torch.arange(len(p))
        if all(
            torch.equal(
                computed_all[(r, j)], _local_documents_visibility(spec, pos[r], pos[j], local, seq)
            )
            for r in range(w)
            for j in range(w)
        ):
            out.append(
                "document boundaries taken from local positions: the pairs computed are exactly "
                "those of the document ids looked up at each token's local index on its rank, not "
                "at its global position"
            )
    return out


def _window_of(spec) -> int | None:
    if spec["kind"] == "sliding_window":
        return int(spec["left"])
    if spec["kind"] == "and":
        return next((w for w in (_window_of(m) for m in spec["masks"]) if w is not None), None)
    return None


def _has_documents(spec) -> bool:
    return spec["kind"] == "document" or (
        spec["kind"] in ("and", "or") and any(_has_documents(m) for m in spec["masks"])
    )


def _local_documents_visibility(spec, q_pos, kv_pos, local, seq) -> torch.Tensor:
    """``spec`` on global positions, except that document ids are read at local indices."""
    kind = spec["kind"]
    if kind == "document":
        ids = document_ids(spec, seq)
        dq, dk = ids[local[q_pos]].view(-1, 1), ids[local[kv_pos]].view(1, -1)
        seen = (dq == dk) & (dq >= 0)
        return (
            seen & (kv_pos.view(1, -1) <= q_pos.view(-1, 1)) if spec.get("causal", True) else seen
        )
    if kind in ("and", "or"):
        parts = [_local_documents_visibility(m, q_pos, kv_pos, local, seq) for m in spec["masks"]]
        out = parts[0]
        for p in parts[1:]:
            out = out & p if kind == "and" else out | p
        return out
    return visibility(spec, len(q_pos), len(kv_pos), q_positions=q_pos, k_positions=kv_pos)[0, 0]


# ---------------------------------------------------------------------- bounds


@dataclass(frozen=True)
class Figures:
    """What a bound may depend on: world size ``w``, global length ``seq``, the window's reach
    ``left`` and the row bound ``rows`` = seq * (keys the widest row sees) / (visible pairs):
    no layout that gives each rank seq/W rows and computes only visible pairs exceeds it, since
    no rank does more than seq/W times the widest row."""

    w: int
    seq: int
    left: int
    rows: float


@dataclass(frozen=True)
class Bound:
    limit: Callable[[Figures], float]
    unbalanced: bool = False  # the known-unbalanced cases: held only to what any layout meets
