"""The cross-rank input check of an unmasked ``ring_attention`` call inside ``torch.compile``.

Eagerly every call first agrees across the group
(:func:`ring_impl.checks.inputs.agree_across_ranks`, one all-reduce): a rank with bad input, or
ranks that disagree on shapes or options, raise InputError on every rank before any ring collective.
A traced call cannot branch on the result of a collective, so a compiled graph would leave the check
out, and then a rank whose input is bad raises alone while tracing and the others wait in their ring
collectives for ever. Here the check is a custom op the graph keeps, run when the graph runs:

``ring_impl::agree(query, key, value, sinks, call) -> (query, key, value)``
    Runs the eager call's checks (:func:`ring_impl.api.call_path`, found by the call's
    description, :func:`ring_impl.compiled.masked_call.describe_call`), which raise InputError on
    every rank as eagerly, and returns copies of query, key and value that the ring then runs on:
    every collective of the call depends on the op, so no compiler can move one before the check.
    Gradients pass through unchanged.
``ring_impl::refuse(query, key, value, sinks, call, out_shape, lse_shape) -> (out, lse)``
    What a rank traces when its own input is bad (the traced checks raise InputError on this rank
    alone): the same checks, which raise on every rank, in place of the attention. Its outputs
    have the shapes the call would give, so the code after it traces on.

Cost: one all-reduce per call, as eagerly, and a copy of query, key and value: within noise of
the call without them (0.98x-0.99x, W=2, causal, seq 2048 and 8192, inductor, forward and
backward). A call that cannot be described (a value that is not a plain literal) or that does not
give tensors is traced without the check, as before (``CHECK_LEFT_OUT``); so is a call on a
single rank, which has nothing to agree on. An op object is carried by a key this process maps
back to it (``ring_impl.compiled.masked_call._op_literal``).
"""

from __future__ import annotations

import torch

from ..call import Call
from ..checks.inputs import InputError
from .masked_call import describe_call, rebuild_call

__all__ = ["CHECK_LEFT_OUT", "checked_call"]

#: When a compiled call runs without the cross-rank
#: check (each rank still refuses its own bad input).
CHECK_LEFT_OUT = (
    "an option that is not a plain literal, inputs that are not tensors, or a single rank"
)


def checked_call(attend, call_path, bound, query, key, value, call: Call):
    """``attend(bound, call, query, key, value)`` (an unmasked ring_attention call, traced)
    behind the cross-rank check op; None when the call cannot carry it (see CHECK_LEFT_OUT).
    ``call_path``: ring_impl.api.call_path (handed over: this module does not import api)."""
    if not all(isinstance(t, torch.Tensor) for t in (query, key, value)):
        return None
    described = describe_call(bound.name, query, key, call)
    if described is None or described[2] == 1:
        return None
    description = described[0]
    try:  # this rank's own checks, while tracing: InputError for bad input
        call_path(bound.impl, bound.algorithms, call, query, key, value)
        refused = False
    except InputError:
        refused = True
    if refused:
        out_shape, lse_shape = _result_shapes(query, value)
        out, lse = torch.ops.ring_impl.refuse(
            query, key, value, call.sinks, description, out_shape, lse_shape
        )
        return (out, lse) if call.return_lse else out
    q, k, v = torch.ops.ring_impl.agree(query, key, value, call.sinks, description)
    return attend(bound, call, q, k, v)


def _result_shapes(query, value) -> tuple[list[int], list[int]]:
    """The output and LSE shapes the call would have (query's leading dims, value's head dim)."""
    if query.dim() >= 1 and value.dim() >= 1:
        out = [*query.shape[:-1], value.shape[-1]]
    else:
        out = list(query.shape)
    return [int(n) for n in out], [int(n) for n in out[:-1]] if len(out) >= 1 else []


def _run_checks(query, key, value, sinks, call) -> None:
    call_path, impl, algorithms, described = rebuild_call(call, [], sinks)
    call_path(impl, algorithms, described, query, key, value)


@torch.library.custom_op("ring_impl::agree", mutates_args=())
def _agree(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    sinks: torch.Tensor | None,
    call: str,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    _run_checks(query, key, value, sinks, call)
    return query.clone(), key.clone(), value.clone()


@_agree.register_fake
def _(query, key, value, sinks, call):
    return torch.empty_like(query), torch.empty_like(key), torch.empty_like(value)


def _agree_backward(ctx, grad_query, grad_key, grad_value):
    return grad_query, grad_key, grad_value, None, None


_agree.register_autograd(_agree_backward)


@torch.library.custom_op("ring_impl::refuse", mutates_args=())
def _refuse(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    sinks: torch.Tensor | None,
    call: str,
    out_shape: list[int],
    lse_shape: list[int],
) -> tuple[torch.Tensor, torch.Tensor]:
    _run_checks(query, key, value, sinks, call)  # raises InputError on every rank
    raise InputError(  # pragma: no cover - the traced checks refused what the same checks accept
        "ring_attention: the compiled call's input was refused while tracing but passes its "
        "checks when run; please report this with the call's arguments"
    )


@_refuse.register_fake
def _(query, key, value, sinks, call, out_shape, lse_shape):
    return query.new_empty(out_shape), query.new_empty(lse_shape, dtype=torch.float32)


def _refuse_backward(ctx, grad_out, grad_lse):
    return None, None, None, None, None, None, None


_refuse.register_autograd(_refuse_backward)
