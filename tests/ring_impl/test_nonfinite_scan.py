"""The causal prefix/suffix ``any`` of ``ring_impl.numerics.nonfinite`` against the running maximum
it replaces (``torch.cummax``, a scan that on CUDA also writes int64 indices per element)."""

from __future__ import annotations

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from ring_impl.numerics.nonfinite import _prefix_any, _suffix_any


@settings(max_examples=200, deadline=None)
@given(
    b=st.integers(1, 2),
    h=st.integers(1, 3),
    n=st.integers(1, 40),
    d=st.integers(0, 4),
    density=st.sampled_from([0.0, 0.05, 0.3, 1.0]),
    seed=st.integers(0, 2**16),
)
def test_prefix_and_suffix_any_equal_running_maximum(b, h, n, d, density, seed) -> None:
    gen = torch.Generator().manual_seed(seed)
    shape = (b, h, n, d) if d else (b, h, n)
    flags = torch.rand(shape, generator=gen) < density
    running = torch.cummax(flags.to(torch.uint8), dim=2).values.bool()
    assert torch.equal(_prefix_any(flags, n), running)
    if not d:
        from_end = torch.cummax(flags.to(torch.uint8).flip(2), dim=2).values.bool().flip(2)
        assert torch.equal(_suffix_any(flags, n), from_end)


def test_the_all_finite_shortcut_is_taken_only_when_nothing_is_non_finite() -> None:
    """The ring skips the NaN propagation for a block only when all_finite says so: it must say
    False for any NaN or inf (and may say False for a finite tensor whose sum overflows)."""
    from ring_impl.exchanges.ring import RingAttention

    impl = RingAttention()
    x = torch.randn(2, 3, 5, 4)
    assert impl.all_finite(x, x.double())
    for bad in (float("nan"), float("inf"), float("-inf")):
        y = x.clone()
        y[1, 2, 3, 0] = bad
        assert not impl.all_finite(x, y), f"{bad} not seen"
    big = torch.full((4,), 3e38)
    assert not impl.all_finite(big)  # overflowing sum: the propagation runs, which changes nothing
    assert not impl.all_finite(
        torch.tensor([float("inf"), float("-inf")])
    )  # inf - inf = nan, still seen
