"""Rank functions the harness tests send to pools (module level, so they pickle by reference).

Kept free of pytest so a rank imports only what it runs.
"""

from __future__ import annotations

import os
import random
import signal
import sys
import time
import warnings
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as fc

from harness import RankContext
from harness.accounting import CollectiveLog


def rank_info(ctx: RankContext) -> dict[str, Any]:
    """What the rank knows about itself and its process."""
    return {
        "rank": ctx.rank,
        "world_size": ctx.world_size,
        "dist_rank": dist.get_rank(),
        "dist_world_size": dist.get_world_size(),
        "pid": os.getpid(),
        "device": str(ctx.device),
        "backend": ctx.backend,
        "case": ctx.case,
        "seed": ctx.seed,
        "threads": torch.get_num_threads(),
        "sys_path": list(sys.path),
        "cwd": os.getcwd(),
        "env_marker": os.environ.get("HARNESS_TEST_MARKER"),
        "tmp_dir_exists": os.path.isdir(ctx.tmp_dir),
    }


def all_reduce_sum(ctx: RankContext, n: int) -> float:
    """Each rank contributes ``rank + 1`` n times; returns the reduced sum."""
    x = torch.full((n,), float(ctx.rank + 1))
    dist.all_reduce(x, group=ctx.group)
    return float(x.sum().item())


def echo(ctx: RankContext, tensor: torch.Tensor, *, scale: float = 1.0) -> torch.Tensor:
    """Returns ``tensor * scale + rank``: checks args,
    kwargs and tensor results cross the boundary."""
    return tensor * scale + ctx.rank


def draw_random(ctx: RankContext) -> tuple[float, float, list[float]]:
    """One draw from each generator the harness seeds."""
    return random.random(), float(np.random.rand()), torch.rand(3).tolist()


def raise_on(ctx: RankContext, bad_rank: int, collective_after: bool) -> float:
    """``bad_rank`` raises ValueError; the others
    (optionally) wait in an all_reduce it never joins."""
    if ctx.rank == bad_rank:
        raise ValueError(f"bad input detected on rank {ctx.rank}")
    if collective_after:
        return all_reduce_sum(ctx, 1)
    return 0.0


def raise_everywhere(ctx: RankContext) -> None:
    """Every rank rejects its input, like a validation error in a bad-input test."""
    raise ValueError(f"head_dim must be positive (rank {ctx.rank})")


def exit_on(ctx: RankContext, bad_rank: int, code: int) -> float:
    """``bad_rank`` leaves with ``os._exit(code)``; the others wait in an all_reduce."""
    if ctx.rank == bad_rank:
        os._exit(code)
    return all_reduce_sum(ctx, 1)


def sigkill_on(ctx: RankContext, bad_rank: int) -> float:
    """``bad_rank`` is SIGKILLed (like the OOM killer); the others wait in an all_reduce."""
    if ctx.rank == bad_rank:
        os.kill(os.getpid(), signal.SIGKILL)
        time.sleep(60)
    return all_reduce_sum(ctx, 1)


def hang_in_collective(ctx: RankContext) -> None:
    """Every rank waits to receive from its neighbour, who never sends: a deadlock in p2p."""
    buf = torch.empty(1)
    dist.recv(buf, src=(ctx.rank + 1) % ctx.world_size)


def skip_collective(ctx: RankContext, skipping_rank: int) -> float:
    """Every rank but ``skipping_rank`` calls all_reduce: the classic divergent-control-flow bug."""
    if ctx.rank == skipping_rank:
        return 0.0
    return all_reduce_sum(ctx, 1)


def return_unpicklable(ctx: RankContext) -> Any:
    return lambda: ctx.rank


def print_and_return(ctx: RankContext, text: str) -> int:
    print(f"{text} from rank {ctx.rank}")
    return ctx.rank


def leak_global_state(ctx: RankContext) -> str:
    """Changes process-wide torch state a later case must not inherit."""
    torch.set_default_dtype(torch.float64)
    torch.set_grad_enabled(False)
    torch.set_num_threads(2)
    return str(torch.get_default_dtype())


def global_state(ctx: RankContext) -> tuple[str, bool, int]:
    return str(torch.get_default_dtype()), torch.is_grad_enabled(), torch.get_num_threads()


def sleep_then_sum(ctx: RankContext, seconds: float) -> float:
    time.sleep(seconds)
    return all_reduce_sum(ctx, 1)


# ---------------------------------------------------------------------- accounting


def eager_collectives(ctx: RankContext) -> dict[str, Any]:
    """Every eager c10d collective once, in phase "eager"; p2p between ranks 0 and 1."""
    peer = 1 - ctx.rank
    group = ctx.group
    x = torch.ones(4)  # 16 bytes
    log = CollectiveLog()
    with log, log.phase("eager"), warnings.catch_warnings():
        warnings.simplefilter(
            "ignore", FutureWarning
        )  # the deprecated names are the ones under test
        dist.all_reduce(x, group=group)
        dist.all_gather_into_tensor(torch.empty(8), x, group=group)
        dist.all_gather([torch.empty(4), torch.empty(4)], x, group=group)
        dist.all_to_all_single(torch.empty(4), x, group=group)
        dist.reduce_scatter_tensor(torch.empty(2), x, group=group)
        dist.broadcast(x, src=0, group=group)
        dist.barrier(group=group)
        if ctx.rank == 0:
            dist.send(torch.ones(2, dtype=torch.float64), dst=1, group=group)  # 16 bytes
        else:
            dist.recv(torch.empty(2, dtype=torch.float64), src=0, group=group)
        ops = [
            dist.P2POp(dist.isend, torch.ones(3), peer, group),  # 12 bytes
            dist.P2POp(dist.irecv, torch.empty(3), peer, group),
        ]  # 12 bytes
        for work in dist.batch_isend_irecv(ops):
            work.wait()
    return log.summary()


def functional_collectives(ctx: RankContext) -> dict[str, Any]:
    """Every functional collective once, forward and backward phases, bf16 for byte counts."""
    peer = 1 - ctx.rank
    group = ctx.group
    name = group.group_name
    x = torch.ones(8, dtype=torch.bfloat16)  # 16 bytes
    log = CollectiveLog()
    with log, warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        with log.phase("forward"):
            fc.wait_tensor(fc.all_reduce(x, "sum", group))
            fc.wait_tensor(fc.all_gather_tensor(x, 0, group))
            fc.wait_tensor(fc.reduce_scatter_tensor(x, "sum", 0, group))
            fc.wait_tensor(fc.all_to_all_single(x, None, None, group))
            fc.wait_tensor(fc.broadcast(x, 0, group))
            sent, received = torch.ops._c10d_functional.batch_p2p_ops(
                ["isend", "irecv"], [peer, peer], [0, 0], [torch.ones(2), torch.empty(2)], name
            )  # 8 + 8 bytes
            torch.ops._c10d_functional.wait_tensor(sent)
            torch.ops._c10d_functional.wait_tensor(received)
            if ctx.rank == 0:
                work = torch.ops._c10d_functional.isend(torch.ones(5), 1, 0, name)  # 20 bytes
            else:
                work = torch.ops._c10d_functional.irecv(torch.empty(5), 0, 0, name)
            torch.ops._c10d_functional.wait_tensor(work)
            leaf = torch.ones(4, requires_grad=True)  # 16 bytes fp32
            out = fc.all_to_all_single_autograd(leaf, None, None, group)
            out = fc.wait_tensor(out)
        with log.phase("backward"):
            out.sum().backward()
    return log.summary()


def calls_outside_phase(ctx: RankContext) -> dict[str, Any]:
    log = CollectiveLog()
    with log:
        dist.all_reduce(torch.ones(1), group=ctx.group)
        with log.phase("outer"):
            with log.phase("inner"):
                dist.all_reduce(torch.ones(2), group=ctx.group)
            dist.all_reduce(torch.ones(3), group=ctx.group)
    dist.all_reduce(torch.ones(4), group=ctx.group)  # outside the log: not recorded
    return log.summary()


def segfault_on(ctx: RankContext, bad_rank: int) -> float:
    """``bad_rank`` dies of a segmentation fault (like a kernel bug);
    the others wait in an all_reduce."""
    if ctx.rank == bad_rank:
        print(f"rank {ctx.rank} about to crash", flush=True)
        import faulthandler

        faulthandler._sigsegv()  # type: ignore[attr-defined]
    return all_reduce_sum(ctx, 1)


def skip_all_reduce_on_rank0(ctx: RankContext) -> float:
    """Every rank but 0 joins an all_reduce: a deadlock (a real backend hangs)."""
    x = torch.ones(2)
    if ctx.rank != 0:
        dist.all_reduce(x, group=ctx.group)
    return float(x.sum())


def raise_on_rank1_then_all_reduce(ctx: RankContext) -> float:
    """Rank 1 raises before an all_reduce the others wait in."""
    if ctx.rank == 1:
        raise ValueError("rank 1 rejects its input")
    x = torch.ones(2)
    dist.all_reduce(x, group=ctx.group)
    return float(x.sum())


def mismatched_collectives(ctx: RankContext) -> None:
    """Rank 0 all-gathers while the others all-reduce, as their first collective."""
    x = torch.ones(2)
    if ctx.rank == 0:
        fc.all_gather_single(x, 0, ctx.group).wait()
    else:
        dist.all_reduce(x, group=ctx.group)


def collectives_round(ctx: RankContext) -> dict[str, Any]:
    """One of each collective and a p2p ring hop, eager and functional, counted."""
    w, r = ctx.world_size, ctx.rank
    with CollectiveLog() as log:
        x = torch.full((2,), float(r + 1))
        dist.all_reduce(x, group=ctx.group)
        gathered = fc.all_gather_single(torch.tensor([float(r)]), 0, ctx.group).wait()
        send = torch.arange(w, dtype=torch.float64) + 10 * r
        to_all = fc.all_to_all_single(send, None, None, ctx.group).wait()
        eager = [torch.zeros(1) for _ in range(w)]
        dist.all_gather(eager, torch.tensor([float(r * r)]), group=ctx.group)
        b = torch.tensor([float(r)])
        dist.broadcast(b, src=w - 1, group=ctx.group)
        recv = torch.zeros(3)
        works = dist.batch_isend_irecv(
            [
                dist.P2POp(dist.isend, torch.full((3,), float(r)), (r + 1) % w),
                dist.P2POp(dist.irecv, recv, (r - 1) % w),
            ]
        )
        for work in works:
            work.wait()
    return {
        "all_reduce": x.tolist(),
        "all_gather": gathered.tolist(),
        "all_to_all": to_all.tolist(),
        "eager_all_gather": [t.item() for t in eager],
        "broadcast": b.item(),
        "recv": recv.tolist(),
        "collectives": log.summary(),
    }


def mesh_groups(ctx: RankContext, shape: tuple[int, int]) -> dict[str, Any]:
    """Ranks of this rank's groups along each dim of a 2-D mesh, and a sum along each."""
    mesh = ctx.device_mesh(shape, ("a", "b"))
    out: dict[str, Any] = {}
    for name in ("a", "b"):
        pg = mesh.get_group(name)
        x = torch.tensor([float(ctx.rank)])
        dist.all_reduce(x, group=pg)
        out[name] = (dist.get_process_group_ranks(pg), x.item())
    return out


def compute_past_the_timeout_on_rank0(ctx: RankContext, seconds: float) -> float:
    """Rank 0 computes (here: sleeps) past the case timeout before a collective."""
    if ctx.rank == 0:
        time.sleep(seconds)
    x = torch.ones(1)
    dist.all_reduce(x, group=ctx.group)
    return float(x.item())
