"""Sequence layouts: which global token positions each rank holds, and shard/unshard from them.

A layout is a permutation of the global positions ``0 .. S-1``: rank ``r`` holds ``S / W`` of
them, in its local order, written as runs ``(start, stop)`` of consecutive positions. Everything
else follows from the runs: :func:`shard` and :func:`unshard`, :func:`permutation`, and the ring's
per-step plan (:mod:`ring_impl.planning.plan` derives from them which local query rows see which
local key/value rows). A new layout (a load balancer) is one function registered with
:func:`register_layout`; the ring, ``context_parallel`` and the input checks then accept its name.

Built in:

``contiguous``: the sequence is cut into ``W`` equal chunks and rank ``r`` holds chunk ``r``.

``head_tail``: the sequence is cut into ``2W`` equal chunks and rank ``r`` holds chunks ``r``
and ``2W-1-r``, concatenated in that order. Under causal attention every rank then does the
same amount of work (a chunk near the head of the sequence sees few keys, its partner near the
tail sees many), which ``contiguous`` does not give: there rank ``W-1`` does ``2W-1`` times the
work of rank 0.

Rules every layout keeps (checked by :func:`layout_runs`): each rank holds ``S / W`` positions,
every position is held exactly once, and a rank's positions increase along its local order (so
under a causal mask the key/value rows a query row sees are a prefix of any rank's block, which
the plan relies on; a balancer reorders *which* positions a rank holds, never their order).

**Uneven lengths.** A layout marked ``uneven`` also splits a length that is not a multiple of its
divisor, giving ranks unequal counts: the chunked layouts cut ``S`` into ``divisor(W)`` chunks
the way ``torch.tensor_split`` does (the first ``S mod divisor`` chunks one longer), so
``contiguous`` over 4 ranks splits 10 tokens 3, 3, 2, 2. :func:`shard_lengths` says how many
tokens each rank gets; :func:`shard` and :func:`unshard` follow it (``contiguous`` takes any split
given as ``lengths=``). ``ring_attention(..., shard_lengths=...)`` runs on such shards
(:mod:`ring_impl.planning.uneven`).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from itertools import pairwise

import torch

from .memo import host_memo

__all__ = [
    "LAYOUTS",
    "Layout",
    "Runs",
    "check_layout",
    "chunk_ids",
    "get_layout",
    "layout_divisor",
    "layout_generation",
    "layout_runs",
    "layouts",
    "permutation",
    "register_layout",
    "shard",
    "shard_lengths",
    "split_runs",
    "unshard",
]

#: A rank's positions: ``((start, stop), ...)`` half-open runs of global positions in local order.
Runs = tuple[tuple[int, int], ...]


@dataclass(frozen=True)
class Layout:
    """A sequence layout.

    ``runs(seq_len, world_size, rank)``: the runs of global positions ``rank`` holds, for a
    global length that is a multiple of ``divisor(world_size)``. ``chunks(world_size, rank)``
    (optional): for layouts that cut the sequence into ``divisor(world_size)`` equal chunks, the
    chunk indices a rank holds in local order (what :func:`chunk_ids` answers). ``uneven``:
    ``runs`` also splits lengths that are not a multiple of the divisor (ranks then hold unequal
    counts). ``derived``: made by the library for one call's shape (an uneven call's padded
    layout, a hybrid mesh's), left out of :func:`layouts`.
    """

    name: str
    runs: Callable[[int, int, int], Runs]
    divisor: Callable[[int], int]
    chunks: Callable[[int, int], tuple[int, ...]] | None = None
    uneven: bool = False
    derived: bool = False


def chunked_layout(
    name: str, pieces: Callable[[int], int], chunks: Callable[[int, int], tuple[int, ...]]
) -> Layout:
    """A layout that cuts the sequence into ``pieces(W)`` chunks, equal when the length is a
    multiple of ``pieces(W)`` (else as ``torch.tensor_split`` cuts: the first ``S mod pieces``
    chunks one longer), and gives rank ``r`` the chunks ``chunks(W, r)`` (in increasing order)."""

    def runs(seq_len: int, world_size: int, rank: int) -> Runs:
        n, longer = divmod(seq_len, pieces(world_size))

        def start(c: int) -> int:
            return c * n + min(c, longer)

        return tuple((start(c), start(c + 1)) for c in chunks(world_size, rank))

    return Layout(name, runs, pieces, chunks, uneven=True)


_REGISTRY: dict[str, Layout] = {}
#: registrations so far (a name registered again may mean another layout: what was derived from
#: a name, ring_impl.checks.remembered, is keyed by this too)
_GENERATION = [0]


def layout_generation() -> int:
    """How many registrations the layout registry has taken."""
    return _GENERATION[0]


def register_layout(layout: Layout, *, replace: bool = False) -> Layout:
    """Make ``layout`` selectable as ``layout=layout.name`` (register it on every rank)."""
    if layout.name in _REGISTRY and not replace:
        raise ValueError(
            f"register_layout: a layout named {layout.name!r} is already registered; pass "
            "replace=True"
        )
    replaced = layout.name in _REGISTRY
    _REGISTRY[layout.name] = layout
    _GENERATION[0] += 1
    if replaced:  # (the caches are keyed by name: a new name has nothing stale in them)
        for cached in (layout_runs, _rank_runs, _check_cover, split_runs):
            cached.cache_clear()  # type: ignore[union-attr]  # (host_memo keeps it)
    return layout


def layouts(*, derived: bool = False) -> tuple[str, ...]:
    """Names accepted by ``layout=``, in registration order; the library's derived layouts
    (:attr:`Layout.derived`) only with ``derived=True``."""
    if derived:
        return (*_REGISTRY, *_BUILT)
    return tuple(name for name, lay in _REGISTRY.items() if not lay.derived)


def is_derived(layout) -> bool:
    """Whether ``layout`` names a derived layout (:attr:`Layout.derived`)."""
    found = _find(layout)
    return found is not None and found.derived


def is_layout(layout) -> bool:
    """Whether ``layout`` names a layout: registered, or derived (made from its name)."""
    return _find(layout) is not None


def check_layout(layout: str) -> None:
    if _find(layout) is None:
        raise ValueError(f"unknown layout {layout!r}; expected one of {layouts()}")


def get_layout(layout: str) -> Layout:
    found = _find(layout)
    if found is None:
        check_layout(layout)  # raises, naming the layouts
    assert found is not None
    return found


#: Name prefix -> the builder of a derived layout from its whole name (ring_impl.planning.uneven's
#: ``padded(...)``): any process that meets the name builds the same layout, so a name made on
#: one rank, or inside a compiled graph, needs no registration on the others.
_DERIVED: dict[str, Callable[[str], Layout]] = {}
#: The derived layouts built so far, the most recently used last; the oldest are dropped past
#: :data:`DERIVED_KEPT` (a loader whose splits change every step would grow it without end), and
#: rebuilt from the name if met again.
_BUILT: OrderedDict[str, Layout] = OrderedDict()
DERIVED_KEPT = 1024


def register_derived(prefix: str, build: Callable[[str], Layout]) -> None:
    """Layouts named ``prefix...`` are built from their name by ``build`` (ValueError: no
    such layout) when first met, then kept like registered ones."""
    _DERIVED[prefix] = build


def _find(name) -> Layout | None:
    if not isinstance(name, str):
        return None
    found = _REGISTRY.get(name)
    if found is not None:
        return found
    found = _BUILT.get(name)
    if found is not None:
        _BUILT.move_to_end(name)
        return found
    for prefix, build in _DERIVED.items():
        if name.startswith(prefix):
            try:
                found = build(name)
            except ValueError:
                return None
            # (a name's layout is a function of the name: caches keyed by it stay right)
            _BUILT[name] = found
            while len(_BUILT) > DERIVED_KEPT:
                _BUILT.popitem(last=False)
            return found
    return None


def layout_divisor(layout: str, world_size: int) -> int:
    """The global length must be a multiple of this (for the built-ins: how many equal chunks
    the sequence is cut into)."""
    return get_layout(layout).divisor(world_size)


def chunk_ids(layout: str, world_size: int, rank: int) -> tuple[int, ...]:
    """The global chunk indices rank holds, in local order (chunked layouts only)."""
    lay = get_layout(layout)
    if lay.chunks is None:
        raise ValueError(f"layout {layout!r} is not made of equal chunks; use layout_runs")
    return lay.chunks(world_size, rank)


@host_memo(maxsize=1024)
def layout_runs(layout: str, seq_len: int, world_size: int, rank: int) -> Runs:
    """Rank ``rank``'s runs of global positions for a global length ``seq_len``, checked
    (ValueError for a length the layout cannot split, or a layout that breaks its rules).

    Pure Python on ints, so plans built from it are constants under ``torch.compile``.
    """
    _check_world(world_size, rank, "layout")
    _check_cover(layout, seq_len, world_size)
    return _rank_runs(layout, seq_len, world_size, rank)


@host_memo(maxsize=1024)
def _rank_runs(layout: str, seq_len: int, world_size: int, rank: int) -> Runs:
    lay = get_layout(layout)
    divisor = lay.divisor(world_size)
    if seq_len % divisor and not lay.uneven:
        raise ValueError(
            f"sequence length {seq_len} cannot be sharded in layout {layout!r} over {world_size} "
            f"ranks: it must be a multiple of {divisor}; pad the sequence"
        )
    runs = tuple((int(a), int(b)) for a, b in lay.runs(seq_len, world_size, rank) if b > a)
    held = sum(b - a for a, b in runs)
    if seq_len % divisor == 0 and held != seq_len // world_size:
        raise ValueError(
            f"layout {layout!r} gives rank {rank} {held} positions of {seq_len}; every rank holds "
            f"{seq_len // world_size}"
        )
    for (_, stop), (start, _) in pairwise(runs):
        if start < stop:
            raise ValueError(
                f"layout {layout!r}: rank {rank}'s positions do not increase along its local "
                f"order ({runs})"
            )
    return runs


@host_memo(maxsize=256)
def _check_cover(layout: str, seq_len: int, world_size: int) -> None:
    """Every position in ``[0, seq_len)`` held by exactly one rank."""
    end = 0
    for a, b in sorted(
        run for r in range(world_size) for run in _rank_runs(layout, seq_len, world_size, r)
    ):
        if a != end:
            raise ValueError(
                f"layout {layout!r}: position {min(a, end)} of {seq_len} is held by no rank or by "
                "two"
            )
        end = b
    if end != seq_len:
        raise ValueError(f"layout {layout!r}: positions {end}..{seq_len - 1} are held by no rank")


def shard_lengths(seq_len: int, world_size: int, layout: str = "contiguous") -> tuple[int, ...]:
    """How many of ``seq_len`` tokens each rank holds in ``layout``, rank 0 first: equal for a
    length the layout's divisor divides, else the layout's uneven split (ValueError for a layout
    that has none: see :attr:`Layout.uneven`). What ``ring_attention(shard_lengths=)`` takes."""
    _check_world(world_size, None, "shard_lengths")
    return tuple(
        sum(b - a for a, b in layout_runs(layout, seq_len, world_size, r))
        for r in range(world_size)
    )


@host_memo(maxsize=1024)
def split_runs(layout: str, lengths: tuple[int, ...], rank: int) -> Runs:
    """Rank ``rank``'s runs of global positions when rank ``r`` holds ``lengths[r]`` tokens:
    ``contiguous`` takes any split (rank ``r`` holds the next ``lengths[r]`` positions), another
    layout its own split of ``sum(lengths)`` (:func:`shard_lengths`; ValueError for another)."""
    world = len(lengths)
    _check_world(world, rank, "split_runs")
    if layout == "contiguous":
        start = sum(lengths[:rank])
        return ((start, start + lengths[rank]),) if lengths[rank] else ()
    expected = shard_lengths(sum(lengths), world, layout)
    if tuple(lengths) != expected:
        raise ValueError(
            f"layout {layout!r} splits {sum(lengths)} tokens over {world} ranks as "
            f"{list(expected)}, not {list(lengths)}; shard with ring_impl.shard(..., "
            f"layout={layout!r}) or use layout='contiguous' for a split of your own"
        )
    return layout_runs(layout, sum(lengths), world, rank)


def permutation(layout: str, seq_len: int, world_size: int) -> torch.Tensor:
    """(seq_len,) int64: the global position of each element of ``cat(shards)`` (rank 0 first)."""
    return torch.cat(
        [
            torch.arange(a, b)
            for r in range(world_size)
            for a, b in layout_runs(layout, seq_len, world_size, r)
        ]
    )


def _check_world(world_size, rank: int | None, what: str) -> None:
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"{what}: world_size must be an int >= 1, got {world_size!r}")
    if rank is not None and (
        isinstance(rank, bool) or not isinstance(rank, int) or not 0 <= rank < world_size
    ):
        raise ValueError(
            f"{what}: rank must be an int in [0, {world_size}) for world_size {world_size}, got "
            f"{rank!r}"
        )


def _check_dim(tensor: torch.Tensor, dim: int, what: str) -> int:
    if not -tensor.dim() <= dim < tensor.dim():
        raise ValueError(
            f"{what}: dim {dim} is out of range for a {tensor.dim()}-D tensor of shape "
            f"{tuple(tensor.shape)}"
        )
    return dim % tensor.dim()


def shard(
    tensor: torch.Tensor,
    world_size: int,
    rank: int,
    *,
    layout: str = "contiguous",
    dim: int = 2,
    lengths: Sequence[int] | None = None,
) -> torch.Tensor:
    """This rank's shard of a global tensor, sequence on ``dim``; a contiguous copy.

    (batch, heads, S, head_dim) -> (batch, heads, S / W, head_dim) for the default ``dim=2``; a
    length the layout's divisor does not divide is split the layout's uneven way
    (:func:`shard_lengths`), and ``lengths`` (one per rank, summing to S) gives ``contiguous``
    any split. Raises ValueError for an unknown layout, ``world_size < 1``, a rank outside
    ``[0, world_size)``, a dim out of range, a length the layout cannot split or ``lengths``
    that do not fit.
    """
    check_layout(layout)
    _check_world(world_size, rank, "shard")
    dim = _check_dim(tensor, dim, "shard")
    try:
        if lengths is None:
            runs = layout_runs(layout, tensor.shape[dim], world_size, rank)
        else:
            runs = split_runs(layout, _lengths(lengths, world_size, tensor.shape[dim]), rank)
    except ValueError as exc:
        raise ValueError(f"shard: {exc}") from None
    parts = [tensor.narrow(dim, a, b - a) for a, b in runs]
    if not parts:
        return tensor.narrow(dim, 0, 0).contiguous()
    return torch.cat(parts, dim=dim).contiguous() if len(parts) > 1 else parts[0].contiguous()


def _lengths(lengths, world_size: int, seq_len: int) -> tuple[int, ...]:
    """``lengths`` as a tuple of ints after checking it splits ``seq_len`` over the ranks."""
    out = tuple(lengths)
    if (
        len(out) != world_size
        or any(isinstance(n, bool) or not isinstance(n, int) or n < 0 for n in out)
        or sum(out) != seq_len
    ):
        raise ValueError(
            f"lengths must be {world_size} ints >= 0 summing to the sequence length {seq_len}, "
            f"got {list(out)}"
        )
    return out


def unshard(
    shards: list[torch.Tensor] | tuple[torch.Tensor, ...],
    *,
    layout: str = "contiguous",
    dim: int = 2,
) -> torch.Tensor:
    """The global tensor from every rank's shard (``shards[r]`` from rank ``r``); differentiable.

    The shards must agree on every dim but ``dim``; their lengths on ``dim`` must be the
    layout's split of their sum (:func:`shard_lengths`; equal for the layouts' even lengths),
    any split for ``contiguous``; ValueError otherwise.
    """
    check_layout(layout)
    shards = list(shards)
    if not shards:
        raise ValueError("unshard: no shards given; pass one shard per rank, rank 0 first")
    world_size = len(shards)
    dim = _check_dim(shards[0], dim, "unshard")
    shapes = [tuple(s.shape) for s in shards]
    if any(
        len(shape) != len(shapes[0])
        or shape[:dim] + shape[dim + 1 :] != shapes[0][:dim] + shapes[0][dim + 1 :]
        for shape in shapes
    ):
        raise ValueError(
            f"unshard: shards have different shapes {shapes}; every rank's shard of a {layout!r} "
            f"layout differs at most in its length on dim {dim}: pass one shard per rank, rank 0 "
            "first"
        )
    lengths = tuple(shape[dim] for shape in shapes)
    try:
        per_rank = [split_runs(layout, lengths, r) for r in range(world_size)]
    except ValueError as exc:
        raise ValueError(
            f"unshard: {world_size} shards of lengths {list(lengths)} on dim {dim}: {exc}"
        ) from None
    pieces: list[tuple[int, torch.Tensor]] = []
    for s, runs in zip(shards, per_rank):
        offset = 0
        for a, b in runs:
            pieces.append((a, s.narrow(dim, offset, b - a)))
            offset += b - a
    return torch.cat([p for _, p in sorted(pieces, key=lambda item: item[0])], dim=dim)


for _layout in (
    chunked_layout("contiguous", lambda w: w, lambda w, r: (r,)),
    chunked_layout("head_tail", lambda w: 2 * w, lambda w, r: (r, 2 * w - 1 - r)),
):
    register_layout(_layout)

#: The built-in layouts (``layouts()`` also lists registered ones).
LAYOUTS = layouts()
