"""The plain-data masks and score_mods the suites hand an implementation (conformance.specs), and
the default implementation's adapter that builds its own objects from them.

Each view is checked against ring_impl's own objects built from the same data, two independent
readings of one description: a spec whose ``visible`` or call disagreed with what ring_impl runs
would judge a vendor by another mask than the one ring_impl passes with.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from conformance.adapters.ring_impl import ring_impl_mask, ring_impl_masks, ring_impl_score_mod
from conformance.specs import MaskSpec, ScoreModSpec
from reference.masks import visibility
from reference.score_mods import apply_score_mod

SEQ = 24
HEADS = 3
BATCH = 2

MASKS = {
    "full": {"kind": "full"},
    "causal": {"kind": "causal"},
    "documents": {"kind": "document", "doc_ids": [0] * 5 + [1] * 9 + [2] * 7 + [-1] * 3},
    "documents_bidirectional": {
        "kind": "document",
        "doc_ids": [0] * 10 + [1] * 14,
        "causal": False,
    },
    "cu_seqlens": {"kind": "document", "cu_seqlens": [0, 4, 4, 15, 20], "seq_len": SEQ},
    "window": {"kind": "sliding_window", "left": 5, "right": 0},
    "window_two_sided": {"kind": "sliding_window", "left": 3, "right": 2},
    "chunked": {"kind": "chunked_causal", "chunk": 7},
    "prefix": {"kind": "prefix_lm", "prefix": 6},
    "and": {
        "kind": "and",
        "masks": [
            {"kind": "document", "cu_seqlens": [0, 11, 24], "seq_len": SEQ},
            {"kind": "sliding_window", "left": 4, "right": 0},
        ],
    },
    "or": {"kind": "or", "masks": [{"kind": "causal"}, {"kind": "prefix_lm", "prefix": 3}]},
    "mask_mod": {
        "kind": "mask_mod",
        "fn": lambda b, h, q, kv: (kv <= q) & ((q - kv) % (h + 2) != 1) & (b + q >= kv),
    },
}


def _indices():
    return (
        torch.arange(BATCH).view(-1, 1, 1, 1),
        torch.arange(HEADS).view(1, -1, 1, 1),
        torch.arange(SEQ).view(1, 1, -1, 1),
        torch.arange(SEQ).view(1, 1, 1, -1),
    )


@pytest.mark.parametrize("name", sorted(MASKS))
def test_a_mask_spec_is_its_data_and_sees_what_ring_impl_and_the_oracle_see(name: str) -> None:
    data = MASKS[name]
    spec = MaskSpec(data)
    assert dict(spec) == data and spec.kind == data["kind"]
    b, h, q, kv = _indices()
    seen = spec.visible(b, h, q, kv).expand(BATCH, HEADS, SEQ, SEQ)
    assert seen.dtype == torch.bool
    assert torch.equal(seen, visibility(data, SEQ, SEQ, batch=BATCH, heads=HEADS))
    ours = ring_impl_mask(spec).visible(b, h, q, kv).expand(BATCH, HEADS, SEQ, SEQ)
    assert torch.equal(seen, ours), f"{name}: the spec and ring_impl's mask differ"
    assert int(seen.sum()) > 0, f"{name}: the mask hides everything: the comparison could not fail"


def test_a_mask_spec_sees_a_block_of_global_positions() -> None:
    spec = MaskSpec(MASKS["documents"])
    b, h = torch.zeros(1, 1, 1, 1, dtype=torch.int64), torch.zeros(1, 1, 1, 1, dtype=torch.int64)
    rows, cols = torch.arange(12, 20), torch.arange(3, 15)
    block = spec.visible(b, h, rows.view(1, 1, -1, 1), cols.view(1, 1, 1, -1))[0, 0]
    whole = visibility(MASKS["documents"], SEQ, SEQ)[0, 0]
    assert torch.equal(block, whole[12:20][:, 3:15])


def _score_mods() -> dict[str, dict]:
    gen = torch.Generator().manual_seed(3)
    return {
        "softcap": {"kind": "softcap", "cap": 2.5},
        "alibi": {
            "kind": "alibi",
            "slopes": torch.tensor([0.5, 0.25, 0.125]),
            "symmetric": False,
        },
        "alibi_symmetric": {
            "kind": "alibi",
            "slopes": torch.tensor([0.5, 0.25, 0.125]),
            "symmetric": True,
        },
        "bias_per_head": {"kind": "bias", "bias": torch.randn(1, HEADS, SEQ, SEQ, generator=gen)},
        "bias_per_row": {"kind": "bias", "bias": torch.randn(BATCH, 1, SEQ, SEQ, generator=gen)},
    }


@pytest.mark.parametrize("name", sorted(_score_mods()))
def test_a_score_mod_spec_changes_scores_as_ring_impl_and_the_oracle_do(name: str) -> None:
    data = _score_mods()[name]
    spec = ScoreModSpec(data)
    score = torch.randn(BATCH, HEADS, SEQ, SEQ, generator=torch.Generator().manual_seed(5)) * 4
    b, h, q, kv = _indices()
    got = spec(score, b, h, q, kv)
    assert got.dtype == score.dtype and got.shape == score.shape
    oracle = apply_score_mod(data, score.double())
    torch.testing.assert_close(got.double(), oracle, rtol=1e-6, atol=1e-5)
    ours = ring_impl_score_mod(spec)(score, b, h, q, kv)
    assert type(ring_impl_score_mod(spec)).__module__ == "ring_impl.score_mods"
    torch.testing.assert_close(got, ours.expand_as(got), rtol=1e-6, atol=1e-5)
    assert not torch.equal(got, score), f"{name} changed nothing: the check could not fail"


def test_a_score_mod_spec_is_differentiable_in_the_scores() -> None:
    spec = ScoreModSpec({"kind": "softcap", "cap": 2.0})
    score = torch.linspace(-5, 5, 11, dtype=torch.float64).view(1, 1, 1, -1).requires_grad_()
    zero = torch.zeros(1, 1, 1, 1, dtype=torch.int64)
    spec(score, zero, zero, zero, torch.arange(11).view(1, 1, 1, -1)).sum().backward()
    assert score.grad is not None
    torch.testing.assert_close(score.grad, 1 - torch.tanh(score.detach() / 2) ** 2)


@pytest.mark.parametrize(
    ("cls", "data", "words"),
    [
        (MaskSpec, {"kind": "diagonal"}, "unknown mask kind 'diagonal'"),
        (MaskSpec, {"cap": 3}, "unknown mask kind None"),
        (ScoreModSpec, {"kind": "score_mod", "fn": abs}, "unknown score_mod kind 'score_mod'"),
    ],
)
def test_a_spec_refuses_an_unknown_kind(cls, data, words: str) -> None:
    with pytest.raises(ValueError, match=words):
        cls(data)


def test_a_spec_is_read_only_and_holds_the_callers_tensors() -> None:
    ids = torch.zeros(SEQ, dtype=torch.int32)
    spec = MaskSpec({"kind": "document", "doc_ids": ids})
    assert spec["doc_ids"] is ids
    with pytest.raises(TypeError):
        spec["doc_ids"] = ids.clone()  # type: ignore[index]
    assert "tensor(24,):int32" in repr(spec)


def test_the_adapter_builds_one_ring_impl_mask_per_spec_and_sees_refills() -> None:
    """The same spec reaches ring_impl as the same mask (its snapshot decides what changed), over
    the caller's buffer: ids refilled in place through numpy are what ring_impl reads next."""
    buffer = np.zeros(SEQ, dtype=np.int32)
    spec = MaskSpec({"kind": "document", "doc_ids": torch.from_numpy(buffer)})
    built = ring_impl_mask(spec)
    assert ring_impl_mask(spec) is built
    assert ring_impl_mask(MaskSpec(dict(spec))) is not built
    buffer[SEQ // 2 :] = 1
    b, h, q, kv = _indices()
    assert not bool(built.visible(b, h, q, kv)[0, 0, SEQ - 1, 0])  # another document now
    pairs = ring_impl_masks([(spec, 3.0), (MaskSpec(MASKS["window"]), 1.0)])
    assert pairs[0] == (built, 3.0) and type(pairs[1][0]).__name__ == "SlidingWindow"
    assert ring_impl_mask(None) is None and ring_impl_mask(built) is built
