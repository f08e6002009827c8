"""The suites' case runner: the ``ring`` fixture and the markers of suite cases.

A pytest plugin (registered from the root ``conftest.py`` and, when the package is installed,
through its ``pytest11`` entry point), so that any test, not only the suites, can run a
:class:`suites.cases.RingCase` through the implementation under test::

    def test_something(ring, case):
        ring.check(ring.prepare(case))      # N/A, run on the pool, judge, diagnose, repro

:class:`RingRunner` checks the implementation's capabilities (N/A for what it declares it lacks,
a failure naming the attribute for a claimed protocol piece it lacks), runs the case on every
rank (:func:`suites.cases.ring_case`), judges every quantity against the float64 reference
(:mod:`suites.judge`), diagnoses a failure to a rank and ring step and prints a repro command.
It records each case's parameters and error figures in the test report (user properties
``ring_case`` and ``ring_verdicts``), which the conformance report reads.

Markers of suite cases (applied at collection, so ``-m`` selects by them): ``world_size(n=N)``
from the case's world size, ``compile`` for a case with a torch.compile backend. The tier
markers (``quick``, ``nightly``) come from :mod:`conformance.pytest_plugin`.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import replace
from typing import Any

import pytest

from conformance.implementation import PROTOCOL_ATTRIBUTES, Capabilities, Implementation
from conformance.pytest_plugin import not_applicable, suite_id
from harness.pytest_plugin import repro_command, settings_of

__all__ = ["RingRunner", "case_properties", "repro_words"]


# ---------------------------------------------------------------------- markers of suite cases


@pytest.hookimpl(tryfirst=True)  # before the harness reads world_size and before -m deselects
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    # Imported here, not at plugin load: it imports torch, and pytest --help should not.
    from suites.cases import RingCase

    for item in items:
        if suite_id(item) is None:
            continue
        params: dict[str, Any] = dict(getattr(getattr(item, "callspec", None), "params", {}) or {})
        case = next((v for v in params.values() if isinstance(v, RingCase)), None)
        world_size = case.world_size if case is not None else params.get("w")
        if isinstance(world_size, int) and item.get_closest_marker("world_size") is None:
            item.add_marker(pytest.mark.world_size(n=world_size))
        if case is not None and case.compile:
            item.add_marker(pytest.mark.compile)


# ---------------------------------------------------------------------- the runner


def repro_words(item: pytest.Item) -> list[str]:
    """How to name ``item`` on a command line run where this session ran: its node id when it
    lies under the rootdir (a checkout), else ``--pyargs package.module::name`` (installed suites,
    run from any directory)."""
    try:
        item.path.relative_to(item.config.rootpath)
        return [item.nodeid]
    except ValueError:
        pass
    sid = suite_id(item)
    if sid is None:
        return [item.nodeid]
    module, _, name = sid.partition("::")
    return [f"{module.removesuffix('.py').replace('/', '.')}::{name}", "--pyargs"]


class RingRunner:
    """Runs :class:`suites.cases.RingCase` on a pool and judges it (one per test)."""

    def __init__(
        self,
        request: pytest.FixtureRequest,
        rank_pool: Callable[..., Any],
        impl: Implementation,
        op_spec: str | None,
        timeout: float,
    ):
        self.request, self.rank_pool, self.impl, self.op_spec, self.timeout = (
            request,
            rank_pool,
            impl,
            op_spec,
            timeout,
        )

    @property
    def caps(self) -> Capabilities:
        return self.impl.capabilities

    def require(self, field: str, value: Any = True, why: str = "") -> None:
        """N/A when the implementation declares it lacks ``field`` (or ``value`` in it).

        Undeclared is claimed: the case runs. For a protocol piece (``collective_schedule``,
        ``record_steps``, ``context_parallel``) that is claimed but missing, the test fails with
        a message naming the missing attribute.
        """
        __tracebackhide__ = True
        lacking = self.caps.lacking(field, value)
        if lacking:
            not_applicable(f"{self.impl.name} {lacking}{f' ({why})' if why else ''}")
        if field in PROTOCOL_ATTRIBUTES:
            missing = self.impl.missing(field)
            if missing:
                pytest.fail(missing + (f" [needed for: {why}]" if why else ""), pytrace=False)

    def protocol(self, field: str, why: str = "") -> Any:
        """The implementation's attribute for protocol piece
        ``field`` (N/A or fail as :meth:`require`)."""
        __tracebackhide__ = True
        self.require(field, why=why)
        return self.impl.protocol(field)

    def record_case(self, case) -> Any:
        """Record ``case`` (its op the session's where it names none) in the test's report
        properties, and return that op. Called first, so a case that ends N/A, skipped or raising
        still lands in its cell of the report."""
        op = case.op if case.op is not None else self.op_spec
        self.request.node.user_properties.append(
            ("ring_case", case_properties(replace(case, op=op)))
        )
        return op

    def loss_of(self, case):
        """``case`` with a loss on the output only where its loss uses the LSE
        (``inputs.lse_grad``) but the case returns no LSE, or the implementation declares it
        lacks the LSE or its gradient: the LSE's gradient has its own suite
        (test_lse_gradient), which is N/A for it."""
        lse = getattr(case, "return_lse", True) and self.caps.claims("lse")
        if case.inputs.lse_grad and not (lse and self.caps.claims("lse_grad")):
            return replace(case, inputs=case.inputs.with_(lse_grad=False))
        return case

    def prepare(self, case):
        """Check capabilities (N/A) and fill in the session's implementation and op."""
        __tracebackhide__ = True
        op = self.record_case(case)
        if case.mesh_shape is not None:
            self.request.node.user_properties.append(
                ("strategy_case", {"strategy": case.strategy, "mesh": list(case.mesh_shape)})
            )
        self.require_exchange(case, rotates=case.rotates)
        if case.count_work:
            self.require("ops", "*", why="counting work wraps the attention op")
        if case.record:
            self.require("record_steps", why="per-step partials")
        self.require_inputs(case, op)
        case = self.loss_of(case)
        return replace(
            case, impl=self.impl.spec, op=op, return_lse=case.return_lse and self.caps.claims("lse")
        )

    def require_exchange(self, case, *, rotates: bool = True) -> None:
        """N/A unless the implementation claims how ``case`` is sharded and exchanged: its
        strategy (a case on a mesh), its layout or load balancer, and (``rotates``) its rotation."""
        __tracebackhide__ = True
        mesh = case.mesh_shape
        if mesh is not None:
            self.require("strategies", case.strategy, why=f"strategy={case.strategy!r}")
        balancer = getattr(case, "balancer", None)
        if balancer is None:
            self.require("layouts", case.layout)
        else:
            self.require_balancer(balancer)
        if rotates:
            why = "" if mesh is None else "the hybrid's ring dimension"
            self.require("rotate_methods", case.rotate_method, why=why)

    def require_balancer(self, balancer: str) -> None:
        """N/A unless the implementation claims ``balancer``; a claim without a callable
        ``balanced_layout`` fails (the suite cannot build the layout it claims)."""
        __tracebackhide__ = True
        self.require("balancers", balancer)
        if not callable(getattr(self.impl.obj, "balanced_layout", None)):
            pytest.fail(
                f"{self.impl.name} claims capabilities.balancers {balancer!r} (undeclared means "
                "claimed) but has no callable balanced_layout: add balanced_layout(balancer, mask, "
                "seq_len, world_size) -> (layout, runs) (see conformance/implementation.py) or "
                "declare capabilities.balancers without it",
                pytrace=False,
            )

    def require_inputs(self, case, op) -> None:
        """What every suite's case asks of its inputs and kernel (ring, strategy and mask cases
        alike): dtype, device, backward, GQA, cross-attention, compile, the op; a registered
        kernel that cannot run the case skips with its reason."""
        __tracebackhide__ = True
        spec = case.inputs
        self.require("dtypes", spec.dtype)
        self.require("devices", self.request.getfixturevalue("device"))
        if getattr(case, "backward", True):
            self.require("backward")
        if spec.heads != spec.heads_kv:
            self.require("gqa", why="key/value with fewer heads than query")
        if spec.seq_q != spec.seq_kv:
            self.require("cross_attention", why="key/value length differs from query length")
        if spec.value_head_dim != spec.head_dim:
            self.require("value_head_dim", why="value's head dim differs from query's and key's")
        if getattr(case, "compile", None):
            self.require("compile")
        if op is not None:
            self.require("ops", "*", why=f"runs op {op!r}")
            self.skip_if_kernel_cannot(op, case)

    def skip_if_kernel_cannot(self, op, case) -> None:
        """Skip (with the kernel's reason) a case whose registered kernel declares it cannot run
        the case's dtype, head size or mask on the session's device: a limit of the kernel, the
        same on one device, not of the implementation under test."""
        if not isinstance(op, str) or ":" in op or op == "auto":
            return
        import torch

        from conformance.kernels import kernel_cannot_run

        spec = case.inputs
        device = torch.device(self.request.getfixturevalue("device"))
        why = kernel_cannot_run(  # (None too for a name the registry lacks: the impl refuses it)
            op,
            device,
            spec.torch_dtype,
            spec.head_dim,
            scale=spec.scale,
            is_causal=case.is_causal,
            head_dim_v=spec.value_head_dim,
        )
        if why is not None:
            pytest.skip(
                f"kernel {op!r} cannot run this case on {device}: {why} (the kernel's own limit; "
                "other dtypes of this test run it)"
            )

    def timeout_for(self, case) -> float:
        """This test's timeout, or the compile bound for a case that compiles."""
        settings = settings_of(self.request.config)
        return (
            max(self.timeout, settings.timeout_for(compiles=True)) if case.compile else self.timeout
        )

    def run(self, case, fn=None) -> list:
        """Raw per-rank results of ``fn`` (default :func:`suites.cases.ring_case`)."""
        from suites.cases import ring_case

        pool = self.rank_pool(case.world_size)
        return pool.run(fn or ring_case, case, timeout=self.timeout_for(case))

    def check(self, case, *, results: Sequence[dict] | None = None) -> list:
        """Run (unless results are given), judge every quantity, diagnose and raise on failure."""
        __tracebackhide__ = True
        from suites.judge import (
            detached_lse,
            diagnose_case,
            diagnose_strategy_case,
            format_failure,
            judge,
        )

        if results is None:
            results = self.run(case)
        detached = detached_lse(case, results) if case.inputs.lse_grad else None
        if detached:  # the gradients would be off by the LSE's share: name why
            pytest.fail(f"{detached}\nrepro: {self.repro()}", pytrace=False)
        try:
            verdicts = judge(case, results, baseline_op=getattr(self.impl.obj, "baseline_op", None))
        except (
            AssertionError
        ) as exc:  # a broken contract (dtype, shape, missing result): no numbers to judge
            pytest.fail(f"{exc}\nrepro: {self.repro()}", pytrace=False)
        self.record(case, verdicts)
        failed = [v for v in verdicts if not v.passed]
        if failed and case.mesh_shape is not None:  # no ring simulation of a strategy's steps
            diagnosis = diagnose_strategy_case(case, results, verdicts)
            if case.compile:
                diagnosis += " " + self.eager_comparison(case)
            pytest.fail(format_failure(failed, diagnosis, self.repro()), pytrace=False)
        if failed:
            records, note = None, ""
            if case.compile:
                # Step records are taken eagerly only; compare with the eager run instead.
                note = " " + self.eager_comparison(case)
            elif self.caps.claims("record_steps"):
                missing = self.impl.missing("record_steps")
                if missing:
                    note = f" (no per-step records: {missing})"
                else:
                    try:
                        records = [
                            rec
                            for r in self.run(replace(case, record=True))
                            for rec in (r["records"] or [])
                        ]
                    except Exception as exc:  # diagnosis is best effort; the verdict stands
                        note = f" (re-run with step recording failed: {exc})"
            diagnosis = diagnose_case(case, results, records) + note
            pytest.fail(format_failure(failed, diagnosis, self.repro()), pytrace=False)
        return verdicts

    def check_collectives(
        self,
        case,
        expected: dict | Sequence[dict],
        results: Sequence[dict],
        headline: str = "collectives differ from the declared schedule",
    ) -> None:
        """Fail with every difference, per rank, phase and kind of collective, between the
        schedule the implementation declared for ``case`` (``expected``: ``{phase: {kind:
        {"calls", "bytes"}}}``, or one such per rank) and what each rank issued
        (``results[rank]["collectives"]``); a kind missing on one side counts 0 calls, 0 bytes. A
        strategy case names each rank's place on its mesh; ``headline`` opens the message."""
        __tracebackhide__ = True
        problems = []
        per_rank = expected if isinstance(expected, Sequence) else [expected] * len(results)
        for rank, (r, declared) in enumerate(zip(results, per_rank, strict=True)):
            issued = r["collectives"] or {}
            where = f"rank {rank}"
            if case.mesh_shape is not None:
                u = case.mesh_shape[0]
                where += f" (ulysses {rank % u}, ring {rank // u})"
            for phase in sorted(set(declared) | set(issued)):
                exp, act = declared.get(phase, {}), issued.get(phase, {})
                for kind in sorted(set(exp) | set(act)):
                    none = {"calls": 0, "bytes": 0}
                    e, a = exp.get(kind, none), act.get(kind, none)
                    if e != a:
                        problems.append(
                            f"{where}: {phase}/{kind}: declared {e['calls']} calls, "
                            f"{e['bytes']} bytes; issued {a['calls']} calls, {a['bytes']} bytes"
                        )
        if problems:
            pytest.fail(
                f"{headline} [{case.label}]:\n" + "\n".join(problems) + f"\nrepro: {self.repro()}",
                pytrace=False,
            )

    def judged(self, case, fn, judge, diagnose=None, *, baseline: bool = True) -> list:
        """Run the rank function ``fn`` for ``case`` on the pool, judge its per-rank results
        with ``judge(case, results[, baseline_op=])`` (with ``baseline``: the implementation's
        ``baseline_op``), record the verdicts, and fail with ``diagnose(case, results)`` (None:
        no diagnosis) and a repro when one fails; a broken contract (AssertionError from the
        judge) fails with its message. Returns the results."""
        __tracebackhide__ = True
        from suites.judge import format_failure

        results = self.run(case, fn)
        try:
            if baseline:
                verdicts = judge(
                    case, results, baseline_op=getattr(self.impl.obj, "baseline_op", None)
                )
            else:
                verdicts = judge(case, results)
        except AssertionError as exc:  # a broken contract or a named bug: no numbers to judge
            pytest.fail(f"{exc}\nrepro: {self.repro()}", pytrace=False)
        self.record(case, verdicts)
        failed = [v for v in verdicts if not v.passed]
        if failed:
            diagnosis = None if diagnose is None else diagnose(case, results)
            pytest.fail(format_failure(failed, diagnosis, self.repro()), pytrace=False)
        return results

    def eager_comparison(self, case) -> str:
        """One sentence on the same case run without torch.compile (for a failed compiled case)."""
        from suites.judge import judge

        try:
            eager = judge(
                replace(case, compile=None),
                self.run(replace(case, compile=None)),
                baseline_op=getattr(self.impl.obj, "baseline_op", None),
            )
        except Exception as exc:  # the eager run failing too is information, not a new failure
            return (
                f"The same case run eagerly fails too ({type(exc).__name__}: "
                f"{str(exc).splitlines()[0][:200]})."
            )
        if all(v.passed for v in eager):
            return (
                "The same case run eagerly (without torch.compile) passes: wrong only when "
                f"compiled (backend {case.compile})."
            )
        return (
            "The same case run eagerly fails too: the ring is wrong with or without torch.compile."
        )

    def record(self, case, verdicts) -> None:
        """Attach case parameters and error figures to
        the test report (for the conformance report)."""
        if ("ring_case", case_properties(case)) not in self.request.node.user_properties:
            self.request.node.user_properties.append(("ring_case", case_properties(case)))
        self.request.node.user_properties.append(
            (
                "ring_verdicts",
                [
                    {
                        "name": v.name,
                        "passed": v.passed,
                        "max_err": v.max_err,
                        "base_max_err": v.base_max_err,
                        "mean_err": v.mean_err,
                        "base_mean_err": v.base_mean_err,
                        "ratio": v.ratio,
                        "k": v.k,
                        "floor": v.floor,
                        "mean_floor": v.mean_floor,
                        "mean_ratio": v.mean_ratio,
                        "rank": v.rank,
                        "worst_index": list(v.worst_index),
                    }
                    for v in verdicts
                ],
            )
        )

    def repro(self) -> str:
        """A command that re-runs this test alone with every ring option of the session."""
        target, *how = repro_words(self.request.node)
        return repro_command(self.request.config, target, *how, "-p", "no:xdist")


def case_properties(case) -> dict[str, Any]:
    s = case.inputs
    return {
        "world_size": case.world_size,
        "dtype": s.dtype,
        "is_causal": case.is_causal,
        "layout": case.layout,
        "rotate_method": case.rotate_method,
        "op": case.op,
        "compile": case.compile,
        "batch": s.batch,
        "heads": s.heads,
        "heads_kv": s.heads_kv,
        "seq_q": s.seq_q,
        "seq_kv": s.seq_kv,
        "head_dim": s.head_dim,
        "head_dim_v": s.value_head_dim,
    }


@pytest.fixture
def ring(
    request: pytest.FixtureRequest, rank_pool, impl: Implementation, op_under_test, case_timeout
) -> RingRunner:
    """The case runner for this test: ``ring.check(ring.prepare(case))``."""
    return RingRunner(request, rank_pool, impl, op_under_test, case_timeout)
