"""Cases of the mask suite: a ring case with a mask (by name, built on the global sequence) and
optionally per-head sink logits; the rank function and the judge.

A case's layout is a built-in one or a balancer's (``document_head_tail``, ``work_aware``): then
every rank asks the implementation's ``balanced_layout`` for it, and the ranks' runs of global
positions shard the inputs and unshard the results. A case's mask is a named one
(:func:`mask_spec`) or plain data given as JSON (``mask_json``: a generated mask).

The judge holds every quantity to the numerics policy (reference.budget) against the float64
oracle with the same mask (reference.masks, written independently of ring_impl.masks), with
the single-device baseline of the same kernel given the same mask (rows that see nothing: out 0,
LSE -inf, as the contract says, whatever the kernel returns there).
"""

from __future__ import annotations

import contextlib
import itertools
import json
from dataclasses import dataclass
from typing import Any

import torch

from conformance.implementation import load_implementation
from conformance.specs import MaskSpec
from reference.budget import Verdict
from reference.layout import shard as oracle_shard
from reference.masks import visibility
from suites.cases import RingCase, backpropagate, collective_phases, lse_shard, strategy_group
from suites.cases_balance import (
    BALANCER_LAYOUTS,
    as_runs,
    balanced_layout_problem,
    runs_positions,
)
from suites.inputs import InputSpec, in_memory, make_inputs
from suites.judge import judge_outputs, unshard_by_positions

__all__ = [
    "MASK_NAMES",
    "MaskCase",
    "diagnose_masked",
    "documents",
    "judge_masked",
    "mask_spec",
    "masked_case",
    "per_head_window",
    "rank_positions",
]

MASK_NAMES = (
    "causal",
    "documents",
    "documents_full",
    "documents_with_gaps",
    "one_token_documents",
    "window_narrow",
    "window_wide",
    "chunked_causal",
    "prefix_lm",
    "documents_window",
    "prefix_lm_window",
    "mask_mod",
    "mask_mod_batch_head",
)
#: The named masks that differ between batch rows: their cases carry batch >= 2 (and heads >= 2).
BATCH_DEPENDENT = frozenset({"mask_mod_batch_head"})


def per_head_window(step: int = 3):
    """A flex-style mask_mod that depends on the head, differently for every head: head 0
    causal, head ``h > 0`` a causal window of ``step * h`` keys back (a head evaluated under
    another head's index, e.g. its index within a rank's slice of heads, shows). It closes over
    ``step`` as a tensor, as mask_mods close over documents' ids: compiled, that is data the
    graph takes as an input, and :func:`other_mask_data` gives the same function over another
    ``step``."""
    steps = torch.tensor(step)

    def per_head_window_mod(b, h, q_idx, kv_idx):
        return (kv_idx <= q_idx) & ((h == 0) | (kv_idx >= q_idx - steps * h))

    per_head_window_mod.step = step
    return per_head_window_mod


def batch_head_window(step: int = 2):
    """A flex-style mask_mod that differs for every (batch row, head): a causal window of
    ``step * (1 + h + 2 b)`` keys back. A mask evaluated at batch 0 for every batch row (as
    ``create_block_mask(B=None)`` does), or at head 0 for every head, shows on every row but the
    first. Closes over ``step`` as a tensor (compiled: data, a graph input); as plain data
    ``{"kind": "batch_head_window", "step": step}`` (:func:`materialized`)."""
    steps = torch.tensor(step)

    def batch_head_window_mod(b, h, q_idx, kv_idx):
        return (kv_idx <= q_idx) & (kv_idx >= q_idx - steps * (1 + h + 2 * b))

    batch_head_window_mod.step = step
    return batch_head_window_mod


def materialized(data: dict[str, Any]) -> dict[str, Any]:
    """Plain mask data with every ``{"kind": "batch_head_window", "step": n}`` (the JSON form
    drawn masks use) replaced by the ``mask_mod`` of :func:`batch_head_window`."""
    if data["kind"] == "batch_head_window":
        return {"kind": "mask_mod", "fn": batch_head_window(int(data["step"]))}
    if data["kind"] in ("and", "or"):
        return {**data, "masks": [materialized(m) for m in data["masks"]]}
    return data


def documents(seq: int, lengths: list[int]) -> list[int]:
    """Document ids for consecutive documents of ``lengths`` (a negative length: that many
    padding tokens), padding after the last."""
    ids, d = [], 0
    for n in lengths:
        if n < 0:
            ids += [-1] * -n
            continue
        ids += [d] * n
        d += 1
    return (ids + [-1] * seq)[:seq]


def mask_spec(name: str, seq: int) -> dict[str, Any]:
    """The plain-data mask (reference.masks) called ``name`` on a global sequence of ``seq``."""
    # Uneven documents crossing shard boundaries, one shorter than a shard, a one-token one, and
    # padding (-1) at the end.
    docs = {
        "kind": "document",
        "doc_ids": documents(seq, [5, 1, seq // 3, 2, seq // 4]),
        "causal": True,
    }
    specs: dict[str, dict[str, Any]] = {
        "causal": {"kind": "causal"},
        "documents": docs,
        "documents_full": {**docs, "causal": False},
        # padding between documents, inside shards: rows that see nothing amid rows that do
        "documents_with_gaps": {
            "kind": "document",
            "doc_ids": documents(seq, [3, -2, seq // 4, -3, seq // 3]),
            "causal": True,
        },
        "one_token_documents": {
            "kind": "document",
            "doc_ids": documents(seq, [1] * (seq - 2)),
            "causal": True,
        },
        "window_narrow": {"kind": "sliding_window", "left": max(1, seq // 12), "right": 0},
        "window_wide": {"kind": "sliding_window", "left": seq // 2, "right": 2},
        "chunked_causal": {"kind": "chunked_causal", "chunk": max(1, seq // 3)},
        "prefix_lm": {"kind": "prefix_lm", "prefix": seq // 3},
        "documents_window": {
            "kind": "and",
            "masks": [docs, {"kind": "sliding_window", "left": 3, "right": 0}],
        },
        # a window that looks forward, under a prefix seen from every query and longer than a
        # shard (W >= 2): an exchange sized by the window alone misses the prefix keys the first
        # rows see on the next rank
        "prefix_lm_window": {
            "kind": "and",
            "masks": [
                {"kind": "prefix_lm", "prefix": seq // 2 + 2},
                {"kind": "sliding_window", "left": max(1, seq // 12), "right": 2},
            ],
        },
        "mask_mod": {"kind": "mask_mod", "fn": per_head_window()},
        "mask_mod_batch_head": {"kind": "mask_mod", "fn": batch_head_window()},
    }
    return specs[name]


def other_mask_data(data: dict[str, Any]) -> dict[str, Any]:
    """A mask of the same kinds as ``data`` (reference.masks' plain form) that sees differently:
    documents' boundaries one position later, windows, chunks and prefixes one wider, the first
    part of an ``and``/``or`` changed, :func:`per_head_window` over a step one longer;
    ``causal``, ``full`` and other ``mask_mod`` functions stay as they are."""
    kind = data["kind"]
    if kind == "document" and "doc_ids" in data:
        ids = list(data["doc_ids"])
        return {**data, "doc_ids": ids[:1] + ids[:-1]}  # non-decreasing (padding aside) as before
    if kind == "sliding_window":
        return {**data, "left": (data.get("left") or 0) + 1}
    if kind == "chunked_causal":
        return {**data, "chunk": data["chunk"] + 1}
    if kind == "prefix_lm":
        return {**data, "prefix": data["prefix"] + 1}
    if kind in ("and", "or"):
        return {**data, "masks": [other_mask_data(data["masks"][0]), *data["masks"][1:]]}
    if kind == "mask_mod" and hasattr(data["fn"], "step"):
        make = (
            batch_head_window if data["fn"].__name__ == "batch_head_window_mod" else per_head_window
        )
        return {**data, "fn": make(data["fn"].step + 1)}
    return data


@dataclass(frozen=True)
class MaskCase(RingCase):
    """``mask``: a name of :data:`MASK_NAMES`, or a label for ``mask_json`` (a generated mask's
    plain data, reference.masks' form, as JSON). ``layout``: built in, or a balancer's name
    (:data:`suites.cases_balance.BALANCER_LAYOUTS`)."""

    mask: str = "causal"
    sinks: bool = False
    mask_json: str = ""
    #: a documents mask whose ids live in an int32 buffer the rank refills in place between two
    #: calls (as a data pipeline refills a ``torch.from_numpy`` buffer: torch's version counter
    #: does not move); the second call, on the same mask object, is judged
    refill: bool = False

    @property
    def balancer(self) -> str | None:
        return self.layout if self.layout in BALANCER_LAYOUTS else None

    def mask_data(self) -> dict[str, Any]:
        """The mask's plain data (reference.masks) on the case's global sequence."""
        return (
            materialized(json.loads(self.mask_json))
            if self.mask_json
            else mask_spec(self.mask, self.inputs.seq_q)
        )

    @property
    def label(self) -> str:
        data = f", mask_data={self.mask_json}" if self.mask_json else ""
        refill = ", ids refilled in place after a first call" if self.refill else ""
        return (
            RingCase.label.fget(self)[:-1]  # type: ignore[attr-defined]
            + f", mask={self.mask}, sinks={self.sinks}{data}{refill})"
        )


def _sinks(spec: InputSpec) -> torch.Tensor:
    """(heads,) sink logits, a parameter in float32 (float64 for a float64 case): its gradient
    comes back in that dtype."""
    gen = torch.Generator().manual_seed(spec.seed + 1)
    s = torch.randn(spec.heads, generator=gen, dtype=torch.float64)
    return s if spec.torch_dtype == torch.float64 else s.float()


def optional_keywords(
    case: RingCase, sinks: torch.Tensor | None, device: torch.device
) -> dict[str, Any]:
    """The ``ring_attention`` keywords a masked or scored case passes only when it has them:
    ``strategy`` on a mesh, ``sinks`` (this rank's (heads,) sink logits), ``op`` (the case's
    kernel, resolved on ``device``, the rank's)."""
    kwargs: dict[str, Any] = {}
    if case.mesh_shape is not None:
        kwargs["strategy"] = case.strategy
    if sinks is not None:
        kwargs["sinks"] = sinks
    if case.op is not None:
        from suites.cases import resolve_case_op

        kwargs["op"] = resolve_case_op(case, device)
    return kwargs


def call_with_sinks(
    attention,
    q,
    k,
    v,
    dout,
    sinks,
    kwargs: dict[str, Any],
    *,
    account: bool = False,
    dlse: torch.Tensor | None = None,
) -> dict[str, Any]:
    """This rank's call ``attention(q, k, v, **kwargs)`` (returning out and LSE) and its backward
    from ``dout`` (and ``dlse``, the LSE's gradient, when the loss uses it): out, lse, dq, dk, dv,
    ``lse_requires_grad`` and ``dsinks`` (the gradient of this rank's ``sinks``, None without), on
    CPU; with ``account``, ``collectives``: what the rank issued per phase (harness.accounting's
    summary)."""
    with contextlib.ExitStack() as stack:
        log, phase = collective_phases(stack, account)
        with phase("forward"):
            out, lse = attention(q, k, v, **kwargs)
        with phase("backward"):
            backpropagate(out, lse, dout, dlse)
    return {
        "lse_requires_grad": lse.requires_grad,
        "out": out.detach().cpu(),
        "lse": lse.detach().cpu(),
        "dq": q.grad.cpu(),
        "dk": k.grad.cpu(),
        "dv": v.grad.cpu(),
        "dsinks": None if sinks is None else sinks.grad.cpu(),
        "collectives": None if log is None else log.summary(),
    }


def oracle_attention(case: RingCase, g, visible: torch.Tensor | None, **options: Any):
    """The float64 oracle's attention (``reference.attention``: out, LSE) of the case's global
    inputs ``g`` (:func:`suites.inputs.make_inputs`) under ``visible`` ((batch or 1, heads or 1,
    seq_q, seq_kv) bool, None: every key), with the case's sinks (``case.sinks``) and scale;
    ``options``: the oracle's other keywords (``score_mod=``)."""
    from reference import attention

    spec = case.inputs
    return attention(
        g.query,
        g.key,
        g.value,
        visible=visible,
        sinks=_sinks(spec) if case.sinks else None,
        scale=spec.scale,
        **options,
    )


def case_shard(case: RingCase, rank: int):
    """``shard(t)``: this rank's shard of a global (batch, heads, seq, dim) tensor of ``case``,
    by its strategy's mesh or, without one, by its built-in layout."""
    if case.mesh_shape is not None:
        from reference.strategies import shard as strategy_shard

        mesh = case.mesh_shape
        return lambda t: strategy_shard(t, case.strategy, case.layout, mesh, rank).contiguous()
    return lambda t: oracle_shard(t, case.layout, case.world_size, rank)


def sharded_inputs(case: RingCase, g, shard, device):
    """(q, k, v, dout, dlse, sinks) of this rank: the global inputs ``g`` cut by ``shard`` in the
    memory the spec asks for (a (batch, seq, heads, dim) model's transposed views, a head dim of
    stride 2), q/k/v leaves that require grad, the LSE gradient's rows (None without one), and
    the case's sinks as a leaf (None without)."""
    spec = case.inputs
    q, k, v = (
        in_memory(shard(t).to(device), spec).detach().requires_grad_()
        for t in (g.query, g.key, g.value)
    )
    dout = in_memory(shard(g.grad_out).to(device), spec)
    dlse = lse_shard(g.grad_lse, shard, device)
    sinks = _sinks(spec).to(device).requires_grad_() if getattr(case, "sinks", False) else None
    return q, k, v, dout, dlse, sinks


def masked_case(ctx, case: MaskCase) -> dict[str, Any]:
    """Run the case on this rank: local out, lse, dq, dk, dv (CPU) and this rank's dsinks."""
    # First: creating the hybrid's mesh is a collective.
    group = strategy_group(ctx, case.strategy, case.mesh_shape) if case.mesh_shape else ctx.group
    impl = load_implementation(case.impl)
    spec = case.inputs
    g = make_inputs(spec)
    w, r = ctx.world_size, ctx.rank
    mask = MaskSpec(case.mask_data())
    layout, runs, shard = case.layout, None, case_shard(case, r)
    if case.balancer is not None:  # the implementation's balancer builds the layout on every rank
        layout, runs = impl.obj.balanced_layout(case.balancer, mask, spec.seq_q, w)
        runs = as_runs(runs)
        mine = runs_positions(runs[r])

        def shard(t: torch.Tensor) -> torch.Tensor:
            return t.index_select(2, mine)

    q, k, v, dout, dlse, sinks = sharded_inputs(case, g, shard, ctx.device)
    kwargs = case.call_keywords(group, is_causal=False, layout=layout, return_lse=True, mask=mask)
    kwargs.update(optional_keywords(case, sinks, ctx.device))
    attention = impl.obj.ring_attention
    if case.refill:
        mask = _refilled_documents(attention, q, k, v, kwargs, case.mask_data())
        kwargs["mask"] = mask
    if case.compile:
        # Ranks live across cases: a reset keeps dynamo's recompile limit for this case's masks.
        torch._dynamo.reset()
        attention = torch.compile(attention, backend=case.compile, fullgraph=True)
        # First the same kind of mask with other data (documents' ids, a window's width), whose
        # result is dropped: a graph that baked that mask's plan in would serve it to the next.
        warm = attention(q, k, v, **{**kwargs, "mask": MaskSpec(other_mask_data(case.mask_data()))})
        del warm
    results = call_with_sinks(
        attention, q, k, v, dout, sinks, kwargs, account=case.account, dlse=dlse
    )
    return {**results, "runs": runs}


def _refilled_documents(attention, q, k, v, kwargs: dict[str, Any], data: dict[str, Any]):
    """A documents mask over an int32 numpy buffer: one call with other ids (its result dropped),
    then the buffer refilled in place with the case's ids (a numpy write, which torch's version
    counter does not see). Returns the same mask object, now holding the case's ids."""
    import numpy as np

    if data["kind"] != "document" or "doc_ids" not in data:
        raise ValueError(
            f"a refill case needs a plain documents mask with doc_ids, got kind {data['kind']!r}"
        )
    buffer = np.asarray(other_mask_data(data)["doc_ids"], dtype=np.int32)
    mask = MaskSpec(
        {
            "kind": "document",
            "doc_ids": torch.from_numpy(buffer),
            "causal": bool(data.get("causal", True)),
        }
    )
    with torch.no_grad():
        attention(q, k, v, **{**kwargs, "mask": mask})
    buffer[:] = np.asarray(data["doc_ids"], dtype=np.int32)
    return mask


def rank_positions(case: MaskCase, results: list[dict[str, Any]]) -> list[torch.Tensor]:
    """Per rank, the global positions of its local rows: the built-in layout's (the reference's
    own), or the runs the balancer gave every rank (held to the layout rules, and equal on
    every rank: AssertionError otherwise)."""
    from reference.layout import positions

    w, seq = case.world_size, case.inputs.seq_q
    if case.mesh_shape is not None:
        from reference.strategies import positions as strategy_positions

        return [
            strategy_positions(case.strategy, case.layout, case.mesh_shape, r, seq)
            for r in range(w)
        ]
    if case.balancer is None:
        return [positions(case.layout, w, r, seq) for r in range(w)]
    problem = balanced_layout_problem(results, seq, w)
    if problem:
        raise AssertionError(
            f"the {case.balancer} balancer's layout breaks the layout rules: {problem} "
            f"[{case.label}]"
        )
    return [runs_positions(rr) for rr in results[0]["runs"]]


def judge_masked(
    case: MaskCase, results: list[dict[str, Any]], baseline_op: str | None = None
) -> list[Verdict]:
    """Verdicts for out, lse, dq, dk, dv (and dsinks) of a masked case."""
    spec = case.inputs
    pos = rank_positions(case, results)

    def on_lse_mismatch(differ: int) -> str:
        g = make_inputs(spec)
        return (
            _stale_documents(case, g, results, pos)
            or _tail_padding_attended(case, g, results, pos)
            or _lengths_rounded_down(case, g, results, pos)
            or _mask_rewritten(case, g, results, pos)
            or _mask_dropped_for_causal(case, g, results, pos)
            or _mask_rows_from_the_start(case, g, results, pos)
            or f"rows that see no key must have LSE -inf and only they: {differ} rows differ"
        )

    return judge_outputs(
        case,
        results,
        positions=pos,
        visible=visibility(
            case.mask_data(), spec.seq_q, spec.seq_kv, batch=spec.batch, heads=spec.heads
        ),
        sinks=_sinks(spec) if case.sinks else None,
        baseline_op=baseline_op,
        call="masked ring_attention",
        on_lse_mismatch=on_lse_mismatch,
    )


def _with_document_ids(data: dict[str, Any], change) -> dict[str, Any] | None:
    """``data`` (a plain mask) with the ``doc_ids`` of every document mask in it (inside
    ``and``/``or`` too) replaced by ``change(ids)``; None when ``change`` returns None (no change)
    for all of them."""
    kind = data["kind"]
    if kind in ("and", "or"):
        parts = [_with_document_ids(m, change) for m in data["masks"]]
        if all(p is None for p in parts):
            return None
        return {**data, "masks": [m if p is None else p for m, p in zip(data["masks"], parts)]}
    if kind != "document" or "doc_ids" not in data:
        return None
    ids = change(list(data["doc_ids"]))
    return None if ids is None else {**data, "doc_ids": ids}


def _tail_padding(ids: list[int]) -> int:
    """How many padding tokens (-1) follow the last document; 0 with no document at all."""
    n = len(ids) - len(list(itertools.dropwhile(lambda i: i < 0, reversed(ids))))
    return 0 if n == len(ids) else n


def _with_tail_padding_as_document(data: dict[str, Any]) -> dict[str, Any] | None:
    """``data`` with the padding after the last document (ids -1 at the end of ``doc_ids``) taken
    as one more document; None when no document mask in it has such padding."""

    def change(ids: list[int]) -> list[int] | None:
        n = _tail_padding(ids)
        return ids[:-n] + [max(ids[:-n]) + 1] * n if n else None

    return _with_document_ids(data, change)


def _with_lengths_rounded_down(data: dict[str, Any], multiple: int = 2) -> dict[str, Any] | None:
    """``data`` with every document's length rounded down to a multiple of ``multiple`` and the
    documents packed again from the start (padding runs keep their length; what is freed at the
    end becomes padding); None when no document mask in it changes."""

    def change(ids: list[int]) -> list[int] | None:
        packed: list[int] = []
        for doc, run in itertools.groupby(ids):
            n = len(list(run))
            packed += [doc] * (n if doc < 0 else n // multiple * multiple)
        packed += [-1] * (len(ids) - len(packed))
        return None if packed == ids else packed

    return _with_document_ids(data, change)


def _equals_attention_under(
    case: MaskCase,
    g,
    results: list[dict[str, Any]],
    pos: list[torch.Tensor],
    data: dict[str, Any] | torch.Tensor,
) -> bool:
    """Whether the ranks' out and LSE are attention under the mask ``data`` (plain form, or its
    visibility ``(batch, heads, seq_q, seq_kv)``): rows that see nothing exactly, the others
    within 1% of the largest output."""
    spec = case.inputs
    vis = (
        data
        if isinstance(data, torch.Tensor)
        else visibility(data, spec.seq_q, spec.seq_kv, batch=spec.batch, heads=spec.heads)
    )
    wrong = oracle_attention(case, g, vis)
    out = unshard_by_positions([r["out"] for r in results], pos).to(torch.float64)
    lse = unshard_by_positions([r["lse"] for r in results], pos).to(torch.float64)
    if not torch.equal(torch.isneginf(lse), torch.isneginf(wrong.lse)):
        return False
    tol = 1e-2 * max(1.0, float(wrong.out.abs().max()))
    seen = torch.isfinite(wrong.lse)
    lse_err = (
        (lse - wrong.lse).masked_fill(~seen, 0.0).abs().max()
    )  # rows that see nothing: -inf on both sides
    return float((out - wrong.out).abs().max()) <= tol and float(lse_err) <= tol


#: How the diagnosis names a mask dropped and plain causal attention run in its place (the
#: meta-tests' expected pattern).
MASK_DROPPED = "the mask was dropped and plain causal attention ran"
#: How the diagnosis names a window over packed documents clamped to the stream's start.
WINDOW_ACROSS_DOCUMENTS = "the window was clamped to the stream start, not the document start"


def _mask_dropped_for_causal(
    case: MaskCase, g, results: list[dict[str, Any]], pos: list[torch.Tensor]
) -> str:
    """Name the bug class 'a layer's mask dropped under context parallelism and replaced by plain
    causal attention', or "": the out and LSE are causal attention where the mask is not."""
    spec = case.inputs
    causal = {"kind": "causal"}
    shape = dict(batch=spec.batch, heads=spec.heads)
    data = case.mask_data()
    if torch.equal(
        visibility(data, spec.seq_q, spec.seq_kv, **shape),
        visibility(causal, spec.seq_q, spec.seq_kv, **shape),
    ) or not _equals_attention_under(case, g, results, pos, causal):
        return ""
    return (
        f"{MASK_DROPPED}: the out and LSE are causal attention over the whole sequence, not "
        f"attention under the case's mask ({data['kind']}). A context-parallel hook that keeps "
        "is_causal and drops the attention mask, or reads a window from a field the model does "
        "not set, trains the layer with full causal attention: every rank's call must carry the "
        "mask"
    )


#: How the diagnosis names a mask whose rows were read from the sequence's start on every rank.
MASK_ROWS_FROM_THE_START = "the mask's rows were read at the queries' local indices"


def _mask_rows_from_the_start(
    case: MaskCase, g, results: list[dict[str, Any]], pos: list[torch.Tensor]
) -> str:
    """Name the bug class 'a mask or indexer padded to the global length where the local shard's
    length was meant': the out and LSE are attention under the mask with each rank's query rows
    taken from the sequence's first positions (row ``i`` of the rank's shard sees what position
    ``i`` sees), or ""."""
    spec = case.inputs
    true = visibility(case.mask_data(), spec.seq_q, spec.seq_kv, batch=spec.batch, heads=spec.heads)
    altered = true.clone()
    for rows in pos:
        altered[:, :, rows] = true[:, :, : rows.numel()]
    if torch.equal(altered, true) or not _equals_attention_under(case, g, results, pos, altered):
        return ""
    return (
        f"{MASK_ROWS_FROM_THE_START}: each rank's query i saw what global position i sees, the "
        "rows at the sequence's start, not the rank's own rows (a mask or index built or padded "
        "to the global length and cut from its start where the rank's rows, or the shard's "
        "length, were meant); a rank's rows are the mask at the global positions its layout "
        "gives it"
    )


def _lengths_rounded_down(
    case: MaskCase, g, results: list[dict[str, Any]], pos: list[torch.Tensor]
) -> str:
    """Name the bug class 'odd document lengths rounded down', or ""."""
    altered = _with_lengths_rounded_down(case.mask_data())
    if altered is None or not _equals_attention_under(case, g, results, pos, altered):
        return ""
    return (
        "document lengths rounded down to even: the out and LSE are those of the documents packed "
        "again with each odd length one token shorter (boundaries after them shifted, the freed "
        "tokens at the end padding); every token of a document of any length belongs to it"
    )


def _tail_padding_attended(
    case: MaskCase, g, results: list[dict[str, Any]], pos: list[torch.Tensor]
) -> str:
    """Name the bug class 'tail padding ignored when detecting padding': the out and LSE are
    those of a mask whose padding after the last document forms a document of its own (the
    padding tokens see each other), or ""."""
    altered = _with_tail_padding_as_document(case.mask_data())
    if altered is None or not _equals_attention_under(case, g, results, pos, altered):
        return ""
    padding = max(
        _tail_padding(m["doc_ids"]) for m in _document_parts(case.mask_data()) if "doc_ids" in m
    )
    return (
        f"tail padding attended: the {padding} padding tokens after the last document see each "
        "other, as if they were one more document (padding detected before or between documents "
        "only); padding tokens see nothing and are seen by nothing, wherever they are"
    )


def _stale_documents(
    case: MaskCase, g, results: list[dict[str, Any]], pos: list[torch.Tensor]
) -> str:
    """Name the bug class 'stale documents after an in-place refill', or ""."""
    if not case.refill or not _equals_attention_under(
        case, g, results, pos, other_mask_data(case.mask_data())
    ):
        return ""
    return (
        "stale documents: the second call ran the documents its mask's ids held at the first "
        "call; the ids were refilled in place (an int32 buffer written through numpy, which "
        "torch's version counter does not see) and a plan or a converted copy of the ids was "
        "served again: a call must plan with the ids as they are when it starts"
    )


def _each_leaf(change):
    """A rewrite of a whole plain mask: every leaf replaced by ``change(leaf)`` (a leaf it returns
    as it is stays), inside ``and``/``or`` too."""

    def rewrite(data: dict[str, Any]) -> dict[str, Any]:
        if data["kind"] in ("and", "or"):
            return {**data, "masks": [rewrite(m) for m in data["masks"]]}
        return change(data)

    return rewrite


def _at_index_zero(which: str):
    """A leaf change: every mask_mod evaluated with
    its batch (``which="batch"``) or head index 0."""

    def change(leaf: dict[str, Any]) -> dict[str, Any]:
        if leaf["kind"] != "mask_mod":
            return leaf
        fn = leaf["fn"]
        if which == "batch":
            return {**leaf, "fn": lambda b, h, q, kv: fn(torch.zeros_like(b), h, q, kv)}
        return {**leaf, "fn": lambda b, h, q, kv: fn(b, torch.zeros_like(h), q, kv)}

    return change


def _window_right_dropped(leaf: dict[str, Any]) -> dict[str, Any]:
    if leaf["kind"] == "sliding_window" and leaf.get("right"):
        return {**leaf, "right": 0}
    return leaf


def _window_from_stream_start(data: dict[str, Any]) -> dict[str, Any]:
    """``data`` with every window over packed documents (an ``and`` of a document mask and a
    sliding window) opened across document starts: the documents merged into one stream (the
    padding still padding), so a query near its document's start sees the previous document's
    last keys inside its window, as a window bound ``max(q - left, 0)`` on stream positions
    gives them."""
    if data["kind"] not in ("and", "or"):
        return data
    parts = [_window_from_stream_start(m) for m in data["masks"]]
    if data["kind"] == "and" and {m["kind"] for m in parts} >= {"document", "sliding_window"}:
        parts = [
            {**m, "doc_ids": [0 if i >= 0 else -1 for i in m["doc_ids"]]}
            if m["kind"] == "document" and "doc_ids" in m
            else m
            for m in parts
        ]
    return {**data, "masks": parts}


#: (rewrite, message): a mask evaluated on the wrong axis, cut short or opened across documents,
#: which the output equals
_MASK_REWRITES = (
    (
        _each_leaf(_at_index_zero("batch")),
        "the mask was evaluated at batch 0 for every batch row (as create_block_mask(B=None) "
        "builds it): a mask_mod that depends on the batch index must be evaluated at each row's "
        "own index",
    ),
    (
        _each_leaf(_at_index_zero("head")),
        "the mask was evaluated at head 0 for every head (as create_block_mask(H=None) builds "
        "it): a mask_mod that depends on the head must be evaluated at each head's own index",
    ),
    (
        _each_leaf(_window_right_dropped),
        "the sliding window's right side was dropped: keys after the query that the window shows "
        "are missing (SlidingWindow(left, right) shows q - left <= kv <= q + right)",
    ),
    (
        _window_from_stream_start,
        f"{WINDOW_ACROSS_DOCUMENTS}: queries near a document's start see the previous document's "
        "last keys inside their window, as a window start max(q - left, 0) on stream positions "
        "gives them; a window over packed documents starts at max(q - left, the document's "
        "start)",
    ),
)


def _mask_rewritten(
    case: MaskCase, g, results: list[dict[str, Any]], pos: list[torch.Tensor]
) -> str:
    """Name a mask evaluated on the wrong axis (batch or head 0 for all), a window missing its
    right side, or a window clamped to the stream start instead of its document's, when the
    output is attention under that mask and that mask differs; or ""."""
    spec = case.inputs
    data = case.mask_data()
    dims = dict(batch=spec.batch, heads=spec.heads)
    true = visibility(data, spec.seq_q, spec.seq_kv, **dims)
    for rewrite, message in _MASK_REWRITES:
        altered = rewrite(data)
        if torch.equal(visibility(altered, spec.seq_q, spec.seq_kv, **dims), true):
            continue  # the same mask: says nothing
        if _equals_attention_under(case, g, results, pos, altered):
            return message
    return ""


def _document_parts(data: dict[str, Any]):
    """The ``document`` masks in ``data`` (inside ``and``/``or`` too)."""
    if data["kind"] in ("and", "or"):
        for m in data["masks"]:
            yield from _document_parts(m)
    elif data["kind"] == "document":
        yield data


def diagnose_masked(case: MaskCase, results: list[dict[str, Any]]) -> str:
    """Name the mask bug classes the output's errors point at, or ""."""
    from reference import attention

    spec, w = case.inputs, case.world_size
    g = make_inputs(spec)
    vis = visibility(case.mask_data(), spec.seq_q, spec.seq_kv, batch=spec.batch, heads=spec.heads)
    ref = oracle_attention(case, g, vis)
    pos = rank_positions(case, results)
    got = unshard_by_positions([r["out"] for r in results], pos).to(torch.float64)
    invented = ~torch.isfinite(got) & torch.isfinite(ref.out)
    if bool(invented.any()):
        rows = sorted({int(i) for i in invented.nonzero()[:, 2].tolist()})[:8]
        return (
            f"NaN/inf where the reference is finite (global rows {rows}...) with finite inputs: a "
            "merge that exponentiates LSEs breaks on rows nothing has reached yet (LSE -inf) or "
            "that a block hides; an exp of the LSE (or of raw scores) overflowed, or -inf - -inf "
            "became NaN: merge with bounded exponentials and give a block's LSE -inf weight 0"
            + (
                f"; or, with this scale {spec.scale:g} <= 0, a causal kernel call on a kernel "
                "whose causal path returns NaN there (the CPU flash kernel): run such blocks "
                "with a mask or another kernel"
                if spec.scale is not None and spec.scale <= 0
                else ""
            )
        )
    # On a head-parallel mesh a mask at each rank's own head index is the narrower cause (with one
    # head per rank it is also "head 0 for every head"): named first.
    named = (
        _stale_documents(case, g, results, pos)
        or (
            _diagnose_head_parallel(case, g, vis, got, ref.out)
            if case.mesh_shape is not None
            else ""
        )
        or _mask_rewritten(case, g, results, pos)
        # (after the narrower causes: a per-head mask_mod whose head 0 is causal, evaluated at
        # head 0 for every head, is causal attention too)
        or _mask_dropped_for_causal(case, g, results, pos)
        or _mask_rows_from_the_start(case, g, results, pos)
        # With sinks no row's LSE is -inf, so the judge's -inf comparison cannot name these.
        or _tail_padding_attended(case, g, results, pos)
        or _lengths_rounded_down(case, g, results, pos)
    )
    if named:
        return named
    if case.sinks:  # ranks whose rows are attention without the sink term
        plain = attention(g.query, g.key, g.value, visible=vis, scale=spec.scale).out
        tol = 1e-3 * max(1.0, float(ref.out.abs().max()))
        dropped = []
        for r in range(w):
            rows = pos[r]
            mine, want, without = got[:, :, rows], ref.out[:, :, rows], plain[:, :, rows]
            off = float((mine - want).abs().max())
            # Nearer attention without the sinks than with them, by more than a low-precision
            # dtype's rounding could make it (bfloat16 rows are 1e-2 off either way).
            if off > tol and float((mine - without).abs().max()) <= off / 4:
                dropped.append(r)
        if dropped:
            return (
                f"the rows of rank(s) {dropped} equal attention without the sink term: the sinks "
                "were not applied on those ranks (every rank adds exp(sink) to each row's "
                "softmax)"
            )
    if (
        case.balancer is not None
    ):  # forward right, gradients wrong: only the backward saw another layout
        from reference import attention_grads

        grads = attention_grads(
            g.query,
            g.key,
            g.value,
            g.grad_out,
            visible=vis,
            sinks=_sinks(spec) if case.sinks else None,
            scale=spec.scale,
        )

        def off(name: str, want: torch.Tensor) -> bool:
            mine = unshard_by_positions([r[name] for r in results], pos).to(torch.float64)
            return float((mine - want).abs().max()) > 1e-2 * max(1.0, float(want.abs().max()))

        if not off("out", ref.out) and any(off(n, getattr(grads, n)) for n in ("dq", "dk", "dv")):
            return (
                f"out is right but the gradients are not, in the {case.balancer} balancer's "
                "layout: the backward did not run the layout the forward ran (it must plan the "
                "same runs of global positions, not a built-in layout's)"
            )
    if case.mesh_shape is not None:
        return _diagnose_head_parallel(case, g, vis, got, ref.out)
    row_err = (got - ref.out).abs().amax(dim=(0, 1, 3))  # (seq,)
    bad = row_err > 1e-2 * max(1.0, float(ref.out.abs().max()))
    if not bool(bad.any()):
        return ""
    # Rows that see something, but nothing at all of some rank's key/value shard that other
    # rows of their own shard do see: the ring computes that block for them with a mask that
    # hides their whole row.
    seen = vis.any(0).any(0)  # (seq_q, seq_kv)
    hidden_somewhere = torch.zeros(spec.seq_q, dtype=torch.bool)
    for r in range(w):
        q_pos = pos[r]
        for kv_r in range(w):
            k_pos = pos[kv_r]
            block = seen[q_pos][:, k_pos]
            if bool(block.any()):
                hidden_somewhere[q_pos] |= ~block.any(1)
    if bool(hidden_somewhere[bad].all()) and not bool(bad[~hidden_somewhere].any()):
        return (
            "every wrong row is one that a rank's key/value block it shares a computed block with "
            "hides completely: rows a masked block hides must merge as nothing (LSE -inf), not as "
            "the kernel returns them (the CPU flash kernel gives out 0, LSE 0)"
        )
    return ""


def _diagnose_head_parallel(
    case: MaskCase, g, vis: torch.Tensor, got: torch.Tensor, want: torch.Tensor
) -> str:
    """Ulysses / hybrid: a head-dependent mask evaluated at each rank's own head index (0 ..
    H/U - 1) instead of the global one. (The ring's block heuristics do not apply: a
    head-parallel rank attends more than its ring block.)"""

    heads, u = vis.shape[1], case.mesh_shape[0]
    if heads == 1 or u == 1:
        return ""
    local = vis[:, [h % (heads // u) for h in range(heads)]]
    if torch.equal(local, vis):
        return ""
    wrong = oracle_attention(case, g, local).out
    tol = 1e-2 * max(1.0, float(want.abs().max()))
    if float((got - wrong).abs().max()) <= tol < float((got - want).abs().max()):
        return (
            "the output is attention under the mask evaluated at each rank's own head index "
            f"(0..{heads // u - 1}) instead of the global head: a head-dependent mask must be "
            "planned for the heads of the rank's slice (head u * H/U + i on Ulysses rank u)"
        )
    return ""
