"""pytest integration: the "ring attention" options, markers, fixtures, report header, profiles.

Loaded by the root ``conftest.py`` (``pytest_plugins = ["harness.pytest_plugin"]``).

Adding an option: call :func:`add_ring_option` from a ``pytest_addoption`` hook (here or in another
plugin module listed in ``conftest.py``); it lands in the same "ring attention" group, its
``RING_*`` variable is echoed in the report header and read by :func:`ring_option` when the option
is not given. Harness settings themselves are declared in :data:`harness.settings.OPTIONS`.

Markers: ``quick``, ``nightly`` (skipped unless ``--tier nightly``), ``gpu`` (skipped unless
``--device cuda``), ``compile``, ``world_size(n)`` (skipped unless n is enabled). Every skip says
why and how to enable the test.

Fixtures: ``rank_pool`` (factory: ``rank_pool(world_size)`` -> pool, skipping when that world
size is not enabled or cannot run here), ``harness_settings``, ``world_sizes``, ``device``,
``dist_backend``, ``tier``, ``case_timeout``.
"""

from __future__ import annotations

import os
import platform
import sys
from collections.abc import Callable
from typing import Any

import pytest

from harness import settings as harness_settings_module
from harness.errors import PoolUnavailable
from harness.pool import Pool, get_pool, shutdown_all_pools, warm_up
from harness.settings import OPTIONS, HarnessSettings, SettingsError

OPTION_GROUP = "ring attention"
OPTION_GROUP_DESCRIPTION = "ring attention conformance (each option also reads a RING_* variable)"
SETTINGS_KEY = pytest.StashKey[HarnessSettings]()

# dest -> environment variable, for every option registered through add_ring_option.
_ENV_FALLBACKS: dict[str, str] = {}

MARKERS = {
    "quick": "part of the quick tier (the default tier, minutes on 2 CPU cores); select with -m quick",
    "nightly": "nightly tier only (full matrix, slow); skipped unless --tier nightly or RING_TIER=nightly",
    "gpu": "needs CUDA; skipped unless run on a CUDA machine with --device cuda (or RING_DEVICE=cuda)",
    "compile": "uses torch.compile (inductor); slow to compile, the nightly tier runs the full matrix",
    "world_size(n)": "needs world size n; skipped unless n is in --world-sizes (RING_WORLD_SIZES)",
}

HYPOTHESIS_PROFILES = {"dev": 20, "ci": 10, "nightly": 100}


# ---------------------------------------------------------------------- options

def add_ring_option(parser: pytest.Parser, flag: str, *, env: str, help: str,
                    dest: str | None = None, **kwargs: Any) -> None:
    """Register ``flag`` in the "ring attention" group with ``env`` as its fallback variable.

    The option's default is ``None`` so :func:`ring_option` can tell "not given" from a value.
    """
    dest = dest or flag.lstrip("-").replace("-", "_")
    group = parser.getgroup(OPTION_GROUP, OPTION_GROUP_DESCRIPTION)
    group.addoption(flag, dest=dest, default=None, help=f"{help} [env: {env}]", **kwargs)
    _ENV_FALLBACKS[dest] = env


def ring_option(config: pytest.Config, dest: str, default: Any = None) -> Any:
    """The value of a ring option: the command line, else its RING_* variable, else ``default``."""
    value = config.getoption(dest, default=None)
    if value is None:
        env = _ENV_FALLBACKS.get(dest)
        value = os.environ.get(env) if env else None
    return default if value is None else value


def pytest_addoption(parser: pytest.Parser) -> None:
    for spec in OPTIONS:
        add_ring_option(parser, spec.flag, env=spec.env, help=spec.help, dest=f"ring_{spec.dest}",
                        metavar=spec.shown_as)


def resolve_settings(config: pytest.Config) -> HarnessSettings:
    """The session's harness settings; raises pytest.UsageError naming the option to fix."""
    cli = {spec.dest: config.getoption(f"ring_{spec.dest}", default=None) for spec in OPTIONS}
    try:
        settings = harness_settings_module.resolve(cli, os.environ)
    except SettingsError as exc:
        raise pytest.UsageError(str(exc)) from None
    if settings.device == "cuda":
        import torch

        if not torch.cuda.is_available():
            raise pytest.UsageError(
                f"--device cuda: CUDA is not available here (torch {torch.__version__}, "
                f"CUDA_VISIBLE_DEVICES={os.environ.get('CUDA_VISIBLE_DEVICES', '<unset>')}); "
                "run on a CUDA machine with a CUDA build of torch, or use --device cpu"
            )
    if settings.backend == "nccl":
        import torch.distributed as dist

        if not dist.is_nccl_available():
            raise pytest.UsageError(
                "--dist-backend nccl: this torch build has no NCCL; install a CUDA build of torch "
                "or use --dist-backend gloo"
            )
    if settings.launcher == "torchrun" and config.getoption("numprocesses", default=None):
        raise pytest.UsageError(
            "torchrun mode runs one pytest process per rank and cannot be combined with "
            "pytest-xdist: drop -n (or use --launcher pool without torchrun)"
        )
    return settings


def settings_of(config: pytest.Config) -> HarnessSettings:
    return config.stash[SETTINGS_KEY]


# ---------------------------------------------------------------------- configure

def register_hypothesis_profiles() -> None:
    """Profiles dev / ci / nightly: derandomized (every rank and worker draws the same examples),
    no deadline (distributed cases vary in time), no example database (no cross-run state)."""
    try:
        from hypothesis import HealthCheck
        from hypothesis import settings as hsettings
    except ImportError:
        return
    for name, examples in HYPOTHESIS_PROFILES.items():
        hsettings.register_profile(
            name,
            max_examples=examples,
            deadline=None,
            derandomize=True,
            database=None,
            print_blob=True,
            suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
        )


def default_hypothesis_profile(settings: HarnessSettings, env: dict[str, str] | os._Environ[str]) -> str:
    if settings.tier == "nightly":
        return "nightly"
    return "ci" if env.get("CI", "").lower() not in ("", "0", "false", "no") else "dev"


@pytest.hookimpl(tryfirst=True)
def pytest_configure(config: pytest.Config) -> None:
    for name, description in MARKERS.items():
        config.addinivalue_line("markers", f"{name}: {description}")
    settings = resolve_settings(config)
    config.stash[SETTINGS_KEY] = settings
    harness_settings_module.install(settings)
    _quiet_torchrun_ranks(config, settings)
    # Registered before hypothesis' own plugin reads --hypothesis-profile (hence tryfirst).
    register_hypothesis_profiles()
    if not config.getoption("hypothesis_profile", default=None):
        try:
            from hypothesis import settings as hsettings

            hsettings.load_profile(default_hypothesis_profile(settings, os.environ))
        except ImportError:
            pass


def _quiet_torchrun_ranks(config: pytest.Config, settings: HarnessSettings) -> None:
    """Under torchrun only rank 0 prints the report (it includes every rank's failures).

    Runs before pytest's terminal plugin configures, so blocking its reporter keeps the other
    ranks silent from the first line; their exit status still reflects the shared verdicts.
    """
    if settings.launcher == "torchrun" and os.environ.get("RANK", "0") != "0":
        config.pluginmanager.set_blocked("terminalreporter")


# ---------------------------------------------------------------------- collection

def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    settings = settings_of(config)
    for item in items:
        if item.get_closest_marker("nightly") and settings.tier != "nightly":
            item.add_marker(pytest.mark.skip(
                reason="nightly tier only: run with --tier nightly (or RING_TIER=nightly)"))
        if item.get_closest_marker("gpu") and settings.device != "cuda":
            item.add_marker(pytest.mark.skip(
                reason="needs CUDA: run on a CUDA machine with --device cuda (or RING_DEVICE=cuda)"))
        marker = item.get_closest_marker("world_size")
        if marker is not None and marker.args:
            reason = world_size_skip_reason(int(marker.args[0]), settings)
            if reason:
                item.add_marker(pytest.mark.skip(reason=reason))


def world_size_skip_reason(world_size: int, settings: HarnessSettings) -> str:
    """Why a case of ``world_size`` does not run in this session ("" when it does)."""
    if settings.launcher == "torchrun":
        launched = int(os.environ.get("WORLD_SIZE", "0"))
        if world_size != launched:
            return (f"needs world_size {world_size} but torchrun launched {launched} ranks: "
                    f"launch torchrun with {world_size} ranks in total to run it")
        return ""
    if world_size not in settings.world_sizes:
        enabled = ",".join(map(str, settings.world_sizes))
        wider = ",".join(map(str, sorted({*settings.world_sizes, world_size})))
        return (f"world_size {world_size} not enabled (world sizes: {enabled}): "
                f"add it with --world-sizes {wider} (or RING_WORLD_SIZES), or use --tier nightly")
    return ""


def pytest_collection_finish(session: pytest.Session) -> None:
    # Start the forkserver (which imports torch once for every rank) while pytest gets ready.
    settings = settings_of(session.config)
    if settings.launcher == "pool" and settings.rank_start == "forkserver" and any(
        "rank_pool" in getattr(item, "fixturenames", ()) for item in session.items
    ):
        warm_up()


# ---------------------------------------------------------------------- fixtures

@pytest.fixture(scope="session")
def harness_settings(pytestconfig: pytest.Config) -> HarnessSettings:
    """The session's resolved harness settings (options, RING_* variables, defaults)."""
    return settings_of(pytestconfig)


@pytest.fixture(scope="session")
def world_sizes(harness_settings: HarnessSettings) -> tuple[int, ...]:
    return harness_settings.world_sizes


@pytest.fixture(scope="session")
def device(harness_settings: HarnessSettings) -> str:
    return harness_settings.device


@pytest.fixture(scope="session")
def dist_backend(harness_settings: HarnessSettings) -> str:
    return harness_settings.backend


@pytest.fixture(scope="session")
def tier(harness_settings: HarnessSettings) -> str:
    return harness_settings.tier


@pytest.fixture(scope="session")
def case_timeout(harness_settings: HarnessSettings) -> float:
    return harness_settings.case_timeout


@pytest.fixture(scope="session")
def rank_pool(harness_settings: HarnessSettings) -> Callable[..., Pool]:
    """Factory: ``rank_pool(world_size, backend=None, device=None)`` -> the cached pool.

    Skips (with the reason and how to enable) when the world size is not enabled in this session
    or cannot run here (too few GPUs, another torchrun world size).
    """

    def factory(world_size: int, *, backend: str | None = None, device: str | None = None) -> Pool:
        reason = world_size_skip_reason(world_size, harness_settings)
        if reason:
            pytest.skip(reason)
        try:
            return get_pool(world_size, backend=backend, device=device)
        except PoolUnavailable as exc:
            pytest.skip(str(exc))

    return factory


# ---------------------------------------------------------------------- report

def _version(module: str) -> str:
    try:
        mod = __import__(module)
    except ImportError:
        return "not installed"
    return str(getattr(mod, "__version__", "?"))


def pytest_report_header(config: pytest.Config) -> list[str]:
    from harness.devices import dist_backends, inventory

    settings = settings_of(config)
    lines = [
        f"ring attention: device={settings.device} dist-backend={settings.backend} "
        f"world-sizes={','.join(map(str, settings.world_sizes))} tier={settings.tier} "
        f"case-timeout={settings.case_timeout:g}s rank-threads={settings.rank_threads} "
        f"launcher={settings.launcher} rank-start={settings.rank_start}",
        f"versions: python {platform.python_version()}, torch {_version('torch')}, "
        f"numpy {_version('numpy')}, hypothesis {_version('hypothesis')}",
        "devices: " + "; ".join(inventory()),
        "dist backends: " + ", ".join(dist_backends()),
    ]
    try:
        from hypothesis import settings as hsettings

        lines.append(f"hypothesis profile: {hsettings.get_current_profile_name()}")
    except ImportError:
        pass
    lines.extend(ring_environment_lines())
    if settings.launcher == "torchrun":
        lines.append(f"torchrun: rank {os.environ.get('RANK')} of {os.environ.get('WORLD_SIZE')} "
                     "(rank 0 reports every rank's failures)")
    return lines


def ring_environment_lines(env: dict[str, str] | os._Environ[str] | None = None) -> list[str]:
    """Every RING_* variable, echoed so a typo is visible; unknown names are flagged."""
    env = os.environ if env is None else env
    known = {spec.env for spec in OPTIONS} | set(_ENV_FALLBACKS.values())
    names = sorted(k for k in env if k.startswith("RING_"))
    if not names:
        return ["RING_* environment: (none set)"]
    lines = ["RING_* environment:"]
    for name in names:
        flag = "" if name in known else "  <- not read by any ring attention option: a typo?"
        lines.append(f"  {name}={env[name]}{flag}")
    return lines


# ---------------------------------------------------------------------- teardown

def _shutdown() -> None:
    shutdown_all_pools()
    if "harness.torchrun" in sys.modules:
        from harness.torchrun import shutdown_torchrun_pool

        shutdown_torchrun_pool()


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    _shutdown()


def pytest_unconfigure(config: pytest.Config) -> None:
    _shutdown()
