"""The launcher registry: one launcher per --launcher choice, and get_pool asks the session's."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from harness import Pool, RankPool, get_pool, launchers, settings
from harness.torchrun import TorchrunPool


def test_every_launcher_choice_has_a_launcher() -> None:
    assert set(launchers.LAUNCHERS) == set(settings.LAUNCHERS) - {"auto"}
    assert all(name == launcher.name for name, launcher in launchers.LAUNCHERS.items())


def test_both_launchers_run_cases_through_the_one_pool_interface() -> None:
    # run and run_outcomes are written once, on Pool; each launcher implements _execute
    for cls in (RankPool, TorchrunPool):
        assert issubclass(cls, Pool)
        assert cls.run is Pool.run and cls.run_outcomes is Pool.run_outcomes
        assert cls._execute is not Pool._execute


@pytest.fixture
def session_launcher() -> Iterator[list[tuple[int, str, str]]]:
    """A launcher named like the session's that records what it is asked for."""
    asked: list[tuple[int, str, str]] = []
    previous_settings = settings.current()
    previous = launchers.LAUNCHERS["pool"]

    def get(world_size: int, backend: str, device: str) -> Pool:
        asked.append((world_size, backend, device))
        return previous.get(world_size, backend, device)

    launchers.LAUNCHERS["pool"] = launchers.Launcher(
        "pool", get, previous.shutdown, previous.warm_up
    )
    settings.install(previous_settings.with_(launcher="pool"))
    try:
        yield asked
    finally:
        launchers.LAUNCHERS["pool"] = previous
        settings.install(previous_settings)


def test_get_pool_asks_the_sessions_launcher_with_the_sessions_defaults(
    session_launcher: list[tuple[int, str, str]],
) -> None:
    pool = get_pool(2)
    assert isinstance(pool, RankPool) and pool.world_size == 2
    assert session_launcher == [(2, settings.current().backend, settings.current().device)]
