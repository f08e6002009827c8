"""Masked ``ring_attention`` inside ``torch.compile``, ``fullgraph=True`` included: the call as a
pair of custom ops that every backend (eager, aot_eager, inductor) keeps as one opaque call.

A masked call's plan is data: the mask evaluated on global positions
(:mod:`ring_impl.planning.plan`), packed documents' ids included. Traced into a graph it could only
be baked in, and served stale to the next batch's documents. Here the graph holds the call instead,
and the plan is made (or found in the plan cache) when the op runs, from the tensors it is given:

``ring_impl::masked_ring(query, key, value, sinks, mask_tensors, call) -> (out, lse, handle)``
    ``call`` is the call's description as a Python literal (the mask's structure with its
    tensors replaced by indices into ``mask_tensors``, the strategy, the process groups by name,
    every option), which the traced code builds from the mask's attributes; dynamo guards on
    those, so a mask with another window or prefix recompiles, while documents with other ids (a
    tensor) reuse the graph and get their own plan. The op runs :func:`ring_impl.api.call_path`,
    the eager call's checks included (InputError on every rank, across ranks before any
    collective), and the path's forward. ``sinks`` is only checked there: the sink term is
    applied after the op, in the graph, so autograd gives dsinks. ``handle`` (an int64 scalar on
    the host) names what the backward needs beyond the graph's tensors (the path, its plan, a
    received halo or gathered block), held until the handle tensor is freed, as autograd holds
    saved tensors.
``ring_impl::masked_ring_backward(grad_out, grad_lse, query, key, value, out, lse, handle)
-> (dq, dk, dv)``
    The path's backward: the same collectives as the eager call's. The graph gives it the
    tensors it keeps for it (inputs and outputs): a buffer the graph does not know is held could
    be reused for another result. ``grad_lse`` is None when the LSE is not used (compiled graphs
    give zeros for an unused output's gradient; the eager backward would not see them).

Runs in the graph: every built-in mask, and a :class:`~ring_impl.masks.MaskMod` (a routed flex
call's too), whose function the traced code runs on the global grid into a table of bits
(:mod:`ring_impl.planning.mask_table`: a function is Python the op could only find by identity, and
a table is data), with every strategy and path (the ring, the halo exchange, the sparse gather,
Ulysses, the hybrid: :func:`ring_impl.api.call_path`), an op given by name or as an object (carried
by a key this process maps back to it), and any ``group=`` form (the ops find the process groups by
name). Anything else (a table over ``MAX_TABLE_BITS``, a Mask subclass) runs eagerly inside the
compiled region, a graph break (``MASKS_RUN_EAGERLY`` in :mod:`ring_impl.api`).

A MaskMod's table is evaluated before the op, on every rank, in the graph: a function failing there
on some ranks' data only (an index out of range, an integer divided by zero) is evaluated under
:class:`~ring_impl.planning.mask_table.EvaluationGuard`, whose flag the op's checks turn into
InputError on every rank; raised in the graph, it would leave the other ranks waiting in the op's
cross-rank check. Other failures of the function when the graph runs (an assertion of its own) are
not caught so.
"""

from __future__ import annotations

import ast
import dis
import functools
import itertools
import operator
import types
import weakref
from collections.abc import Callable, Mapping
from functools import lru_cache

import torch

from ..call import Call, kv_shards, strategy_of
from ..exchanges.ring import RingAttention
from ..masks import (
    And,
    Causal,
    ChunkedCausal,
    Documents,
    Full,
    KeyRanges,
    MaskMod,
    Or,
    PrefixLM,
    SlidingWindow,
)
from ..planning.mask_table import EvaluationGuard, VisibilityTable, pack_visibility
from ..sinks import sinks_problem, with_sinks

__all__ = ["describe_call", "masked_ring_call", "rebuild_call", "register_impl", "saved_states"]

#: name -> (a RingAttention variant, its head-parallel algorithms or None, the function that checks
#: a call and returns its Path: ring_impl.api.call_path, handed over so this module does not import
#: api)
_IMPLS: dict[str, tuple[RingAttention, Mapping | None, Callable]] = {}
#: handle -> (path, saved tensors, meta) of a forward whose backward has not been freed yet
_SAVED: dict[int, tuple] = {}
_HANDLES = itertools.count()


def register_impl(impl: RingAttention, algorithms: Mapping | None, call_path: Callable) -> str:
    """The name the ops find ``impl``, ``algorithms`` and ``call_path`` by (``ring_impl.bind``
    registers what it binds)."""
    for name, (known, known_algorithms, known_call) in _IMPLS.items():
        if known is impl and known_algorithms is algorithms and known_call is call_path:
            return name
    name = f"{type(impl).__module__}.{type(impl).__qualname__}#{len(_IMPLS)}"
    _IMPLS[name] = (impl, algorithms, call_path)
    return name


def saved_states() -> int:
    """How many compiled masked forwards' saved states are held (for tests of their lifetime)."""
    return len(_SAVED)


class _NotLiteral(Exception):
    """A value the call description cannot carry: the call runs eagerly."""


def _literal(x) -> str:
    """``x`` (None, bool, int, float, str) as a Python literal, in forms dynamo traces: an int
    read from an argument's attribute may be a SymInt after a recompile, and operator.index
    specialises it (with a guard); a float is carried exactly, as its hex form."""
    if x is None:
        return "None"
    if isinstance(x, bool):
        return "True" if x else "False"
    if isinstance(x, int):
        return str(operator.index(x))
    if isinstance(x, float):
        return f"('{_FLOAT}', '{float(x).hex()}')"
    if isinstance(x, str):
        return repr(x)
    raise _NotLiteral(type(x).__name__)


_FLOAT = "__float__"


def _decode(x):
    """Undo :func:`_literal`'s float form inside a parsed description."""
    if isinstance(x, tuple):
        if len(x) == 2 and x[0] == _FLOAT:
            return float.fromhex(x[1])
        return tuple(_decode(v) for v in x)
    if isinstance(x, dict):
        return {k: _decode(v) for k, v in x.items()}
    return x


# read for real while dynamo traces: a fact of the code, not the data
@torch._dynamo.assume_constant_result
def raises_itself(fn) -> bool:
    """Whether ``fn``'s own code (its body and the functions defined in it; not what it calls)
    holds an ``assert`` or a ``raise``: read from the bytecode, the same on every rank."""
    call = vars(type(fn)).get(
        "__call__"
    )  # a callable object's method (a function has its own code)
    code = getattr(fn, "__code__", None) or getattr(call, "__code__", None)
    if code is None:
        return False
    pending, seen = [code], set()
    while pending:
        c = pending.pop()
        if id(c) in seen:
            continue
        seen.add(id(c))
        if any(
            i.opname in ("RAISE_VARARGS", "LOAD_ASSERTION_ERROR") for i in dis.get_instructions(c)
        ):
            return True
        pending += [k for k in c.co_consts if isinstance(k, types.CodeType)]
    return False


def _structure(mask, tensors: list, grid: dict) -> str:
    """``mask``'s structure as a Python literal tuple; its tensors appended to ``tensors`` and
    named by index. Exact types only: a subclass may see differently. A ``MaskMod`` is evaluated
    here, in the traced code, on the global grid ``grid`` (batch, heads, seq_q, seq_kv) into a
    :class:`~ring_impl.planning.mask_table.VisibilityTable`
    (:mod:`ring_impl.planning.mask_table`)."""
    kind = type(mask)
    if kind is Full:
        return "('full',)"
    if kind is Causal:
        return "('causal',)"
    if kind is SlidingWindow:
        return f"('window', {_literal(mask.left)}, {_literal(mask.right)})"
    if kind is ChunkedCausal:
        return f"('chunked', {_literal(mask.chunk)})"
    if kind is PrefixLM:
        return f"('prefix', {_literal(mask.prefix)})"
    if kind is Documents:
        ids = []
        for t in (mask.doc_ids, mask.kv_doc_ids):
            if t is None:
                ids.append("None")
            elif isinstance(t, torch.Tensor):
                tensors.append(t)
                ids.append(str(len(tensors) - 1))
            else:
                raise _NotLiteral("Documents ids that are not a tensor")
        return f"('documents', {ids[0]}, {ids[1]}, {_literal(mask.causal)})"
    if kind is KeyRanges:
        if not all(isinstance(t, torch.Tensor) for t in (mask.start, mask.end)):
            raise _NotLiteral("KeyRanges bounds that are not a tensor")
        tensors.extend((mask.start, mask.end))
        return f"('ranges', {len(tensors) - 2}, {len(tensors) - 1})"
    if kind is MaskMod:
        fn = mask.fn
        while isinstance(fn, functools.partial):  # its code is its function's; the rest is data
            fn = fn.func
        if raises_itself(fn):
            # An assert (or raise) on the data would fail in the graph on its own rank, while
            # the others wait in the op's check: such a function is evaluated eagerly, where its
            # failure is refused on every rank.
            raise _NotLiteral("a MaskMod whose function asserts or raises")
        # Evaluated under the guard: a function failing on this rank's data (an index out of
        # range) must not raise in the graph, where the other ranks would wait in the op's check.
        guard = EvaluationGuard()
        bits = pack_visibility(mask, guard=guard, **grid)
        if bits is None:
            raise _NotLiteral("a MaskMod table over MAX_TABLE_BITS, or not bool")
        tensors.extend((bits, guard.failed))
        return f"('table', {len(tensors) - 2}, {_literal(grid['seq_kv'])}, {len(tensors) - 1})"
    if kind is And or kind is Or:
        return (
            f"('{'and' if kind is And else 'or'}', {_structure(mask.a, tensors, grid)}, "
            f"{_structure(mask.b, tensors, grid)})"
        )
    raise _NotLiteral(kind.__name__)


def _rebuild(structure, tensors):
    kind, *args = structure
    if kind == "full":
        return Full()
    if kind == "causal":
        return Causal()
    if kind == "window":
        return SlidingWindow(*args)
    if kind == "chunked":
        return ChunkedCausal(*args)
    if kind == "prefix":
        return PrefixLM(*args)
    if kind == "documents":
        ids, kv_ids, causal = args
        return Documents(tensors[ids], causal, None if kv_ids is None else tensors[kv_ids])
    if kind == "ranges":
        start, end = args
        return KeyRanges(tensors[start], tensors[end])
    if kind == "table":
        bits, seq_kv, failed = args
        return VisibilityTable(tensors[bits], seq_kv, tensors[failed])
    a, b = (_rebuild(s, tensors) for s in args)
    return And(a, b) if kind == "and" else Or(a, b)


def _groups(strategy, group) -> tuple[str, int]:
    """The process groups of the call by name: ``('pg', name)`` for the ring and Ulysses, ``('mesh',
    ulysses name, ring name)`` for the hybrid (any of its ``group=`` forms); and the number of
    ranks the sequence is sharded over (the global length is that times the local one)."""
    from ..group import resolve_group

    if strategy in ("hybrid", "ulysses"):
        from ..exchanges.mesh_groups import resolve_strategy_groups

        groups = resolve_strategy_groups(strategy, group)
        if strategy == "ulysses":
            return f"('pg', {_literal(groups.ulysses.group_name)})", groups.ulysses.size()
        assert groups.ring is not None  # the hybrid's groups: a Ulysses and a ring group
        names = (
            f"('mesh', {_literal(groups.ulysses.group_name)}, {_literal(groups.ring.group_name)})"
        )
        return names, groups.ulysses.size() * groups.ring.size()
    pg = resolve_group(group)
    return f"('pg', {_literal(pg.group_name)})", pg.size()


def _grid(query, key, world: int, kv_world: int) -> dict:
    """The global grid a MaskMod is evaluated on: batch, query heads and global lengths
    (``kv_world``: the key/value's shards, 1 where every rank holds it whole)."""
    if not (
        isinstance(query, torch.Tensor)
        and isinstance(key, torch.Tensor)
        and query.dim() == 4
        and key.dim() == 4
    ):
        raise _NotLiteral("inputs that are not 4-D tensors")  # the eager call says what is wrong
    b, h, sq, skv = (
        operator.index(n) for n in (query.shape[0], query.shape[1], query.shape[2], key.shape[2])
    )
    return {"batch": b, "heads": h, "seq_q": sq * world, "seq_kv": skv * kv_world}


def _group(names: tuple):
    resolve = torch.distributed.distributed_c10d._resolve_process_group
    if names[0] == "mesh":
        return {"ulysses": resolve(names[1]), "ring": resolve(names[2])}
    return resolve(names[1])


def describe_call(impl_name: str, query, key, call: Call) -> tuple[str, list, int] | None:
    """``call`` (a :class:`~ring_impl.call.Call`) on these tensors as ``(description,
    mask_tensors, ranks)`` for the custom ops: the call as a Python literal (its options, the
    mask's structure with its tensors replaced by indices into ``mask_tensors``, the process
    groups by name), the mask's tensors, and the number of ranks the sequence is sharded over;
    None when something in it cannot be carried (the call then runs eagerly, which says what is
    wrong with it)."""
    if call.sinks is not None and not isinstance(call.sinks, torch.Tensor):
        return None
    tensors: list = []
    try:
        names, world = _groups(call.strategy, call.group)
        mask = call.mask
        structure = (
            "None"
            if mask is None
            else _structure(
                mask,
                tensors,
                _grid(query, key, world, kv_shards(call, world)) if _has_mask_mod(mask) else {},
            )
        )
        fields = [
            f"'impl': {_literal(impl_name)}",
            f"'mask': {structure}",
            f"'group': {names}",
            f"'lse_used': {_literal(call.lse_needed)}",
        ]
        fields += [
            f"'{name}': {_op_literal(value) if name == 'op' else _literal(value)}"
            for name, value in call.options().items()
        ]
    except _NotLiteral:
        return None
    return "{" + ", ".join(fields) + "}", tensors, world


#: op objects compiled calls were given that are not registered by their name, by a key unique
#: in this process (type and id). Held for the process's life, so an id a graph names is never
#: reused by another object.
_OP_OBJECTS: dict[str, object] = {}
_OP_OBJECT = "__op_object__"


@torch._dynamo.assume_constant_result
def _op_object_key(op) -> str:
    """``op``'s key in :data:`_OP_OBJECTS`, stored there. Run for real while dynamo traces (a
    store traced as a side effect would be replayed only after the graph, whose ops need the
    object), its key a constant of the graph, guarded on the object: another object retraces and
    gets its own key."""
    key = f"{type(op).__module__}.{type(op).__qualname__}@{id(op):x}"
    _OP_OBJECTS[key] = op
    return key


def _op_literal(op) -> str:
    """``op=`` as a literal: a name as given; an op object by the name it is registered under (the
    registered object itself: the op finds that same object by name), or else by its key in
    :data:`_OP_OBJECTS`."""
    if op is None or isinstance(op, str):
        return _literal(op)
    from ..ops import available_ops, get_op

    name = getattr(op, "name", None)
    if isinstance(name, str) and name in available_ops() and get_op(name) is op:
        return _literal(name)
    return f"({_literal(_OP_OBJECT)}, {_literal(_op_object_key(op))})"


def rebuild_call(
    description: str, mask_tensors, sinks
) -> tuple[Callable, RingAttention, Mapping | None, Call]:
    """What :func:`describe_call` described: ``(call_path, impl, algorithms, call)``, to run as
    ``call_path(impl, algorithms, call, query, key, value)`` (the eager call's checks and path);
    ``sinks``: the call's sink logits (an input of the op, not part of the description)."""
    c = dict(_parse(description))
    impl, algorithms, call_path = _IMPLS[c.pop("impl")]
    structure = c.pop("mask")
    mask = None if structure is None else _rebuild(structure, mask_tensors)
    group = _group(c.pop("group"))
    c.pop("lse_used")
    op = c.get("op")
    if isinstance(op, tuple) and len(op) == 2 and op[0] == _OP_OBJECT:
        c["op"] = _OP_OBJECTS[op[1]]
    return call_path, impl, algorithms, Call(group=group, mask=mask, sinks=sinks, **c)


def masked_ring_call(impl_name: str, query, key, value, call: Call):
    """``call`` (a masked ``ring_attention`` call) as the custom ops, for traced code; None when
    something in the call cannot be carried (run it eagerly then)."""
    described = describe_call(impl_name, query, key, call)
    if described is None:
        return None
    description, tensors, _ = described
    sinks = call.sinks
    out, lse, _ = torch.ops.ring_impl.masked_ring(query, key, value, sinks, tensors, description)
    if sinks is not None and sinks_problem(sinks, query.shape[1]) is None:
        # (Bad sinks: the op raises InputError on every rank before the sink term would run.)
        out, lse = with_sinks(out, lse, sinks)
    return (out, lse) if call.return_lse else out


def _has_mask_mod(mask) -> bool:
    if type(mask) in (And, Or):
        return _has_mask_mod(mask.a) or _has_mask_mod(mask.b)
    return type(mask) is MaskMod


@lru_cache(maxsize=256)
def _parse(call: str) -> dict:
    return _decode(ast.literal_eval(call))


def _drop(handle: int) -> None:
    _SAVED.pop(handle, None)


@torch.library.custom_op("ring_impl::masked_ring", mutates_args=())
def _masked_ring(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    sinks: torch.Tensor | None,
    mask_tensors: list[torch.Tensor],
    call: str,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    call_path, impl, algorithms, described = rebuild_call(call, mask_tensors, sinks)
    path = call_path(impl, algorithms, described, query, key, value)
    out, lse, saved, meta = path.forward(query, key, value)
    # Fresh, dense outputs: a custom op's outputs may not alias its inputs, and the fake says dense.
    out_c = out.contiguous().clone() if _aliases(out, query, key, value) else out.contiguous()
    lse_c = lse.contiguous()
    number = next(_HANDLES)
    handle = torch.tensor(number, dtype=torch.int64)
    _SAVED[number] = (path, _stash(saved, (query, key, value, out, lse)), meta)
    weakref.finalize(handle, _drop, number)
    return out_c, lse_c, handle


class _FromGraph(int):
    """In a stashed saved tuple: the index of a tensor the backward op is given by the graph."""


def _stash(saved: tuple, graph: tuple) -> tuple:
    """``saved`` with the tensors the graph also holds (query, key, value, out, lse) replaced by
    their index: the backward op is given those by the graph, which keeps them for it. Holding
    them here instead would be unsafe: a compiled graph may reuse an op output's buffer for a
    later result (inductor writes ``out * 0.5`` into ``out``'s) once it sees no later use. A view
    of one of them is copied, for the same reason."""
    kept = []
    for t in saved:
        index = next((i for i, g in enumerate(graph) if t is g), None) if t is not None else None
        if index is not None:
            kept.append(_FromGraph(index))
        else:
            kept.append(t.clone() if t is not None and _aliases(t, *graph) else t)
    return tuple(kept)


def _unstash(kept: tuple, graph: tuple) -> tuple:
    return tuple(graph[t] if isinstance(t, _FromGraph) else t for t in kept)


def _aliases(t: torch.Tensor, *others: torch.Tensor | None) -> bool:
    return any(
        o is not None and t.untyped_storage().data_ptr() == o.untyped_storage().data_ptr()
        for o in others
    )


@_masked_ring.register_fake
def _(query, key, value, sinks, mask_tensors, call):
    c = _parse(call)
    acc = _IMPLS[c["impl"]][0].accumulation_dtype(query.dtype)
    # A head-parallel strategy computes no LSE it is not asked for (an empty tensor).
    ring = strategy_of(c["exchange"]) == "ring"
    lse_shape = query.shape[:3] if ring or c["lse_used"] else (0,)
    # The handle lives on the host whatever the device: the backward reads it without a sync.
    return (
        query.new_empty((*query.shape[:3], value.shape[-1])),
        query.new_empty(lse_shape, dtype=acc),
        torch.empty((), dtype=torch.int64, device="cpu"),
    )


@torch.library.custom_op("ring_impl::masked_ring_backward", mutates_args=())
def _masked_ring_backward(
    grad_out: torch.Tensor,
    grad_lse: torch.Tensor | None,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    handle: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    entry = _SAVED.get(int(handle))
    if entry is None:
        raise RuntimeError(
            "ring_impl::masked_ring_backward: the forward's saved state is gone (its graph was "
            "freed); pass retain_graph=True to the first backward to run another"
        )
    path, kept, meta = entry
    saved = _unstash(kept, (query, key, value, out, lse))
    dq, dk, dv = path.backward(
        saved, meta, grad_out.contiguous(), None if grad_lse is None else grad_lse.contiguous()
    )
    grads: list[torch.Tensor] = []
    for g in (
        dq,
        dk,
        dv,
    ):  # dK and dV are often two halves of one buffer: the op's outputs may not share
        g = g.contiguous()
        grads.append(
            g.clone() if _aliases(g, grad_out, grad_lse, query, key, value, out, lse, *grads) else g
        )
    return grads[0], grads[1], grads[2]


@_masked_ring_backward.register_fake
def _(grad_out, grad_lse, query, key, value, out, lse, handle):
    return query.new_empty(query.shape), key.new_empty(key.shape), value.new_empty(value.shape)


def _setup_context(ctx, inputs, output):
    query, key, value, _sinks, tensors, call = inputs
    ctx.save_for_backward(query, key, value, output[0], output[1], output[2])
    ctx.n_tensors = len(tensors)
    ctx.lse_used = _parse(call)["lse_used"]


def _backward(ctx, grad_out, grad_lse, _grad_handle):
    query, key, value, out, lse, handle = ctx.saved_tensors
    if grad_out is None:
        grad_out = torch.zeros(out.shape, dtype=query.dtype, device=query.device)
    grad_lse = grad_lse if ctx.lse_used else None
    dq, dk, dv = torch.ops.ring_impl.masked_ring_backward(
        grad_out, grad_lse, query, key, value, out, lse, handle
    )
    return dq, dk, dv, None, [None] * ctx.n_tensors, None


_masked_ring.register_autograd(_backward, setup_context=_setup_context)
