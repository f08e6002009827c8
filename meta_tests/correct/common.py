"""What the correct implementations share and what holds no attention math: the sequence layouts,
the dtypes they compute in, the input checks that raise on every rank, the capabilities they all
declare, the bytes of a key/value block for their schedules, and per-step recording for diagnosis.

Written from the layout definition (design.md, "Layouts"), not from ring_impl: ``contiguous``
cuts the sequence into W chunks and rank r holds chunk r; ``head_tail`` cuts it into 2W chunks and
rank r holds chunks r and 2W-1-r, in that order. A balancer's layout is every rank's runs of
global positions, registered on the process under a name derived from what built it
(:func:`register_runs_layout`).
"""

from __future__ import annotations

import contextlib
import hashlib
import math
import struct
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist

from conformance import Capabilities

__all__ = [
    "LAYOUTS",
    "ROTATE_METHODS",
    "CorrectRingError",
    "RingSetup",
    "StepRecords",
    "accumulation_dtype",
    "all_gather",
    "block_bytes",
    "check_bytes",
    "check_inputs",
    "check_schedule_request",
    "chunk_ids",
    "chunk_rows",
    "correct_capabilities",
    "digest",
    "group_rank",
    "local_positions",
    "normalized_lse",
    "op_problem",
    "record_step",
    "record_steps",
    "recording",
    "reduce_scatter",
    "register_runs_layout",
    "widened",
]

LAYOUTS = ("contiguous", "head_tail")
ROTATE_METHODS = ("allgather", "alltoall", "p2p")


#: torch 2.13 names (the *_tensor names warn there); the older names before.
all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


class CorrectRingError(ValueError):
    """Bad input to a correct ring; raised on every rank before any ring collective."""


# ------------------------------------------------------------------------------------- dtypes


def accumulation_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype partial results, the LSE and dK/dV in flight are kept in for inputs of
    ``dtype``: float64 for float64, float32 for every other dtype."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def widened(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """An input ``t`` (any shape) in ``dtype``, the same shape, with ±inf made NaN: attention is
    undefined wherever an infinite input reaches, and NaN (unlike an inf score that exp turns into
    a weight of 0) carries that through every later operation."""
    t = t.to(dtype)
    return torch.where(torch.isinf(t), torch.full((), float("nan"), dtype=dtype), t)


# ------------------------------------------------------------------------------------ layouts


def chunk_ids(layout: str, world_size: int, rank: int) -> tuple[int, ...]:
    """Global chunk indices a rank holds, in local order: (r,) or (r, 2W-1-r)."""
    return (rank,) if layout == "contiguous" else (rank, 2 * world_size - 1 - rank)


def chunk_rows(layout: str, world_size: int, rank: int, seq_local: int) -> list[tuple[int, slice]]:
    """[(global chunk id, local rows)] of a rank's shard of length seq_local."""
    ids = chunk_ids(layout, world_size, rank)
    n = seq_local // len(ids)
    return [(c, slice(i * n, (i + 1) * n)) for i, c in enumerate(ids)]


#: Runs layouts built on this process: name -> every rank's runs ((start, stop), ...) of global
#: positions, in local order.
_RUNS_LAYOUTS: dict[str, tuple[tuple[tuple[int, int], ...], ...]] = {}


def register_runs_layout(name: str, runs) -> str:
    """Register every rank's ``runs`` (one sequence of (start, stop) per rank) as layout ``name``
    on this process (call it on every rank alike); returns ``name``."""
    _RUNS_LAYOUTS[name] = tuple(tuple((int(a), int(b)) for a, b in rank_runs) for rank_runs in runs)
    return name


def _layout_code(layout: str) -> int:
    """The check exchange's int64 for ``layout``: its index among the built-in ones, else a
    digest of its runs above them."""
    if layout in LAYOUTS:
        return LAYOUTS.index(layout)
    runs = repr(_RUNS_LAYOUTS[layout]).encode()
    return len(LAYOUTS) + int.from_bytes(hashlib.blake2b(runs, digest_size=7).digest(), "little")


def local_positions(layout: str, world_size: int, rank: int, seq_local: int) -> torch.Tensor:
    """(seq_local,) int64: the global sequence position of every local row (a runs layout's:
    this rank's runs, in order)."""
    if layout in _RUNS_LAYOUTS:
        runs = _RUNS_LAYOUTS[layout][rank]
        return torch.cat(
            [torch.arange(a, b) for a, b in runs] or [torch.zeros(0, dtype=torch.long)]
        )
    parts = [
        torch.arange(c * (rows.stop - rows.start), (c + 1) * (rows.stop - rows.start))
        for c, rows in chunk_rows(layout, world_size, rank, seq_local)
    ]
    return torch.cat(parts)


# ------------------------------------------------------------------------------- input checks


@dataclass(frozen=True)
class RingSetup:
    """A checked call: the group, this rank, the ring's size and the softmax scale to use."""

    group: dist.ProcessGroup | None
    world_size: int
    rank: int
    scale: float

    def peer(self, group_rank: int) -> int:
        """The global rank of ``group_rank`` (p2p ops address global ranks)."""
        return group_rank if self.group is None else dist.get_global_rank(self.group, group_rank)


_DTYPE_NAMES = {
    torch.float64: "float64",
    torch.float32: "float32",
    torch.bfloat16: "bfloat16",
    torch.float16: "float16",
}
_DTYPE_CODES = {dt: i + 1 for i, dt in enumerate(_DTYPE_NAMES)}
_CODE_NAMES = {code: _DTYPE_NAMES[dt] for dt, code in _DTYPE_CODES.items()}

#: Fields every rank sends in the one check exchange, in order after the problem flag.
_FIELDS = (
    "batch",
    "heads",
    "heads_kv",
    "seq_q",
    "seq_kv",
    "head_dim",
    "dtype",
    "is_causal",
    "layout",
    "rotate_method",
    "scale",
    "replicated_kv",
    "mask",
    "sinks",
    "score_mod",
)


def digest(t: torch.Tensor) -> int:
    """A nonzero int64 digest of a CPU tensor's shape, dtype and values, for the check exchange
    (0 stands for "none given")."""
    t = t.detach().contiguous()
    h = hashlib.blake2b(digest_size=8)
    h.update(repr((tuple(t.shape), str(t.dtype))).encode())
    h.update(t.reshape(-1).view(torch.uint8).numpy().tobytes())
    return int.from_bytes(h.digest(), "little", signed=True) or 1


def check_bytes() -> int:
    """Bytes of the check exchange's all-gather input: int64 flag (0, or 1 + the index in
    _ARGUMENTS of what this rank rejected) plus one int64 per field."""
    return 8 * (1 + len(_FIELDS))


#: What a rank's problem is about; its index + 1 is the flag it sends, so every rank can name it.
_ARGUMENTS = (
    "query/key/value",
    "is_causal",
    "scale",
    "layout",
    "rotate_method",
    "op",
    "arguments",
    "replicated_kv",
    "mask",
    "sinks",
    "score_mod",
)

Problem = tuple[str, str]  # (argument from _ARGUMENTS, what is wrong and what to do)


def _local_problem(query, key, value, **options) -> Problem | None:
    """Everything this rank can see alone (``options``: :func:`_checked`'s); never raises (an
    exception here, on one rank only, would leave the other ranks waiting in the check's
    all-gather)."""
    try:
        return _checked(query, key, value, **options)
    except Exception as exc:  # an argument so odd that even looking at it raised
        return (
            "arguments",
            f"could not check the arguments ({type(exc).__name__}: {exc}); pass tensors and plain "
            "options",
        )


def _is_dtensor(t) -> bool:
    from torch.distributed.tensor import DTensor

    return isinstance(t, DTensor)


def _checked(
    query,
    key,
    value,
    *,
    is_causal,
    scale,
    layout,
    rotate_method,
    rotate_methods,
    op_problem,
    replicated_kv=False,
    replicated_problem=None,
    mask_problem=None,
    sinks_problem=None,
    score_mod_problem=None,
    packed=False,
) -> Problem | None:
    tensors = _tensor_problem(query, key, value, packed)
    if tensors is not None:
        return "query/key/value", tensors
    sq, skv = query.shape[2], key.shape[2]
    if not isinstance(is_causal, bool):
        return (
            "is_causal",
            f"is_causal must be a bool (True or False), got {is_causal!r} of type "
            f"{type(is_causal).__name__}",
        )
    if is_causal and replicated_kv:
        return "is_causal", (
            "replicated_kv=True (the whole key/value on every rank, a cross-attention's) is "
            "non-causal only; pass is_causal=False"
        )
    if is_causal and sq != skv:
        return "is_causal", (
            f"causal attention needs equal local query and key/value lengths, got {sq} and {skv}; "
            "cross attention (different lengths) is non-causal only"
        )
    if not isinstance(layout, str) or layout not in (*LAYOUTS, *_RUNS_LAYOUTS):
        return "layout", (
            f"unknown layout {layout!r}; expected one of {LAYOUTS} or a balanced layout's name"
        )
    if layout == "head_tail" and (sq % 2 or (skv % 2 and not replicated_kv)):
        return "layout", (
            "layout 'head_tail' holds two equal chunks per rank, so local lengths must be even, "
            f"got query {sq} and key/value {skv}; shard a sequence whose length is a multiple of "
            "2 * world_size"
        )
    if rotate_method not in rotate_methods:
        return (
            "rotate_method",
            f"unknown rotate_method {rotate_method!r}; this ring supports {tuple(rotate_methods)}",
        )
    if scale is not None and (
        isinstance(scale, bool) or not isinstance(scale, (int, float)) or not math.isfinite(scale)
    ):
        return "scale", f"scale must be a finite number or None, got {scale!r}"
    if replicated_problem is not None:
        return "replicated_kv", replicated_problem
    if mask_problem is not None:
        return "mask", mask_problem
    if sinks_problem is not None:
        return "sinks", sinks_problem
    if score_mod_problem is not None:
        return "score_mod", score_mod_problem
    return None if op_problem is None else ("op", op_problem)


def _runs_problem(layout, world: int, rank: int, query, key, replicated_kv: bool):
    """What is wrong with a runs layout for this rank's shards, or None (also for the built-in
    layouts); called once the shards and the layout's name have passed :func:`_checked`."""
    if layout not in _RUNS_LAYOUTS:
        return None
    runs = _RUNS_LAYOUTS[layout]
    held = sum(b - a for a, b in runs[rank]) if len(runs) == world else None
    sq, skv = query.shape[2], key.shape[2]
    if held == sq and (skv == sq or replicated_kv):
        return None
    return "layout", (
        f"layout {layout!r} was built for {len(runs)} ranks, rank {rank} holding {held} tokens, "
        f"but this call is on {world} ranks with query {sq} and key/value {skv} local tokens; "
        "build the layout for this call's sequence and group"
    )


def _tensor_problem(query, key, value, packed: bool = False) -> str | None:
    for name, t in (("query", query), ("key", key), ("value", value)):
        if _is_dtensor(t):
            return (
                f"{name} is a DTensor; ring_attention takes each rank's local shard as a plain "
                f"tensor: pass {name}.to_local() of a DTensor sharded on the sequence dim "
                "(Shard(2)) in the given layout"
            )
        if not isinstance(t, torch.Tensor) or t.dim() != 4:
            shape = tuple(t.shape) if isinstance(t, torch.Tensor) else type(t).__name__
            if packed:  # the ring takes 3-D shards as (1, heads, tokens_local, head_dim) views
                return (
                    f"{name} must be a 3-D tensor (tokens_local, heads, head_dim) with "
                    f"cu_seqlens, got {shape}"
                )
            return f"{name} must be a 4-D tensor (batch, heads, seq_local, head_dim), got {shape}"
        if t.dtype not in _DTYPE_CODES:
            return (
                f"{name} has dtype {t.dtype}; supported dtypes are {sorted(_DTYPE_NAMES.values())}"
            )
    if not query.dtype == key.dtype == value.dtype:
        return (
            f"query/key/value dtypes differ on this rank ({query.dtype}, {key.dtype}, "
            f"{value.dtype}); cast them to one dtype"
        )
    if not query.device == key.device == value.device or query.device.type != "cpu":
        return (
            f"query/key/value must all be on the CPU device, got {query.device}, {key.device}, "
            f"{value.device}"
        )
    if key.shape != value.shape:
        return f"key and value shapes differ: {tuple(key.shape)} vs {tuple(value.shape)}"
    b, h, sq, d = query.shape
    bk, hkv, skv, dk = key.shape
    if b != bk:
        return f"batch differs: query has {b}, key/value have {bk}"
    if d != dk:
        return f"head_dim differs: query has {d}, key/value have {dk}"
    if hkv == 0 or h % hkv:
        return (
            f"query heads ({h}) must be a multiple of key/value heads ({hkv}) for grouped-query "
            "attention"
        )
    if min(b, h, sq, skv, d) == 0:
        return f"empty input: query {tuple(query.shape)}, key/value {tuple(key.shape)}"
    return None


def _describe(field: str, value: int) -> str:
    if field == "dtype":
        return _CODE_NAMES.get(value, f"code {value}")
    if field in ("is_causal", "replicated_kv"):
        return str(bool(value))
    if field == "layout":
        if value < len(LAYOUTS):
            return repr(LAYOUTS[value])
        return f"a balanced layout (digest {value - len(LAYOUTS):014x})"
    if field == "rotate_method":
        return repr(ROTATE_METHODS[value])
    if field == "scale":
        return repr(struct.unpack("<d", struct.pack("<q", value))[0])
    if field in ("mask", "sinks", "score_mod"):
        return f"no {field}" if value == 0 else f"{field} digest {value & (2**64 - 1):016x}"
    return str(value)


def _ranks(ranks: Sequence[int]) -> str:
    return f"rank {ranks[0]}" if len(ranks) == 1 else "ranks " + ", ".join(map(str, ranks))


def check_inputs(
    query,
    key,
    value,
    *,
    group,
    is_causal,
    scale,
    layout,
    rotate_method,
    rotate_methods,
    op_problem: str | None = None,
    replicated_kv: bool = False,
    replicated_problem: str | None = None,
    mask_problem: str | None = None,
    sinks_problem: str | None = None,
    score_mod_problem: str | None = None,
    digests: tuple[int, int, int] = (0, 0, 0),
    packed: bool = False,
) -> RingSetup:
    """Check the call on every rank; raise :class:`CorrectRingError` on every rank if any rank's
    input is bad or the ranks disagree (shapes, dtype, options, scale, ``replicated_kv``, the
    mask, the sinks and the score_mod), before any ring collective. ``op_problem``: what the ring
    found wrong with its ``op=`` argument, if anything; ``replicated_kv``: key/value are the whole
    sequence on every rank (their length is not the layout's to split), ``replicated_problem``
    what the ring cannot do with them; ``mask_problem`` / ``sinks_problem`` /
    ``score_mod_problem`` what is wrong with those arguments; ``digests``: nonzero int64 digests
    of the call's whole mask, its sinks and its score_mod (0: none given), which every rank must
    hold alike; ``packed``: the call's tensors are packed (THD) shards, taken as (1, heads,
    tokens_local, head_dim) views.

    One all-gather of ``1 + len(_FIELDS)`` int64 per rank (see :func:`check_bytes`); none at W=1.
    """
    if hasattr(group, "get_group"):  # a 1-D DeviceMesh
        group = group.get_group()
    world, rank = group_rank(group)
    problem = _local_problem(
        query,
        key,
        value,
        is_causal=is_causal,
        scale=scale,
        layout=layout,
        rotate_method=rotate_method,
        rotate_methods=rotate_methods,
        op_problem=op_problem,
        replicated_kv=replicated_kv,
        replicated_problem=replicated_problem,
        mask_problem=mask_problem,
        sinks_problem=sinks_problem,
        score_mod_problem=score_mod_problem,
        packed=packed,
    ) or _runs_problem(layout, world, rank, query, key, replicated_kv)
    if world == 1:
        if problem is not None:
            raise CorrectRingError(f"ring_attention: {problem[1]}")
        return RingSetup(group, 1, 0, _resolved_scale(scale, query.shape[-1]))

    if problem is None:
        resolved = _resolved_scale(scale, query.shape[-1])
        b, h, sq, d = query.shape
        fields = [
            b,
            h,
            key.shape[1],
            sq,
            key.shape[2],
            d,
            _DTYPE_CODES[query.dtype],
            int(is_causal),
            _layout_code(layout),
            ROTATE_METHODS.index(rotate_method),
            struct.unpack("<q", struct.pack("<d", resolved))[0],
            int(replicated_kv),
            *digests,
        ]
        mine = torch.tensor([0, *fields], dtype=torch.int64)
    else:
        resolved = math.nan
        mine = torch.tensor(
            [1 + _ARGUMENTS.index(problem[0])] + [0] * len(_FIELDS), dtype=torch.int64
        )
    everyone = torch.empty(world * mine.numel(), dtype=torch.int64)
    all_gather(everyone, mine, group=group)
    table = everyone.view(world, -1).tolist()

    if problem is not None:
        raise CorrectRingError(f"ring_attention (rank {rank}): {problem[1]}")
    bad = [r for r in range(world) if table[r][0]]
    if bad:
        args = [_ARGUMENTS[table[r][0] - 1] for r in bad]
        what = (
            f"rank {bad[0]} rejected its {args[0]} argument"
            if len(bad) == 1
            else f"{_ranks(bad)} rejected their input ("
            + "; ".join(f"rank {r}: {a}" for r, a in zip(bad, args))
            + ")"
        )
        raise CorrectRingError(
            f"ring_attention (rank {rank}): {what} (see the error raised there); "
            "every rank raises so that none waits in a collective"
        )
    differences = []
    for i, field in enumerate(_FIELDS, start=1):
        values: dict[int, list[int]] = {}
        for r in range(world):
            values.setdefault(table[r][i], []).append(r)
        if len(values) > 1:
            held = "; ".join(
                f"{_ranks(rs)} {'have' if len(rs) > 1 else 'has'} {_describe(field, v)}"
                for v, rs in sorted(values.items(), key=lambda kv: kv[1][0])
            )
            differences.append(f"{field}: {held}")
    if differences:
        lengths = any(d.startswith(("seq_q", "seq_kv")) for d in differences)
        hint = (
            (
                "; shard the global sequence into equal parts (pad it to a multiple of the "
                "layout's chunk count: W for contiguous, 2W for head_tail)"
            )
            if lengths
            else "; every rank must pass the same options and shapes"
        )
        raise CorrectRingError(
            f"ring_attention (rank {rank}): ranks disagree on " + " | ".join(differences) + hint
        )
    return RingSetup(group, world, rank, resolved)


def group_rank(group) -> tuple[int, int]:
    """(world size, rank) of ``group`` (a process group, a 1-D DeviceMesh, or None: the world)."""
    if hasattr(group, "get_group"):  # a 1-D DeviceMesh
        group = group.get_group()
    return dist.get_world_size(group), dist.get_rank(group)


def _resolved_scale(scale: float | None, head_dim: int) -> float:
    return 1.0 / math.sqrt(head_dim) if scale is None else float(scale)


# ------------------------------------------------------------------------- attention ops


def op_problem(op, query, *, scale, is_causal, ring: str, fallback: str) -> str | None:
    """Why ``op=`` (an attention-op object: ``forward``, ``backward``, ``capabilities`` as in
    ring_impl/ops/contract.py) cannot run this call in ``ring``, or None; ``fallback`` names what
    runs with ``op=None``. Never raises: a raise on one rank would leave the others waiting in
    the check's all-gather."""
    if op is None:
        return None
    if isinstance(op, str) or not all(
        hasattr(op, a) for a in ("forward", "backward", "capabilities")
    ):
        return (
            f"op={op!r}: {ring} takes an attention op object (forward, backward, capabilities "
            f"as in ring_impl/ops.py), not a name; leave op=None for {fallback}"
        )
    name = getattr(op, "name", op)
    try:
        caps = op.capabilities
        if getattr(caps, "lse_layout", None) not in ("bhs", "bhs1", "bhs_padded32"):
            return (
                f"attention op {name!r} declares an unknown LSE layout "
                f"{getattr(caps, 'lse_layout', None)!r}"
            )
        if isinstance(query, torch.Tensor) and query.dim() == 4:
            try:  # with the call's scale and causality, where the op takes them (its known faults)
                why = caps.unsupported(
                    query.device, query.dtype, query.shape[-1], scale=scale, is_causal=is_causal
                )
            except TypeError:
                why = caps.unsupported(query.device, query.dtype, query.shape[-1])
            if why is not None:
                return (
                    f"attention op {name!r} does not support this input (scale {scale!r}, "
                    f"is_causal {is_causal!r}): {why}; leave op=None for {fallback}"
                )
    except Exception as exc:
        return (
            f"attention op {name!r}: its capabilities could not be read ({type(exc).__name__}: "
            f"{exc})"
        )
    return None


def normalized_lse(op, lse: torch.Tensor, batch: int, heads: int, seq_q: int) -> torch.Tensor:
    """An op's forward LSE in its declared layout (``bhs``, ``bhs1``: (b, h, s, 1), or
    ``bhs_padded32``: (b, h, ceil(s/32)*32), the padding not part of the result) as (b, h, s)."""
    layout = op.capabilities.lse_layout
    if layout == "bhs1":
        lse = lse.squeeze(-1)
    elif layout == "bhs_padded32":
        lse = lse[..., :seq_q]
    if tuple(lse.shape) != (batch, heads, seq_q):
        raise RuntimeError(
            f"attention op {getattr(op, 'name', op)!r} returned LSE {tuple(lse.shape)} in layout "
            f"{layout!r}, expected (batch, heads, seq_q) = {(batch, heads, seq_q)} after "
            "normalising"
        )
    return lse


# ------------------------------------------------------------------ capabilities and schedules


def correct_capabilities(**declared) -> Capabilities:
    """What every correct implementation here declares, with ``declared`` (its own fields of
    :class:`conformance.Capabilities`) added: both layouts, every rotation method, every dtype the
    input check takes, the CPU only, backward with the LSE, grouped-query and cross attention, no
    torch.compile and no context-parallel API."""
    return Capabilities(
        layouts=frozenset(LAYOUTS),
        rotate_methods=frozenset(ROTATE_METHODS),
        dtypes=frozenset(_DTYPE_NAMES.values()),
        devices=frozenset({"cpu"}),
        backward=True,
        lse=True,
        gqa=True,
        cross_attention=True,
        compile=False,
        context_parallel=False,
        **declared,
    )


def check_schedule_request(ring: str, rotate_method: str, compiled: bool) -> None:
    """Raise ValueError for a schedule that ring ``ring`` cannot have: an unknown
    ``rotate_method``, or a compiled call (no correct ring runs under torch.compile)."""
    if rotate_method not in ROTATE_METHODS:
        raise ValueError(
            f"unknown rotate_method {rotate_method!r}; expected one of {ROTATE_METHODS}"
        )
    if compiled:
        raise ValueError(f"{ring} does not run under torch.compile (capabilities.compile is False)")


def block_bytes(
    *, batch: int, heads_kv: int, seq_kv: int, head_dim: int, dtype: torch.dtype
) -> tuple[int, int]:
    """(kv, dkv): the bytes of one rank's key/value block, (2, batch, heads_kv, seq_kv, head_dim)
    in the input ``dtype``, and of the same elements of dK/dV in :func:`accumulation_dtype`."""
    elems = 2 * batch * heads_kv * seq_kv * head_dim
    return elems * dtype.itemsize, elems * accumulation_dtype(dtype).itemsize


# ---------------------------------------------------------------------------- step recording


class StepRecords:
    """Per-step partial results in the format reference.diagnose reads: dicts with ``rank``,
    ``step``, ``kv_rank``, ``q_rows`` (start, stop), ``out`` (batch, heads, rows, head_dim) and
    ``lse`` (batch, heads, rows), float64 copies."""

    def __init__(self) -> None:
        self.records: list[dict] = []


_ACTIVE: list[StepRecords] = []


@contextlib.contextmanager
def record_steps() -> Iterator[StepRecords]:
    """``with record_steps() as rec: ring_attention(...)``; then ``rec.records``."""
    rec = StepRecords()
    _ACTIVE.append(rec)
    try:
        yield rec
    finally:
        _ACTIVE.remove(rec)


def recording() -> bool:
    return bool(_ACTIVE)


def record_step(
    *,
    rank: int,
    step: int,
    kv_rank: int,
    q_rows: tuple[int, int],
    out: torch.Tensor,
    lse: torch.Tensor,
) -> None:
    """Append one partial (out (b, h, rows, d), lse (b, h, rows)) to the active recorder."""
    if _ACTIVE:
        _ACTIVE[-1].records.append(
            {
                "rank": rank,
                "step": step,
                "kv_rank": kv_rank,
                "q_rows": q_rows,
                "out": out.detach().to(torch.float64, copy=True),
                "lse": lse.detach().to(torch.float64, copy=True),
            }
        )
