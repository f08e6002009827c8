"""Harness settings: their command-line options, environment fallbacks, validation and defaults.

Every setting has a pytest option and a ``RING_*`` environment variable; the option wins, then the
variable, then the default. Parsing is plain Python (no pytest) so it can be unit-tested and used
by scripts; a bad value raises :class:`SettingsError` whose message names the option, the variable
it may have come from, and a valid example. The pytest plugin turns that into ``pytest.UsageError``.

``current()`` is the process-wide settings object that ``get_pool`` reads its defaults from (case
timeout, rank thread count, grace period); the pytest plugin installs the session's settings with
``install()``, scripts may do the same.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, replace
from typing import Any

TIERS = ("quick", "nightly")
DEVICES = ("cpu", "cuda")
BACKENDS = ("gloo", "nccl")
LAUNCHERS = ("auto", "pool", "torchrun", "simulated")
RANK_STARTS = ("forkserver", "spawn")
DEFAULT_WORLD_SIZES = {"quick": (1, 2, 3, 4), "nightly": (1, 2, 3, 4, 5, 6, 7, 8)}
#: World sizes of the suites over 2-D meshes when --world-sizes is not given: their mesh shapes
#: need 6 ranks (2x3, 3x2) in the quick tier and 8 and 16 (4x2, 4x4, 2x8) in the nightly one.
DEFAULT_MESH_WORLD_SIZES = {"quick": (4, 6), "nightly": (4, 6, 8, 16)}
DEFAULT_CASE_TIMEOUT_S = 60.0
# A case that compiles: a cold inductor cache compiles C++ on every rank of the case at once
# (see the measurement in the docstring of HarnessSettings.timeout_for).
DEFAULT_COMPILE_TIMEOUT_S = 600.0
DEFAULT_GRACE_S = 2.0
DEFAULT_RANK_THREADS = 1


class SettingsError(ValueError):
    """A setting has a bad value; the message names the option and says what to use instead."""


@dataclass(frozen=True)
class OptionSpec:
    """One harness setting: its pytest option, environment variable, parser and help text.

    ``parse`` turns the raw string into a value or raises ``ValueError`` with what was wrong;
    ``example`` is a valid value quoted in error messages.
    """

    dest: str
    flag: str
    env: str
    help: str
    parse: Callable[[str], Any]
    example: str
    choices: tuple[str, ...] | None = None
    metavar: str = ""

    @property
    def shown_as(self) -> str:
        """Placeholder in --help: the choices, or the metavar."""
        return "|".join(self.choices) if self.choices else (self.metavar or "VALUE")


def _parse_world_sizes(raw: str) -> tuple[int, ...]:
    parts = [p.strip() for p in raw.replace(" ", ",").split(",") if p.strip()]
    if not parts:
        raise ValueError("no world size given")
    sizes: list[int] = []
    for part in parts:
        if not part.isdigit() or int(part) < 1:
            raise ValueError(f"{part!r} is not a positive integer")
        if int(part) not in sizes:
            sizes.append(int(part))
    return tuple(sorted(sizes))


def _parse_choice(choices: tuple[str, ...]) -> Callable[[str], str]:
    def parse(raw: str) -> str:
        value = raw.strip().lower()
        if value not in choices:
            raise ValueError(f"{raw!r} is not one of {', '.join(choices)}")
        return value

    return parse


def _parse_positive_float(raw: str) -> float:
    try:
        value = float(raw)
    except ValueError:
        raise ValueError(f"{raw!r} is not a number of seconds") from None
    if not value > 0 or value == float("inf"):
        raise ValueError(f"{raw!r} must be a positive, finite number of seconds")
    return value


def _parse_positive_int(raw: str) -> int:
    if not raw.strip().isdigit() or int(raw) < 1:
        raise ValueError(f"{raw!r} is not a positive integer")
    return int(raw)


OPTIONS: tuple[OptionSpec, ...] = (
    OptionSpec(
        "world_sizes",
        "--world-sizes",
        "RING_WORLD_SIZES",
        "Comma-separated world sizes to run (default 1,2,3,4; nightly tier 1..8; suites over 2-D "
        "meshes: 4,6; nightly 4,6,8,16)",
        _parse_world_sizes,
        "1,2,4",
        metavar="N[,N...]",
    ),
    OptionSpec(
        "device",
        "--device",
        "RING_DEVICE",
        "Device the ranks compute on: cpu or cuda (default cpu)",
        _parse_choice(DEVICES),
        "cpu",
        DEVICES,
    ),
    OptionSpec(
        "dist_backend",
        "--dist-backend",
        "RING_DIST_BACKEND",
        "torch.distributed backend: gloo or nccl (default gloo on cpu, nccl on cuda)",
        _parse_choice(BACKENDS),
        "gloo",
        BACKENDS,
    ),
    OptionSpec(
        "case_timeout",
        "--case-timeout",
        "RING_CASE_TIMEOUT",
        "Seconds a distributed case may take before its ranks' stacks are dumped and the pool is "
        "rebuilt (default 60)",
        _parse_positive_float,
        "60",
        metavar="SECONDS",
    ),
    OptionSpec(
        "compile_timeout",
        "--compile-timeout",
        "RING_COMPILE_TIMEOUT",
        "Seconds a case that compiles (marked compile, or a ring case with a torch.compile "
        "backend) may take; covers a cold inductor cache compiling on every rank at once (default "
        "600; the larger of this and --case-timeout applies)",
        _parse_positive_float,
        "600",
        metavar="SECONDS",
    ),
    OptionSpec(
        "tier",
        "--tier",
        "RING_TIER",
        "Test tier: quick (default) or nightly (full matrix, world sizes up to 8, more examples)",
        _parse_choice(TIERS),
        "quick",
        TIERS,
    ),
    OptionSpec(
        "rank_threads",
        "--rank-threads",
        "RING_RANK_THREADS",
        "torch intra-op threads per CPU rank (default 1, so -n auto does not oversubscribe)",
        _parse_positive_int,
        "1",
        metavar="N",
    ),
    OptionSpec(
        "launcher",
        "--launcher",
        "RING_LAUNCHER",
        "How ranks are launched: pool (rank processes per pytest worker), torchrun (this pytest "
        "is one torchrun rank), simulated (every rank a thread of this process, exact "
        "collectives: W up to 64 on CPU, no torch.compile) or auto (torchrun when its environment "
        "is present)",
        _parse_choice(LAUNCHERS),
        "auto",
        LAUNCHERS,
    ),
    OptionSpec(
        "rank_start",
        "--rank-start",
        "RING_RANK_START",
        "How pool ranks start: forkserver (default; forked from a server that imported torch "
        "once, fast) or spawn (fresh interpreters: slow, for debugging a forkserver problem)",
        _parse_choice(RANK_STARTS),
        "spawn",
        RANK_STARTS,
    ),
)


@dataclass(frozen=True)
class HarnessSettings:
    """The resolved settings of one session (or script)."""

    world_sizes: tuple[int, ...] = DEFAULT_WORLD_SIZES["quick"]
    device: str = "cpu"
    backend: str = "gloo"
    case_timeout: float = DEFAULT_CASE_TIMEOUT_S
    compile_timeout: float = DEFAULT_COMPILE_TIMEOUT_S
    tier: str = "quick"
    rank_threads: int = DEFAULT_RANK_THREADS
    launcher: str = "pool"
    rank_start: str = "forkserver"
    grace: float = DEFAULT_GRACE_S
    sources: Mapping[str, str] = field(default_factory=dict)

    def with_(self, **changes: Any) -> HarnessSettings:
        return replace(self, **changes)

    @property
    def mesh_world_sizes(self) -> tuple[int, ...]:
        """World sizes of the suites over 2-D meshes: ``world_sizes`` when given explicitly
        (option or variable), else the tier's :data:`DEFAULT_MESH_WORLD_SIZES`."""
        return (
            self.world_sizes
            if "world_sizes" in self.sources
            else DEFAULT_MESH_WORLD_SIZES[self.tier]
        )

    def runs_world_size(self, world_size: int) -> bool:
        """Whether a case of ``world_size`` ranks runs in this session."""
        return world_size in self.world_sizes or world_size in self.mesh_world_sizes

    def timeout_for(self, *, compiles: bool) -> float:
        """The case timeout of a case, in seconds: ``case_timeout``, or for a case that compiles
        the larger of ``case_timeout`` and ``compile_timeout``.

        Why a separate bound: with an empty inductor cache every rank of a compiled case
        generates and builds C++ at the same time. Measured on 2 shared CPU cores (torch 2.13,
        empty ``TORCHINDUCTOR_CACHE_DIR``), ``tests/ring_impl/test_head_chunks.py::
        test_chunked_ring_compiles_in_one_order[allgather-inductor]`` (W=3, causal head_tail)
        took 162 s alone while other processes kept the load average near 12, and 154 s with its
        ``p2p`` twin compiling at the same time under ``-n 2``; 17 s with a warm cache. The
        default, 600 s, is about 3.7 times the slowest cold run: a slower core or one more
        compile at once still fits, and a hang in one of the few compiling cases is still
        reported within 10 minutes.
        """
        return max(self.case_timeout, self.compile_timeout) if compiles else self.case_timeout


def default_backend(device: str) -> str:
    """The natural backend of a device: nccl for cuda, gloo otherwise."""
    return "nccl" if device == "cuda" else "gloo"


def torchrun_env_present(env: Mapping[str, str]) -> bool:
    """True when this process was launched as one rank by torchrun (or another env:// launcher)."""
    return all(env.get(k) for k in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"))


def resolve(cli: Mapping[str, Any], env: Mapping[str, str] | None = None) -> HarnessSettings:
    """Resolve settings from option values (``None`` = not given) and the environment.

    Raises :class:`SettingsError` naming the option (and variable) and a valid example.
    """
    env = os.environ if env is None else env
    values: dict[str, Any] = {}
    sources: dict[str, str] = {}
    for spec in OPTIONS:
        raw = cli.get(spec.dest)
        origin = spec.flag
        if raw is None and env.get(spec.env, "").strip():
            raw, origin = env[spec.env], f"{spec.env} (environment)"
        if raw is None:
            continue
        try:
            values[spec.dest] = spec.parse(str(raw))
        except ValueError as exc:
            raise SettingsError(
                f"{spec.flag}: {exc} (value from {origin}); use e.g. {spec.flag} {spec.example}"
                + (f" or unset {spec.env}" if origin != spec.flag else "")
            ) from None
        sources[spec.dest] = origin

    tier = values.get("tier", "quick")
    device = values.get("device", "cpu")
    backend = values.get("dist_backend", default_backend(device))
    if backend == "nccl" and device != "cuda":
        raise SettingsError(
            "--dist-backend nccl needs --device cuda (nccl only moves GPU tensors); "
            "use --dist-backend gloo for CPU ranks"
        )
    launcher = values.get("launcher", "auto")
    if launcher == "auto":
        launcher = "torchrun" if torchrun_env_present(env) else "pool"
    elif launcher == "torchrun" and not torchrun_env_present(env):
        raise SettingsError(
            "--launcher torchrun: RANK, WORLD_SIZE, MASTER_ADDR and MASTER_PORT are not all set; "
            "start pytest through torchrun (torchrun --nproc-per-node=2 -m pytest ...) "
            "or use --launcher pool"
        )
    return HarnessSettings(
        world_sizes=values.get("world_sizes", DEFAULT_WORLD_SIZES[tier]),
        device=device,
        backend=backend,
        case_timeout=values.get("case_timeout", DEFAULT_CASE_TIMEOUT_S),
        compile_timeout=values.get("compile_timeout", DEFAULT_COMPILE_TIMEOUT_S),
        tier=tier,
        rank_threads=values.get("rank_threads", DEFAULT_RANK_THREADS),
        launcher=launcher,
        rank_start=values.get("rank_start", "forkserver"),
        sources=sources,
    )


_current: HarnessSettings | None = None


def current() -> HarnessSettings:
    """The settings of this process: installed by the pytest plugin, else resolved from RING_*."""
    global _current
    if _current is None:
        _current = resolve({})
    return _current


def install(settings: HarnessSettings) -> None:
    """Make ``settings`` the process-wide defaults for pools created from now on."""
    global _current
    _current = settings
