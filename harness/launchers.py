"""The launchers of ranks, by name, and ``get_pool``, which picks the session's.

A launcher is a way to get a :class:`~harness.pool_base.Pool` for (world size, backend, device):

``pool``
    rank processes started and owned by this process (:mod:`harness.pool`), cached per key;
``torchrun``
    this process is one rank of a torchrun job (:mod:`harness.torchrun`);
``simulated``
    every rank a thread of this process, collectives exact (:mod:`harness.simulated`): world
    sizes up to 64 and beyond on one machine, CPU only, no torch.compile.

``--launcher`` (``RING_LAUNCHER``, :mod:`harness.settings`) names the session's; ``auto`` means
torchrun when the torchrun environment is present, else pool. A new launcher is a module with a
:class:`~harness.pool_base.Pool` subclass, an entry in :data:`LAUNCHERS` and its name in
:data:`harness.settings.LAUNCHERS`.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from harness import pool, rank_start, simulated, torchrun
from harness.pool_base import Pool
from harness.settings import current, default_backend

__all__ = ["LAUNCHERS", "Launcher", "get_pool", "shutdown_all_pools", "warm_up"]


@dataclass(frozen=True)
class Launcher:
    """``get(world_size, backend, device)``: the pool (started); ``shutdown()``: stop every pool
    it made in this process (safe to call more than once); ``warm_up()``: get ready for a first
    pool in the background (returns at once)."""

    name: str
    get: Callable[[int, str, str], Pool]
    shutdown: Callable[[], None]
    warm_up: Callable[[], None] = lambda: None


LAUNCHERS: dict[str, Launcher] = {
    "pool": Launcher("pool", pool.rank_pool, pool.shutdown_rank_pools, rank_start.warm_up),
    "torchrun": Launcher("torchrun", torchrun.get_torchrun_pool, torchrun.shutdown_torchrun_pool),
    "simulated": Launcher(
        "simulated", simulated.simulated_pool, simulated.shutdown_simulated_pools
    ),
}


def get_pool(world_size: int, backend: str | None = None, device: str | None = None) -> Pool:
    """The pool of ``world_size`` ranks for (backend, device), from the session's launcher.

    ``device`` defaults to the session's ``--device``; ``backend`` to the session's
    ``--dist-backend`` when the device is the session's, else the device's natural backend. With
    the ``pool`` launcher the pool is started on first use and cached; under torchrun
    (``--launcher torchrun``, or its environment) it is this process's torchrun pool. Raises
    :class:`~harness.errors.PoolUnavailable` when the pool cannot exist here (the pytest fixture
    ``rank_pool`` turns that into a skip) and :class:`~harness.errors.PoolStartError` when the
    ranks fail to start.
    """
    settings = current()
    device = device or settings.device
    backend = backend or (
        settings.backend if device == settings.device else default_backend(device)
    )
    return LAUNCHERS[settings.launcher].get(world_size, backend, device)


def shutdown_all_pools() -> None:
    """Stop every pool of this process, whichever launcher made it; safe to call more than once
    (session end, atexit, signals)."""
    for launcher in LAUNCHERS.values():
        try:
            launcher.shutdown()
        except Exception:  # a failing shutdown must not stop the others
            pass


def warm_up() -> None:
    """Let the session's launcher get ready for its first pool while pytest collects."""
    LAUNCHERS[current().launcher].warm_up()
