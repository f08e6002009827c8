"""Checks inside the suites that must be able to fail: the non-contiguous inputs check."""

from __future__ import annotations

import torch

from suites.cases import RingCase
from suites.inputs import InputSpec, local_inputs
from suites.test_shapes import noncontiguous_problems


def _strides(spec: InputSpec, world_size: int) -> list[dict]:
    """What each rank reports: the strides of the query, key and value it passed."""
    return [
        {"input_strides": [tuple(t.stride()) for t in (inp.query, inp.key, inp.value)]}
        for inp in (
            local_inputs(spec, "head_tail", world_size, r, "cpu") for r in range(world_size)
        )
    ]


def test_noncontiguous_check_fails_for_contiguous_inputs() -> None:
    spec = InputSpec(
        batch=2, heads=4, heads_kv=2, seq_q=16, seq_kv=16, head_dim=16, noncontiguous=True
    )
    case = RingCase(spec, 2, layout="head_tail")
    assert noncontiguous_problems(case, _strides(spec, 2)) == []
    contiguous = _strides(spec.with_(noncontiguous=False), 2)
    problems = noncontiguous_problems(case, contiguous)
    assert (
        len(problems) == 6
        and "rank 0: query (2, 4, 8, 16) passed with strides (512, 128, 16, 1)" in problems[0]
    )
    # a view that is non-contiguous in another way is not the (batch, seq, heads, dim) memory either
    other = [
        {"input_strides": [tuple(torch.empty(2, 16, 8, 4).permute(0, 2, 1, 3)[:, :4].stride())] * 3}
    ] * 2
    assert len(noncontiguous_problems(case, other)) == 6


def test_tail_padding_taken_as_a_document_is_the_diagnosis_hypothesis() -> None:
    """The mask the 'tail padding attended' diagnosis compares with: only the padding after the
    last document becomes one more document; leading and in-between padding stay padding."""
    from suites.cases_masks import _with_tail_padding_as_document

    docs = {"kind": "document", "doc_ids": [-1, 0, 0, -1, 1, 1, -1, -1], "causal": True}
    assert _with_tail_padding_as_document(docs)["doc_ids"] == [-1, 0, 0, -1, 1, 1, 2, 2]
    assert (
        _with_tail_padding_as_document({**docs, "doc_ids": [0, 0, -1, 1]}) is None
    )  # no tail padding
    assert (
        _with_tail_padding_as_document({**docs, "doc_ids": [-1, -1]}) is None
    )  # padding only: nothing to attend
    window = {"kind": "sliding_window", "left": 2, "right": 0}
    both = _with_tail_padding_as_document({"kind": "and", "masks": [window, docs]})
    assert both == {
        "kind": "and",
        "masks": [window, {**docs, "doc_ids": [-1, 0, 0, -1, 1, 1, 2, 2]}],
    }
    assert (
        _with_tail_padding_as_document({"kind": "and", "masks": [window, {"kind": "causal"}]})
        is None
    )


def test_lengths_rounded_down_is_the_diagnosis_hypothesis() -> None:
    """The mask the 'odd document lengths rounded down' diagnosis compares with: documents packed
    again with even lengths from the start, padding runs kept, the freed tokens at the end
    padding."""
    from suites.cases_masks import _with_lengths_rounded_down

    docs = {"kind": "document", "doc_ids": [0, 0, 0, 1, -1, -1, 2, 2, 3, 3, 3], "causal": False}
    # 0: 3 -> 2 tokens, 1: 1 -> 0, padding 2, 2: 2, 3: 3 -> 2; four tokens freed at the end
    assert _with_lengths_rounded_down(docs)["doc_ids"] == [0, 0, -1, -1, 2, 2, 3, 3, -1, -1, -1]
    assert (
        _with_lengths_rounded_down({**docs, "doc_ids": [0, 0, -1, 1, 1]}) is None
    )  # even lengths: unchanged
    both = _with_lengths_rounded_down({"kind": "or", "masks": [{"kind": "causal"}, docs]})
    assert both["masks"][1]["doc_ids"] == [0, 0, -1, -1, 2, 2, 3, 3, -1, -1, -1]
