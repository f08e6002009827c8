"""Calls checked before (``ring_impl.checks.remembered``): a repeated call skips the checks and
the configuration its shapes, options and mask decided, and anything those read makes the call
checked in full again, with the answer a call with nothing remembered gives."""

from __future__ import annotations

import pytest
import torch

from tests.ring_impl.outcomes import assert_input_error_on_every_rank

SEQ = 64


def _inputs(dtype=torch.float32, seq=SEQ, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(1, 4, seq, 16, generator=gen).to(dtype) for _ in range(3)]


class _Counted:
    """Counts the calls of ``ring_impl.api.local_problem`` (the local checks a kept call skips)."""

    def __enter__(self):
        import ring_impl.api as api

        self.api, self.checks, self.n = api, api.local_problem, 0

        def counted(*args, **kwargs):
            self.n += 1
            return self.checks(*args, **kwargs)

        api.local_problem = counted
        return self

    def __exit__(self, *exc):
        self.api.local_problem = self.checks


def _call(ctx, tensors, options, grad: bool):
    import ring_impl

    leaves = [t.detach().clone().requires_grad_(grad) for t in tensors]
    out = ring_impl.ring_attention(*leaves, group=ctx.group, **options)
    out = out[0] if isinstance(out, tuple) else out
    if not grad:
        return (out,)
    return (out, *torch.autograd.grad(out, leaves, torch.ones_like(out)))


def _fresh(ctx, tensors, options, grad: bool):
    """The call with nothing remembered, and forgotten again after it."""
    from ring_impl.checks.remembered import CHECKED

    CHECKED.clear()
    try:
        return _call(ctx, tensors, options, grad)
    finally:
        CHECKED.clear()


def _assert_same(got, want, what: str) -> None:
    for g, w in zip(got, want, strict=True):
        torch.testing.assert_close(g, w, rtol=0, atol=0, equal_nan=True, msg=what)


def _repeat(ctx, case: str):
    """The local checks each of two calls ran (the second is ``case``'s change of the first),
    and whether the second call gave what the same call with nothing remembered gives."""
    import ring_impl
    from ring_impl.checks.remembered import CHECKED
    from ring_impl.masks import Documents
    from ring_impl.ops.cpu import CpuFlashOp

    ids = torch.tensor([0] * 20 + [1] * 30 + [2] * (SEQ - 50), dtype=torch.int32)
    first = dict(is_causal=True, op="cpu_flash")
    tensors = _inputs()
    second_tensors = tensors
    grad = True
    if case == "same":
        second = dict(first)
    elif case == "documents refilled in place":
        first = dict(mask=Documents(ids), op="math")
        second = first  # the same Documents object; its int32 ids written over
    elif case == "dtype":
        second, second_tensors = dict(first), _inputs(torch.float64)
    elif case == "length":
        second, second_tensors = dict(first), _inputs(seq=2 * SEQ)
    elif case == "strides":
        second = dict(first)
        second_tensors = [t.transpose(1, 2).contiguous().transpose(1, 2) for t in tensors]
    elif case == "no grad":
        second, grad = dict(first), False
    elif case == "scale":
        second = dict(first, scale=0.5)
    elif case == "op":
        second = dict(first, op="math")
    elif case == "causal":
        second = dict(first, is_causal=False)
    elif case == "layout":
        second = dict(first, layout="head_tail")
    elif case == "op registered again":
        second = dict(first, op="checked_calls_op")
    else:
        raise AssertionError(case)

    CHECKED.clear()
    if case == "op registered again":
        first = dict(first, op="checked_calls_op")
        ring_impl.register_op(CpuFlashOp(), name="checked_calls_op", replace=True)
    counts = []
    with _Counted() as checks:
        _call(ctx, tensors, first, grad=True)
        counts.append(checks.n)
        if case == "documents refilled in place":
            ids[10:40] = 7  # a new layout of documents in the same tensor
            ids[40:] = 8
        if case == "op registered again":
            ring_impl.register_op(ring_impl.ops.MathOp(), name="checked_calls_op", replace=True)
        got = _call(ctx, second_tensors, second, grad)
        counts.append(checks.n - counts[0])
    want = _fresh(ctx, second_tensors, second, grad)
    _assert_same(got, want, case)
    return counts


#: change -> local checks the second call runs (0: it took what the first call decided)
CHANGES = {
    "same": 0,
    "documents refilled in place": 1,
    "dtype": 1,
    "length": 1,
    "strides": 1,
    "no grad": 1,
    "scale": 1,
    "op": 1,
    "causal": 1,
    "layout": 1,
    "op registered again": 1,
}


@pytest.mark.parametrize("case", sorted(CHANGES))
def test_a_call_is_checked_again_when_anything_its_checks_read_changes(ring, case: str) -> None:
    (counts,) = ring.rank_pool(1).run(_repeat, case, timeout=120.0)
    assert counts == [1, CHANGES[case]], f"{case}: local checks per call {counts}"


def _never_kept(ctx, case: str) -> list[int]:
    from ring_impl.checks.remembered import CHECKED
    from ring_impl.masks import MaskMod
    from ring_impl.score_mods import SoftCap

    options = {
        "mask_mod": dict(mask=MaskMod(lambda b, h, q, kv: kv <= q), op="math"),
        "sinks": dict(is_causal=True, sinks=torch.zeros(4), op="math"),
        "score_mod": dict(is_causal=True, score_mod=SoftCap(20.0)),
        "tensor scale": dict(is_causal=True, scale=torch.tensor(0.25)),
    }[case]
    CHECKED.clear()
    counts = []
    with _Counted() as checks:
        for _ in range(2):
            try:
                _call(ctx, _inputs(), options, grad=False)
            except ValueError:  # (a tensor scale is refused: what matters is that it is checked)
                pass
            counts.append(checks.n)
    return [counts[0], counts[1] - counts[0], len(CHECKED)]


@pytest.mark.parametrize("case", ["mask_mod", "sinks", "score_mod", "tensor scale"])
def test_calls_their_key_cannot_describe_are_checked_every_time(ring, case: str) -> None:
    """A MaskMod's description does not determine it; sinks and a score_mod are data the key
    does not hold; a tensor cannot be hashed."""
    (counts,) = ring.rank_pool(1).run(_never_kept, case, timeout=120.0)
    assert counts == [1, 1, 0], f"{case}: checks per call and calls kept {counts}"


def _boolean_head_chunks(ctx) -> None:
    from ring_impl.checks.remembered import CHECKED

    CHECKED.clear()
    _call(ctx, _inputs(), dict(is_causal=True, head_chunks=1), grad=False)
    _call(ctx, _inputs(), dict(is_causal=True, head_chunks=True), grad=False)


def test_a_boolean_head_chunks_is_refused_after_the_integer_passed(ring) -> None:
    """``True == 1`` and they hash alike: the key holds each option's type too."""
    outcomes = ring.rank_pool(1).run_outcomes(_boolean_head_chunks, timeout=60.0)
    assert_input_error_on_every_rank(outcomes, "head_chunks must be a positive int")


def _second_call_differs(ctx, what: str):
    """Two calls; on the second, the last rank passes ``what`` differently (a dtype its peers do
    not, a NaN in its key), while the other ranks repeat their first call exactly."""
    from ring_impl.checks.remembered import CHECKED

    CHECKED.clear()
    options = dict(is_causal=True, op="cpu_flash")
    tensors = _inputs(seed=ctx.rank)
    _call(ctx, tensors, options, grad=True)
    last = ctx.rank == ctx.world_size - 1
    if what == "dtype" and last:
        tensors = [t.double() for t in tensors]
    if what == "nan" and last:
        tensors[1] = tensors[1].clone()
        tensors[1][0, 2, 5, 3] = float("nan")
    got = _call(ctx, tensors, options, grad=True)
    want = _fresh(ctx, tensors, options, grad=True)
    _assert_same(got, want, what)
    return [bool(t.isnan().any()) for t in got]


def test_a_rank_that_changes_its_call_makes_every_rank_raise(ring) -> None:
    """The other ranks took their kept configuration; the cross-rank check still runs on every
    call, so they raise with the rank that changed."""
    outcomes = ring.rank_pool(2).run_outcomes(_second_call_differs, "dtype", timeout=120.0)
    assert_input_error_on_every_rank(outcomes, "dtype")


def test_a_kept_call_still_learns_of_another_ranks_nan(ring) -> None:
    """The group's finite verdict is the cross-rank check's, made on every call: a NaN that only
    the last rank's key holds on the second call reaches every rank's output as in a call with
    nothing remembered (causal: rank 0's rows see the last rank's keys only in the backward's
    dK/dV, so rank 0's output stays finite and its dK/dV carry it)."""
    results = ring.rank_pool(2).run(_second_call_differs, "nan", timeout=120.0)
    assert any(any(r) for r in results), f"no NaN reached any output: {results}"
