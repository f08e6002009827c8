"""One ``ring_attention`` call, described once: the :class:`Call` every later stage takes.

The user's arguments are read here and nowhere else: the exchange chosen (one ``exchange=``
value, or the older ``strategy=``/``halo=``/``sparse_kv=`` keywords as aliases), the mask
copied so the caller's later writes cannot reach a plan (:func:`ring_impl.masks.snapshot`), the
default rotation filled in. A problem found in the arguments themselves (an unknown exchange,
aliases that contradict each other) is kept in :attr:`Call.problem` rather than raised, so it is
raised through the cross-rank agreement like any other bad input: on every rank together.

The checks, the cross-rank agreement, the compiled call's description
(:func:`ring_impl.compiled.masked_call.describe_call`) and the path take the Call; the path's own
configuration (:class:`ring_impl.exchanges.ring.RingConfig`) is built from it and the tensors.
"""

from __future__ import annotations

import warnings
from typing import Any, NamedTuple

import torch

__all__ = ["EXCHANGES", "Call", "exchange_of", "replicated_problem", "strategy_of"]

#: ``exchange=`` values. ``"auto"``: the halo exchange where the mask is narrow enough
#: (:func:`ring_impl.exchanges.halo.halo_reach`), else the ring. ``"ring"``: the ring always.
#: ``"halo"``: the halo exchange or an error saying why not. ``"gather"``: the sparse key/value
#: gather (:mod:`ring_impl.exchanges.kv_gather`). ``"ulysses"``, ``"hybrid"``: the head-parallel
#: strategies (:mod:`ring_impl.exchanges`).
EXCHANGES = ("auto", "ring", "halo", "gather", "ulysses", "hybrid")

#: The strategy each exchange belongs to: the first three exchanges and the gather are the ring's.
_STRATEGY = {
    "auto": "ring",
    "ring": "ring",
    "halo": "ring",
    "gather": "ring",
    "ulysses": "ulysses",
    "hybrid": "hybrid",
}


def strategy_of(exchange) -> str:
    """``"ring"`` (the ring, the halo exchange, the gather), ``"ulysses"`` or ``"hybrid"``; an
    unknown exchange counts as the ring's, whose check then refuses it."""
    return _STRATEGY.get(exchange, "ring") if isinstance(exchange, str) else "ring"


class Call(NamedTuple):
    """A ``ring_attention`` call's options (everything but query, key and value), as given,
    with the exchange resolved to one of :data:`EXCHANGES` and the rotation's default filled in.

    ``problem``: what is wrong with the options themselves, or a route's own refusal (the SDPA
    route's ``attn_mask``), raised on every rank by the cross-rank check. ``routed_from``: the
    function the user called when a context-parallel route runs it as ring attention; refusals
    name it (:func:`ring_impl.checks.inputs.routed_error`). ``backward``: whether the output
    needs a backward, as a compiled call traced it (grad mode and the inputs' ``requires_grad``,
    which the tensors inside the compiled custom ops no longer carry); None: read from the
    tensors (eager calls). A NamedTuple: immutable, and traced by torch.compile as plain values.
    """

    group: Any = None
    is_causal: bool = False
    scale: float | None = None
    rotate_method: str = "allgather"
    op: Any = None
    layout: str = "contiguous"
    return_lse: bool = False
    return_max_logit: bool = False
    head_chunks: int = 1
    mask: Any = None
    sinks: torch.Tensor | None = None
    score_mod: Any = None
    exchange: str = "auto"
    replicated_kv: bool = False
    problem: str | None = None
    routed_from: str | None = None
    backward: bool | None = None

    @property
    def strategy(self) -> str:
        """The exchange's strategy (:func:`strategy_of`)."""
        return strategy_of(self.exchange)

    @property
    def lse_needed(self) -> bool:
        """Whether the path computes the LSE: asked for, or needed by the sink term."""
        return bool(self.return_lse) or self.sinks is not None

    def options(self) -> dict[str, Any]:
        """The plain options (every field but group, mask, sinks and score_mod), by name: what
        a compiled call carries as a literal (:func:`ring_impl.compiled.masked_call.describe_call`;
        a call with a score_mod runs eagerly)."""
        skip = ("group", "mask", "sinks", "score_mod")
        return {
            name: value for name, value in zip(self._fields, self, strict=True) if name not in skip
        }

    def with_(self, **changes) -> Call:
        return self._replace(**changes)


def exchange_of(exchange, strategy, halo, sparse_kv) -> tuple[Any, str | None]:
    """``(exchange, problem)`` from ``exchange=`` and its older aliases ``strategy=`` ("ring",
    "ulysses", "hybrid"), ``halo=`` (None, True, False) and ``sparse_kv=`` (True, False), each
    None when not given. An alias given warns (DeprecationWarning) and maps to its exchange;
    aliases that contradict each other or ``exchange=`` give a problem (raised on every rank by
    the cross-rank check), never a guess. Never raises."""
    given = {
        name: value
        for name, value in (("strategy", strategy), ("halo", halo), ("sparse_kv", sparse_kv))
        if value is not None
    }
    if not given:
        return exchange, _unknown(exchange)
    if not torch.compiler.is_compiling():  # (dynamo cannot trace warnings.warn: eager calls warn)
        warnings.warn(
            "ring_attention: "
            + ", ".join(f"{k}=" for k in given)
            + (
                f" are deprecated; pass exchange= one of {EXCHANGES} (strategy='ulysses' -> "
                "exchange='ulysses', halo=True -> 'halo', halo=False -> 'ring', sparse_kv=True "
                "-> 'gather')"
            ),
            DeprecationWarning,
            stacklevel=3,
        )
    if halo is not None and not isinstance(halo, bool):
        return exchange, f"halo must be None (automatic), True or False, got {halo!r}"
    if sparse_kv is not None and not isinstance(sparse_kv, bool):
        return exchange, f"sparse_kv must be True or False, got {sparse_kv!r}"
    if strategy is not None and strategy not in ("ring", "ulysses", "hybrid"):
        return (
            exchange,
            f"unknown strategy {strategy!r}; expected one of ('ring', 'ulysses', 'hybrid')",
        )
    fits: tuple[str, ...]  # the exchanges the aliases allow
    if strategy in ("ulysses", "hybrid"):
        if halo:
            return exchange, f"halo={halo!r} runs with strategy='ring' only; pass halo=None"
        if sparse_kv:
            return (
                exchange,
                f"sparse_kv={sparse_kv!r} runs with strategy='ring' only; pass sparse_kv=False",
            )
        implied, fits = strategy, (strategy,)
    elif sparse_kv:
        if halo:
            return (
                exchange,
                "halo=True and sparse_kv=True ask for two different exchanges; pass one of them",
            )
        implied, fits = "gather", ("gather",)
    elif halo is not None:
        implied = "halo" if halo else "ring"
        fits = (implied,)
    else:  # strategy="ring" alone, or sparse_kv=False: any of the ring's exchanges
        implied, fits = "auto", ("auto", "ring", "halo", "gather")
    if exchange == "auto" or (exchange in fits and exchange != "auto"):
        return (implied if exchange == "auto" else exchange), None
    if _unknown(exchange) is not None:
        return exchange, _unknown(exchange)
    return exchange, (
        f"exchange={exchange!r} and "
        + ", ".join(f"{k}={v!r}" for k, v in given.items())
        + " ask for different exchanges; pass exchange= alone"
    )


def _unknown(exchange) -> str | None:
    if isinstance(exchange, str) and exchange in EXCHANGES:
        return None
    return f"unknown exchange {exchange!r}; expected one of {EXCHANGES}"


def kv_shards(call: Call, world: int) -> int:
    """How many shards make the global key/value of ``call`` over ``world`` ranks: 1 where every
    rank holds it whole (``replicated_kv=True``), else ``world``."""
    return 1 if call.replicated_kv is True else world


def replicated_problem(call: Call) -> str | None:
    """What ``replicated_kv=`` cannot serve in ``call``, or None. With ``replicated_kv=True``
    every rank holds the whole key/value sequence (cross-attention over text tokens, say): each
    rank attends its own query rows to all of it and nothing is exchanged. Its keys have no
    positions on the query's sequence, so causality and score_mods, which compare the two, are
    refused rather than guessed; a mask is read at (the query's global position, the key's index
    ``0..L-1``), which is what a key padding mask or cross-attention documents
    (``Documents(q_ids, kv_doc_ids=kv_ids)``) say. The other exchanges and the max logit (an
    all-reduce of the ring's) are refused too. (``ring_attention`` refuses the packed and
    uneven forms with it: the query's are the only shards.) Never raises."""
    replicated = call.replicated_kv
    if not isinstance(replicated, bool):
        return f"replicated_kv must be True or False, got {replicated!r}"
    if not replicated:
        return None
    refused = [
        name
        for name, given in (
            ("is_causal=True", call.is_causal is True),
            ("score_mod=", call.score_mod is not None),
            ("return_max_logit=True", call.return_max_logit is True),
        )
        if given
    ]
    if refused:
        return (
            "replicated_kv=True (key and value the whole key/value sequence on every rank) takes "
            f"no {', '.join(refused)}: its keys have no positions on the query's sequence for "
            "causality or a score_mod to compare with the query's; pass a mask= on (query "
            "position, key index) instead, or pass them without replicated_kv, with key/value "
            "sharded like the query"
        )
    if call.exchange not in ("auto", "ring"):
        return (
            f"replicated_kv=True moves no key/value, so it takes no exchange={call.exchange!r}: "
            "pass exchange='auto' (each rank attends its query rows to the whole key/value it "
            "holds; group= the group the query is sharded over)"
        )
    return None
