"""The stable merge and the declared collective schedule."""

from __future__ import annotations

import torch

from ring_impl import collective_schedule
from ring_impl.numerics.merge import merge_into


def test_merge_equals_joint_softmax_and_survives_huge_logits() -> None:
    torch.manual_seed(0)
    for magnitude in (1.0, 1e3, 1e5):
        s1, s2 = (
            torch.randn(2, 3, 4, 5, dtype=torch.float64) * magnitude,
            torch.randn(2, 3, 4, 7, dtype=torch.float64) * magnitude,
        )
        v1, v2 = (
            torch.randn(2, 3, 5, 8, dtype=torch.float64),
            torch.randn(2, 3, 7, 8, dtype=torch.float64),
        )
        out, lse = torch.softmax(s1, -1) @ v1, s1.logsumexp(-1)
        merge_into(out, lse, torch.softmax(s2, -1) @ v2, s2.logsumexp(-1))
        joint = torch.cat([s1, s2], -1)
        assert torch.isfinite(out).all() and torch.isfinite(lse).all()
        torch.testing.assert_close(lse, joint.logsumexp(-1), atol=1e-12 * magnitude, rtol=1e-14)
        torch.testing.assert_close(
            out, torch.softmax(joint, -1) @ torch.cat([v1, v2], -2), atol=1e-12, rtol=0
        )


def test_merge_accumulates_in_the_accumulator_dtype() -> None:
    out, lse = torch.zeros(1, 1, 2, 4), torch.zeros(1, 1, 2)
    merge_into(out, lse, torch.ones(1, 1, 2, 4, dtype=torch.bfloat16), torch.zeros(1, 1, 2))
    assert out.dtype == torch.float32 and torch.allclose(out, torch.full_like(out, 0.5))


def test_schedule_by_hand_for_four_ranks() -> None:
    # batch 2, heads_kv 3, seq 5, head_dim 8: kv = 2*2*3*5*8 = 480 elements.
    args = dict(batch=2, heads_kv=3, seq_kv=5, head_dim=8)
    bf16 = collective_schedule(4, "allgather", dtype=torch.bfloat16, **args)
    assert bf16["forward"]["all_gather"] == {"calls": 1, "bytes": 960}
    # dK/dV accumulators (float32 for bf16) take W-1 hops home; the owner's share never travels.
    assert bf16["backward"]["all_to_all"] == {"calls": 3, "bytes": 3 * 480 * 4}
    assert "reduce_scatter" not in bf16["backward"]
    p2p = collective_schedule(4, "p2p", dtype=torch.float64, **args)
    assert p2p["forward"]["send"] == {"calls": 3, "bytes": 3 * 3840}
    # eager: 3 key/value and 3 dK/dV hops, one transfer each
    assert p2p["backward"]["recv"] == {"calls": 6, "bytes": 3 * 3840 + 3 * 3840}
    a2a = collective_schedule(4, "alltoall", dtype=torch.float32, compiled=True, **args)
    # compiled too, the cross-rank input check (ring_impl.compiled.checks):
    # 4 int64 rows of ring_impl.checks.inputs.row_width() (24) entries
    assert (
        a2a["forward"]["all_reduce"] == {"calls": 1, "bytes": 8 * 4 * 24}
        and a2a["forward"]["all_to_all"]["calls"] == 3
    )
    # Compiled p2p hops go by all-to-all (see
    # ring_impl.transports.link.p2p_hop): same counts and bytes.
    compiled_p2p = collective_schedule(4, "p2p", dtype=torch.float64, compiled=True, **args)
    assert "send" not in compiled_p2p["backward"]
    # compiled: the same hops packed into 5 transfers: [kv], [kv], [kv+dkv], [dkv], [dkv]
    assert compiled_p2p["backward"]["all_to_all"] == {"calls": 5, "bytes": 3 * 3840 + 3 * 3840}
    assert collective_schedule(1, "p2p", dtype=torch.float32, **args) == {
        "forward": {},
        "backward": {},
    }
