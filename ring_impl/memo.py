"""A least-recently-used cache of pure host functions that ``torch.compile`` traces through.

Planning functions (a layout's runs, a ring's step plans) take ints and strings and give the
same answer every time, so eager calls keep their results. Under ``torch.compile`` Dynamo
ignores a ``functools.lru_cache`` wrapper, traces the function inside and warns that the cache
may hide a wrong answer ("silent incorrectness"), once per call site: a user compiling a model
would see a warning for every cached planner on its path. :func:`host_memo` calls the function
itself while compiling (its results are constants of the graph either way) and the cache
otherwise.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any, TypeVar

import torch

__all__ = ["host_memo"]

F = TypeVar("F", bound=Callable[..., Any])


def host_memo(maxsize: int) -> Callable[[F], F]:
    """``functools.lru_cache(maxsize)`` for eager calls; while compiling, the plain function.
    The wrapper keeps ``cache_clear`` and ``cache_info``."""

    def wrap(fn: F) -> F:
        cached = functools.lru_cache(maxsize=maxsize)(fn)

        @functools.wraps(fn)
        def call(*args, **kwargs):
            if torch.compiler.is_compiling():
                return fn(*args, **kwargs)
            return cached(*args, **kwargs)

        call.cache_clear = cached.cache_clear  # type: ignore[attr-defined]
        call.cache_info = cached.cache_info  # type: ignore[attr-defined]
        return call  # type: ignore[return-value]

    return wrap
