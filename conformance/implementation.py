"""The implementation-under-test protocol, and loading one from ``--impl`` / ``RING_IMPL``.

An implementation is any object (a module works too) with:

``ring_attention(query, key, value, *, group, is_causal, scale, rotate_method, op, layout,
return_lse)``
    Same signature and semantics as :func:`ring_impl.ring_attention`: local shards
    ``(batch, heads, seq_local, head_dim)`` in ``layout`` in, the local output out (and the local
    LSE ``(batch, heads, seq_local)`` with ``return_lse=True``), differentiable in query, key and
    value. The suite shards and unshards the global tensors itself.

Everything else the protocol describes is **claimed unless the implementation declares that it
lacks it**. ``capabilities`` (a :class:`Capabilities`, or a dict of its fields) says what it
lacks: a field set to ``False``, or a set that leaves the value out (``rotate_methods=
frozenset({"p2p"})`` lacks ``allgather`` and ``alltoall``). A field left ``None``, or no
``capabilities`` at all, is claimed: its cases run and must pass. Only what is declared lacking
is reported N/A; an object with ``ring_attention`` and nothing else is tested on everything.

The other pieces of the protocol, each claimed unless its capability field is ``False``:

``collective_schedule(world_size, rotate_method, *, batch, heads_kv, seq_kv, head_dim, dtype,
compiled)``
    (capability ``collective_schedule``) ``{phase: {kind: {"calls": n, "bytes": b}}}`` for one
    forward and one backward call, in the accounting convention of :mod:`harness.accounting`;
    the suite asserts it exactly on every rank. Cases whose value has its own head dim (capability
    ``value_head_dim``) also pass ``head_dim_v=``; masked cases (capability ``masks``) pass
    ``mask=`` (the call's :class:`conformance.specs.MaskSpec`), ``is_causal=``, ``layout=``,
    ``rank=`` (the rank whose collectives are asked: an exchange sized by the mask, a halo or a
    sparse gather, differs between ranks), ``heads=`` and ``seq_q=`` (local). Replicated
    key/value cases (capability ``replicated_kv``) pass ``replicated_kv=True`` with
    ``rotate_method`` None (nothing rotates) and ``seq_kv`` the whole key/value's length.
``record_steps()``
    (capability ``record_steps``) a context manager yielding an object with ``records`` (see
    :mod:`ring_impl.debug`): the per-step partials that ``test_causal_layouts`` compares with
    the float64 ring simulation, and that pin a failure to a rank and ring step.
``api_module``
    (capability ``context_parallel``) the name of an importable module that offers
    ``context_parallel``, ``context_parallel_unshard`` and ``ContextParallel`` with the semantics
    of ``ring_impl``'s (PyTorch's ``torch.distributed.tensor.experimental`` API on plain
    tensors). The context-parallel and model cases run that module's API; nothing falls back to
    ``ring_impl``'s. :meth:`Implementation.api_module` resolves it.

A claimed piece that is missing fails every case that needs it, with a message that names the
missing attribute and the capability field that would declare it lacking; it is never N/A.

Optional, with defaults:

``name``
    Shown in reports (default: the spec).
``baseline_op``
    The name of the :mod:`ring_impl.ops` kernel that matches the implementation's own local
    kernel; the single-device baseline of the numerics policy runs it (default ``"auto"``).

``mask`` (capability ``masks``) and ``sinks`` (capability ``sinks``) are passed to
``ring_attention`` by the mask suite (``suites/test_masks.py``): ``mask`` a
:class:`conformance.specs.MaskSpec` on global positions, the plain data of
:mod:`reference.masks` as a read-only mapping (``mask["kind"]``, ``mask["doc_ids"]``, ...;
``mask.visible(b, h, q_idx, kv_idx)`` on index tensors evaluates it), ``sinks`` a
(heads,) tensor of per-head sink logits that requires grad; the suite sums every rank's
``sinks.grad``. Rows that see nothing must come back as out 0, LSE -inf (the sink logit with
sinks), zero gradients.

``score_mod`` (capability ``score_mod``) is passed to ``ring_attention`` by the score_mod suite
(``suites/test_score_mods.py``): a callable ``score_mod(score, b, h, q_idx, kv_idx)`` in flex
attention's convention, called on broadcastable tensors (score (B, H, rows, cols), b (B, 1, 1,
1), h (1, H, 1, 1), q_idx (1, 1, rows, 1), kv_idx (1, 1, 1, cols)) and returning the modified
scores; ``q_idx``/``kv_idx`` are *global* token positions and ``h`` the global query head. It
changes the scaled logit ``scale * q . k`` before the mask and the softmax, inside each ring
step's block (before the merge). The built-in kinds (:data:`reference.score_mods.SCORE_MOD_KINDS`:
soft-capping, ALiBi, a post-scale bias) come as :class:`conformance.specs.ScoreModSpec`, such a
callable that is also the kind's plain data (``score_mod["cap"]``, ``["slopes"]``/``["symmetric"]``,
``["bias"]``); any other callable is one kind, ``score_mod``. Gradients must reach query, key
and value through it.

``return_max_logit`` (capability ``max_logit``) is passed to ``ring_attention`` by the max-logit
suite (``suites/test_max_logit.py``): with ``return_max_logit=True`` it returns ``(out,
max_logit)`` (``(out, lse, max_logit)`` with ``return_lse=True``), ``max_logit`` a (heads,)
tensor in float32 (float64 for float64 inputs), not requiring grad, equal on every rank: per
head the largest ``scale * q . k`` over the batch, every query row on every rank and every key
that row sees under causality and the mask (sinks are no keys' logits), -inf for a head that
sees nothing, NaN where a NaN input reaches a visible logit (what QK-clip optimisers read;
TransformerEngine's ``return_max_logit``). With ``collective_schedule`` claimed, the suite also
asks ``collective_schedule(..., heads=, return_max_logit=True)`` for the call's collectives.

``shard_lengths`` (capability ``uneven_shards``) is passed to ``ring_attention`` by the
uneven-shard suite (``suites/test_uneven.py``): ``shard_lengths=[n_0, ..., n_{W-1}]``, a list of
ints equal on every rank, says that rank ``r`` holds ``n_r >= 0`` tokens (query, key and value
alike; a rank may hold none) of a global sequence of ``S = sum(shard_lengths)`` tokens that no
layout need divide. ``layout="contiguous"`` takes any split (rank ``r`` holds the next ``n_r``
positions); another layout only its own split of ``S`` (``head_tail``: its 2W chunks cut as
``torch.tensor_split`` cuts, :func:`reference.layout.split_lengths`), the suite cutting the
shards with :func:`reference.layout.split_positions`. Every rank returns its own rows only: out
``(batch, heads, n_r, head_dim_v)``, the LSE ``(batch, heads, n_r)``, and the gradients of its
own query, key and value rows (its inputs' shapes); causality, masks and windows hold on the
true global positions (rank ``r``'s first token is at ``n_0 + ... + n_{r-1}``). Whatever an
implementation pads a shard with must be seen by no query and returned to no caller.

``replicated_kv`` (capability ``replicated_kv``) is passed to ``ring_attention`` by the
replicated key/value suite (``suites/test_replicated_kv.py``): ``replicated_kv=True`` says that
``key`` ``(batch, heads_kv, seq_kv, head_dim)`` and ``value`` ``(batch, heads_kv, seq_kv,
head_dim_v)`` are the *whole* key/value sequence, equal on every rank (the text tokens of a
cross-attention every rank holds), while ``query`` ``(batch, heads, seq_q_local, head_dim)`` is
this rank's shard of the global query in ``layout`` as usual; ``seq_kv`` is unrelated to the
query's length (1 key is a case). The call is non-causal with no score_mod; ``sinks`` and
``op`` may come with it, ``rotate_method`` may be left out (nothing rotates), and (capability
``masks`` with ``mask_mod``) a ``mask=`` whose ``visible(b, h, q, kv)`` takes the query's global
position and the key's index ``0..seq_kv-1`` (a key padding mask, documents across the two
sequences). Every query row attends to all ``seq_kv`` keys (those its mask shows) once: the
local output ``(batch, heads, seq_q_local, head_dim_v)``
and, with ``return_lse=True``, the local LSE ``(batch, heads, seq_q_local)``. Gradients: dQ of
the rank's own rows; dK and dV on each rank are of key's and value's shapes and their **sum over
the ranks** is the gradient of the replicated tensors, which is what the suite judges (the caller
reduces them over the group as it reduces a parameter's gradient, so any split with that sum
trains alike; ring_impl's and math_ring's: each rank its own query rows' contribution; an
implementation that reduces them itself returns W times the gradient in that sum); each rank's
``sinks.grad`` covers its own rows, summed over the ranks by the suite. Treating the replicated
key/value as sequence shards (rotating or all-to-all-ing it) shows every query W copies: the LSE
is off by ``log W``, the output with sinks too.

``balanced_layout(balancer, mask, seq_len, world_size)``
    (capability ``balancers``: the names of the balancers it has, ``"document_head_tail"``
    (head_tail per packed document) and ``"work_aware"`` (chunks dealt by their work under the
    mask)) builds the balancer's layout for ``mask`` (a :class:`conformance.specs.MaskSpec` on
    global positions) on a sequence of ``seq_len`` tokens over ``world_size`` ranks, makes
    ``ring_attention`` accept it, and returns ``(layout, runs)``: the name to pass as
    ``layout=`` and, per rank, the half-open runs ``((start, stop), ...)`` of global positions
    it holds in local order. The balance suite (``suites/test_balance.py``) and the mask suite
    (``suites/test_masks.py``) call it on every rank with equal arguments and shard the global
    tensors by ``runs`` themselves; the first holds each rank's work to the bound the suite
    declares for the balancer, the second the outputs and gradients to the float64 oracle. Built-in
    layouts are ``capabilities.layouts``; undeclared ``balancers`` claims both
    (and ``balanced_layout``).

    ``mask`` may also be a list of ``(mask, weight)`` pairs (capability ``multi_mask_layouts``):
    the masks of one model's layers (documents everywhere, a sliding window in some layers),
    ``weight`` a positive number (how many layers run that mask, or any relative cost); the one
    layout balances the weighted sum of their work. The multi-mask layout suite
    (``suites/test_multi_mask_layouts.py``) holds each rank's weighted work to the balancer's
    bound and judges every mask's outputs and gradients on that one layout against the oracle.
    Declare ``multi_mask_layouts=False`` for a balancer that takes one mask only.

``cu_seqlens`` (capability ``packed``) is passed to ``ring_attention`` by the packed suite
(``suites/test_packed.py``): packed (THD) inputs, query/key/value ``(tokens_local, heads,
head_dim)`` (key and value ``heads_kv``), each rank's shard in ``layout`` (dim 0) of the global
packed sequence of ``tokens = tokens_local * world_size`` tokens, and ``cu_seqlens`` the global
cumulative document lengths ``[0, l0, l0 + l1, ...]`` (a list of ints or a 1-D int32 tensor,
equal on every rank). Attention stays inside each document (causal within it with
``is_causal=True``); tokens from ``cu_seqlens[-1]`` to ``tokens`` are padding: out 0, LSE -inf,
zero gradients. Returns out ``(tokens_local, heads, head_dim_v)`` and, with ``return_lse=True``,
the LSE as ``(heads, tokens_local)`` (FlashAttention's varlen layout).

``strategy`` (capability ``strategies``) is passed to ``ring_attention`` by the strategy axis of
the forward/backward, collectives, compile, bad-input, LSE-layout and shapes suites
(``suites/meshes.py``; the mask and score_mod suites run it too): ``"ulysses"`` with
``group=`` the Ulysses process group, ``"hybrid"`` with ``group=`` a 2-D DeviceMesh whose dims are
named ``"ring"`` and ``"ulysses"``; shards follow :mod:`reference.strategies`' layouts.
Undeclared claims all three.

``value_head_dim`` (capability ``value_head_dim``): ``value`` may have a head dim ``head_dim_v``
other than query's and key's (DeepSeek's multi-head latent attention): value ``(batch,
heads_kv, seq_local, head_dim_v)``, the output and its gradient ``(batch, heads, seq_local,
head_dim_v)``, dQ/dK of query's and key's shape. ``suites/test_forward_backward.py`` runs such
cases across rotations, layouts and world sizes (``test_value_head_dim``) and
``suites/test_collectives.py`` asserts ``collective_schedule(..., head_dim_v=)`` when the
schedule is claimed too.

``op`` is passed to ``ring_attention`` when a case runs a given kernel (``--op``, the LSE-layout
cases, the work-counting cases): as an op object (:class:`ring_impl.ops.AttentionOp`), which needs
``"*"`` in ``capabilities.ops`` (undeclared ``ops`` claims it). Declare ``ops=frozenset()`` for
an implementation that always runs its own kernel.

``--impl`` takes ``package.module:object``; ``package.module`` alone means that module's
``IMPLEMENTATION`` if it has one, else the module itself; ``ring_impl`` means the default
implementation (:data:`DEFAULT_IMPL_SPEC`).
"""

from __future__ import annotations

import dataclasses
import functools
import importlib
import os
from dataclasses import dataclass
from types import ModuleType
from typing import Any

__all__ = [
    "CONTEXT_PARALLEL_API",
    "DEFAULT_IMPL_SPEC",
    "PROTOCOL_ATTRIBUTES",
    "Capabilities",
    "ImplSpecError",
    "Implementation",
    "ProtocolError",
    "canonical_spec",
    "load_implementation",
    "load_op",
]

DEFAULT_IMPL_SPEC = "conformance.adapters.ring_impl:IMPLEMENTATION"

#: ``--impl`` names that stand for another spec.
ALIASES = {"ring_impl": DEFAULT_IMPL_SPEC}

#: Capability field -> the implementation attribute that provides it.
PROTOCOL_ATTRIBUTES = {
    "collective_schedule": "collective_schedule",
    "record_steps": "record_steps",
    "context_parallel": "api_module",
}

#: What the module named by ``api_module`` must offer.
CONTEXT_PARALLEL_API = ("context_parallel", "context_parallel_unshard", "ContextParallel")


class ImplSpecError(ValueError):
    """A ``--impl`` / ``--op`` value that cannot be loaded; the message names the fix."""


class ProtocolError(ImplSpecError):
    """A piece of the protocol the implementation
    claims (by not declaring it lacking) is missing."""


@dataclass(frozen=True)
class Capabilities:
    """What an implementation declares it supports or lacks.

    ``None`` (the default) means undeclared, which claims the capability: its cases run. N/A is
    only for a bool field set to ``False`` or a set that does not contain the value a case needs.
    """

    layouts: frozenset[str] | None = None
    rotate_methods: frozenset[str] | None = None
    dtypes: frozenset[str] | None = None  # "float64", "float32", "bfloat16", "float16"
    devices: frozenset[str] | None = None  # "cpu", "cuda"
    ops: frozenset[str] | None = None  # op names accepted by op=; "*" accepts op objects too
    backward: bool | None = None
    lse: bool | None = None  # return_lse=True supported
    lse_grad: bool | None = None  # the returned LSE is differentiable (a loss may use it)
    gqa: bool | None = None
    cross_attention: bool | None = None  # non-causal with seq_kv != seq_q
    value_head_dim: bool | None = (
        None  # value's head dim differs from query's/key's (MLA: d_v != d_qk)
    )
    compile: bool | None = None  # works under torch.compile(fullgraph=True)
    input_errors: bool | None = None  # raises on every rank for bad input, never hangs
    context_parallel: bool | None = (
        None  # offers context_parallel / ContextParallel (needs api_module)
    )
    collective_schedule: bool | None = None  # has collective_schedule(...), asserted exactly
    record_steps: bool | None = None  # has record_steps(), per-step partials
    strategies: frozenset[str] | None = (
        None  # "ring", "ulysses", "hybrid": ring_attention(strategy=...)
    )
    masks: frozenset[str] | None = (
        None  # mask kinds (reference.masks.MASK_KINDS) of ring_attention(mask=...)
    )
    sinks: bool | None = None  # ring_attention(sinks=...): per-head sink logits, differentiable
    #: ring_attention(score_mod=...): flex-style score changes on global positions
    score_mod: bool | None = None
    balancers: frozenset[str] | None = (
        None  # "document_head_tail", "work_aware": balanced_layout(balancer, ...)
    )
    max_logit: bool | None = None  # ring_attention(return_max_logit=True): the per-head max logit
    #: ring_attention(shard_lengths=[n_0, ...]): rank r holds n_r tokens, any n_r >= 0
    uneven_shards: bool | None = None
    #: ring_attention(cu_seqlens=...): packed (tokens_local, heads, head_dim) documents
    packed: bool | None = None
    #: balanced_layout(balancer, [(mask, weight), ...], ...): one layout for several masks
    multi_mask_layouts: bool | None = None
    #: ring_attention(replicated_kv=True): key/value whole and equal on every rank (cross-attention
    #: text tokens), the query sharded; dK/dV per rank are its rows' share, summed over ranks
    replicated_kv: bool | None = None

    @staticmethod
    def of(obj: Any) -> Capabilities:
        raw = getattr(obj, "capabilities", None)
        if raw is None:
            return Capabilities()
        if isinstance(raw, Capabilities):
            return raw
        if isinstance(raw, dict):
            known = {f.name for f in dataclasses.fields(Capabilities)}
            unknown = sorted(set(raw) - known)
            if unknown:
                raise ImplSpecError(
                    f"capabilities has unknown fields {unknown}; known fields: {sorted(known)}"
                )
            fields: dict[str, Any] = {
                k: frozenset(v) if isinstance(v, (list, tuple, set)) else v for k, v in raw.items()
            }
            return Capabilities(**fields)
        raise ImplSpecError(
            f"capabilities must be a conformance.Capabilities or a dict, not {type(raw).__name__}"
        )

    def declares(self, name: str, value: Any = True) -> bool | None:
        """What the field says: True/False if declared (contains/equals value), None if undeclared.

        For decisions use :meth:`claims`: undeclared is claimed.
        """
        field = getattr(self, name)
        if field is None:
            return None
        if isinstance(field, frozenset):
            return value in field or "*" in field
        return bool(field) == bool(value)

    def claims(self, name: str, value: Any = True) -> bool:
        """True unless the implementation declares it lacks ``name`` (or ``value`` in it)."""
        declared = self.declares(name, value)
        return True if declared is None else declared

    def lacking(self, name: str, value: Any = True) -> str:
        """Why ``name``/``value`` is not claimed, in words ("" when it is claimed)."""
        if self.claims(name, value):
            return ""
        field = getattr(self, name)
        if isinstance(field, frozenset):
            return f"declares capabilities.{name}={sorted(field)}, without {value!r}"
        return f"declares capabilities.{name}={field!r}"


@dataclass(frozen=True)
class Implementation:
    """A loaded implementation under test and the spec it came from (picklable by spec)."""

    spec: str
    obj: Any

    @property
    def name(self) -> str:
        return str(getattr(self.obj, "name", self.spec))

    @property
    def capabilities(self) -> Capabilities:
        return Capabilities.of(self.obj)

    def missing(self, capability: str) -> str:
        """The message for a claimed protocol piece that is missing ("" when present or lacking).

        ``capability``: a key of :data:`PROTOCOL_ATTRIBUTES`.
        """
        attr = PROTOCOL_ATTRIBUTES[capability]
        if not self.capabilities.claims(capability):
            return ""
        value = getattr(self.obj, attr, None)
        present = (
            isinstance(value, str) and bool(value) if attr == "api_module" else callable(value)
        )
        if present:
            return ""
        if value is None:
            has = f"has no {attr}"
        else:
            has = (
                f"its {attr} is {type(value).__name__} {value!r}, not "
                f"{'a module name' if attr == 'api_module' else 'callable'}"
            )
        return (
            f"{self.name} claims capabilities.{capability} (not declared False; undeclared means "
            f"claimed) but {has}: add {attr} (see conformance/implementation.py) or declare "
            f"capabilities.{capability}=False"
        )

    def protocol(self, capability: str) -> Any:
        """The attribute that provides a claimed ``capability``;
        :class:`ProtocolError` if it is missing."""
        problem = self.missing(capability)
        if problem:
            raise ProtocolError(problem)
        if not self.capabilities.claims(capability):
            raise ProtocolError(
                f"{self.name} {self.capabilities.lacking(capability)}: nothing to call"
            )
        return getattr(self.obj, PROTOCOL_ATTRIBUTES[capability])

    def api_module(self) -> ModuleType:
        """The module whose ``context_parallel``, ``context_parallel_unshard`` and
        ``ContextParallel`` are under test (the implementation's ``api_module``).

        Raises :class:`ProtocolError` when the implementation declares ``context_parallel=False``,
        has no ``api_module``, names a module that cannot be imported, or one that lacks a name of
        :data:`CONTEXT_PARALLEL_API`.
        """
        name = self.protocol("context_parallel")
        try:
            module = importlib.import_module(name)
        except ImportError as exc:
            raise ProtocolError(
                f"{self.name}: api_module {name!r} cannot be imported ({exc}); make it importable "
                "or fix api_module"
            ) from exc
        lacking = [a for a in CONTEXT_PARALLEL_API if not hasattr(module, a)]
        if lacking:
            raise ProtocolError(
                f"{self.name}: api_module {name!r} lacks {lacking}; it must offer "
                f"{list(CONTEXT_PARALLEL_API)} (or declare capabilities.context_parallel=False)"
            )
        return module

    def __reduce__(self):
        return (load_implementation, (self.spec,))


def _import_object(spec: str, what: str, option: str, env: str) -> Any:
    module_name, _, attr = spec.partition(":")
    if not module_name:
        raise ImplSpecError(
            f"{option}={spec!r}: expected 'package.module:object' or 'package.module' (or set "
            f"{env})"
        )
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise ImplSpecError(
            f"{option}={spec!r}: cannot import module {module_name!r} ({exc}); make it importable "
            f"(pip install it, or run pytest from the directory that contains it) or fix {env}"
        ) from exc
    if not attr:
        return module
    obj = module
    for part in attr.split("."):
        if not hasattr(obj, part):
            raise ImplSpecError(f"{option}={spec!r}: {module_name} has no attribute {attr!r}")
        obj = getattr(obj, part)
    return obj


def canonical_spec(spec: str) -> str:
    """``package.module:object`` for a ``--impl`` value: aliases resolved, and a bare module that
    has an ``IMPLEMENTATION`` attribute turned into ``module:IMPLEMENTATION``."""
    spec = ALIASES.get(spec.strip(), spec.strip())
    if ":" in spec:
        return spec
    module = _import_object(spec, "implementation", "--impl", "RING_IMPL")
    return f"{spec}:IMPLEMENTATION" if hasattr(module, "IMPLEMENTATION") else spec


_CACHE: dict[str, Implementation] = {}


def load_implementation(spec: str | None = None) -> Implementation:
    """Load ``package.module:object`` (default: ``RING_IMPL`` or ring_impl's adapter)."""
    given = spec or os.environ.get("RING_IMPL") or DEFAULT_IMPL_SPEC
    if given not in _CACHE:
        canonical = canonical_spec(given)
        if canonical not in _CACHE:
            obj = _import_object(canonical, "implementation", "--impl", "RING_IMPL")
            if not callable(getattr(obj, "ring_attention", None)):
                raise ImplSpecError(
                    f"--impl={given!r}: {obj!r} has no callable ring_attention; see "
                    "conformance/implementation.py for the protocol"
                )
            Capabilities.of(obj)  # validate now, at start, not in the middle of a run
            _CACHE[canonical] = Implementation(canonical, obj)
        _CACHE[given] = _CACHE[canonical]
    return _CACHE[given]


@functools.cache
def load_op(spec: str):
    """An attention op object from ``package.module:object`` (``--op`` / ``RING_OP``) or a
    registered name.

    One object per spec, registered under its ``name`` unless that name is taken: compiled,
    ring_impl carries an op by its registered name (ring_impl.compiled.checks), and an op it
    cannot name runs without the compiled cross-rank check the schedule declares."""
    from ring_impl import ops

    if ":" not in spec and "." not in spec:
        return ops.get_op(spec)
    obj = _import_object(spec, "attention op", "--op", "RING_OP")
    if isinstance(obj, type):
        obj = obj()
    missing = ops.missing_members(obj)
    if missing:
        raise ImplSpecError(
            f"--op={spec!r}: {obj!r} lacks {missing}; see ring_impl/ops.py (AttentionOp) for the "
            "contract"
        )
    name = getattr(obj, "name", None)
    if isinstance(name, str) and name not in ops.available_ops():
        ops.register_op(obj)
    return obj
