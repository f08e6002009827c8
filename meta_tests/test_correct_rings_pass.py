"""The false-failure side of the proof: the conformance suites pass correct implementations.

meta_tests/broken.py shows that the suites fail broken rings; here two independently written
correct rings (meta_tests/correct/: ``math_ring``, plain torch math with an online-softmax merge;
``flash_ring``, the CPU flash kernel with one LSE-weighted merge at the end) run the whole tier of
this session (quick unless ``--tier nightly``) through ``--impl``, each in its own pytest
process, and must pass with no failure. A pass must also mean something: enough cases passed,
and every suite module executed at least one case unless all its cases are N/A for a capability
the ring declares it lacks.

Also here: the rings' gradient through the LSE against float64 autograd, which the suites do not
test.
"""

from __future__ import annotations

import re
import subprocess
import time
import xml.etree.ElementTree as ET
from collections import Counter
from collections.abc import Sequence
from pathlib import Path

import pytest
import torch

from conformance.implementation import Capabilities, load_implementation
from harness.procs import pytest_command, run_tree  # the command's process tree dies with the test
from harness.pytest_plugin import settings_of
from meta_tests.correct import CORRECT
from meta_tests.test_suite_catches_bugs import suite_env

ROOT = Path(__file__).resolve().parents[1]

#: Cases a correct ring must pass at the least, per tier. Measured at the tiers' defaults:
#: quick (W 1..4, 1064 cases): math_ring passes 764 (298 N/A: strategies, compile, the
#: context-parallel API, value's own head dim), flash_ring 473 (589 N/A: masks, sinks,
#: score mods, packed inputs too); nightly (W 1..8, 7937 cases): math_ring 6567; 2 CUDA-only
#: cases skip in both. A quick run that lost test_forward_backward (192 passes) falls below its
#: minimum.
MIN_PASSED = {"quick": 400, "nightly": 1100}


def run_suites(
    impl: str,
    tier: str,
    junit: Path,
    timeout: float,
    paths: Sequence[str] = ("suites",),
    select: Sequence[str] = (),
) -> subprocess.CompletedProcess:
    """``pytest <paths> <select>`` (every suite by default) at ``tier`` (its default world
    sizes) against ``impl`` in a fresh process."""
    cmd = pytest_command(
        *paths, *select, "-p", "no:xdist", "--impl", impl, "--tier", tier, "--report-dir", "none"
    )
    cmd.append(f"--junitxml={junit}")
    return run_tree(cmd, cwd=ROOT, env=suite_env(), capture_output=True, text=True, timeout=timeout)


def outcomes_by_module(junit: Path) -> dict[str, Counter]:
    """suite module -> Counter of passed / failed / error / skipped / n/a, with N/A reasons kept
    under ``("reason", text)`` keys."""
    modules: dict[str, Counter] = {}
    for case in ET.parse(junit).getroot().iter("testcase"):
        module = case.get("classname", "").rsplit(".", 1)[-1]
        counts = modules.setdefault(module, Counter())
        tags = {child.tag: child for child in case}
        if "failure" in tags:
            counts["failed"] += 1
        elif "error" in tags:
            counts["error"] += 1
        elif "skipped" in tags:
            reason = tags["skipped"].get("message", "")
            kind = "n/a" if reason.startswith("N/A") else "skipped"
            counts[kind] += 1
            counts[("reason", reason)] += 1
        else:
            counts["passed"] += 1
    return modules


def undeclared_lacks(reasons: list[str], caps: Capabilities) -> list[str]:
    """The N/A reasons that do not name a capability field the ring declares it lacks
    (False, or a set without the value asked for): those must not hide a whole module."""
    bad = []
    for reason in reasons:
        match = re.search(r"capabilities\.(\w+)", reason)
        field = match.group(1) if match else None
        declared = getattr(caps, field, None) if field else None
        if declared is None or declared is True:
            bad.append(reason)
    return bad


@pytest.mark.parametrize("name", sorted(CORRECT))
def test_correct_ring_passes_the_suites(
    name: str, tmp_path: Path, pytestconfig: pytest.Config
) -> None:
    """The whole tier this session runs (quick by default, nightly with ``--tier nightly``)."""
    impl = f"meta_tests.correct:{name}"
    tier = settings_of(pytestconfig).tier
    junit = tmp_path / "junit.xml"
    started = time.monotonic()
    proc = run_suites(impl, tier, junit, timeout=1200 if tier == "quick" else 3600)
    wall = time.monotonic() - started
    tail = f"\n{proc.stdout[-6000:]}\n{proc.stderr[-2000:]}"
    assert junit.exists(), (
        f"pytest suites --impl {impl} wrote no JUnit report (exit {proc.returncode}){tail}"
    )
    modules = outcomes_by_module(junit)
    totals = sum(modules.values(), Counter())
    figures = (
        f"{totals['passed']} passed, {totals['failed']} failed, {totals['error']} errors, "
        f"{totals['n/a']} N/A, {totals['skipped']} skipped in {wall:.0f} s"
    )
    assert totals["failed"] == 0 and totals["error"] == 0, (
        f"the suites failed a correct ring ({name}): {figures}; either the ring has a bug or the "
        f"suite judges a correct result wrongly{tail}"
    )
    assert proc.returncode == 0, (
        f"pytest suites --impl {impl} exited {proc.returncode} ({figures}){tail}"
    )
    least = MIN_PASSED[tier]
    assert totals["passed"] >= least, (
        f"{name}: only {figures} at tier {tier}; at least {least} cases must pass{tail}"
    )

    suite_modules = sorted(p.stem for p in (ROOT / "suites").glob("test_*.py"))
    caps = load_implementation(impl).capabilities
    for module in suite_modules:
        counts = modules.get(module, Counter())
        assert sum(counts[k] for k in ("passed", "failed", "error", "skipped", "n/a")), (
            f"{name}: suites/{module}.py collected no case at all"
        )
        if counts["passed"]:
            continue
        reasons = [key[1] for key in counts if isinstance(key, tuple)]
        assert counts["n/a"] and not counts["skipped"] and not undeclared_lacks(reasons, caps), (
            f"{name}: suites/{module}.py executed no case, and not because the ring declares it "
            f"lacks a capability: {dict(counts)}"
        )


# ---------------------------------------------------------------------------- strategies

#: Strategy cases a correct head-parallel implementation must pass at the least, per tier.
#: Measured at the quick tier's defaults (W 4 and 6, 117 cases): gather_strategies passes 33;
#: 84 are N/A (compile, bad input on every rank, the collective schedule, op objects). The
#: nightly matrix holds the quick one's product of meshes and more (658 cases).
MIN_STRATEGY_PASSED = {"quick": 30, "nightly": 150}


#: The strategy axis: its cases in the capability suites (ids that start with the strategy).
STRATEGY_AXIS = (
    (
        "suites/test_forward_backward.py",
        "suites/test_collectives.py",
        "suites/test_compile.py",
        "suites/test_bad_input.py",
        "suites/test_lse_layouts.py",
        "suites/test_shapes.py",
    ),
    ("-k", "ulysses or hybrid"),
)


def test_correct_strategies_pass_the_strategy_suite(
    tmp_path: Path, pytestconfig: pytest.Config
) -> None:
    """gather_strategies (meta_tests/correct/gather_strategies.py: every rank all-gathers the
    key/value sequence and attends its own rows; no all-to-all, no ring_impl) passes the whole
    strategy axis of this session's tier with no failure."""
    impl = "meta_tests.correct.gather_strategies:IMPLEMENTATION"
    tier = settings_of(pytestconfig).tier
    junit = tmp_path / "junit.xml"
    proc = run_suites(
        impl,
        tier,
        junit,
        timeout=1200 if tier == "quick" else 3600,
        paths=STRATEGY_AXIS[0],
        select=STRATEGY_AXIS[1],
    )
    tail = f"\n{proc.stdout[-6000:]}\n{proc.stderr[-2000:]}"
    assert junit.exists(), (
        f"pytest {' '.join(STRATEGY_AXIS[0])} -k ... --impl {impl} wrote no JUnit report{tail}"
    )
    totals = sum(outcomes_by_module(junit).values(), Counter())
    figures = (
        f"{totals['passed']} passed, {totals['failed']} failed, {totals['error']} errors, "
        f"{totals['n/a']} N/A, {totals['skipped']} skipped"
    )
    assert totals["failed"] == 0 and totals["error"] == 0, (
        f"the strategy axis failed a correct implementation (gather_strategies): {figures}{tail}"
    )
    assert proc.returncode == 0, f"pytest exited {proc.returncode} ({figures}){tail}"
    reasons = [key[1] for key in totals if isinstance(key, tuple)]
    caps = load_implementation(impl).capabilities
    assert not totals["skipped"] and not undeclared_lacks(reasons, caps), (
        "gather_strategies: cases skipped, or N/A for a capability it does not declare lacking: "
        f"{dict(totals)}"
    )
    least = MIN_STRATEGY_PASSED[tier]
    assert totals["passed"] >= least, (
        f"gather_strategies: only {figures} at tier {tier}; at least {least} must pass{tail}"
    )


# ---------------------------------------------------------------------------- LSE gradient


def _global_inputs(seed: int, heads: int, heads_kv: int, seq: int, head_dim: int):
    gen = torch.Generator().manual_seed(seed)
    b = 2
    return [
        torch.randn(*shape, generator=gen, dtype=torch.float64)
        for shape in (
            (b, heads, seq, head_dim),
            (b, heads_kv, seq, head_dim),
            (b, heads_kv, seq, head_dim),
            (b, heads, seq, head_dim),
            (b, heads, seq),
        )
    ]


def lse_gradient_case(
    ctx, impl: str, layout: str, is_causal: bool, rotate_method: str, shape: tuple
) -> dict:
    """Rank side: loss = sum(out * dO) + sum(lse * dLSE) on this rank's shard; local dQ/dK/dV."""
    from reference.layout import shard

    q, k, v, d_out, d_lse = _global_inputs(*shape)
    local = [shard(t, layout, ctx.world_size, ctx.rank, dim=2) for t in (q, k, v, d_out, d_lse)]
    q, k, v = (t.clone().requires_grad_() for t in local[:3])
    out, lse = load_implementation(impl).obj.ring_attention(
        q,
        k,
        v,
        group=ctx.group,
        is_causal=is_causal,
        layout=layout,
        rotate_method=rotate_method,
        return_lse=True,
    )
    ((out * local[3]).sum() + (lse * local[4]).sum()).backward()
    return {"dq": q.grad, "dk": k.grad, "dv": v.grad}


@pytest.mark.parametrize("world_size", [2, 3])
@pytest.mark.parametrize("name", sorted(CORRECT))
def test_lse_gradient_matches_float64_autograd(rank_pool, name: str, world_size: int) -> None:
    from reference.attention import causal_visibility
    from reference.budget import assert_verdict, check, error_scales
    from reference.layout import unshard

    impl = f"meta_tests.correct:{name}"
    shape = (7, 4, 2, 8 * world_size, 16)  # seed, heads, heads_kv (GQA), global sequence, head_dim
    pool = rank_pool(world_size)
    for layout in ("contiguous", "head_tail"):
        for is_causal in (False, True):
            q, k, v, d_out, d_lse = (
                t.requires_grad_(i < 3) for i, t in enumerate(_global_inputs(*shape))
            )
            group = q.shape[1] // k.shape[1]
            scores = q @ k.repeat_interleave(group, 1).transpose(-1, -2) / shape[-1] ** 0.5
            if is_causal:
                scores = scores.masked_fill(
                    torch.ones_like(scores, dtype=torch.bool).triu(1), float("-inf")
                )
            lse = scores.logsumexp(-1)
            out = torch.softmax(scores, -1) @ v.repeat_interleave(group, 1)
            ref = dict(
                zip(
                    ("dq", "dk", "dv"),
                    torch.autograd.grad((out * d_out).sum() + (lse * d_lse).sum(), (q, k, v)),
                )
            )
            # The policy's floors from the terms' magnitudes: a float64 gradient is a sum whose
            # terms can be far larger than the result, so a few roundings of them exceed a floor
            # taken from the result's own size.
            visible = (
                causal_visibility(torch.arange(shape[3]), torch.arange(shape[3]))
                if is_causal
                else None
            )
            scales = error_scales(
                q.detach(), k.detach(), v.detach(), d_out, visible=visible, grad_lse=d_lse
            )
            for rotate_method in ("allgather", "alltoall", "p2p"):
                results = pool.run(lse_gradient_case, impl, layout, is_causal, rotate_method, shape)
                context = f"[{name}, W={world_size}, {layout}, causal={is_causal}, {rotate_method}]"
                for grad in ("dq", "dk", "dv"):
                    got = unshard([r[grad] for r in results], layout)
                    assert_verdict(
                        check(
                            grad,
                            got,
                            ref[grad],
                            ref[grad],
                            dtype=torch.float64,
                            scales=scales[grad],
                            layout=layout,
                            world_size=world_size,
                            context=context,
                        )
                    )
