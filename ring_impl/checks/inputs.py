"""Input checks that fail on every rank, before any ring collective, never with a hang.

A check that fails on one rank only (a shape that differs between ranks, a dtype one rank got
wrong, an option of the wrong type on one rank) would leave the other ranks blocked in the first
ring collective. So every rank first runs its local checks *without raising* (:func:`local_problem`,
which never raises whatever the arguments are), then all ranks exchange one small table (a SUM
all-reduce in which each rank fills its own row: its problem flag and its :data:`SIGNATURE_FIELDS`),
and every rank raises the same :class:`InputError` if any rank found a problem or the rows
differ, naming which rank has what. The exchange is one tiny all-reduce per call, declared in the
collective schedule (phase ``forward``, kind ``all_reduce``); it is skipped under
``torch.compile``, where shapes are static per graph and a data-dependent branch would break the
graph.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import struct
import zlib
from collections.abc import Callable, Sequence
from typing import Any, ParamSpec

import torch
import torch.distributed as dist

from ..call import Call
from ..exchanges.heads import check_head_chunks
from ..layout import is_layout, layout_divisor, layout_runs, layouts
from ..masks import IdsCheck, StaleIds
from ..ops import AttentionOp, available_ops, resolve_scale_and_op
from ..transports import rotate_methods

__all__ = [
    "EXCHANGE_PATHS",
    "SIGNATURE_FIELDS",
    "STRATEGIES",
    "STRATEGY_FIELDS",
    "InputError",
    "LocalCall",
    "agree",
    "agree_across_ranks",
    "exchange_nbytes",
    "local_problem",
    "needs_backward",
    "never_raises",
    "routed_error",
    "row_width",
    "signature",
    "strategy_codes",
    "strategy_disagreement",
]

#: Fields compared across ranks; each must be equal on every rank. (``op``: different kernels on
#: different ranks would still give a valid result, but is always a mistake: rejected too.)
SIGNATURE_FIELDS = (
    "batch",
    "heads",
    "heads_kv",
    "seq_q",
    "seq_kv",
    "head_dim",
    "head_dim_v",
    "dtype",
    "device",
    "is_causal",
    "scale",
    "layout",
    "rotate_method",
    "op",
    "head_chunks",
    "mask",
    "backward",
)

_P = ParamSpec("_P")

_DTYPES = (torch.float64, torch.float32, torch.bfloat16, torch.float16)
_DEVICE_TYPES = ("cpu", "cuda")


class InputError(ValueError):
    """Bad input to ring attention; raised on every rank of the group."""


def routed_error(exc: InputError, caller: str) -> InputError:
    """``exc`` worded for a call the user made as ``caller`` (``scaled_dot_product_attention``,
    ``flex_attention``), which a context-parallel route ran as ring attention: the message then
    names the function the user called, not only the one that refused it."""
    return InputError(f"{caller} under context parallel (run as ring attention): {exc}")


#: The strategies (``strategy=``); the first codes of :data:`EXCHANGE_PATHS`.
STRATEGIES = ("ring", "ulysses", "hybrid")
#: The exchanges a call can take (``exchange=`` resolved: "auto" takes the halo or the ring), in
#: the order the cross-rank check codes them; the strategies first, in their own order.
#: "replicated_kv": none, every rank holding the whole key/value (``replicated_kv=True``).
EXCHANGE_PATHS = (*STRATEGIES, "halo", "gather", "replicated_kv")
#: Fields beyond :data:`SIGNATURE_FIELDS` in every row, each equal on every rank: the ring's own
#: check carries them too (a 1 x W mesh), so ranks that take different exchanges exchange tables
#: of one size and all raise, naming the exchanges, instead of pairing one rank's collectives
#: with another's.
STRATEGY_FIELDS = ("exchange", "ulysses_degree", "ring_degree", "return_lse", "return_max_logit")


def strategy_codes(
    exchange: str, mesh_shape: tuple[int, int], return_lse, return_max_logit=False
) -> list[int]:
    """A row's :data:`STRATEGY_FIELDS` for a call taking ``exchange`` (one of
    :data:`EXCHANGE_PATHS`). Only Ulysses and the hybrid compare ``return_lse`` (their LSE
    travels); the others send 0. ``return_max_logit`` adds the ring's all-reduce of the max
    logit: ranks that disagree on it would pair it with another collective."""
    lse = int(bool(return_lse)) if exchange in ("ulysses", "hybrid") else 0
    max_logit = int(bool(return_max_logit))
    return [EXCHANGE_PATHS.index(exchange), mesh_shape[0], mesh_shape[1], lse, max_logit]


def strategy_disagreement(codes: list[list[int]]) -> str | None:
    """Which :data:`STRATEGY_FIELDS` differ between the rows ``codes``, in words, or None. Ranks
    taking different exchanges are told only that: the other fields follow from it."""
    differing = []
    for i, field in enumerate(STRATEGY_FIELDS):
        values: dict[int, list[int]] = {}
        for r, row in enumerate(codes):
            values.setdefault(row[i], []).append(r)
        if len(values) > 1:
            shown = {
                "exchange": lambda c: repr(EXCHANGE_PATHS[c]),
                "return_lse": lambda c: str(bool(c)),
                "return_max_logit": lambda c: str(bool(c)),
            }.get(field, str)
            differing.append(
                f"{field} ("
                + "; ".join(f"{_ranks(ranks)} {shown(c)}" for c, ranks in values.items())
                + ")"
            )
            if field == "exchange":
                break
    if not differing:
        return None
    return (
        "ranks disagree on "
        + ", ".join(differing)
        + "; every rank must take the same exchange with the same options (exchange=, or its "
        "aliases strategy=, halo= and sparse_kv=; 'auto' resolved: the halo where the mask allows "
        "it; return_lse too: under Ulysses and the hybrid the LSE travels in the all-to-all)"
    )


def row_width() -> int:
    """Entries of a rank's row in the cross-rank check's table: the problem flag, the signature
    and strategy fields, and the flag "my query, key and value are finite" (the ring's
    :func:`agree_across_ranks` fills it; 0 elsewhere)."""
    return 1 + len(SIGNATURE_FIELDS) + len(STRATEGY_FIELDS) + 1


def exchange_nbytes(world_size: int) -> int:
    """Bytes of the cross-rank check's all-reduce input: a row per rank (:func:`row_width`),
    int64; the same for every strategy."""
    return 8 * world_size * row_width()


def _is_bool(value: Any) -> bool:
    return (
        isinstance(value, bool)
        or (type(value).__name__ == "bool_" and value in (True, False))
        or (isinstance(value, int) and value in (0, 1))
    )


def _is_dtensor(t: Any) -> bool:
    try:
        from torch.distributed.tensor import DTensor
    except ImportError:  # pragma: no cover - every supported torch has it
        return False
    return isinstance(t, DTensor)


def never_raises(check: Callable[_P, str | None]) -> Callable[_P, str | None]:
    """``check`` (one rank's checks: its problem in words, or None) made total: an exception it
    trips into over an argument is returned as the problem too, so a rank with a bad argument
    still reaches the cross-rank exchange (:func:`agree`) instead of raising alone and leaving the
    other ranks waiting in it."""

    @functools.wraps(check)
    def checked(*args: _P.args, **kwargs: _P.kwargs) -> str | None:
        try:
            return check(*args, **kwargs)
        except Exception as exc:  # a check that trips over an argument is a problem, not a crash
            return f"invalid arguments ({type(exc).__name__}: {exc})"

    return checked


@dataclasses.dataclass(frozen=True)
class LocalCall:
    """One rank's call as its checks and the cross-rank agreement see it: the local tensors and
    the :class:`ring_impl.call.Call`'s options, with the op and the effective scale resolved
    (``op`` None and ``op_error`` saying why when that failed). Built once per call
    (:meth:`of`); :func:`local_problem`, :func:`signature` and the agreement take it. Fields hold
    whatever the caller passed: the checks say what is wrong with them."""

    query: Any
    key: Any
    value: Any
    is_causal: Any
    scale: Any  # as given (checked); the kernel's is ``effective_scale``
    layout: Any
    rotate_method: Any
    head_chunks: Any
    return_lse: Any
    op: AttentionOp | None
    effective_scale: float | None
    op_error: str | None
    #: Whether the output will need a backward: grad mode on and query, key, value or sinks
    #: requiring grad. A rank's backward takes part in the others' (key/value gradients travel),
    #: so the ranks must agree on it.
    needs_grad: bool = False
    #: ``replicated_kv=``: key and value are the whole key/value sequence (any length, whatever
    #: the layout), not shards (ring_impl.call.replicated_problem).
    replicated_kv: Any = False

    @classmethod
    def of(cls, call: Call, query, key, value, *, score_mod: object = None) -> LocalCall:
        """``call`` on these tensors, its op and scale resolved for them (``score_mod``: the
        call's resolved one, which narrows the ops that can serve it)."""
        effective_scale, op, op_error = resolve_scale_and_op(
            query,
            call.scale,
            call.op,
            call.is_causal,
            masked=call.mask is not None,
            score_mod=score_mod is not None,
            value=value,
        )
        return cls(
            query=query,
            key=key,
            value=value,
            is_causal=call.is_causal,
            scale=call.scale,
            layout=call.layout,
            rotate_method=call.rotate_method,
            head_chunks=call.head_chunks,
            return_lse=call.return_lse,
            op=op,
            effective_scale=effective_scale,
            op_error=op_error,
            needs_grad=needs_backward(query, key, value, call.sinks)
            if call.backward is None
            else call.backward,
            replicated_kv=call.replicated_kv,
        )


def needs_backward(*tensors) -> bool:
    """Whether an output made of ``tensors`` (None allowed) needs a backward: grad mode on and one
    of them requiring grad."""
    return torch.is_grad_enabled() and any(
        isinstance(t, torch.Tensor) and t.requires_grad for t in tensors
    )


@never_raises
def local_problem(local: LocalCall, world_size: int | None = None) -> str | None:
    """Everything one rank can check alone; returns the problem or None. Never raises.

    world_size: the ring's size, to check the local lengths against the layout (None: not checked
    beyond the built-in layouts' own rule)."""
    query, key, value = local.query, local.key, local.value
    is_causal, scale, layout = local.is_causal, local.scale, local.layout
    rotate_method, head_chunks = local.rotate_method, local.head_chunks
    return_lse, op, op_error = local.return_lse, local.op, local.op_error
    names = ("query", "key", "value")
    for name, t in zip(names, (query, key, value)):
        if _is_dtensor(t):
            return (
                f"{name} is a DTensor; ring_attention takes this rank's local shard as a plain "
                f"tensor: pass {name}.to_local() of a tensor sharded on the sequence dim in the "
                "layout you name (layout='contiguous' for DTensor's Shard(2)), or shard a global "
                "tensor with ring_impl.shard, or use context_parallel"
            )
        if not isinstance(t, torch.Tensor):
            return f"{name} must be a torch.Tensor, got {type(t).__name__}"
        if t.dim() != 4:
            return (
                f"{name} must be 4-D (batch, heads, seq_local, head_dim), got shape "
                f"{tuple(t.shape)}"
            )
        if not t.is_floating_point():
            return f"{name} must be floating point, got {t.dtype}"
    if query.dtype != key.dtype or query.dtype != value.dtype:
        return (
            f"query/key/value dtypes differ: {query.dtype}, {key.dtype}, {value.dtype}; cast them "
            "to one dtype"
        )
    if query.dtype not in _DTYPES:
        return f"dtype {query.dtype} is not supported; use one of {[str(d) for d in _DTYPES]}"
    if query.device != key.device or query.device != value.device:
        return f"query/key/value devices differ: {query.device}, {key.device}, {value.device}"
    if query.device.type not in _DEVICE_TYPES:
        return f"device {query.device} is not supported; use one of {_DEVICE_TYPES}"
    if key.shape[:3] != value.shape[:3]:
        return (
            f"key and value shapes differ before the head dim: {tuple(key.shape)} vs "
            f"{tuple(value.shape)}; they must agree on (batch, heads_kv, seq_kv_local) (value's "
            "head dim may differ)"
        )
    b, h, sq, d = query.shape
    bk, hkv, skv, dk = key.shape
    dv = value.shape[-1]
    if b != bk:
        return f"batch differs: query has {b}, key/value have {bk}"
    if d != dk:
        return (
            f"head_dim differs: query has {d}, key has {dk}; query and key must share it (value's "
            "may differ)"
        )
    if hkv == 0 or h % hkv:
        return (
            f"query heads ({h}) must be a multiple of key/value heads ({hkv}) for grouped-query "
            "attention"
        )
    if min(b, h, sq, skv, d, dv) == 0:
        return (
            f"empty input: query {tuple(query.shape)}, key {tuple(key.shape)}, value "
            f"{tuple(value.shape)}"
        )
    if not _is_bool(is_causal):
        return f"is_causal must be a bool, got {is_causal!r} ({type(is_causal).__name__})"
    if not _is_bool(return_lse):
        return f"return_lse must be a bool, got {return_lse!r} ({type(return_lse).__name__})"
    if is_causal and sq != skv:
        return (
            f"causal ring attention needs equal local query and key/value lengths, got {sq} and "
            f"{skv}; use is_causal=False for cross attention"
        )
    if not is_layout(layout):
        return f"unknown layout {layout!r}; expected one of {layouts()}"
    if layout == "head_tail" and (sq % 2 or (skv % 2 and local.replicated_kv is not True)):
        return (
            "layout 'head_tail' holds two equal chunks per rank, so local lengths must be even; "
            f"got query {sq}, key/value {skv}; shard a sequence that is a multiple of 2 * "
            "world_size"
        )
    if is_causal and world_size is not None:  # the causal plan follows the layout's positions
        divisor = layout_divisor(layout, world_size)
        if (sq * world_size) % divisor:
            return (
                f"layout {layout!r} over {world_size} ranks splits global lengths that are "
                f"multiples of {divisor}; local length {sq} x {world_size} ranks is not: shard a "
                f"sequence whose length is a multiple of {divisor}"
            )
    if not isinstance(rotate_method, str) or rotate_method not in rotate_methods():
        return f"unknown rotate_method {rotate_method!r}; expected one of {rotate_methods()}"
    chunks_problem = check_head_chunks(head_chunks, hkv)
    if chunks_problem is not None:
        return chunks_problem
    if scale is not None and (
        isinstance(scale, bool) or not isinstance(scale, (int, float)) or not math.isfinite(scale)
    ):
        return f"scale must be a finite number or None, got {scale!r}"
    if op_error is not None:
        return op_error
    if op is None:
        return "no attention op resolved"
    effective_scale = 1.0 / math.sqrt(d) if scale is None else float(scale)
    why = op.capabilities.unsupported(
        query.device,
        query.dtype,
        d,
        scale=effective_scale,
        is_causal=bool(is_causal),
        head_dim_v=dv,
    )
    if why is not None:
        hint = (
            " (op='auto' picks one that takes value's head dim; ring_impl.available_ops() lists "
            "them all)"
            if dv != d and not getattr(op.capabilities, "value_head_dim", False)
            else ""
        )
        return (
            f"attention op {getattr(op, 'name', op)!r} does not support this input: {why}; choose "
            f"another op={hint}"
        )
    return None


def _scale_code(scale: float) -> int:
    """The float64 bits of the scale as an int64: equal codes iff equal scales."""
    return struct.unpack("<q", struct.pack("<d", float(scale)))[0]


def _op_name(op: AttentionOp) -> str:
    return str(getattr(op, "name", type(op).__name__))


def _name_code(name: str) -> int:
    return zlib.crc32(name.encode()) & 0x7FFFFFFF


def _op_code(op: AttentionOp) -> int:
    return _name_code(_op_name(op))


def op_names(op: AttentionOp | None) -> dict[int, str]:
    """:func:`_op_code` -> name for every op registered on this rank and ``op``: the names a
    disagreement can show for the other ranks' ops."""
    names = [*available_ops(), *([] if op is None else [_op_name(op)])]
    return {_name_code(name): name for name in names}


def layout_code(layout: str, world_size: int | None = None, seq_q: int = 0, seq_kv: int = 0) -> int:
    """31 bits for the cross-rank check: the layout's name and, for a ring over ``world_size``
    ranks, the global positions every rank holds for local lengths ``seq_q``/``seq_kv``. So a
    layout registered under one name with other positions on another rank disagrees (it would
    pair wrong rows silently), and names registered in another order on another rank agree."""
    text = layout
    if world_size is not None:
        try:
            runs = [
                layout_runs(layout, n * world_size, world_size, r)
                for n in (seq_q, seq_kv)
                for r in range(world_size)
            ]
            text += "|" + repr(runs)
        except ValueError:
            # Lengths the layout cannot split: a call that needs no positions (non-causal,
            # unmasked) still runs, so the code never raises here, before the check's collective.
            text += "|unsplit"
    return zlib.crc32(text.encode()) & 0x7FFFFFFF


def layout_names(world_size: int | None = None, seq_q: int = 0, seq_kv: int = 0) -> dict[int, str]:
    """:func:`layout_code` of every layout registered on this rank that can split these lengths."""
    names = {}
    for name in layouts(derived=True):
        try:
            names[layout_code(name, world_size, seq_q, seq_kv)] = name
        except ValueError:
            continue
    return names


def signature(local: LocalCall, *, mask_code: int = 0, world_size: int | None = None) -> list[int]:
    """This rank's values of :data:`SIGNATURE_FIELDS` as integers (only for a call without a
    local problem); ``world_size``: the ring's, whose layout positions are compared too
    (:func:`layout_code`)."""
    query, key, op = local.query, local.key, local.op
    assert op is not None and local.effective_scale is not None, "a call with a local problem"
    b, h, sq, d = query.shape
    hkv, skv = key.shape[1], key.shape[2]
    dv = local.value.shape[-1]
    return [
        b,
        h,
        hkv,
        sq,
        skv,
        d,
        dv,
        _DTYPES.index(query.dtype),
        _DEVICE_TYPES.index(query.device.type),
        int(bool(local.is_causal)),
        _scale_code(local.effective_scale),
        layout_code(local.layout, world_size, sq, skv),
        rotate_methods().index(local.rotate_method),
        _op_code(op),
        local.head_chunks,
        mask_code,
        int(local.needs_grad),
    ]


def _shown(field: str, code: int, op_names: dict[int, str], layout_names: dict[int, str]) -> str:
    """A field's integer code in words."""
    if field == "dtype":
        return str(_DTYPES[code]).removeprefix("torch.")
    if field == "device":
        return _DEVICE_TYPES[code]
    if field in ("is_causal", "backward"):
        return str(bool(code))
    if field == "scale":
        return f"{struct.unpack('<d', struct.pack('<q', code))[0]:.6g}"
    if field == "layout":
        if code in layout_names:
            return repr(layout_names[code])
        return (
            f"layout #{code:#010x} (none registered here holds those positions: a name registered "
            "with other runs on another rank?)"
        )
    if field == "rotate_method":
        return repr(rotate_methods()[code])
    if field == "op":
        return repr(op_names.get(code, f"op #{code}"))
    if field == "mask":
        if code == 0:
            return "no mask, sinks or score_mod"
        return f"mask/sinks/score_mod digest {code:#010x}"
    return str(code)


def _ranks(ranks: list[int]) -> str:
    """[0, 1, 2, 5] -> 'ranks 0-2, 5'; [3] -> 'rank 3'."""
    parts, start = [], None
    for i, r in enumerate(ranks):
        if start is None:
            start = r
        if i + 1 == len(ranks) or ranks[i + 1] != r + 1:
            parts.append(str(start) if start == r else f"{start}-{r}")
            start = None
    return ("ranks " if len(ranks) > 1 else "rank ") + ", ".join(parts)


def disagreement(
    table: list[list[int]],
    op_names: dict[int, str],
    layout_names: dict[int, str],
    fields: Sequence[str] = SIGNATURE_FIELDS,
) -> str | None:
    """Which signature fields (of ``fields``) differ between the ranks' rows, in words, or None;
    ``op_names`` and ``layout_names`` name the codes this rank knows."""
    differing = []
    for i, field in enumerate(SIGNATURE_FIELDS):
        if field not in fields:
            continue
        by_value: dict[int, list[int]] = {}
        for rank, row in enumerate(table):
            by_value.setdefault(row[i], []).append(rank)
        named = {layout_names.get(c) for c in by_value} if field == "layout" else set()
        if len(named) == 1 and None not in named:
            continue  # one layout, its positions differing only with the lengths (said there)
        if len(by_value) > 1:
            held = "; ".join(
                f"{_ranks(ranks)} {_shown(field, code, op_names, layout_names)}"
                for code, ranks in by_value.items()
            )
            differing.append(f"{field} ({held})")
    if not differing:
        return None
    text = (
        "ranks disagree on "
        + ", ".join(differing)
        + "; every rank must pass shards of equal shape and the same options"
    )
    if any(f.startswith("backward") for f in differing):
        text += (
            " (backward: whether the output needs one, from torch.is_grad_enabled() and the "
            "requires_grad of query, key, value and sinks; a rank's backward exchanges gradients "
            "with the others', so every rank runs one or none)"
        )
    if any(f.startswith(("seq_q", "seq_kv")) for f in differing):
        lengths = [row[SIGNATURE_FIELDS.index("seq_q")] for row in table]
        text += (
            f" (local lengths differ: for uneven shards pass shard_lengths={lengths}, the "
            "tokens each rank holds (ring_impl.planning.uneven), or pad the global sequence to a "
            "multiple of the layout's chunk count, W or 2W)"
        )
    return text


def agree(
    problem: str | None,
    codes: list[int] | None,
    *,
    row: int,
    size: int,
    groups: Sequence[dist.ProcessGroup],
    device: torch.device,
    op: AttentionOp | None,
    world_size: int | None,
    where: str,
    refused: Callable[[list[int]], str] = _ranks,
    numbering: str = "",
    finite: tuple[torch.Tensor, ...] = (),
    ids: IdsCheck | None = None,
) -> list[list[int]]:
    """The cross-rank check of every strategy: raise the same InputError on every rank if any
    rank has a problem or the ranks' rows differ; else return the table's ``size`` rows.

    The table is ``size`` rows of :func:`row_width` int64 entries. This rank fills row ``row``:
    the problem flag (1 when ``problem`` is not None), else ``codes`` (its :func:`signature` and
    :func:`strategy_codes`; None with a problem) and, with ``finite``, the last entry: 1 for
    "these tensors are finite"; ``ids`` (the call's unread compare of its document ids) adds 2
    to it when they differ from the snapshot the call plans with: every rank then raises
    StaleIds, before any other verdict (that rank's codes describe the stale snapshot), and
    the call runs again. The table is SUM-all-reduced over each of ``groups`` in turn, so every
    entry is added once by the rank that fills it (the ring: its one group; a 2-D mesh: the
    Ulysses group, then the ring group). Nothing raises before the last all-reduce, so no rank is
    left waiting in one.

    The errors start with ``where``; ``refused`` names the rows that flagged a problem,
    ``world_size`` is the one :func:`signature` got (the layout codes carry the ring's positions
    for it; None: by name), and ``numbering`` follows a disagreement to say how rows are
    numbered."""
    n = row_width()
    table = [0] * (size * n)
    if problem is not None:
        table[row * n] = 1
    else:
        assert codes is not None
        table[row * n + 1 : (row + 1) * n - 1] = codes
    differs = None if ids is None else ids.take()
    vec = torch.tensor(table, dtype=torch.int64)
    for i, pg in enumerate(groups):
        staged = device.type != "cpu" and str(dist.get_backend(pg)).lower() == "gloo"
        vec = vec if staged else vec.to(device)
        if i == 0:
            _write_last_entry(vec, row * n + n - 1, problem, finite, differs)
        dist.all_reduce(vec, op=dist.ReduceOp.SUM, group=pg)
    agreed: list[int] = vec.cpu().tolist()
    rows = [agreed[r * n : (r + 1) * n] for r in range(size)]
    if any(r[n - 1] >= 2 for r in rows):
        raise StaleIds()  # (on every rank: the call runs again, its ids compared on the host)
    if problem is not None:
        raise InputError(f"{where}: {problem}")
    bad = [r for r in range(size) if rows[r][0]]
    if bad:
        raise InputError(
            f"{where}: {refused(bad)} rejected their input (see the error on those ranks); "
            "every rank raises so none is left waiting in a collective"
        )
    if all(r[1 : n - 1] == rows[0][1 : n - 1] for r in rows):
        return rows  # (the common case, without the naming below)
    base = 1 + len(SIGNATURE_FIELDS)
    # Every row's layout code named with that row's lengths
    names: dict[int, str] = {}
    for lengths in {
        tuple(r[1 + SIGNATURE_FIELDS.index(f)] for f in ("seq_q", "seq_kv")) for r in rows
    }:
        names.update(layout_names(world_size, *lengths))
    exchanges = strategy_disagreement([r[base : n - 1] for r in rows])
    signatures = [r[1:base] for r in rows]
    if len({r[base] for r in rows}) > 1:
        # Other exchanges: the other fields follow from it, but for the mask, which chooses the
        # exchange under "auto" (a rank that lost its mask takes the ring, the others the halo).
        cause = disagreement(signatures, op_names(op), names, fields=("mask",))
        said = "; ".join(t for t in (cause, exchanges) if t)
        raise InputError(f"{where}: {said}{numbering}")
    texts = [disagreement(signatures, op_names(op), names), exchanges]
    said = "; ".join(t for t in texts if t) or "ranks disagree on the call's options"
    raise InputError(f"{where}: {said}{numbering}")


def _write_last_entry(
    vec: torch.Tensor,
    at: int,
    problem: str | None,
    finite: tuple[torch.Tensor, ...],
    differs: torch.Tensor | None,
) -> None:
    """Write this rank's last table entry, 0 until then, into ``vec`` (:func:`agree`): 1 when
    every tensor of ``finite`` is, plus 2 when ``differs`` (the unread compare of the call's ids)
    is True.

    Written on the device, read with the table: no read of its own. A table staged through the
    host (gloo with device tensors) cannot take device values without a read: its finiteness
    reports 0, "maybe not" (the blocks then decide for themselves), and the compare is read."""
    stale = 0
    if differs is not None and differs.device != vec.device:
        stale = 2 * int(bool(differs))  # (a read: the table is host memory)
        differs = None
    entry: torch.Tensor | int = stale
    if finite and problem is None and all(t.device == vec.device for t in finite):
        # A sum is NaN/inf when any element is (finite tensors whose sum overflows only lose the
        # shortcut).
        total = sum(
            (t.sum(dtype=torch.float32) for t in finite), torch.zeros((), device=vec.device)
        )
        entry = torch.isfinite(total).to(torch.int64)
        entry = entry + stale if stale else entry
    if differs is not None:  # (on the table's device: stale is 0)
        if isinstance(entry, torch.Tensor):
            entry = torch.add(entry, differs, alpha=2)
        else:
            entry = differs.to(torch.int64) * 2
    if isinstance(entry, torch.Tensor) or entry:
        vec[at] = entry


def agree_across_ranks(
    problem: str | None,
    local: LocalCall,
    *,
    group: dist.ProcessGroup,
    device: torch.device,
    mask_code: int = 0,
    exchange: str = "ring",
    return_max_logit: bool = False,
    finite: tuple[torch.Tensor, ...] = (),
    ids: IdsCheck | None = None,
) -> bool | None:
    """The ring's :func:`agree` over ``group``: raise InputError on every rank if any rank has a
    problem or the ranks disagree on ``local``'s :func:`signature` or on the ``exchange`` the
    call takes ("ring", "halo" or "gather").

    ``finite``: tensors (the call's query, key, value) whose finiteness every rank reports in
    the same all-reduce, computed on their device and read with the table, so no read of its
    own: returns True when every rank's are finite (the ring then skips the NaN propagation of
    every block, :meth:`ring_impl.exchanges.ring.RingAttention.forward`), False when some rank's may
    not be, None without ``finite``."""
    world, rank = dist.get_world_size(group), dist.get_rank(group)
    codes = None
    if problem is None:
        codes = signature(local, mask_code=mask_code, world_size=world) + strategy_codes(
            exchange, (1, world), local.return_lse, return_max_logit
        )
    rows = agree(
        problem,
        codes,
        row=rank,
        size=world,
        groups=(group,),
        device=device,
        op=local.op,
        world_size=world,
        where=f"ring_attention (rank {rank})",
        finite=finite,
        ids=ids,
    )
    return all(row[-1] == 1 for row in rows) if finite else None
