"""pytest integration: the "ring attention" options, markers, fixtures, report header, profiles.

Loaded through the ``harness.pytest_plugin`` ``pytest11`` entry point of the installed package,
by a root ``conftest.py`` (``pytest_plugins = ["harness.pytest_plugin"]``), or with
``-p harness.pytest_plugin``.

Adding an option: call :func:`add_ring_option` from a ``pytest_addoption`` hook (here or in another
plugin module); it lands in the same "ring attention" group, its
``RING_*`` variable is echoed in the report header and read by :func:`ring_option` when the option
is not given. Harness settings themselves are declared in :data:`harness.settings.OPTIONS`.

Markers: ``quick`` (a case of the quick tier), ``nightly`` (a case only the nightly tier has;
skipped unless ``--tier nightly``), ``gpu`` (skipped unless ``--device cuda``), ``compile``
(compiles with torch.compile: its case timeout is ``--compile-timeout``; skipped on the simulated
launcher), ``process_state`` (changes process-wide state on every rank; skipped on the simulated
launcher), ``world_size(n)`` or
``world_size(n=N)`` (skipped unless n is enabled; ``-m "world_size(n=2)"`` selects by it). Every
skip says why and how to enable the test. Any test may apply them; the conformance suites'
plugins apply them to every suite case.

Fixtures: ``rank_pool`` (factory: ``rank_pool(world_size)`` -> pool, skipping when that world
size is not enabled or cannot run here), ``harness_settings``, ``world_sizes``, ``device``,
``dist_backend``, ``tier``, ``case_timeout`` (this test's: the compile timeout for a test marked
``compile``).

:func:`repro_args` gives the ring options of this session that differ from their defaults (from
the command line or a ``RING_*`` variable), so a printed repro command reproduces the session.
"""

from __future__ import annotations

import os
import platform
import shlex
from collections.abc import Callable
from typing import Any

import pytest

from harness import settings as harness_settings_module
from harness.errors import PoolUnavailable
from harness.launchers import get_pool, shutdown_all_pools, warm_up
from harness.pool_base import Pool
from harness.settings import OPTIONS, HarnessSettings, SettingsError

OPTION_GROUP = "ring attention"
OPTION_GROUP_DESCRIPTION = "ring attention conformance (each option also reads a RING_* variable)"
SETTINGS_KEY = pytest.StashKey[HarnessSettings]()

# dest -> environment variable, for every option registered through add_ring_option.
_ENV_FALLBACKS: dict[str, str] = {}
# dest -> command-line flag, for the same options.
_FLAGS: dict[str, str] = {}

MARKERS = {
    "quick": (
        "a case of the quick tier (the default tier, minutes on 2 CPU cores: every suite case of "
        "a default run, and those of --tier nightly that the quick tier runs too); select with -m "
        "quick"
    ),
    "nightly": (
        "a case only the nightly tier has (full matrix, slow); collected with --tier nightly "
        "(RING_TIER=nightly), skipped otherwise; select with -m nightly"
    ),
    "gpu": (
        "needs CUDA; skipped unless run on a CUDA machine with --device cuda (or RING_DEVICE=cuda)"
    ),
    "compile": (
        "uses torch.compile; its case timeout is --compile-timeout (a cold inductor cache "
        "compiles on every rank); leave these out with -m 'not compile'"
    ),
    "process_state": "changes process-wide state on every rank (patches a module attribute such "
    "as F.scaled_dot_product_attention): needs a process per rank; skipped on "
    "--launcher simulated",
    "world_size(n)": "needs world size n; skipped unless n is in --world-sizes (RING_WORLD_SIZES); "
    "suite cases carry world_size(n=N): select with -m 'world_size(n=2)'",
}

HYPOTHESIS_PROFILES = {"dev": 20, "ci": 10, "nightly": 100}


# ---------------------------------------------------------------------- options


def add_ring_option(
    parser: pytest.Parser, flag: str, *, env: str, help: str, dest: str | None = None, **kwargs: Any
) -> None:
    """Register ``flag`` in the "ring attention" group with ``env`` as its fallback variable.

    The option's default is ``None`` so :func:`ring_option` can tell "not given" from a value.
    """
    dest = dest or flag.lstrip("-").replace("-", "_")
    group = parser.getgroup(OPTION_GROUP, OPTION_GROUP_DESCRIPTION)
    group.addoption(flag, dest=dest, default=None, help=f"{help} [env: {env}]", **kwargs)
    _ENV_FALLBACKS[dest] = env
    _FLAGS[dest] = flag


def ring_option(config: pytest.Config, dest: str, default: Any = None) -> Any:
    """The value of a ring option: the command line, else its RING_* variable, else ``default``."""
    value = config.getoption(dest, default=None)
    if value is None:
        env = _ENV_FALLBACKS.get(dest)
        value = os.environ.get(env) if env else None
    return default if value is None else value


def repro_args(config: pytest.Config, *, exclude: tuple[str, ...] = ("report_dir",)) -> list[str]:
    """``[flag, value, ...]`` for every ring option this session was given, on the command line
    or through its ``RING_*`` variable (the variable shown as its flag), in registration order.

    ``exclude``: option dests left out (by default ``report_dir``: where files go does not change
    a verdict). A repro command built from these runs the same configuration in a shell whose
    environment has no ``RING_*`` variables.
    """
    args: list[str] = []
    for dest, flag in _FLAGS.items():
        if dest in exclude or dest.removeprefix("ring_") in exclude:
            continue
        value = ring_option(config, dest)
        if value is not None and str(value).strip():
            args += [flag, str(value)]
    return args


def repro_command(config: pytest.Config, nodeid: str, *extra: str) -> str:
    """A shell command that re-runs ``nodeid`` alone with this session's ring options."""
    words = ["pytest", nodeid, *repro_args(config), *extra]
    return " ".join(shlex.quote(w) for w in words)


def pytest_addoption(parser: pytest.Parser) -> None:
    for spec in OPTIONS:
        add_ring_option(
            parser,
            spec.flag,
            env=spec.env,
            help=spec.help,
            dest=f"ring_{spec.dest}",
            metavar=spec.shown_as,
        )


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


def default_hypothesis_profile(
    settings: HarnessSettings, env: dict[str, str] | os._Environ[str]
) -> str:
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
            item.add_marker(
                pytest.mark.skip(
                    reason="nightly tier only: run with --tier nightly (or RING_TIER=nightly)"
                )
            )
        if item.get_closest_marker("gpu") and settings.device != "cuda":
            item.add_marker(
                pytest.mark.skip(
                    reason=(
                        "needs CUDA: run on a CUDA machine with --device cuda (or RING_DEVICE=cuda)"
                    )
                )
            )
        if settings.launcher == "simulated":
            _skip_what_threads_cannot_run(item)
        marker = item.get_closest_marker("world_size")
        n = marker_world_size(marker)
        if n is not None:
            reason = world_size_skip_reason(n, settings)
            if reason:
                item.add_marker(pytest.mark.skip(reason=reason))


#: Markers of what the simulated world's rank threads cannot run, and why.
_NEEDS_RANK_PROCESSES = {
    "compile": "uses torch.compile, which cannot run on the simulated world's rank threads "
    "(dynamo is not thread-safe)",
    "process_state": "changes process-wide state on every rank, which the simulated world's rank "
    "threads share",
}


def _skip_what_threads_cannot_run(item: pytest.Item) -> None:
    """On the simulated launcher (ranks are threads of one process): skip what needs a process
    per rank, saying why and how to run it."""
    for marker, why in _NEEDS_RANK_PROCESSES.items():
        if item.get_closest_marker(marker):
            item.add_marker(
                pytest.mark.skip(reason=f"{why}: run it with --launcher pool (the default)")
            )
            return


def marker_world_size(marker: pytest.Mark | None) -> int | None:
    """n of ``world_size(n)`` or ``world_size(n=N)`` (None without the marker)."""
    if marker is None:
        return None
    if "n" in marker.kwargs:
        return int(marker.kwargs["n"])
    return int(marker.args[0]) if marker.args else None


def world_size_skip_reason(world_size: int, settings: HarnessSettings) -> str:
    """Why a case of ``world_size`` does not run in this session ("" when it does)."""
    if settings.launcher == "torchrun":
        launched = int(os.environ.get("WORLD_SIZE", "0"))
        if world_size != launched:
            return (
                f"needs world_size {world_size} but torchrun launched {launched} ranks: "
                f"launch torchrun with {world_size} ranks in total to run it"
            )
        return ""
    if not settings.runs_world_size(world_size):
        enabled = ",".join(map(str, settings.world_sizes))
        wider = ",".join(map(str, sorted({*settings.world_sizes, world_size})))
        mesh = ",".join(map(str, settings.mesh_world_sizes))
        return (
            f"world_size {world_size} not enabled (world sizes: {enabled}): "
            f"add it with --world-sizes {wider} (or RING_WORLD_SIZES), or use --tier nightly"
            + (f" (suites over 2-D meshes run {mesh})" if mesh != enabled else "")
        )
    return ""


def pytest_collection_finish(session: pytest.Session) -> None:
    # Start the forkserver (which imports torch once for every rank) while pytest gets ready.
    if any("rank_pool" in getattr(item, "fixturenames", ()) for item in session.items):
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


@pytest.fixture
def case_timeout(request: pytest.FixtureRequest, harness_settings: HarnessSettings) -> float:
    """This test's case timeout in seconds (``--compile-timeout``
    bound for a test marked ``compile``)."""
    return harness_settings.timeout_for(
        compiles=request.node.get_closest_marker("compile") is not None
    )


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
        f"case-timeout={settings.case_timeout:g}s compile-timeout={settings.compile_timeout:g}s "
        f"rank-threads={settings.rank_threads} "
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
        lines.append(
            f"torchrun: rank {os.environ.get('RANK')} of {os.environ.get('WORLD_SIZE')} "
            "(rank 0 reports every rank's failures)"
        )
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


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    shutdown_all_pools()


def pytest_unconfigure(config: pytest.Config) -> None:
    shutdown_all_pools()
