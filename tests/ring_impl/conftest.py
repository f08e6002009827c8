"""ring_impl's own tests: they call ring_impl itself (its API, kernels and internals), so with
another implementation under test (``--impl``) every one of them skips, said here once. The
suites are what test that implementation."""

from __future__ import annotations

import pytest

from conformance.implementation import DEFAULT_IMPL_SPEC


@pytest.fixture(autouse=True)
def _ring_impl_under_test(impl) -> None:
    if impl.spec != DEFAULT_IMPL_SPEC:
        pytest.skip(
            f"ring_impl's own test; the implementation under test is {impl.spec} (run without "
            "--impl to check ring_impl)"
        )
