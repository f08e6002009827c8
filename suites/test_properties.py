"""Hypothesis properties over shapes: batch, heads, GQA ratio, head_dim, value's head dim (d_v
other than d_qk, multi-head latent attention, where the implementation claims
``value_head_dim``), tokens per rank, world size, layout, causal, rotation. Every draw is
labelled; the profiles (harness/pytest_plugin.py) are derandomized, so every xdist worker and
every rerun draws the same examples."""

from __future__ import annotations

import pytest
from hypothesis import strategies as st

from suites.cases import RingCase
from suites.inputs import InputSpec
from suites.matrix import LAYOUTS, ROTATIONS, draw_claimed, drawn, seed_for, world_sizes


@drawn
def test_any_shape_matches_reference(ring, pytestconfig, data) -> None:
    caps = ring.caps
    # Draw only what the implementation claims (undeclared is claimed); what it declares it lacks
    # has its own N/A cases.
    sizes = world_sizes(pytestconfig, at_least=2) or [1]
    w = data.draw(st.sampled_from(sizes), label="world_size")
    layout = draw_claimed(data, caps, "layouts", LAYOUTS, "layout")
    causal = data.draw(st.booleans(), label="is_causal")
    rotate = draw_claimed(data, caps, "rotate_methods", ROTATIONS, "rotate_method")
    dtype = data.draw(st.sampled_from(("float64", "float32")), label="dtype")
    batch = data.draw(st.integers(1, 2), label="batch")
    heads_kv = data.draw(st.integers(1, 3), label="heads_kv")
    group = data.draw(st.integers(1, 3), label="gqa_group") if caps.claims("gqa") else 1
    head_dim = data.draw(st.sampled_from((8, 12, 16, 40, 64)), label="head_dim")
    # None: d_v = d_qk; the others narrower and wider than most drawn d_qk
    value_dims = (None, 4, 24, 32) if caps.claims("value_head_dim") else (None,)
    head_dim_v = data.draw(st.sampled_from(value_dims), label="value_head_dim")
    step = 2 if layout == "head_tail" else 1
    local_q = data.draw(st.integers(1, 6), label="tokens_per_rank") * step
    cross = not causal and caps.claims("cross_attention")
    local_kv = data.draw(st.integers(1, 6), label="kv_tokens_per_rank") * step if cross else local_q
    inputs = InputSpec(
        batch=batch,
        heads=heads_kv * group,
        heads_kv=heads_kv,
        seq_q=local_q * w,
        seq_kv=local_kv * w,
        head_dim=head_dim,
        head_dim_v=None if head_dim_v == head_dim else head_dim_v,
        dtype=dtype,
    )
    inputs = inputs.with_(seed=seed_for(repr(inputs)))
    case = RingCase(inputs, w, is_causal=causal, layout=layout, rotate_method=rotate)
    if inputs.head_dim_v is not None:
        try:  # the session's kernel (--op) may not take d_v != d_qk: then d_v = d_qk
            ring.skip_if_kernel_cannot(ring.op_spec, case)
        except pytest.skip.Exception:
            case = case.with_(inputs=inputs.with_(head_dim_v=None))
    case = ring.prepare(case)
    if case.inputs.head_dim_v is None:
        ring.check(case)
        return
    try:
        ring.check(case)
        return
    except Exception as exc:  # a rank's error counts too: a buffer of the wrong size
        failure: BaseException = exc
    except pytest.fail.Exception as exc:
        failure = exc
    d, dv = case.inputs.head_dim, case.inputs.value_head_dim
    try:  # as test_forward_backward.py::test_value_head_dim: is d_v != d_qk the cause?
        ring.check(case.with_(inputs=case.inputs.with_(head_dim_v=None, head_dim=dv)))
    except (Exception, pytest.fail.Exception):
        raise failure from None
    pytest.fail(
        f"{failure}\nThe same case with value's head dim equal to query's and key's ({dv}) "
        f"passes: the implementation is wrong only when d_v != d_qk (d_qk={d}, d_v={dv}) "
        f"[{case.label}]\nrepro: {ring.repro()}",
        pytrace=False,
    )
