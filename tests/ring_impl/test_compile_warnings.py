"""A compiled call warns nothing of the library's own.

Dynamo warns, once per call site, when it traces a function behind ``functools.lru_cache``: it
drops the cache and says the result may be silently wrong. The ring's host planners (a layout's
runs, the step plans) are pure functions of ints and strings, so nothing is wrong, but a user
compiling a model would read a warning of possible silent incorrectness for every planner on the
path. They are cached with :func:`ring_impl.memo.host_memo`, which calls the plain function while
compiling. Dynamo warns each message once per process, so the test forgets the messages it has
warned (``torch._dynamo.utils.warn_once_cache``) before compiling.
"""

from __future__ import annotations

import warnings

import pytest
import torch


def _compiled_warnings(ctx) -> list[str] | None:
    """The first line of every warning three compiled calls give; None where this torch keeps no
    ``warn_once_cache`` to clear (a warning given earlier in the process would then be missed)."""
    import torch._dynamo
    import torch._dynamo.utils

    import ring_impl
    from ring_impl.masks import Documents, SlidingWindow

    torch._dynamo.reset()
    warned = getattr(torch._dynamo.utils, "warn_once_cache", None)
    if not isinstance(warned, set):
        return None
    warned.clear()
    gen = torch.Generator().manual_seed(ctx.rank)
    q = torch.randn(1, 4, 8, 8, generator=gen, requires_grad=True)
    k, v = (torch.randn(1, 2, 8, 8, generator=gen, requires_grad=True) for _ in range(2))
    calls = (
        {"is_causal": True, "layout": "head_tail"},
        {"mask": SlidingWindow(3, 0)},
        {"mask": Documents(torch.tensor([0] * 5 + [1] * 11))},
    )
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for options in calls:
            fn = torch.compile(ring_impl.ring_attention, backend="aot_eager")
            fn(q, k, v, group=ctx.group, **options).sum().backward()
    return [str(w.message).splitlines()[0] for w in caught]


def test_a_compiled_call_warns_nothing_of_the_librarys(ring) -> None:
    for rank, messages in enumerate(ring.rank_pool(2).run(_compiled_warnings, timeout=240.0)):
        if messages is None:
            pytest.skip(
                "this torch keeps no torch._dynamo.utils.warn_once_cache, so warnings already "
                "given in the rank process cannot be seen again; run on a torch that keeps it "
                "(2.13 does)"
            )
        ours = [m for m in messages if "lru_cache" in m or "ring_impl" in m]
        assert not ours, f"rank {rank}: a compiled call warned: {ours}"


def test_host_memo_caches_eager_calls_and_traces_the_function_when_compiled() -> None:
    from ring_impl.memo import host_memo

    calls = []

    @host_memo(maxsize=4)
    def plan(n: int) -> tuple[int, ...]:
        calls.append(n)
        return tuple(range(n))

    assert plan(3) == plan(3) == (0, 1, 2)
    assert calls == [3], "a repeated eager call ran the function again"
    assert plan.cache_info().hits == 1

    @torch.compile(backend="eager", fullgraph=True)
    def use(x):
        return x + len(plan(5))

    assert float(use(torch.zeros(()))) == 5.0
    assert calls == [3, 5], "the compiled trace did not run the function itself"
    plan.cache_clear()
    assert plan.cache_info().currsize == 0
