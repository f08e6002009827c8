"""Mask specs as visibility on global positions, and attention with masks and sinks, against
definitions written out by hand (loops over positions) and the independent numpy oracle."""

from __future__ import annotations

import itertools

import numpy as np
import pytest
import torch

from reference.attention import attention_grads, masked_attention
from reference.masks import document_ids, visibility
from tests.reference import numpy_attention

N = 13


def _by_hand(spec: dict, n: int) -> list[list[bool]]:
    """Visibility by the words of each family's definition, one (i, j) at a time."""
    kind = spec["kind"]
    rows = []
    for i in range(n):
        row = []
        for j in range(n):
            if kind == "full":
                seen = True
            elif kind == "causal":
                seen = j <= i
            elif kind == "document":
                ids = (
                    spec["doc_ids"]
                    if "doc_ids" in spec
                    else [
                        next(
                            (
                                d
                                for d, (a, b) in enumerate(itertools.pairwise(spec["cu_seqlens"]))
                                if a <= t < b
                            ),
                            -1,
                        )
                        for t in range(n)
                    ]
                )
                seen = (
                    ids[i] == ids[j] and ids[i] != -1 and (j <= i or not spec.get("causal", True))
                )
            elif kind == "sliding_window":
                left, right = spec.get("left"), spec.get("right")
                seen = (left is None or i - left <= j) and (right is None or j <= i + right)
            elif kind == "chunked_causal":
                seen = j <= i and i // spec["chunk"] == j // spec["chunk"]
            elif kind == "prefix_lm":
                seen = j <= i or j < spec["prefix"]
            else:
                raise AssertionError(kind)
            row.append(seen)
        rows.append(row)
    return rows


SPECS = [
    {"kind": "full"},
    {"kind": "causal"},
    {"kind": "document", "doc_ids": [0, 0, 0, 1, 2, 2, 2, 2, 2, 3, -1, -1, -1], "causal": True},
    {"kind": "document", "doc_ids": [0, 0, 0, 1, 2, 2, 2, 2, 2, 3, -1, -1, -1], "causal": False},
    {"kind": "document", "cu_seqlens": [0, 5, 6, 11], "causal": True},  # tokens 11, 12: padding
    {"kind": "sliding_window", "left": 3, "right": 0},
    {"kind": "sliding_window", "left": 2, "right": 1},
    {"kind": "sliding_window", "left": 0, "right": 0},
    {"kind": "sliding_window", "left": None, "right": 2},
    {"kind": "chunked_causal", "chunk": 4},
    {"kind": "prefix_lm", "prefix": 5},
]


@pytest.mark.parametrize(
    "spec", SPECS, ids=lambda s: "-".join(f"{k}={v}" for k, v in s.items() if k != "doc_ids")
)
def test_each_family_matches_its_definition(spec: dict) -> None:
    got = visibility(spec, N, N)
    assert got.shape == (1, 1, N, N)
    assert got[0, 0].tolist() == _by_hand(spec, N)


def test_and_or_and_mask_mod_compose() -> None:
    doc = SPECS[2]
    window = {"kind": "sliding_window", "left": 2, "right": 0}
    both = visibility({"kind": "and", "masks": [doc, window]}, N, N)
    assert torch.equal(both, visibility(doc, N, N) & visibility(window, N, N))
    either = visibility({"kind": "or", "masks": [doc, window]}, N, N)
    assert torch.equal(either, visibility(doc, N, N) | visibility(window, N, N))
    # mask_mod in flex attention's convention, varying by batch and head
    per_head = visibility(
        {"kind": "mask_mod", "fn": lambda b, h, q, k: (k <= q) & ((q - k) <= h + b)},
        N,
        N,
        batch=2,
        heads=3,
    )
    for b, h in itertools.product(range(2), range(3)):
        want = [[j <= i and i - j <= h + b for j in range(N)] for i in range(N)]
        assert per_head[b, h].tolist() == want


def test_local_blocks_are_the_global_mask_at_global_positions() -> None:
    spec = SPECS[2]
    rows, cols = [2, 3, 11, 12], [0, 3, 4, 9]
    block = visibility(spec, 4, 4, q_positions=rows, k_positions=cols)[0, 0]
    full = visibility(spec, N, N)[0, 0]
    assert torch.equal(block, full[rows][:, cols])


def test_document_ids_from_cu_seqlens_and_bad_boundaries() -> None:
    assert document_ids({"cu_seqlens": [0, 2, 3]}, 5).tolist() == [0, 0, 1, -1, -1]
    with pytest.raises(ValueError, match="cu_seqlens"):
        document_ids({"cu_seqlens": [0, 3, 2]}, 5)
    with pytest.raises(ValueError, match="doc_ids has shape"):
        document_ids({"doc_ids": [0, 0]}, 5)


@pytest.mark.parametrize(
    "spec", [SPECS[2], SPECS[4], SPECS[6], SPECS[9]], ids=["doc", "cu", "window", "chunked"]
)
@pytest.mark.parametrize("with_sinks", [False, True])
def test_masked_attention_with_sinks_matches_numpy(spec: dict, with_sinks: bool) -> None:
    gen = torch.Generator().manual_seed(4)
    q = torch.randn(2, 4, N, 8, generator=gen, dtype=torch.float64)
    k, v = (torch.randn(2, 2, N, 8, generator=gen, dtype=torch.float64) for _ in range(2))
    do = torch.randn(2, 4, N, 8, generator=gen, dtype=torch.float64)
    sinks = torch.randn(4, generator=gen, dtype=torch.float64) if with_sinks else None
    vis = visibility(spec, N, N)
    ref = attention_grads(q, k, v, do, visible=vis, sinks=sinks)
    want = numpy_attention.masked_forward_backward(
        q.numpy(),
        k.numpy(),
        v.numpy(),
        do.numpy(),
        vis.numpy(),
        None if sinks is None else sinks.numpy(),
    )
    for name, got, w in zip(("out", "lse", "dq", "dk", "dv"), ref[:5], want[:5], strict=True):
        np.testing.assert_allclose(got.numpy(), w, rtol=0, atol=1e-12, err_msg=name)
    if with_sinks:
        np.testing.assert_allclose(
            ref.dsinks.numpy(), want[5], rtol=0, atol=1e-12, err_msg="dsinks"
        )
        pad = vis[0, 0].sum(-1) == 0  # padding rows: out 0, lse = the sink
        assert torch.equal(ref.lse[:, :, pad], sinks.view(1, 4, 1).expand(2, 4, int(pad.sum())))
    else:
        assert ref.dsinks is None
        assert torch.isneginf(ref.lse[..., 10:]).all() == (spec is SPECS[2])


def test_sinks_must_have_one_logit_per_head() -> None:
    q = torch.zeros(1, 4, 3, 2, dtype=torch.float64)
    with pytest.raises(ValueError, match="sinks must have shape"):
        masked_attention(q, q, q, sinks=torch.zeros(3))
