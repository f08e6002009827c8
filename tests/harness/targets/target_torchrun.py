"""Run by torchrun with 2 ranks per tests/harness/test_torchrun.py:
each rank is a pytest process."""

from __future__ import annotations

import os
from collections.abc import Callable

import torch
import torch.distributed as dist

from harness import Pool, RankContext


def _sum_of_ranks(ctx: RankContext) -> float:
    x = torch.tensor([float(ctx.rank)])
    dist.all_reduce(x, group=ctx.group)
    return float(x.item())


def _raise_on_rank_1(ctx: RankContext) -> int:
    if ctx.rank == 1:
        raise RuntimeError("rank 1 rejects this case (torchrun)")
    return ctx.rank


def _raise_everywhere(ctx: RankContext) -> None:
    raise ValueError(f"bad input on rank {ctx.rank}")


def test_all_reduce_in_lockstep(rank_pool: Callable[[int], Pool]) -> None:
    pool = rank_pool(2)
    assert pool.run(_sum_of_ranks) == [1.0, 1.0]
    assert os.environ["RANK"] in ("0", "1")


def test_failure_on_rank_1_reported_by_rank_0(rank_pool: Callable[[int], Pool]) -> None:
    rank_pool(2).run(_raise_on_rank_1)


def test_expected_errors_on_every_rank(rank_pool: Callable[[int], Pool]) -> None:
    outcomes = rank_pool(2).run_outcomes(_raise_everywhere)
    assert [(o.ok, o.exc_type, o.exc_message) for o in outcomes] == [
        (False, "ValueError", "bad input on rank 0"),
        (False, "ValueError", "bad input on rank 1"),
    ]


def test_other_world_size_skips(rank_pool: Callable[[int], Pool]) -> None:
    rank_pool(4)
