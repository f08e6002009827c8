"""Collective accounting: counts and bytes per kind and phase,
eager and functional, on real ranks."""

from __future__ import annotations

import torch

from harness import get_pool
from harness.accounting import classify
from tests.harness import rank_fns


def test_eager_c10d_collectives_are_counted_with_input_bytes() -> None:
    rank0, rank1 = get_pool(2).run(rank_fns.eager_collectives)
    common = {
        "all_reduce": {"calls": 1, "bytes": 16},
        "all_gather": {"calls": 2, "bytes": 32},  # all_gather_into_tensor + all_gather (list)
        "all_to_all": {"calls": 1, "bytes": 16},
        "reduce_scatter": {"calls": 1, "bytes": 16},
        "broadcast": {"calls": 1, "bytes": 16},
        "barrier": {"calls": 1, "bytes": 0},
    }
    # rank 0: a blocking send (16 B) plus the batched isend (12 B); one batched irecv (12 B)
    assert rank0 == {
        "eager": {**common, "send": {"calls": 2, "bytes": 28}, "recv": {"calls": 1, "bytes": 12}}
    }
    # rank 1: the blocking recv counts its receive buffer (16 B)
    assert rank1 == {
        "eager": {**common, "send": {"calls": 1, "bytes": 12}, "recv": {"calls": 2, "bytes": 28}}
    }


def test_functional_collectives_and_batched_p2p_per_phase() -> None:
    rank0, rank1 = get_pool(2).run(rank_fns.functional_collectives)
    forward_common = {
        "all_reduce": {"calls": 1, "bytes": 16},
        "all_gather": {"calls": 1, "bytes": 16},
        "reduce_scatter": {"calls": 1, "bytes": 16},
        # bf16 all_to_all_single (16 B) + the autograd variant on 4 fp32 (16 B)
        "all_to_all": {"calls": 2, "bytes": 32},
        "broadcast": {"calls": 1, "bytes": 16},
    }
    # autograd's backward of all_to_all_single is one all_to_all of the gradient (16 B)
    backward = {"all_to_all": {"calls": 1, "bytes": 16}}
    assert rank0 == {
        "forward": {
            **forward_common,
            "send": {"calls": 2, "bytes": 28},
            "recv": {"calls": 1, "bytes": 8},
        },
        "backward": backward,
    }
    assert rank1 == {
        "forward": {
            **forward_common,
            "send": {"calls": 1, "bytes": 8},
            "recv": {"calls": 2, "bytes": 28},
        },
        "backward": backward,
    }


def test_calls_outside_a_phase_go_to_default_and_phases_nest() -> None:
    summary = get_pool(2).run(rank_fns.calls_outside_phase)[0]
    assert summary == {
        "default": {"all_reduce": {"calls": 1, "bytes": 4}},
        "inner": {"all_reduce": {"calls": 1, "bytes": 8}},
        "outer": {"all_reduce": {"calls": 1, "bytes": 12}},
    }


def test_classify_maps_op_names_without_a_process_group() -> None:
    t = torch.empty(3, dtype=torch.float16)  # 6 bytes
    assert classify("_c10d_functional::wait_tensor", (t,)) == []
    assert classify("_c10d_functional::_wrap_tensor_autograd", (t,)) == []
    assert classify("aten::add", (t, t)) == []
    assert classify("_c10d_functional::all_gather_into_tensor_coalesced", ([t, t], 2, "g")) == [
        ("all_gather", 12, None)
    ]
    assert classify("c10d::alltoall_", ([t], [t, t], None)) == [("all_to_all", 12, None)]
    assert classify("c10d::reduce_scatter_", ([t], [[t, t]], None, None)) == [
        ("reduce_scatter", 12, None)
    ]
    assert classify("c10d::recv_", ([t], None, 3, 0)) == [("recv", 6, 3)]
    assert classify(
        "_c10d_functional::batch_p2p_ops",
        (["isend", "irecv", "irecv"], [1, 2, 3], [0, 0, 0], [t, t, t], "g"),
    ) == [("send", 6, 1), ("recv", 6, 2), ("recv", 6, 3)]
    assert classify("c10d::reduce_", ([t], None, None, 0, 0)) == [("other:c10d::reduce_", 0, None)]
