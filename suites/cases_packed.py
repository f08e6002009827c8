"""Cases of the packed (THD) suite: ``ring_attention(q, k, v, cu_seqlens=...)`` on every rank, and
what the pytest process makes of the results.

The global inputs are the suite's usual ``(1, heads, tokens, head_dim)`` tensors
(:func:`suites.inputs.make_inputs`, batch 1) read as one packed sequence ``(tokens, heads,
head_dim)``; each rank gets the rows the layout gives it (the reference's positions,
:mod:`reference.layout`, never the implementation's sharding). ``cu_seqlens`` is global and equal
on every rank. The oracle is the float64 attention under the reference's own document mask
(:mod:`reference.masks`, ids from ``cu_seqlens``, -1 past ``cu_seqlens[-1]``): the judge is the
mask suite's, on the packed results turned back into ``(1, heads, tokens_local, ...)``.
"""

from __future__ import annotations

import functools
import json
from dataclasses import dataclass
from itertools import pairwise
from types import SimpleNamespace
from typing import Any

import torch

from conformance.implementation import load_implementation
from reference.budget import Verdict
from reference.layout import positions as reference_positions
from reference.masks import visibility
from suites.cases import RingCase, backpropagate, local_results, lse_shard, resolve_case_op
from suites.cases_masks import MaskCase, _equals_attention_under
from suites.inputs import make_inputs
from suites.judge import judge_outputs, produced

__all__ = [
    "DOCUMENTS",
    "TOKENS_PER_RANK",
    "PackedCase",
    "cu_seqlens_for",
    "document_spec",
    "judge_packed",
    "packed_case",
]

#: Tokens per rank: a multiple of 2 for head_tail's two chunks, enough for documents to cross
#: every shard edge.
TOKENS_PER_RANK = 24

#: The document sets (how ``cu_seqlens`` cuts the global sequence of ``tokens``):
#: ``crossing``: four documents of about a quarter of the sequence each, starting one token past
#: a multiple of tokens/4 (with W > 1 they cross shard edges, and head_tail chunk edges);
#: ``one_token``: one-token documents at the start, in the middle and at the end, among long
#: ones; ``padding_tail``: a one-token document, two long ones, then padding longer than a shard
#: (more than one rank holds only padding rows with contiguous).
DOCUMENTS = ("crossing", "one_token", "padding_tail")


def cu_seqlens_for(documents: str, tokens: int, world_size: int) -> list[int]:
    """The global cumulative document lengths of ``documents`` over ``tokens`` packed tokens."""
    if documents == "crossing":
        cuts = {0, tokens, *(min(tokens, tokens * i // 4 + 1) for i in (1, 2, 3))}
    elif documents == "one_token":
        half = tokens // 2
        cuts = {0, 1, 2, 3, half, half + 1, tokens - 1, tokens}
    elif documents == "padding_tail":
        padding = tokens // world_size + 3 if world_size > 1 else 3
        used = tokens - padding
        cuts = {0, 1, 1 + (used - 1) // 2, used}
    else:
        raise ValueError(f"unknown document set {documents!r}; one of {DOCUMENTS}")
    return sorted(cuts)


def document_ids(cu: list[int], tokens: int) -> list[int]:
    """Per global token, the index of its document; -1 for the padding past ``cu[-1]``."""
    ids = [-1] * tokens
    for d, (a, b) in enumerate(pairwise(cu)):
        ids[a:b] = [d] * (b - a)
    return ids


def document_spec(cu: list[int], tokens: int, causal: bool) -> dict[str, Any]:
    """The reference's plain document mask (:mod:`reference.masks`) of ``cu``."""
    return {"kind": "document", "doc_ids": document_ids(cu, tokens), "causal": causal}


@dataclass(frozen=True)
class PackedCase(RingCase):
    """``documents``: a name of :data:`DOCUMENTS`; ``cu_as``: ``"list"`` (Python ints) or
    ``"int32"`` (a 1-D int32 tensor on the rank's device); ``cuts``: the cumulative document
    lengths themselves (a Hypothesis draw, ``documents`` then only names them), None: those of
    ``documents``."""

    documents: str = "crossing"
    cu_as: str = "list"
    cuts: tuple[int, ...] | None = None

    @property
    def cu_seqlens(self) -> list[int]:
        if self.cuts is not None:
            return list(self.cuts)
        return cu_seqlens_for(self.documents, self.inputs.seq_q, self.world_size)

    def mask_case(self) -> MaskCase:
        """The equivalent 4-D masked case: the mask suite's judge and baseline run on it."""
        spec = document_spec(self.cu_seqlens, self.inputs.seq_q, self.is_causal)
        return MaskCase(
            self.inputs,
            self.world_size,
            is_causal=False,
            layout=self.layout,
            rotate_method=self.rotate_method,
            op=self.op,
            impl=self.impl,
            mask=f"packed_{self.documents}",
            mask_json=json.dumps(spec),
        )

    @property
    def label(self) -> str:
        s = self.inputs
        return (
            f"ring_attention(W={self.world_size}, {s.dtype}, causal={self.is_causal}, "
            f"rotate={self.rotate_method}, layout={self.layout}, heads={s.heads}, "
            f"heads_kv={s.heads_kv}, tokens={s.seq_q}, cu_seqlens={self.cu_seqlens} as "
            f"{self.cu_as}, return_lse={self.return_lse}, backward={self.backward})"
        )


def _packed(t: torch.Tensor) -> torch.Tensor:
    """(1, heads, tokens, dim) -> (tokens, heads, dim)."""
    return t[0].transpose(0, 1)


def packed_case(ctx, case: PackedCase) -> dict[str, Any]:
    """Rank side: shard the packed global inputs by the reference's positions, run the packed
    call (and its backward); the results as the implementation returned them (CPU)."""
    impl = load_implementation(case.impl)
    spec, w, r = case.inputs, ctx.world_size, ctx.rank
    g = make_inputs(spec)
    mine = reference_positions(case.layout, w, r, spec.seq_q)

    def shard(t: torch.Tensor) -> torch.Tensor:
        return _packed(t).index_select(0, mine).contiguous().to(ctx.device)

    q, k, v = (shard(t).requires_grad_(case.backward) for t in (g.query, g.key, g.value))
    cu: Any = case.cu_seqlens
    if case.cu_as == "int32":
        cu = torch.tensor(cu, dtype=torch.int32, device=ctx.device)
    kwargs = case.call_keywords(ctx.group, cu_seqlens=cu)
    if case.op is not None:
        kwargs["op"] = resolve_case_op(case, ctx.device)
    result = impl.obj.ring_attention(q, k, v, **kwargs)
    out, lse = result if case.return_lse else (result, None)
    if case.backward:
        dlse = lse_shard(g.grad_lse, shard, ctx.device)  # (tokens_local, heads)
        # in the packed LSE's layout: (heads, tokens_local)
        backpropagate(out, lse, shard(g.grad_out), None if dlse is None else dlse.T)
    return local_results(out, lse, q, k, v, lse_requires_grad=lse is not None and lse.requires_grad)


# ---------------------------------------------------------------------- the pytest side


def _shape_problems(case: PackedCase, results: list[dict[str, Any]]) -> list[str]:
    """The packed contract's shapes: out (tokens_local, heads, head_dim_v), LSE (heads,
    tokens_local), gradients of the inputs' shapes; a message per breach, naming a known
    wrong LSE layout."""
    s, w = case.inputs, case.world_size
    n = s.seq_q // w
    want = {
        "out": (n, s.heads, s.value_head_dim),
        "lse": (s.heads, n),
        "dq": (n, s.heads, s.head_dim),
        "dk": (n, s.heads_kv, s.head_dim),
        "dv": (n, s.heads_kv, s.value_head_dim),
    }
    problems = []
    for name in produced(case):
        for rank, res in enumerate(results):
            got = res.get(name)
            if got is None:
                problems.append(f"{name}: rank {rank} returned none (expected shape {want[name]})")
                break
            if tuple(got.shape) != want[name]:
                known = ""
                if name == "lse" and tuple(got.shape) in ((1, s.heads, n), (n, s.heads)):
                    which = (
                        "(1, heads, tokens_local)" if got.dim() == 3 else "(tokens_local, heads)"
                    )
                    known = (
                        f": the packed LSE in the layout {which} instead of (heads, "
                        "tokens_local), FlashAttention's varlen layout"
                    )
                problems.append(
                    f"{name}: rank {rank} returned shape {tuple(got.shape)}, expected "
                    f"{want[name]}{known}"
                )
                break
    return problems


def _as_4d(case: PackedCase, results: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Packed results as the mask suite's (1, heads, tokens_local, ...) / (1, heads,
    tokens_local)."""
    out = []
    for res in results:
        four = {
            k: None if res[k] is None else _packed_back(res[k]) for k in ("out", "dq", "dk", "dv")
        }
        four["lse"] = None if res["lse"] is None else res["lse"].unsqueeze(0)
        out.append(four)
    return out


def _packed_back(t: torch.Tensor) -> torch.Tensor:
    """(tokens, heads, dim) -> (1, heads, tokens, dim)."""
    return t.transpose(0, 1).unsqueeze(0)


def judge_packed(
    case: PackedCase, results: list[dict[str, Any]], baseline_op: str | None = None
) -> list[Verdict]:
    """Verdicts for out (and LSE with return_lse, dq/dk/dv with backward) against the float64
    oracle under the documents of ``cu_seqlens``; AssertionError for a broken contract (a shape,
    a padding row's LSE), naming a known bug class where the results match one exactly."""
    problems = _shape_problems(case, results)
    if problems:
        raise AssertionError(
            "the packed results break the contract:\n  "
            + "\n  ".join(problems)
            + f"\n[{case.label}]"
        )
    spec, w = case.inputs, case.world_size
    pos = [reference_positions(case.layout, w, r, spec.seq_q) for r in range(w)]
    four = _as_4d(case, results)
    data = case.mask_case().mask_data()

    @functools.cache
    def named() -> str:  # only on a failure: it runs the oracle under other documents
        return _known_wrong_documents(case, make_inputs(spec), four, pos)

    def on_lse_mismatch(differ: int) -> str:
        what = named() or (
            "rows that see no key (padding past cu_seqlens[-1]) must have LSE -inf and only they"
        )
        return f"{what}: {differ} rows differ"

    return judge_outputs(
        case,
        four,
        positions=pos,
        names=produced(case),
        visible=visibility(data, spec.seq_q, spec.seq_kv, batch=spec.batch, heads=spec.heads),
        baseline_op=baseline_op,
        on_lse_mismatch=on_lse_mismatch,
        known_failure=named,
    )


def _known_wrong_documents(
    case: PackedCase, g, four: list[dict[str, Any]], pos: list[torch.Tensor]
) -> str:
    """Name a known wrong reading of the packed inputs or ``cu_seqlens`` that the out and LSE
    match exactly, or ""."""
    if not case.return_lse:
        return ""
    masked = case.mask_case()
    tokens, w = case.inputs.seq_q, case.world_size
    cu = case.cu_seqlens
    if cu[-1] < tokens:
        as_document = document_ids([*cu, tokens], tokens)
        if _equals_attention_under(
            masked, g, four, pos, {**masked.mask_data(), "doc_ids": as_document}
        ):
            return (
                f"padding past cu_seqlens[-1] attended: the {tokens - cu[-1]} tokens from "
                f"cu_seqlens[-1]={cu[-1]} to the global token count {tokens} see each other, as "
                "one more document; they are padding, which sees nothing and is seen by nothing "
                "(out 0, LSE -inf)"
            )
    if _equals_attention_under(masked, _read_as_contiguous(g, pos), four, pos, masked.mask_data()):
        return (
            "the packed shards read as if contiguous: the out and LSE are attention over each "
            "rank's (tokens_local, heads, head_dim) memory read as (heads, tokens_local, "
            "head_dim), what a kernel that ignores the strides of the (1, heads, tokens_local, "
            "head_dim) view of a packed shard reads; wrong only with non-contiguous inputs"
        )
    if w > 1:
        # Each token's document read at its local index on its rank: cu_seqlens taken as offsets
        # into the local shard.
        local_ids = document_ids(cu, max(tokens, cu[-1]))
        ids = [0] * tokens
        for p in pos:
            for i, t in enumerate(p.tolist()):
                ids[t] = local_ids[i]
        if ids != masked.mask_data()["doc_ids"] and _equals_attention_under(
            masked, g, four, pos, {**masked.mask_data(), "doc_ids": ids}
        ):
            return (
                "cu_seqlens read as offsets into the local shard: the out and LSE are those of "
                "documents cut at each rank's local indices; cu_seqlens holds global positions "
                "of the packed sequence, equal on every rank"
            )
    return ""


def _read_as_contiguous(g, pos: list[torch.Tensor]) -> SimpleNamespace:
    """Global (1, heads, tokens, dim) query, key and value as a kernel reads them that takes each
    rank's packed (tokens_local, heads, dim) shard through a (1, heads, tokens_local, dim) view
    and ignores its strides: the shard's memory in storage order, shaped (heads, tokens_local,
    dim)."""

    def misread(t: torch.Tensor) -> torch.Tensor:
        read = torch.empty_like(t)
        heads, dim = t.shape[1], t.shape[3]
        for p in pos:
            shard = _packed(t).index_select(0, p).contiguous()  # (tokens_local, heads, dim)
            read[0, :, p] = shard.view(heads, len(p), dim)
        return read

    return SimpleNamespace(query=misread(g.query), key=misread(g.key), value=misread(g.value))
