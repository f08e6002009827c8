"""Every suite puts its tensors on the session's device (``--device``), on both sides of a case.

A suite that builds its baseline or its ranks' tensors on a hard-coded device passes every CPU
run and fails every GPU run (a CUDA-only kernel cannot run on the CPU). This file finds that on
a CPU machine:

- **Parent side.** With the session's device set to ``meta``, the single-device baseline of
  every suite (:func:`suites.judge.baseline`, with each suite's kind of inputs) is run with a
  probe kernel (tests/conformance/device_probe.py) that records the device of the tensors it is
  handed: anything but ``meta`` means the baseline bypassed :mod:`conformance.baseline`.
- **Rank side.** Each suite's rank function runs in this process with a rank context whose
  device is ``meta`` and a probe implementation: the tensors handed to ``ring_attention`` must be
  on ``meta``. Every rank function of ``suites/`` (a function whose first parameter is ``ctx``)
  is either probed here or listed with the reason it needs no probe, so a new suite's rank
  function cannot be forgotten.
- **Source.** No suite module names a device itself (``"cpu"``, ``"cuda"`` as a device, or
  ``.cuda()``): devices come from the session.
"""

from __future__ import annotations

import ast
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import torch

from harness import settings as harness_settings
from reference.masks import visibility
from suites.inputs import InputSpec
from tests.conformance.device_probe import Probed

SUITES = Path(__file__).resolve().parents[2] / "suites"
PROBE_OP = "tests.conformance.device_probe:PROBE_OP"
PROBE_IMPL = "tests.conformance.device_probe:IMPLEMENTATION"
SPEC = InputSpec(
    batch=2, heads=4, heads_kv=2, seq_q=8, seq_kv=8, head_dim=8, dtype="float32", seed=11
)


@pytest.fixture
def meta_session():
    """The session's device is ``meta`` for the test."""
    before = harness_settings.current()
    harness_settings.install(before.with_(device="meta"))
    try:
        yield
    finally:
        harness_settings.install(before)


def _mask_baseline(mask: str, sinks: bool):
    from suites.cases_masks import MaskCase, _sinks
    from suites.judge import baseline

    case = MaskCase(SPEC, 1, mask=mask, sinks=sinks)
    vis = visibility(case.mask_data(), SPEC.seq_q, SPEC.seq_kv, batch=SPEC.batch, heads=SPEC.heads)
    return baseline(SPEC, PROBE_OP, visible=vis, sinks=_sinks(SPEC) if sinks else None)


def _score_mod_baseline():
    from suites.cases_masks import _sinks
    from suites.cases_score_mods import ScoreModCase, _visible, oracle_data
    from suites.judge import baseline

    case = ScoreModCase(SPEC, 1, score_mod="alibi", mask="documents", sinks=True)
    return baseline(
        SPEC,
        PROBE_OP,
        visible=_visible(case),
        sinks=_sinks(SPEC),
        score_mod=oracle_data(case.score_mod_data(), SPEC.torch_dtype),
    )


def _uneven_baseline():
    from suites.cases_uneven import UnevenCase, _visible
    from suites.judge import baseline

    case = UnevenCase(SPEC, 1, lengths=(SPEC.seq_q,), mask="documents")
    return baseline(SPEC, PROBE_OP, visible=_visible(case))


def _replicated_kv_baseline():
    from suites.cases_masks import _sinks
    from suites.judge import baseline

    spec = SPEC.with_(seq_kv=5)  # the whole key/value: any length
    return baseline(spec, PROBE_OP, sinks=_sinks(spec))


def _probed(run) -> tuple[str, ...]:
    with pytest.raises(Probed) as info:
        run()
    return info.value.devices


# ---------------------------------------------------------------------- the parent side

BASELINES = {
    "ring suites (suites.judge)": lambda: __import__("suites.judge", fromlist=["x"]).baseline_for(
        SPEC, True, PROBE_OP
    ),
    "mask suite": lambda: _mask_baseline("documents", sinks=False),
    "mask suite with sinks": lambda: _mask_baseline("window_narrow", sinks=True),
    "score_mod suite": lambda: _score_mod_baseline(),
    "uneven-shard suite": lambda: _uneven_baseline(),
    "replicated key/value suite": lambda: _replicated_kv_baseline(),
}


@pytest.mark.parametrize("suite", sorted(BASELINES))
def test_baseline_runs_on_the_session_device(meta_session, suite: str) -> None:
    devices = _probed(BASELINES[suite])
    assert set(devices) == {"meta"}, (
        f"{suite}: the single-device baseline handed its kernel tensors on {devices} while the "
        "session's device is meta: build the baseline through "
        "conformance.baseline.single_device_baseline"
    )


def test_baseline_refuses_a_kernel_the_session_device_lacks(meta_session) -> None:
    from conformance.baseline import single_device_baseline

    q = torch.zeros(1, 2, 4, 8)
    with pytest.raises(ValueError, match="cannot run op 'cpu_flash' on meta"):
        single_device_baseline(q, q, q, q, op_spec="cpu_flash")


# ---------------------------------------------------------------------- the rank side


@dataclass
class MetaRank:
    """A rank context of one rank on the ``meta`` device (no process group: the probe stops the
    case before any collective)."""

    rank: int = 0
    world_size: int = 1
    group: Any = None
    device: torch.device = field(default_factory=lambda: torch.device("meta"))

    def device_mesh(self, shape, dim_names):  # pragma: no cover - no probed case builds a mesh
        raise AssertionError("a probed case asked for a device mesh")


def _ring_case():
    from suites.cases import RingCase, ring_case

    return ring_case(MetaRank(), RingCase(SPEC, 1, impl=PROBE_IMPL))


def _ring_case_twice():
    from suites.cases import RingCase, ring_case_twice

    return ring_case_twice(MetaRank(), RingCase(SPEC, 1, impl=PROBE_IMPL))


def _masked_case():
    from suites.cases_masks import MaskCase, masked_case

    return masked_case(MetaRank(), MaskCase(SPEC, 1, mask="documents", sinks=True, impl=PROBE_IMPL))


def _scored_case():
    from suites.cases_score_mods import ScoreModCase, scored_case

    case = ScoreModCase(SPEC, 1, score_mod="bias", mask="documents", sinks=True, impl=PROBE_IMPL)
    return scored_case(MetaRank(), case)


def _max_logit_case():
    from suites.cases_max_logit import MaxLogitCase, max_logit_case

    case = MaxLogitCase(SPEC, 1, mask="documents", sinks=True, impl=PROBE_IMPL)
    return max_logit_case(MetaRank(), case)


def _uneven_case():
    from suites.cases_uneven import UnevenCase, uneven_case

    case = UnevenCase(SPEC, 1, lengths=(SPEC.seq_q,), mask="documents", impl=PROBE_IMPL)
    return uneven_case(MetaRank(), case)


def _replicated_kv_case():
    from suites.cases_replicated_kv import ReplicatedKVCase, replicated_kv_case

    case = ReplicatedKVCase(SPEC.with_(seq_kv=5), 1, sinks=True, impl=PROBE_IMPL)
    return replicated_kv_case(MetaRank(), case)


def _strategy_case():
    """ring_case's strategy path (its shards by reference.strategies, its group)."""
    from suites.cases import RingCase, ring_case

    return ring_case(
        MetaRank(), RingCase(SPEC, 1, strategy="ulysses", mesh_shape=(1, 1), impl=PROBE_IMPL)
    )


def _balance_case():
    from suites.cases_balance import BalanceCase, balance_case

    return balance_case(
        MetaRank(), BalanceCase(SPEC.with_(heads_kv=4), 1, family="documents", impl=PROBE_IMPL)
    )


def _packed_case():
    from suites.cases_packed import PackedCase, packed_case

    spec = SPEC.with_(batch=1, seq_q=24, seq_kv=24)
    return packed_case(MetaRank(), PackedCase(spec, 1, cu_as="int32", impl=PROBE_IMPL))


def _multi_mask_case():
    from suites.cases_balance import MultiMaskCase, case_inputs, multi_mask_case

    return multi_mask_case(
        MetaRank(), MultiMaskCase(case_inputs(1), 1, layout="work_aware", impl=PROBE_IMPL)
    )


RANK_FUNCTIONS = {
    "suites.cases.ring_case": _ring_case,
    "suites.cases.ring_case_twice": _ring_case_twice,
    "suites.cases_masks.masked_case": _masked_case,
    "suites.cases_score_mods.scored_case": _scored_case,
    "suites.cases_max_logit.max_logit_case": _max_logit_case,
    "suites.cases_balance.balance_case": _balance_case,
    "suites.cases_uneven.uneven_case": _uneven_case,
    "suites.cases_balance.multi_mask_case": _multi_mask_case,
    "suites.cases_packed.packed_case": _packed_case,
    "suites.cases_replicated_kv.replicated_kv_case": _replicated_kv_case,
}

#: Rank functions that need no probe here, and why.
NOT_PROBED = {
    "suites.cases.strategy_group": "builds the group of a strategy case; no tensors",
    "suites.cases_errors.bad_input_case": (
        "bad input is refused before any kernel runs; its tensors use ctx.device"
    ),
    "suites.cases_strategies.strategy_bad_input_case": (
        "bad input is refused before any kernel runs"
    ),
}
#: suites.cases_api: the context-parallel API and model cases build modules and tensors on
#: ctx.device and call the implementation's API module, not ring_attention; the source check
#: below holds them to the session's device.
NOT_PROBED_MODULES = {"suites.cases_api"}


@pytest.mark.parametrize("name", sorted(RANK_FUNCTIONS))
def test_rank_function_hands_the_session_device(name: str) -> None:
    devices = _probed(RANK_FUNCTIONS[name])
    assert set(devices) == {"meta"}, (
        f"{name}: ring_attention was handed tensors on {devices} on a rank whose device is meta: "
        "put the case's tensors on ctx.device"
    )


def test_a_strategy_case_hands_the_session_device() -> None:
    devices = _probed(_strategy_case)
    assert set(devices) == {"meta"}, (
        f"suites.cases.ring_case (a strategy case): ring_attention was handed tensors on "
        f"{devices} on a rank whose device is meta: put the case's tensors on ctx.device"
    )


def _rank_functions() -> set[str]:
    """Every public function of suites/cases*.py whose first parameter is ``ctx``."""
    found = set()
    for path in sorted(SUITES.glob("cases*.py")):
        tree = ast.parse(path.read_text(), filename=str(path))
        for node in tree.body:
            if (
                isinstance(node, ast.FunctionDef)
                and not node.name.startswith("_")
                and node.args.args
                and node.args.args[0].arg == "ctx"
            ):
                found.add(f"suites.{path.stem}.{node.name}")
    return found


def test_every_rank_function_is_probed_or_exempt() -> None:
    found = _rank_functions()
    assert "suites.cases_masks.masked_case" in found, (
        f"the scan found no mask rank function: {sorted(found)}"
    )
    unknown = {
        name
        for name in found - set(RANK_FUNCTIONS) - set(NOT_PROBED)
        if name.rsplit(".", 1)[0] not in NOT_PROBED_MODULES
    }
    assert not unknown, (
        f"rank functions neither probed nor exempt: {sorted(unknown)}; add each to RANK_FUNCTIONS "
        f"in {Path(__file__).name} (a probe run on the meta device) or to NOT_PROBED with the "
        "reason"
    )
    stale = (set(RANK_FUNCTIONS) | set(NOT_PROBED)) - found
    assert not stale, f"listed here but no longer rank functions of suites/: {sorted(stale)}"


# ---------------------------------------------------------------------- the source

#: (file, line text) of the device names a suite may spell: the seeded generator draws on the
#: CPU so that every process draws the same numbers; the draws are then moved to the device.
ALLOWED = {("inputs.py", 'gen = torch.Generator(device="cpu").manual_seed(spec.seed)')}


def _device_literals(path: Path) -> list[tuple[int, str]]:
    """Lines of ``path`` that name a device: ``torch.device("cpu"|"cuda")``, ``device="cpu"``,
    ``.to("cuda")``, ``.cuda()``."""
    source = path.read_text()
    lines = source.splitlines()
    tree = ast.parse(source, filename=str(path))
    hits = []

    def is_device_name(node) -> bool:
        return (
            isinstance(node, ast.Constant)
            and isinstance(node.value, str)
            and node.value.split(":")[0] in ("cpu", "cuda")
        )

    for node in ast.walk(tree):
        if not isinstance(node, ast.Call):
            continue
        func = node.func
        name = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", "")
        literal = (
            (name in ("device", "to") and any(is_device_name(a) for a in node.args))
            or any(k.arg == "device" and is_device_name(k.value) for k in node.keywords)
            or name == "cuda"
        )
        if literal and (path.name, lines[node.lineno - 1].strip()) not in ALLOWED:
            hits.append((node.lineno, lines[node.lineno - 1].strip()))
    return sorted(hits)


def test_no_suite_names_a_device() -> None:
    hits = [
        f"suites/{p.name}:{line}: {text}"
        for p in sorted(SUITES.glob("*.py"))
        for line, text in _device_literals(p)
    ]
    assert not hits, (
        "suite code that names a device instead of the session's "
        "(conformance.baseline.session_device on the parent side, ctx.device on a rank):\n"
    ) + "\n".join(hits)


def test_the_source_check_sees_a_hard_coded_device(tmp_path: Path) -> None:
    bad = tmp_path / "cases_new.py"
    bad.write_text(
        'import torch\nx = torch.zeros(2, device="cpu")\ny = x.to("cuda:0")\n'
        'op = f(torch.device("cpu"))\n'
        "z = x.cuda()\nw = x.to(ctx.device)\n"
    )
    assert [line for line, _ in _device_literals(bad)] == [2, 3, 4, 5]
