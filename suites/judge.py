"""Parent-side verdicts: a case's per-rank results against the float64 oracle.

For each of out, lse, dq, dk, dv the global result X (unsharded with the reference's layout
code) is judged by :func:`reference.budget.check` against the float64 reference R on the same
dtype-rounded inputs, relative to the single-device baseline B of the same kernel and dtype.
R and B depend only on the inputs (not on world size, rotation or layout), so they are
computed once per input spec and cached for the session (:func:`baseline`, the one B of every
suite). The masked suites (masks, score_mods, uneven shards, packed) judge through
:func:`judge_outputs`: their results unsharded by each rank's global positions, the rows that
see nothing held to LSE -inf first, and dsinks summed over ranks; the replicated key/value
suite's (key and value whole on every rank) with dK/dV summed over ranks too.

A strategy case (Ulysses, the hybrid) is unsharded with the oracle's layout of its strategy
(:mod:`reference.strategies`), and the policy's ``world_size`` is the number of key/value blocks
a row's result merges (:func:`merged_blocks`: the ring degree R, Ulysses' 1).

A failure of the ring is re-run with per-step recording (when the implementation can record)
and diagnosed against the float64 ring simulation, so the message says which rank and ring step
first diverges; a strategy's by replaying the strategies' known bugs in float64
(:func:`reference.diagnose.diagnose_strategy`) and matching the output's heads against the
reference's (:func:`reference.diagnose.heads_permutation`); an LSE returned in the head-sharded
layout is named as such (:func:`lse_layout_problem`) before the shape contract. Every message
ends with a copy-pasteable repro.
"""

from __future__ import annotations

import functools
import hashlib
from collections import OrderedDict
from collections.abc import Callable, Hashable, Sequence
from typing import Any

import torch

from conformance.baseline import session_device, single_device_baseline
from reference import layout as ref_layout
from reference import strategies as ref_strategies
from reference.attention import attention_grads
from reference.budget import (
    ErrorScale,
    Verdict,
    assert_verdict,
    check,
    compute_dtype,
    error_scales,
)
from reference.diagnose import diagnose, diagnose_strategy, head_sharded_lse, heads_permutation
from reference.simulate import simulate_ring
from suites.cases import RingCase
from suites.inputs import InputSpec, make_inputs

__all__ = [
    "QUANTITIES",
    "baseline",
    "baseline_for",
    "contract_violations",
    "diagnose_case",
    "diagnose_strategy_case",
    "format_failure",
    "judge",
    "judge_float64_model",
    "judge_outputs",
    "lse_layout_problem",
    "merged_blocks",
    "produced",
    "reference_for",
    "scales_for",
    "simulation_for",
    "unshard_by_positions",
    "unshard_case",
    "unshard_results",
    "worst_location",
]

QUANTITIES = ("out", "lse", "dq", "dk", "dv")


def judge_float64_model(
    rank: int, name: str, got: torch.Tensor, ref: torch.Tensor, what: str, tokens: int
) -> None:
    """Fail with the numerics policy's message unless ``got`` (rank ``rank``'s ``name`` of a
    float64 model run under context parallelism) matches ``ref`` (the unsharded float64 run's).

    The unsharded run is both reference and baseline (error 0), so the policy reduces to its
    float64 floor. A model's outputs and parameter gradients sum one contribution per token, in
    another order when sharded (per rank, then the all-reduce): up to ``tokens`` (batch x seq)
    roundings more than the unsharded run's (reference.budget, ``roundings``). ``what`` names the
    run in the message."""
    __tracebackhide__ = True
    assert_verdict(
        check(
            name,
            got,
            ref,
            ref,
            dtype=torch.float64,
            rank=rank,
            roundings=tokens,
            context=f"[{what}]",
        )
    )


def produced(case: RingCase) -> tuple[str, ...]:
    """The quantities of :data:`QUANTITIES` a case asks for: out, the LSE with ``return_lse``,
    dq, dk, dv with ``backward``."""
    return (
        ("out",)
        + (("lse",) if case.return_lse else ())
        + (("dq", "dk", "dv") if case.backward else ())
    )


@functools.lru_cache(maxsize=128)
def reference_for(spec: InputSpec, is_causal: bool) -> dict[str, torch.Tensor]:
    """float64 out, lse, dq, dk, dv of the global inputs."""
    g = make_inputs(spec)
    r = attention_grads(
        g.query,
        g.key,
        g.value,
        g.grad_out,
        is_causal=is_causal,
        scale=spec.scale,
        grad_lse=g.grad_lse,
    )
    return {"out": r.out, "lse": r.lse, "dq": r.dq, "dk": r.dk, "dv": r.dv}


@functools.lru_cache(maxsize=128)
def scales_for(spec: InputSpec, is_causal: bool) -> dict[str, ErrorScale]:
    """The numerics policy's per-element magnitudes of out, lse, dq, dk, dv for these inputs."""
    from reference.attention import causal_visibility

    g = make_inputs(spec)
    visible = (
        causal_visibility(torch.arange(spec.seq_q), torch.arange(spec.seq_kv))
        if is_causal
        else None
    )
    return error_scales(
        g.query, g.key, g.value, g.grad_out, visible=visible, scale=spec.scale, grad_lse=g.grad_lse
    )


def baseline_for(spec: InputSpec, is_causal: bool, op_spec: str | None) -> dict[str, torch.Tensor]:
    """The ring suites' B: :func:`baseline` with the kernel's causal path for ``is_causal`` and
    the spec's grad_lse."""
    return baseline(spec, op_spec, is_causal=is_causal, grad_lse=True)


#: The baselines computed this session, by :func:`baseline`'s key, the oldest first.
_BASELINES: OrderedDict[tuple, dict[str, torch.Tensor]] = OrderedDict()
_BASELINES_KEPT = 128


def baseline(
    spec: InputSpec,
    op_spec: str | None,
    *,
    is_causal: bool = False,
    visible: torch.Tensor | None = None,
    sinks: torch.Tensor | None = None,
    score_mod: dict[str, Any] | None = None,
    grad_lse: bool = False,
) -> dict[str, torch.Tensor]:
    """The numerics policy's B of every suite: the same kernel, same dtype, on one device of the
    session's kind (the ranks' ``--device``) and the whole sequence of ``spec``'s inputs
    (:func:`conformance.baseline.single_device_baseline`), as CPU tensors.

    ``is_causal``: the kernel's causal path; visible (b or 1, h or 1, sq, skv) bool, sinks
    (h,), score_mod (reference.score_mods' plain data) as the single-device baseline takes them;
    ``grad_lse``: the loss also uses the LSE (the spec's drawn grad_lse, ``spec.lse_grad``).
    B depends only on these (not on world size, rotation or layout): it is computed once per
    session device and content of these arguments, and kept for the session.
    """
    key = (
        spec,
        op_spec,
        str(session_device()),
        is_causal,
        grad_lse,
        _content_key(visible),
        _content_key(sinks),
        _content_key(score_mod),
    )
    if key in _BASELINES:
        _BASELINES.move_to_end(key)
        return _BASELINES[key]
    g = make_inputs(spec)
    result = single_device_baseline(
        g.query,
        g.key,
        g.value,
        g.grad_out,
        op_spec=op_spec,
        is_causal=is_causal,
        scale=spec.scale,
        grad_lse=g.grad_lse if grad_lse else None,
        visible=visible,
        sinks=sinks,
        score_mod=score_mod,
    )
    _BASELINES[key] = result
    if len(_BASELINES) > _BASELINES_KEPT:
        _BASELINES.popitem(last=False)
    return result


def _content_key(value: Any) -> Hashable:
    """A hashable stand-in for ``value`` that equal contents share: a tensor by its dtype, shape
    and bytes; dicts, lists and tuples by their items; anything else (numbers, strings, a
    score_mod's function) as it is."""
    if isinstance(value, torch.Tensor):
        t = value.detach().cpu().contiguous()
        digest = hashlib.sha256(t.reshape(-1).view(torch.uint8).numpy().tobytes()).hexdigest()
        return ("tensor", str(t.dtype), tuple(t.shape), digest)
    if isinstance(value, dict):
        return ("dict", tuple(sorted((k, _content_key(v)) for k, v in value.items())))
    if isinstance(value, (list, tuple)):
        return ("seq", tuple(_content_key(v) for v in value))
    return value


def unshard_results(
    results: Sequence[dict[str, Any]],
    layout: str,
    unshard: Callable[[list[torch.Tensor]], torch.Tensor] | None = None,
) -> dict[str, torch.Tensor | None]:
    """Global tensors from per-rank local results (None where a rank returned None), put
    together by ``unshard`` (default: the ring's ``layout`` on dim 2; the LSE gets a trailing
    dim for it)."""
    if unshard is None:
        unshard = functools.partial(ref_layout.unshard, layout=layout, dim=2)
    merged: dict[str, torch.Tensor | None] = {}
    for name in QUANTITIES:
        parts = [r.get(name) for r in results]
        if any(p is None for p in parts):
            merged[name] = None
            continue
        if name == "lse":
            parts = [p.unsqueeze(-1) for p in parts]
        t = unshard(parts)
        merged[name] = t.squeeze(-1) if name == "lse" else t
    return merged


def unshard_case(
    case: RingCase, results: Sequence[dict[str, Any]]
) -> dict[str, torch.Tensor | None]:
    """:func:`unshard_results` by the case's layout: the ring's, or its strategy's on its mesh
    (index = mesh rank)."""
    if case.mesh_shape is None:
        return unshard_results(results, case.layout)
    return unshard_results(
        results,
        case.layout,
        lambda parts: ref_strategies.unshard(parts, case.strategy, case.layout, case.mesh_shape),
    )


def unshard_by_positions(
    parts: Sequence[torch.Tensor], positions: Sequence[torch.Tensor]
) -> torch.Tensor:
    """The global tensor (sequence dim 2) from every rank's local rows ``parts[r]`` at the global
    positions ``positions[r]`` (rows no rank holds are 0)."""
    shape = list(parts[0].shape)
    shape[2] = sum(len(p) for p in positions)
    whole = parts[0].new_zeros(shape)
    for part, p in zip(parts, positions):
        whole[:, :, p] = part
    return whole


def merged_blocks(case: RingCase) -> int:
    """The policy's world_size of a case: the key/value blocks a row's result merges. The ring's
    W; a case with a ``strategy`` on a ``mesh_shape`` (U, R): Ulysses' 1 (its kernel sees the
    whole sequence), the hybrid's R (reference.strategies.kv_blocks)."""
    mesh_shape = getattr(case, "mesh_shape", None)
    return (
        case.world_size
        if mesh_shape is None
        else ref_strategies.kv_blocks(case.strategy, mesh_shape)
    )


def judge_outputs(
    case: RingCase,
    results: Sequence[dict[str, Any]],
    *,
    positions: Sequence[torch.Tensor],
    visible: torch.Tensor | None,
    on_lse_mismatch: Callable[[int], str],
    baseline_op: str | None = None,
    names: Sequence[str] = QUANTITIES,
    sinks: torch.Tensor | None = None,
    score_mod: dict[str, Any] | None = None,
    causal_kernel: bool = False,
    call: str = "ring_attention",
    known_failure: Callable[[], str] | None = None,
    replicated_kv: bool = False,
) -> list[Verdict]:
    """Verdicts for ``names`` (of out, lse, dq, dk, dv) and, with ``sinks``, dsinks summed over
    ranks, each against the float64 oracle under ``visible``, ``sinks`` and ``score_mod``
    (reference.attention_grads), relative to the single-device :func:`baseline` of the same
    kernel given the same (``case.op``, else ``baseline_op``). With ``case.inputs.lse_grad`` the
    loss is ``(out * dO).sum() + (lse * dLSE).sum()`` for all three, and an LSE returned
    detached (``lse_requires_grad`` False on a rank) is named before any verdict.

    results: per rank, local tensors with the sequence on dim 2 (out (b, h, n_r, dv), lse
    (b, h, n_r), dq, dk, dv, dsinks (h,)); positions: per rank, the global positions (n_r,) of
    its rows. visible (b or 1, h or 1, seq_q, seq_kv) bool or None; ``causal_kernel``: B runs the
    kernel's causal path (``visible`` is then the causal mask, for the oracle only). The
    policy's world_size is :func:`merged_blocks` (dsinks, summed over every rank, is judged with
    the case's).

    Rows that see nothing (LSE -inf in the oracle) must be -inf exactly: otherwise an
    AssertionError ``"lse: {on_lse_mismatch(rows that differ)} [label]"``; they are then
    compared as 0. A rank that returned none of a quantity: AssertionError naming ``call``. With
    ``known_failure``, a failed verdict raises ``"{name}: {known_failure()} [label]"`` when it
    names a bug class (it runs only then).

    ``replicated_kv``: key and value are the whole sequence on every rank (capability
    ``replicated_kv``). out, lse and dq are unsharded by ``positions`` and judged as the result of
    one key/value block (the policy's world_size 1: a row merges nothing); dk and dv are each
    rank's contribution, of key's and value's global shapes, summed over the ranks in float64 and
    judged with the case's world_size, as dsinks are.
    """
    __tracebackhide__ = True
    spec = case.inputs
    g = make_inputs(spec)
    if spec.lse_grad:  # named before the verdicts, which it would only make wrong
        detached = detached_lse(case, results)
        if detached:
            raise AssertionError(f"lse: {detached}")
    inputs = (g.query, g.key, g.value, g.grad_out)
    oracle = dict(
        visible=visible, sinks=sinks, scale=spec.scale, score_mod=score_mod, grad_lse=g.grad_lse
    )
    ref = attention_grads(*inputs, **oracle)
    scales = error_scales(*inputs, **oracle, input_dtype=spec.torch_dtype)
    base = baseline(
        spec,
        case.op or baseline_op,
        is_causal=causal_kernel,
        visible=None if causal_kernel else visible,
        sinks=sinks,
        score_mod=score_mod,
        grad_lse=spec.lse_grad,
    )
    lse_dtype = compute_dtype(spec.torch_dtype)
    blocks = 1 if replicated_kv else merged_blocks(case)
    verdicts = []
    for name in names:
        parts = [r.get(name) for r in results]
        if any(p is None for p in parts):
            raise AssertionError(
                f"{name}: a rank returned no {name} ({call} with return_lse=True returns "
                "(out, lse) and gradients for query, key, value)"
            )
        want, b = getattr(ref, name), base[name].to(torch.float64)
        merged, where = blocks, ""
        if replicated_kv and name in ("dk", "dv"):  # each rank's rows' share of the whole's
            got = torch.stack([p.to(torch.float64) for p in parts]).sum(0)
            merged, where = case.world_size, " (summed over ranks)"
        else:
            got = unshard_by_positions(parts, positions).to(torch.float64)
        if name == "lse":  # rows that see nothing (and no sink): exactly -inf, compared as 0
            nothing = torch.isneginf(want)
            if not torch.equal(torch.isneginf(got), nothing):
                differ = int((torch.isneginf(got) != nothing).sum())
                raise AssertionError(f"lse: {on_lse_mismatch(differ)} [{case.label}]")
            got, want, b = (t.masked_fill(nothing, 0.0) for t in (got, want, b))
        verdict = check(
            name,
            got,
            want,
            b,
            dtype=spec.torch_dtype,
            result_dtype=lse_dtype if name == "lse" else spec.torch_dtype,
            scales=scales[name],
            world_size=merged,
            context=f"[{case.label}]{where}",
        )
        if known_failure is not None and not verdict.passed and known_failure():
            raise AssertionError(f"{name}: {known_failure()} [{case.label}]")
        verdicts.append(verdict)
    if sinks is not None:
        parts = [r.get("dsinks") for r in results]
        if any(p is None for p in parts):
            raise AssertionError(
                "dsinks: a rank's sinks got no gradient (sinks must be differentiable)"
            )
        got = torch.stack([p.to(torch.float64) for p in parts]).sum(0)
        verdicts.append(
            check(
                "dsinks",
                got,
                ref.dsinks,
                base["dsinks"].to(torch.float64),
                dtype=spec.torch_dtype,
                result_dtype=lse_dtype,
                world_size=case.world_size,
                roundings=spec.batch * spec.seq_q,
                scales=scales["dsinks"],
                context=f"[{case.label}] (summed over ranks)",
            )
        )
    return verdicts


def contract_violations(case: RingCase, results: Sequence[dict[str, Any]]) -> list[str]:
    """What each rank returned against the protocol's contract (conformance/implementation.py).

    Per rank: out has the input dtype and the shape (batch, heads, seq_q_local, head_dim_v)
    (value's head dim); the LSE is float32 (float64 for float64 inputs) of shape (batch, heads,
    seq_q_local); dq, dk, dv have the dtype and shape of query, key and value.
    """
    spec = case.inputs
    w = case.world_size
    in_dtype = spec.torch_dtype
    sq, skv = spec.seq_q // w, spec.seq_kv // w
    q_shape = (spec.batch, spec.heads, sq, spec.head_dim)
    k_shape = (spec.batch, spec.heads_kv, skv, spec.head_dim)
    v_shape = (spec.batch, spec.heads_kv, skv, spec.value_head_dim)
    expected = {
        "out": (in_dtype, (*q_shape[:3], spec.value_head_dim), "the input dtype"),
        "lse": (compute_dtype(in_dtype), q_shape[:3], "float32 (float64 for float64 inputs)"),
        "dq": (in_dtype, q_shape, "the dtype of query"),
        "dk": (in_dtype, k_shape, "the dtype of key"),
        "dv": (in_dtype, v_shape, "the dtype of value"),
    }
    problems = []
    for rank, r in enumerate(results):
        for name, (dtype, shape, dtype_words) in expected.items():
            t = r.get(name)
            if t is None:
                continue
            if t.dtype != dtype:
                problems.append(
                    f"contract: {name} must be {dtype_words}, {str(dtype).removeprefix('torch.')}; "
                    f"rank {rank} returned {str(t.dtype).removeprefix('torch.')}"
                )
            if tuple(t.shape) != shape:
                problems.append(
                    f"contract: {name} must have shape {shape} on every rank; rank {rank} "
                    f"returned {tuple(t.shape)}"
                )
    return problems


def detached_lse(case: RingCase, results: Sequence[dict[str, Any]]) -> str | None:
    """For a case whose loss uses the returned LSE: which ranks returned an LSE that does not
    require grad while query, key and value do (a loss through it backpropagates as if it were
    not there), in words; None when every rank's does."""
    detached = [rank for rank, r in enumerate(results) if not r.get("lse_requires_grad", True)]
    if not detached:
        return None
    return (
        f"the LSE returned on rank(s) {detached} does not require grad while query, key and value "
        f"do: a loss that uses it backpropagates as if it were not there [{case.label}]"
    )


def judge(
    case: RingCase, results: Sequence[dict[str, Any]], *, baseline_op: str | None = None
) -> list[Verdict]:
    """Verdicts for every quantity the case produced; AssertionError for a broken contract."""
    __tracebackhide__ = True
    spec = case.inputs
    missing = [
        f"{name}[rank={rank}]"
        for rank, r in enumerate(results)
        for name in sorted(produced(case))
        if r.get(name) is None
    ]
    if missing:
        raise AssertionError(
            f"no result for {', '.join(missing)}: the output or LSE was not returned, or the "
            "gradient did not reach that input (it was detached, or backward returned None for "
            f"it) [{case.label}]"
        )
    broken = contract_violations(case, results)
    layout_problem = lse_layout_problem(case, results)
    if layout_problem:
        broken = [layout_problem, *broken]
    if broken:
        raise AssertionError("\n".join([*broken, f"[{case.label}]"]))
    ref = reference_for(spec, case.is_causal)
    base = baseline_for(spec, case.is_causal, case.op or baseline_op)
    scales = scales_for(spec, case.is_causal)
    got = unshard_case(case, results)
    verdicts = []
    for name in QUANTITIES:
        x = got[name]
        if x is None:
            continue
        if x.shape != ref[name].shape:
            raise AssertionError(
                f"{name}: the implementation returned global shape {tuple(x.shape)} (unsharded "
                f"from per-rank {tuple(results[0][name].shape)}), expected "
                f"{tuple(ref[name].shape)} [{case.label}]"
            )
        verdicts.append(
            check(
                name,
                x,
                ref[name],
                base[name],
                dtype=spec.torch_dtype,
                result_dtype=compute_dtype(spec.torch_dtype) if name == "lse" else spec.torch_dtype,
                scales=scales[name],
                # (the rank of the worst element: the ring's layout; a strategy's is located by
                # worst_location)
                layout=case.layout if case.mesh_shape is None else None,
                world_size=merged_blocks(case),
                context=f"[{case.label}]",
            )
        )
    return verdicts


def lse_layout_problem(case: RingCase, results: Sequence[dict[str, Any]]) -> str | None:
    """In words, when the ranks of a strategy case returned the LSE in the head-sharded layout of
    the inner attention instead of the sequence shard; else None
    (:func:`reference.diagnose.head_sharded_lse` on the shapes the ranks returned)."""
    if case.mesh_shape is None:
        return None
    spec = case.inputs
    return head_sharded_lse(
        [None if r.get("lse") is None else tuple(r["lse"].shape) for r in results],
        batch=spec.batch,
        heads=spec.heads,
        seq_local=spec.seq_q // case.world_size,
        ulysses=case.mesh_shape[0],
    )


def worst_location(case: RingCase, verdict: Verdict) -> str:
    """Where the worst element of a strategy case's verdict lives: mesh rank, its coordinates
    and local index ("" for the ring, whose verdicts carry their rank)."""
    if case.mesh_shape is None or len(verdict.worst_index) < 3:
        return ""
    seq = case.inputs.seq_q if verdict.name in ("out", "lse", "dq") else case.inputs.seq_kv
    rank, local = ref_strategies.locate(
        verdict.worst_index, case.strategy, case.layout, case.mesh_shape, seq
    )
    u = case.mesh_shape[0]
    return (
        f"{verdict.name}: worst element on mesh rank {rank} (ulysses {rank % u}, ring "
        f"{rank // u}) at local {local}"
    )


def diagnose_strategy_case(
    case: RingCase, results: Sequence[dict[str, Any]], verdicts: Sequence[Verdict]
) -> str:
    """The strategy diagnosis of a failed strategy case (from its output), and where the worst
    elements are."""
    assert case.mesh_shape is not None, "a ring case is diagnosed by diagnose_case"
    g = make_inputs(case.inputs)
    got = unshard_case(case, results)
    out_verdict = next((v for v in verdicts if v.name == "out"), None)
    tolerance = None if out_verdict is None else max(out_verdict.max_bound, 1e-300)
    lines = []
    if got["out"] is not None:
        lines.append(
            diagnose_strategy(
                g.query,
                g.key,
                g.value,
                got["out"],
                strategy=case.strategy,
                layout=case.layout,
                mesh_shape=case.mesh_shape,
                is_causal=case.is_causal,
                scale=case.inputs.scale,
                tolerance=tolerance,
            )
        )
    if got["out"] is not None and tolerance is not None:
        ref_out = reference_for(case.inputs, case.is_causal)["out"]
        permuted = heads_permutation(got["out"], ref_out, tolerance)
        if permuted:
            lines.insert(0, permuted)
    lines += [worst_location(case, v) for v in verdicts if not v.passed]
    return "; ".join(line for line in lines if line)


def simulation_for(case: RingCase, g):
    """The float64 chunked ring simulation (:func:`reference.simulate.simulate_ring`) of the
    case's global inputs ``g`` (:func:`suites.inputs.make_inputs`): every (rank, step)'s partial
    on ``case.world_size`` ranks in its layout, with its causality and scale. ValueError for a
    shape the simulation cannot shard."""
    return simulate_ring(
        g.query,
        g.key,
        g.value,
        world_size=case.world_size,
        layout=case.layout,
        is_causal=case.is_causal,
        scale=case.inputs.scale,
    )


def diagnose_case(
    case: RingCase, results: Sequence[dict[str, Any]], records: Sequence[dict] | None
) -> str:
    """A paragraph naming the rank and ring step that first diverge from the float64 simulation."""
    spec = case.inputs
    g = make_inputs(spec)
    try:
        sim = simulation_for(case, g)
    except ValueError as exc:  # a shape the simulation cannot shard: nothing to compare
        return f"(no diagnosis: {exc})"
    grads = None
    if all(r.get("dq") is not None for r in results):
        grads = {n: [r[n] for r in results] for n in ("dq", "dk", "dv")}
    lses = [r["lse"] for r in results] if all(r.get("lse") is not None for r in results) else None
    d = diagnose(
        sim,
        [r["out"] for r in results],
        records=records,
        dtype=spec.torch_dtype,
        lse_by_rank=lses,
        grads_by_rank=grads,
        grad_out=g.grad_out if grads else None,
        grad_lse=g.grad_lse if grads else None,
    )
    return d.summary


def format_failure(failed: Sequence[Verdict], diagnosis: str | None, repro: str | None) -> str:
    lines = [v.message for v in failed]
    if diagnosis:
        lines.append(f"diagnosis: {diagnosis}")
    if repro:
        lines.append(f"repro: {repro}")
    return "\n".join(lines)
