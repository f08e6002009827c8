"""Option and RING_* variable resolution and validation
(pure unit tests plus two real pytest runs)."""

from __future__ import annotations

import pytest

from harness.settings import DEFAULT_WORLD_SIZES, SettingsError, resolve
from tests.harness.subproc import run_pytest

TORCHRUN_ENV = {"RANK": "0", "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29500"}


def test_defaults() -> None:
    s = resolve({}, {})
    assert (
        s.world_sizes,
        s.device,
        s.backend,
        s.case_timeout,
        s.tier,
        s.rank_threads,
        s.launcher,
        s.rank_start,
    ) == ((1, 2, 3, 4), "cpu", "gloo", 60.0, "quick", 1, "pool", "forkserver")


def test_compile_timeout_covers_cases_that_compile() -> None:
    s = resolve({}, {})
    assert (s.compile_timeout, s.timeout_for(compiles=True), s.timeout_for(compiles=False)) == (
        600.0,
        600.0,
        60.0,
    )
    s = resolve({"case_timeout": "900"}, {"RING_COMPILE_TIMEOUT": "120"})
    assert (s.compile_timeout, s.timeout_for(compiles=True)) == (
        120.0,
        900.0,
    )  # never below the case timeout
    with pytest.raises(SettingsError, match="--compile-timeout: 'x' is not a number of seconds"):
        resolve({"compile_timeout": "x"}, {})


def test_nightly_tier_widens_the_default_world_sizes() -> None:
    assert (
        resolve({"tier": "nightly"}, {}).world_sizes
        == DEFAULT_WORLD_SIZES["nightly"]
        == tuple(range(1, 9))
    )


def test_environment_is_the_fallback_and_the_option_wins() -> None:
    env = {
        "RING_WORLD_SIZES": "4,2",
        "RING_CASE_TIMEOUT": "12.5",
        "RING_TIER": "nightly",
        "RING_RANK_THREADS": "2",
    }
    s = resolve({}, env)
    assert (s.world_sizes, s.case_timeout, s.tier, s.rank_threads) == ((2, 4), 12.5, "nightly", 2)
    assert s.sources["world_sizes"] == "RING_WORLD_SIZES (environment)"
    s = resolve({"world_sizes": "1,3", "case_timeout": "5"}, env)
    assert (s.world_sizes, s.case_timeout) == ((1, 3), 5.0)
    assert s.sources["world_sizes"] == "--world-sizes"


def test_cuda_defaults_to_nccl_and_gloo_can_share_gpus() -> None:
    assert resolve({"device": "cuda"}, {}).backend == "nccl"
    assert resolve({"device": "cuda", "dist_backend": "gloo"}, {}).backend == "gloo"


@pytest.mark.parametrize(
    ("cli", "env", "expected"),
    [
        (
            {"world_sizes": "1,x"},
            {},
            "--world-sizes: 'x' is not a positive integer (value from --world-sizes); use e.g. "
            "--world-sizes 1,2,4",
        ),
        ({"world_sizes": "0"}, {}, "--world-sizes: '0' is not a positive integer"),
        (
            {},
            {"RING_WORLD_SIZES": "two"},
            "value from RING_WORLD_SIZES (environment)); use e.g. --world-sizes 1,2,4 or unset "
            "RING_WORLD_SIZES",
        ),
        ({"device": "tpu"}, {}, "--device: 'tpu' is not one of cpu, cuda"),
        ({"dist_backend": "mpi"}, {}, "--dist-backend: 'mpi' is not one of gloo, nccl"),
        (
            {"case_timeout": "-1"},
            {},
            "--case-timeout: '-1' must be a positive, finite number of seconds",
        ),
        ({"case_timeout": "soon"}, {}, "--case-timeout: 'soon' is not a number of seconds"),
        ({"tier": "weekly"}, {}, "--tier: 'weekly' is not one of quick, nightly"),
        ({"rank_threads": "0"}, {}, "--rank-threads: '0' is not a positive integer"),
        ({"dist_backend": "nccl"}, {}, "--dist-backend nccl needs --device cuda"),
        ({"launcher": "torchrun"}, {}, "start pytest through torchrun"),
        ({}, {"RING_RANK_START": "fork"}, "--rank-start: 'fork' is not one of forkserver, spawn"),
    ],
)
def test_bad_values_name_the_option_and_the_fix(
    cli: dict[str, str], env: dict[str, str], expected: str
) -> None:
    with pytest.raises(SettingsError) as info:
        resolve(cli, env)
    assert expected in str(info.value)


def test_launcher_follows_the_torchrun_environment() -> None:
    assert resolve({}, TORCHRUN_ENV).launcher == "torchrun"
    assert resolve({"launcher": "pool"}, TORCHRUN_ENV).launcher == "pool"
    assert resolve({"launcher": "torchrun"}, TORCHRUN_ENV).launcher == "torchrun"


def test_bad_option_stops_pytest_at_start_with_a_usage_error() -> None:
    result = run_pytest("--world-sizes", "2,zero", "--co", "-q", "tests/harness/test_settings.py")
    assert result.returncode == 4, result.stdout  # pytest's usage-error exit code
    assert "--world-sizes: 'zero' is not a positive integer" in result.stdout
    assert "use e.g. --world-sizes 1,2,4" in result.stdout


def test_bad_environment_variable_stops_pytest_naming_the_variable() -> None:
    result = run_pytest("--co", "-q", "tests/harness/test_settings.py", env={"RING_DEVICE": "tpu"})
    assert result.returncode == 4, result.stdout
    assert (
        "--device: 'tpu' is not one of cpu, cuda (value from RING_DEVICE (environment))"
        in result.stdout
    )
    assert "unset RING_DEVICE" in result.stdout
