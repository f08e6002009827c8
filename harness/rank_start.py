"""How pool ranks start: forked from a forkserver that imported torch once, or spawned.

``--rank-start forkserver`` (the default): ranks are forked from multiprocessing's forkserver,
which imports torch (and the modules of :data:`FORKSERVER_PRELOAD`) once for the whole process,
so a rank costs a fork plus a process-group handshake. ``--rank-start spawn``: each rank is a
fresh interpreter (slow; for debugging a forkserver problem, or for settings the C library reads
when a process starts).
"""

from __future__ import annotations

import multiprocessing
import os
from multiprocessing.context import BaseContext

from harness.settings import current

__all__ = ["FORKSERVER_PRELOAD", "mp_context", "rank_env", "warm_up"]

# Modules the forkserver imports once so every rank (and every rebuilt rank) starts with them
# loaded. torch._dynamo is imported by the first TorchDispatchMode (CollectiveLog) or
# torch.compile a rank runs: about 2 s of CPU per rank otherwise.
FORKSERVER_PRELOAD = [
    "torch",
    "torch.distributed",
    "torch._dynamo",
    "numpy",
    "harness.rank_main",
    "harness.accounting",
]


def mp_context(method: str | None = None) -> BaseContext:
    """The multiprocessing context ranks start from: the forkserver with torch preloaded (default)
    or spawn (``--rank-start spawn``)."""
    method = method or current().rank_start
    if method == "forkserver" and "forkserver" in multiprocessing.get_all_start_methods():
        ctx = multiprocessing.get_context("forkserver")
        ctx.set_forkserver_preload(FORKSERVER_PRELOAD)
        _ensure_forkserver()
        return ctx
    return multiprocessing.get_context("spawn")


def _ensure_forkserver() -> None:
    """Start the forkserver if it is not running, with CUDA kept uninitialised in it.

    Ranks are forked from it, and CUDA does not survive a fork once the driver is initialised:
    any ``torch.cuda.is_available()`` during the preload must ask NVML, not the CUDA runtime.
    """
    from multiprocessing import forkserver

    key = "PYTORCH_NVML_BASED_CUDA_CHECK"
    previous = os.environ.get(key)
    os.environ[key] = "1"
    try:
        forkserver.ensure_running()
    finally:
        if previous is None:
            os.environ.pop(key, None)
        else:
            os.environ[key] = previous


def warm_up() -> None:
    """Start the forkserver now so its torch import overlaps with test collection.

    Returns at once: the forkserver imports torch in the background and the first pool start
    waits for it only if it has not finished.
    """
    if current().rank_start == "forkserver":
        mp_context("forkserver")


def rank_env(rank: int, world_size: int, extra: dict[str, str] | None = None) -> dict[str, str]:
    """The environment of a pool rank: this process's, plus ``extra``, as rank ``rank`` of
    ``world_size`` (and not as a rank of whatever launched this process)."""
    env = dict(os.environ)
    env.update(extra or {})
    # Rendezvous and data stay on this machine: listen on loopback unless told otherwise.
    if "GLOO_SOCKET_IFNAME" not in env and "GLOO_DEVICE_TRANSPORT" not in env:
        env["GLOO_SOCKET_IFNAME"] = "lo"
    env.setdefault("NCCL_SOCKET_IFNAME", "lo")
    for key in ("MASTER_ADDR", "MASTER_PORT", "TORCHELASTIC_RUN_ID", "GROUP_RANK"):
        env.pop(key, None)  # a rank is not a torchrun rank, whatever launched pytest
    env.update(
        RANK=str(rank),
        LOCAL_RANK=str(rank),
        WORLD_SIZE=str(world_size),
        LOCAL_WORLD_SIZE=str(world_size),
        PYTHONUNBUFFERED="1",
    )
    env.pop("PYTEST_CURRENT_TEST", None)
    return env
