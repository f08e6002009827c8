"""The context-parallel API: buffers sharded and restored, SDPA routed and restored, unshard,
the tutorial example. Needs ``capabilities.context_parallel`` (ring_impl's API).

And the ways an API can leave context parallelism quietly off or misapplied: a parallelised
module compiled with ``torch.compile`` (quick tier: backends eager and aot_eager; inductor in
``--tier nightly``, whose cold compile takes minutes on 2 cores), compiled SDPA inside
``context_parallel``, ``nn.MultiheadAttention``'s default ``need_weights=True`` path (a wrong
answer fails; a clear error on every rank passes), a tensor listed more than once in
``buffers``, nested contexts over the same buffer, and an ``nn.Parameter`` buffer's ``.grad``
after the context.
"""

from __future__ import annotations

import os
import re
import sys

import pytest
import torch

from harness.procs import run_tree
from reference.attention import attention
from reference.budget import assert_verdict, check
from suites import cases_api
from suites.checkout import ROOT, checkout_file
from suites.judge import judge_float64_model
from suites.matrix import tier, world_sizes

# context_parallel patches F.scaled_dot_product_attention, a module attribute of the rank's process.
pytestmark = pytest.mark.process_state

#: Seconds a compiled case may take: each rank compiles the graphs itself (the harness's hang
#: timeout stays the session's --case-timeout elsewhere). A cold inductor cache on 2 CPU cores
#: takes minutes.
COMPILE_TIMEOUT_S = {"eager": 180.0, "aot_eager": 180.0, "inductor": 900.0}


def pytest_generate_tests(metafunc):
    if "w" in metafunc.fixturenames:
        metafunc.parametrize(
            "w", [pytest.param(w, id=f"W{w}") for w in world_sizes(metafunc.config, at_least=2)]
        )
    nightly = tier(metafunc.config) == "nightly"
    if "cw" in metafunc.fixturenames:  # compiled cases: the smallest ring in the quick tier
        sizes = world_sizes(metafunc.config, at_least=2, at_most=4 if nightly else 2)
        metafunc.parametrize("cw", [pytest.param(w, id=f"W{w}") for w in sizes])
    if "backend" in metafunc.fixturenames:
        backends = ("eager", "aot_eager", "inductor") if nightly else ("eager", "aot_eager")
        metafunc.parametrize("backend", backends)


@pytest.fixture
def cp(ring):
    ring.require("context_parallel", why="context_parallel / ContextParallel API")
    return ring


@pytest.mark.parametrize("dtype", ["float64", "bfloat16"])
@pytest.mark.parametrize("is_causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("layout", ["contiguous", "head_tail"])
def test_buffers_sharded_routed_and_restored(
    cp, w: int, layout: str, is_causal: bool, dtype: str
) -> None:
    results = cp.rank_pool(w).run(
        cases_api.context_parallel_case, cp.impl.spec, layout, is_causal, dtype, timeout=cp.timeout
    )
    for rank, r in enumerate(results):
        assert r["routed_inside"], (
            f"rank {rank}: F.scaled_dot_product_attention was not routed inside the context"
        )
        assert r["inside_q_matches_shard"], (
            f"rank {rank}: the buffer inside the context is not this rank's {layout} shard"
        )
        assert r["inside_shapes"][0][2] == 8, (
            f"rank {rank}: sharded buffer shapes {r['inside_shapes']}, expected seq 8 per rank"
        )
        assert r["restored"], (
            f"rank {rank}: buffers were not restored to their global contents on exit"
        )
        assert r["kept_positions"] == r["expected_kept"], (
            f"rank {rank}: a no_restore buffer was restored or mis-sharded"
        )
        assert r["sdpa_restored"], (
            f"rank {rank}: F.scaled_dot_product_attention was not restored on exit"
        )
    q, k, v = results[0]["inputs"]
    ref = attention(q, k, v, is_causal=is_causal).out
    for rank, r in enumerate(results):
        _judge_unsharded_out(r, ref, f"[context_parallel_unshard on rank {rank}, {layout}]")


def test_exception_inside_restores_buffers_and_sdpa(cp, w: int) -> None:
    for rank, r in enumerate(
        cp.rank_pool(w).run(
            cases_api.context_parallel_exception_case, cp.impl.spec, timeout=cp.timeout
        )
    ):
        assert r == {"raised": True, "restored": True, "sdpa_restored": True}, f"rank {rank}: {r}"


def test_tutorial_example_in_the_pool(cp) -> None:
    """The tutorial's own check (same-dtype comparison, atol 1e-3 * W) at its world size, 4."""
    for rank, r in enumerate(
        cp.rank_pool(4).run(cases_api.tutorial_case, cp.impl.spec, timeout=cp.timeout)
    ):
        assert r["allclose"], (
            f"rank {rank}: tutorial check failed: max diff {r['max_diff']:.3e} > atol "
            f"{r['atol']:.1e}"
        )


def test_tutorial_script_under_torchrun(cp, device, tmp_path) -> None:
    """examples/context_parallel_tutorial.py, verbatim, under torchrun: 4 CPU ranks on gloo, or
    under ``--device cuda`` one rank per visible GPU (at most 4) on NCCL, as the script picks."""
    if cp.impl.spec != cp_default_spec():
        pytest.skip(
            "the tutorial script imports ring_impl: it runs with the default implementation only "
            "(drop --impl to run it)"
        )
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
        "OMP_NUM_THREADS": "1",
    }
    if device == "cuda":
        # The script pins cuda:<rank> and uses NCCL: one rank per GPU.
        nproc = min(4, torch.cuda.device_count())
    else:
        # The script takes CUDA when it sees it; on a CPU run it must not, whatever the machine has.
        env["CUDA_VISIBLE_DEVICES"] = ""
        nproc = 4
    # A process tree: torchrun's ranks leave its session; an interrupted run must not orphan them.
    proc = run_tree(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            f"--nproc-per-node={nproc}",
            str(checkout_file("examples", "context_parallel_tutorial.py")),
        ],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert proc.returncode == 0, (
        f"torchrun exited {proc.returncode}\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    )
    assert "matches single-process SDPA" in proc.stdout


def _judge_unsharded_out(r: dict, ref: torch.Tensor, context: str) -> None:
    """A rank's attention output inside the context, unsharded (``r["full"]``), against the
    float64 oracle ``ref``, with single-process SDPA on the same inputs in their dtype
    (``r["expected"]``) as the policy's baseline."""
    __tracebackhide__ = True
    assert_verdict(check("out", r["full"], ref, r["expected"], context=context))


def _summary(outcomes) -> str:
    return "\n".join(
        f"rank {o.rank}: "
        + (f"returned {sorted(o.value)}" if o.ok else f"{o.exc_type}: {o.exc_message}")
        for o in outcomes
    )


def _judge_float64(
    rank: int, name: str, got: torch.Tensor, ref: torch.Tensor, what: str, tokens: int
) -> None:
    """:func:`suites.judge.judge_float64_model`, after the shapes: float64 run against the
    float64 unsharded one."""
    __tracebackhide__ = True
    assert tuple(got.shape) == tuple(ref.shape), (
        f"rank {rank}: {name} has shape {tuple(got.shape)}, expected {tuple(ref.shape)} [{what}]"
    )
    judge_float64_model(rank, name, got, ref, what, tokens)


# ---------------------------------------------------------------------- buffers


@pytest.mark.parametrize("layout", ["contiguous", "head_tail"])
def test_buffer_listed_three_times_is_sharded_once(cp, w: int, layout: str) -> None:
    """q = k = v = x: ``buffers=[x, x, x]`` shards x once."""
    results = cp.rank_pool(w).run(
        cases_api.repeated_buffer_case, cp.impl.spec, layout, timeout=cp.timeout
    )
    for rank, r in enumerate(results):
        seq = r["global"][2]
        assert r["inside"][2] == seq // w, (
            f"rank {rank}: a tensor listed three times in buffers was sharded to length "
            f"{r['inside'][2]} instead of {seq // w} (global {seq}, {w} ranks): sharded once per "
            f"listing, not once per tensor [{layout}]"
        )
        assert r["matches_shard"], (
            f"rank {rank}: the buffer listed three times is not this rank's {layout} shard"
        )
        assert r["restored"], f"rank {rank}: the buffer listed three times was not restored on exit"
        x = r["x"]
        ref = attention(x, x, x, is_causal=True).out
        _judge_unsharded_out(r, ref, f"[buffer listed three times, {layout}, rank {rank}]")


def test_buffer_listed_with_two_seq_dims_is_rejected(cp, w: int) -> None:
    """A tensor has one sequence dim: listed with two, it must raise on every rank, unchanged."""
    outcomes = cp.rank_pool(w).run_outcomes(
        cases_api.repeated_buffer_two_dims_case, cp.impl.spec, timeout=cp.timeout
    )
    assert all(not o.ok for o in outcomes), (
        "a tensor listed in buffers with sequence dims 1 and 2 was accepted on some rank: it has "
        f"one sequence dim and must be rejected on every rank\n{_summary(outcomes)}"
    )
    for o in outcomes:
        assert "left changed" not in o.exc_message, f"rank {o.rank}: {o.exc_message}"


@pytest.mark.parametrize("layout", ["contiguous", "head_tail"])
def test_nested_context_does_not_shard_again(cp, w: int, layout: str) -> None:
    """Nested contexts over one buffer: a clear error on every rank, or the inner one leaves the
    outer one's shard as it is; the buffer is restored at the end either way."""
    results = cp.rank_pool(w).run(
        cases_api.nested_buffers_case, cp.impl.spec, layout, timeout=cp.timeout
    )
    raised = [r["error"] is not None for r in results]
    assert all(raised) or not any(raised), (
        "nested context_parallel raised on some ranks only:\n"
        + "\n".join(f"rank {rank}: {r['error'] or 'no error'}" for rank, r in enumerate(results))
    )
    for rank, r in enumerate(results):
        assert torch.equal(r["outer"], r["shard"]), (
            f"rank {rank}: the outer context did not shard the buffer [{layout}]"
        )
        if r["error"] is None:
            assert torch.equal(r["inner"], r["shard"]), (
                f"rank {rank}: a nested context_parallel over a buffer the outer one already "
                f"sharded sharded it again: length {r['shard'].shape[2]} -> {r['inner'].shape[2]} "
                f"[{layout}, W={w}]"
            )
        assert torch.equal(r["after_inner"], r["shard"]), (
            f"rank {rank}: after the nested context_parallel the buffer is not the outer "
            f"context's shard (length {r['after_inner'].shape[2]}, expected "
            f"{r['shard'].shape[2]}) [{layout}]"
        )
        assert r["restored"], (
            f"rank {rank}: the buffer was not restored after the nested contexts [{layout}]"
        )


@pytest.mark.parametrize("layout", ["contiguous", "head_tail"])
def test_parameter_buffer_grad_is_global_after_exit(cp, w: int, layout: str) -> None:
    """An nn.Parameter buffer with a gradient on entry: after a normal exit its .grad is the
    global gradient (the entry gradient plus the shards' gradients in layout order) and an SGD
    step gives the unsharded run's parameter."""
    results = cp.rank_pool(w).run(
        cases_api.parameter_buffer_case, cp.impl.spec, layout, False, timeout=cp.timeout
    )
    for rank, r in enumerate(results):
        assert r["grad_shape"] == r["param_shape"], (
            f"rank {rank}: the Parameter buffer's .grad after exit has shape {r['grad_shape']}, "
            f"the parameter {r['param_shape']}: a shard-shaped .grad left behind [{layout}, W={w}]"
        )
        assert r["step_error"] is None, (
            f"rank {rank}: optimizer.step() after the context failed: {r['step_error']}"
        )
        assert r["data_restored"], (
            f"rank {rank}: the Parameter buffer's data was not restored on exit"
        )
        what = f"Parameter buffer .grad after exit, {layout}, W={w}"
        _judge_float64(rank, "grad", r["grad"], r["ref_grad"], what, tokens=2 * 8 * w)
        _judge_float64(
            rank, "param after SGD step", r["param"], r["ref_param"], what, tokens=2 * 8 * w
        )


def test_parameter_buffer_grad_after_exception_fits_the_parameter(cp, w: int) -> None:
    """Left by an exception: the .grad the implementation leaves (its documented choice) must
    fit the restored parameter, so the next optimizer step runs."""
    results = cp.rank_pool(w).run(
        cases_api.parameter_buffer_case, cp.impl.spec, "head_tail", True, timeout=cp.timeout
    )
    for rank, r in enumerate(results):
        assert r["data_restored"], (
            f"rank {rank}: the Parameter buffer's data was not restored after an exception"
        )
        assert r["grad_shape"] in (None, r["param_shape"]), (
            f"rank {rank}: after an exception inside the context the Parameter buffer's .grad has "
            f"shape {r['grad_shape']}, the parameter {r['param_shape']}: a shard-shaped .grad "
            "left behind"
        )
        assert r["step_error"] is None, (
            f"rank {rank}: optimizer.step() after the context failed: {r['step_error']}"
        )


# ---------------------------------------------------------------------- silent fallbacks


@pytest.mark.parametrize("route", ["context_parallel", "ContextParallel"])
def test_multihead_attention_default_need_weights(cp, w: int, route: str) -> None:
    """nn.MultiheadAttention's default need_weights=True never calls SDPA: under context parallel it
    must raise on every rank (saying need_weights) or give the unsharded module's output."""
    outcomes = cp.rank_pool(w).run_outcomes(
        cases_api.mha_default_case, cp.impl.spec, route, timeout=cp.timeout
    )
    if all(not o.ok for o in outcomes):
        for o in outcomes:
            assert re.search("need_weights", o.exc_message), (
                f"rank {o.rank}: nn.MultiheadAttention (need_weights=True) under {route} raised "
                f"without naming need_weights, the fix: {o.exc_type}: {o.exc_message}"
            )
        return
    assert all(o.ok for o in outcomes), (
        f"nn.MultiheadAttention (need_weights=True) under {route}: some ranks "
        f"raised\n{_summary(outcomes)}"
    )
    for o in outcomes:
        _judge_float64(
            o.rank,
            "out",
            o.value["out"],
            o.value["ref_out"],
            f"nn.MultiheadAttention with need_weights=True (its default) under {route}, W={w}: "
            "a wrong answer here is attention over the local shard only",
            tokens=o.value["ref_out"].shape[:-1].numel(),
        )


@pytest.mark.parametrize("layout", ["contiguous", "head_tail"])
def test_compiled_sdpa_inside_context_parallel(cp, cw: int, backend: str, layout: str) -> None:
    """A torch.compile'd function calling SDPA inside context_parallel runs ring attention."""
    outcomes = cp.rank_pool(cw).run_outcomes(
        cases_api.compiled_sdpa_case,
        cp.impl.spec,
        backend,
        layout,
        timeout=max(cp.timeout, COMPILE_TIMEOUT_S[backend]),
    )
    assert all(o.ok for o in outcomes), (
        f"a torch.compile(backend={backend!r}) function calling SDPA inside context_parallel "
        f"failed\n{_summary(outcomes)}"
    )
    q, k, v = outcomes[0].value["inputs"]
    ref = attention(q, k, v, is_causal=True).out
    for o in outcomes:
        for call, full in enumerate(o.value["fulls"]):
            assert_verdict(
                check(
                    "out",
                    full,
                    ref,
                    o.value["expected"],
                    rank=o.rank,
                    context=(
                        f"[compiled SDPA inside context_parallel, backend={backend}, {layout}, "
                        f"call {call + 1}]"
                    ),
                )
            )


@pytest.mark.parametrize("layout", ["contiguous", "head_tail"])
def test_compiled_parallelized_module(cp, cw: int, backend: str, layout: str) -> None:
    """parallelize_module(layer, mesh, ContextParallel()) then torch.compile(layer): training
    steps equal the unsharded nn.TransformerEncoderLayer's (outputs and parameter gradients)."""
    results = cp.rank_pool(cw).run(
        cases_api.compiled_module_case,
        cp.impl.spec,
        backend,
        layout,
        timeout=max(cp.timeout, COMPILE_TIMEOUT_S[backend]),
    )
    what = (
        f"compiled parallelized module: ContextParallel then torch.compile(backend={backend}), "
        f"{layout}, W={cw}"
    )
    for rank, r in enumerate(results):
        for step, out in enumerate(r["outs"]):
            _judge_float64(
                rank, "out", out, r["ref_out"], f"{what}, step {step + 1}", tokens=2 * 8 * cw
            )
        assert r["grads"].keys() == r["ref_grads"].keys(), (
            f"rank {rank}: parameters without gradients differ [{what}]"
        )
        for name, g in r["grads"].items():
            _judge_float64(rank, f"grad {name}", g, r["ref_grads"][name], what, tokens=2 * 8 * cw)


def cp_default_spec() -> str:
    from conformance.implementation import DEFAULT_IMPL_SPEC

    return DEFAULT_IMPL_SPEC
