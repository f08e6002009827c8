"""The collective schedule ring_impl declares, so a suite can assert it exactly.

Per phase (forward, backward) and collective kind, the calls and bytes one rank issues for one
call of ``ring_attention`` and its backward. The ring's collectives come from the transport
(``rotate_method``; each declares its own in :mod:`ring_impl.transports`), with packed key/value
bytes ``kv = batch*heads_kv*seq_kv*(head_dim + head_dim_v)*itemsize`` (``head_dim_v``: value's
head dim, ``head_dim`` unless given) and dK/dV accumulator bytes ``dkv`` (the same elements in
the accumulation dtype, float32 or float64):

============  ==========================================  =============================================
method        forward                                     backward
============  ==========================================  =============================================
allgather     all_gather: 1 call, kv                      all_gather: 1 call, kv; all_to_all: W-1, (W-1)*dkv
alltoall      all_to_all: W-1 calls, (W-1)*kv             all_to_all: T calls, (W-1)*(kv + dkv)
p2p           send, recv: W-1 calls each, (W-1)*kv each   send, recv: T each, (W-1)*(kv + dkv) each
============  ==========================================  =============================================

``T = 2W - 2`` eager; compiled ``T = 2`` at ``W = 2`` and ``W + 1`` from ``W = 3`` on (see
:mod:`ring_impl.transports.neighbour`); compiled p2p hops count as ``all_to_all``. Every figure is
the minimum of a ring.

With ``head_chunks = c`` the ring runs ``c`` times over groups of heads (:mod:`ring_impl.exchanges.heads`):
every ring call count is multiplied by ``c`` and the bytes are unchanged (the chunks split
``heads_kv``). Every call adds the forward's cross-rank input check: all_reduce, 1 call (see
:mod:`ring_impl.checks.inputs`; compiled, the op of :mod:`ring_impl.compiled.checks`, left out only for
a call that cannot carry it: an option that is not a plain literal).
``W == 1`` issues no collective at all.

A call with ``return_max_logit=True`` (the ring only; ``heads`` given) adds one ``all_reduce`` to
the forward: the max logits of every query head with a NaN flag each, ``2 * heads * acc`` bytes
(``acc`` = 4, or 8 for float64; :func:`ring_impl.numerics.max_logit.reduce_max_logit`), once per call
whatever ``head_chunks``. A mask the halo exchange would serve then runs on the ring; under
``torch.compile`` the call runs eagerly, so ``compiled=True`` declares the eager ring's.

A call the halo exchange serves (``mask=`` and ``rank=`` given; :mod:`ring_impl.exchanges.halo`) has no
ring: with ``r = batch*heads_kv*(head_dim + head_dim_v)`` elements per packed key/value row, rank
``k`` receives ``l_k`` rows from rank ``k-1`` and ``r_k`` from rank ``k+1`` (the mask's reach, 0
past the ends of the sequence) and sends ``a_k`` of its first rows to ``k-1`` and ``b_k`` of its
last to ``k+1`` (:func:`ring_impl.exchanges.halo.halo_rows`):

- forward: ``send``, one call per nonzero of ``a_k, b_k``, ``(a_k + b_k) r itemsize`` bytes;
  ``recv``, one per nonzero of ``l_k, r_k``, ``(l_k + r_k) r itemsize``;
- backward: ``send``, one per nonzero of ``l_k, r_k``, ``(l_k + r_k) r acc``; ``recv``, one per
  nonzero of ``a_k, b_k``, ``(a_k + b_k) r acc``;

plus the forward's input check. The forward's bytes are the minimum (the rows the neighbours'
queries see, each once; summed over ranks ``(W-1)(left+right)`` rows, against the ring's
``W(W-1)S``); the backward sends no key/value (the halos are kept from the forward) and the
halos' dK/dV in the accumulation dtype (``acc`` = 4, or 8 for float64; the ring's accumulators
are too): twice the bytes of the rows in a 16-bit input dtype. The schedule differs between
the end ranks and the others, hence ``rank``.

A call with ``sparse_kv=True`` (:mod:`ring_impl.exchanges.kv_gather`) has no ring either: forward, one
``all_to_all`` whose input is the key/value rows of this rank that other ranks' queries see
(input dtype); backward, one ``all_to_all`` whose input is the dK/dV of the rows it received
(accumulation dtype); plus the input check. Both depend on the mask, the layout and ``rank``.

A call with ``replicated_kv=True`` (every rank holding the whole key/value) exchanges nothing:
its collectives are the forward's input check alone.
"""  # noqa: E501

from __future__ import annotations

import torch

from ..checks.inputs import exchange_nbytes
from ..exchanges.halo import halo_reach, halo_refusal
from ..masks import Mask, fold_causal
from .halo import halo_schedule
from .head_parallel import strategy_schedule
from .ring import KVShards, Schedule, ring_schedule

__all__ = ["collective_schedule"]


def collective_schedule(
    world_size: int,
    rotate_method: str,
    *,
    batch: int,
    heads_kv: int,
    seq_kv: int,
    head_dim: int,
    dtype: torch.dtype,
    compiled: bool = False,
    head_chunks: int = 1,
    strategy: str = "ring",
    mesh_shape: tuple[int, int] | None = None,
    heads: int | None = None,
    seq_q: int | None = None,
    return_lse: bool = True,
    mask=None,
    is_causal: bool = False,
    layout: str = "contiguous",
    rank: int | None = None,
    halo: bool | None = None,
    sparse_kv: bool = False,
    return_max_logit: bool = False,
    exchange: str | None = None,
    head_dim_v: int | None = None,
    replicated_kv: bool = False,
) -> Schedule:
    """``{phase: {kind: {"calls": n, "bytes": b}}}`` for one forward and one backward call.

    ``seq_kv`` is the local key/value length per rank; ``head_dim_v`` value's head dim (None:
    ``head_dim``; multi-head latent attention has its own), which sizes the value, output and
    dV bytes. Sizes must be ints >= 1 and ``dtype`` a floating-point dtype (ValueError otherwise).
    ``strategy="ulysses"`` / ``"hybrid"`` also take ``mesh_shape`` (ulysses degree, ring degree;
    product ``world_size``), ``heads``, ``seq_q`` (local) and ``return_lse``: see
    :mod:`ring_impl.schedule.head_parallel`.

    ``mask`` (a ``ring_impl.masks.Mask``), ``is_causal``, ``layout`` and ``halo`` as given to
    ``ring_attention``: a call the halo exchange serves declares its halo collectives (see the
    module docstring), which depend on ``rank`` (ValueError without it). Masks run eagerly only
    (ValueError with ``compiled=True``). ``sparse_kv=True`` (with ``mask``, ``rank`` and ``heads``
    when the mask depends on the head) declares the sparse gather's (ring_impl.exchanges.kv_gather).
    ``exchange`` (as given to ``ring_attention``, one of ring_impl.call.EXCHANGES) stands for
    ``strategy``, ``halo`` and ``sparse_kv`` (ValueError when given with a contradicting one).
    ``return_max_logit=True`` (with ``heads``) adds the max logit's all-reduce (the ring only;
    ValueError with another strategy, ``sparse_kv`` or ``halo=True``, which refuse it).
    ``replicated_kv=True`` (``seq_kv`` the whole key/value length; ``rotate_method`` may be
    None): no key/value moves, only the input check's all-reduce (ValueError with what such a
    call refuses: a mask, ``is_causal``, the max logit, an exchange but the ring's).
    """
    if mask is not None and not isinstance(mask, Mask):
        # (ring_attention refuses such a mask on every rank: no schedule is the call's)
        raise ValueError(
            "collective_schedule: mask must be a ring_impl.masks.Mask (Causal, Documents, "
            f"SlidingWindow, ..., MaskMod) as given to ring_attention, got {type(mask).__name__}"
        )
    if exchange is not None:
        strategy, halo, sparse_kv = _exchange_options(exchange, strategy, halo, sparse_kv)
    if not isinstance(return_max_logit, bool):
        raise ValueError(
            f"collective_schedule: return_max_logit must be a bool, got {return_max_logit!r}"
        )
    kv = KVShards.of(
        batch=batch,
        heads_kv=heads_kv,
        seq_kv=seq_kv,
        head_dim=head_dim,
        dtype=dtype,
        head_dim_v=head_dim_v,
    )
    if replicated_kv is not False:
        return _replicated_schedule(
            world_size,
            rotate_method,
            replicated_kv,
            compiled=compiled,
            head_chunks=head_chunks,
            refused={
                "strategy other than 'ring'": strategy != "ring",
                "halo=True": halo is True,
                "sparse_kv=True": bool(sparse_kv),
                "is_causal=True": is_causal is True,
                "return_max_logit=True": return_max_logit is True,
            },
            kv=kv,
        )
    if return_max_logit:
        if strategy != "ring" or sparse_kv or halo is True:
            raise ValueError(
                "collective_schedule: return_max_logit=True runs on the ring only "
                "(strategy='ring', sparse_kv=False, halo None or False)"
            )
        if isinstance(heads, bool) or not isinstance(heads, int) or heads < 1:
            raise ValueError(
                "collective_schedule: return_max_logit=True needs heads= (query "
                f"heads, an int >= 1), got {heads!r}"
            )
        # Under torch.compile the call runs eagerly (ring_impl.api.MAX_LOGIT_RUNS_EAGERLY), so
        # `compiled` is checked but the eager ring's collectives are declared.
        ring_schedule(world_size, rotate_method, kv, compiled=compiled, head_chunks=head_chunks)
        schedule = ring_schedule(world_size, rotate_method, kv, head_chunks=head_chunks)
        if world_size > 1:
            entry = schedule["forward"].setdefault("all_reduce", {"calls": 0, "bytes": 0})
            entry["calls"] += 1
            entry["bytes"] += 2 * heads * kv.acc_itemsize
        return schedule
    if sparse_kv and world_size > 1:
        return _gather_schedule(
            world_size,
            rotate_method,
            kv,
            mask=mask,
            is_causal=is_causal,
            layout=layout,
            rank=rank,
            heads=heads,
            seq_q=seq_q,
            compiled=compiled,
            strategy=strategy,
            head_chunks=head_chunks,
        )
    if strategy != "ring":
        mesh_shape = (world_size, 1) if mesh_shape is None and strategy == "ulysses" else mesh_shape
        if mesh_shape is None or heads is None or seq_q is None:
            raise ValueError(
                f"collective_schedule: strategy {strategy!r} needs mesh_shape, heads and seq_q"
            )
        if mesh_shape[0] * mesh_shape[1] != world_size:
            raise ValueError(
                f"collective_schedule: mesh_shape {tuple(mesh_shape)} does not hold {world_size} "
                "ranks"
            )
        return strategy_schedule(
            strategy,
            (mesh_shape[0], mesh_shape[1]),
            rotate_method,
            kv,
            heads=heads,
            seq_q=seq_q,
            compiled=compiled,
            head_chunks=head_chunks,
            return_lse=return_lse,
        )
    if mask is not None and halo is not False and world_size > 1 and strategy == "ring":
        folded = fold_causal(mask, is_causal)
        seq_q = seq_kv if seq_q is None else seq_q
        refusal = halo_refusal(
            folded, layout=layout, world_size=world_size, seq_q=seq_q, seq_kv=seq_kv
        )
        if refusal is None:
            _check_per_rank_path(
                "this call takes the halo exchange, whose collectives differ between the end ranks "
                "and the others",
                world_size,
                rotate_method,
                kv,
                rank=rank,
                compiled=compiled,
            )
            reach = halo_reach(
                folded, layout=layout, world_size=world_size, seq_q=seq_q, seq_kv=seq_kv
            )
            assert reach is not None
            assert rank is not None  # _check_per_rank_path raised unless rank is an int in range
            return halo_schedule(world_size, rank, *reach, kv)
        if halo:
            raise ValueError(
                "collective_schedule: halo=True but the halo exchange cannot serve this call: "
                f"{refusal}"
            )
    return ring_schedule(world_size, rotate_method, kv, compiled=compiled, head_chunks=head_chunks)


def _replicated_schedule(
    world_size, rotate_method, replicated_kv, *, compiled, head_chunks, refused, kv: KVShards
) -> Schedule:
    """A ``replicated_kv=True`` call's: the forward's input check, nothing else (each rank
    attends its rows to the key/value it holds whole, under a mask too). ValueError for what the
    call refuses."""
    if not isinstance(replicated_kv, bool):
        raise ValueError(
            f"collective_schedule: replicated_kv must be True or False, got {replicated_kv!r}"
        )
    given = [name for name, present in refused.items() if present]
    if given:
        raise ValueError(
            f"collective_schedule: replicated_kv=True takes no {', '.join(given)} "
            "(ring_attention refuses them on every rank)"
        )
    # (the sizes, a transport given, compiled and head_chunks checked as for any call; nothing
    # rotates, so rotate_method may be None)
    transport = "allgather" if rotate_method is None else rotate_method
    ring_schedule(world_size, transport, kv, compiled=compiled, head_chunks=head_chunks)
    forward = {"all_reduce": {"calls": 1, "bytes": exchange_nbytes(world_size)}}
    return {"forward": forward if world_size > 1 else {}, "backward": {}}


def _exchange_options(exchange, strategy, halo, sparse_kv) -> tuple[str, bool | None, bool]:
    """``exchange`` as the (strategy, halo, sparse_kv) the schedule reads; ValueError for an
    unknown exchange or one the other keywords (at anything but their defaults) contradict."""
    from ..call import EXCHANGES, strategy_of

    if not isinstance(exchange, str) or exchange not in EXCHANGES:
        raise ValueError(
            f"collective_schedule: unknown exchange {exchange!r}; expected one of {EXCHANGES}"
        )
    implied = (
        strategy_of(exchange),
        {"ring": False, "halo": True}.get(exchange),
        exchange == "gather",
    )
    if (strategy, halo, sparse_kv) not in (("ring", None, False), implied):
        raise ValueError(
            f"collective_schedule: exchange={exchange!r} contradicts strategy={strategy!r}, "
            f"halo={halo!r}, sparse_kv={sparse_kv!r}; pass exchange= alone"
        )
    return implied


def _gather_schedule(
    world_size,
    rotate_method,
    kv: KVShards,
    *,
    mask,
    is_causal,
    layout,
    rank,
    heads,
    seq_q,
    compiled,
    strategy,
    head_chunks,
) -> Schedule:
    """The sparse gather's collectives on ``rank`` (:func:`.kv_gather.gather_schedule`)."""
    from ..exchanges.kv_gather import gather_plan, gather_refusal
    from .kv_gather import gather_schedule

    refusal = gather_refusal(
        mask, world_size=world_size, head_chunks=head_chunks, strategy=strategy
    )
    if refusal is not None:
        raise ValueError(f"collective_schedule: {refusal}")
    _check_per_rank_path(
        "the sparse gather's collectives differ between ranks",
        world_size,
        rotate_method,
        kv,
        rank=rank,
        compiled=compiled,
    )
    plan = gather_plan(
        fold_causal(mask, is_causal),
        rank=rank,
        world_size=world_size,
        layout=layout,
        seq_q=kv.seq_kv if seq_q is None else seq_q,
        seq_kv=kv.seq_kv,
        batch=kv.batch,
        heads=heads or 1,
    )
    return gather_schedule(plan, kv, world_size=world_size)


def _check_per_rank_path(
    why_rank: str,
    world_size: int,
    rotate_method: str,
    kv: KVShards,
    *,
    rank,
    compiled: bool,
) -> None:
    """The checks of a masked path whose collectives depend on the rank (the halo exchange, the
    sparse gather): eager only, ``rank`` given, and the world size and transport as the ring
    checks them."""
    if compiled:
        raise ValueError("collective_schedule: mask= runs eagerly only (compiled=False)")
    if isinstance(rank, bool) or not isinstance(rank, int) or not 0 <= rank < world_size:
        raise ValueError(
            f"collective_schedule: {why_rank}: pass rank= (0 <= rank < {world_size}), got {rank!r}"
        )
    ring_schedule(world_size, rotate_method, kv)
