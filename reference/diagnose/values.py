"""What the values of a result tell by themselves, whatever the ring did.

A result whose every value is exactly a number of a narrower dtype than its own (a float64 output
holding float32 values, a float32 LSE or gradient holding bfloat16 values) was computed or
rounded in that dtype; NaN/inf on rows whose LSE exceeds what ``exp`` can hold is an overflow.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence

import torch
from torch import Tensor

from reference.diagnose.findings import Finding, _ranges
from reference.simulate import RingSimulation

__all__ = ["narrowest_dtype"]

# Narrower dtypes a result may have been computed or rounded in, narrowest first.
_NARROWER = {
    torch.float64: (torch.bfloat16, torch.float16, torch.float32),
    torch.float32: (torch.bfloat16, torch.float16),
}
# Fewer finite nonzero values than this say nothing about the dtype they went through.
_MIN_VALUES_FOR_DTYPE = 16


def narrowest_dtype(
    t: Tensor, ref: Tensor | None = None, *, wider: torch.dtype | None = None
) -> torch.dtype | None:
    """The narrowest dtype (bfloat16, float16, float32) narrower than ``wider`` (default
    ``t.dtype``: the dtype the values should have been computed in) in which every finite nonzero
    value of ``t`` is exactly representable, or None.

    A float32 result computed in float32 from random inputs is not exactly bfloat16 everywhere;
    one that is was rounded to bfloat16 somewhere. ``ref`` (the float64 truth), when given, must
    not be representable in that dtype itself, so exact results (small integers) are not blamed.
    """
    values = t.detach()
    values = values[torch.isfinite(values) & (values != 0)]
    if values.numel() < _MIN_VALUES_FOR_DTYPE:
        return None
    for narrow in _NARROWER.get(wider or t.dtype, ()):
        if torch.equal(values.to(narrow).to(values.dtype), values):
            if ref is not None:
                r = ref.detach().to(torch.float64)
                r = r[torch.isfinite(r) & (r != 0)]
                if r.numel() and torch.equal(r.to(narrow).to(torch.float64), r):
                    return None
            return narrow
    return None


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _dtype_findings(
    sim: RingSimulation,
    out_by_rank: Sequence[Tensor] | None,
    lse_by_rank: Sequence[Tensor] | None,
    grads_by_rank: Mapping[str, Sequence[Tensor]] | None,
    dtype: torch.dtype,
) -> list[Finding]:
    """Results whose every value is a number of a narrower dtype than the one they should have
    been computed in (``dtype``; for the LSE float32, float64 for float64): computed or rounded
    in that dtype (see :func:`narrowest_dtype`). One finding per quantity, naming the ranks."""
    found: list[Finding] = []
    lse_dtype = torch.float64 if dtype == torch.float64 else torch.float32
    named: list[tuple[str, Sequence[Tensor], Callable[[int], Tensor | None], torch.dtype]] = []
    if out_by_rank is not None:
        named.append(("out", out_by_rank, sim.local_out, dtype))
    if lse_by_rank is not None:
        named.append(("lse", lse_by_rank, sim.local_lse, lse_dtype))
    for name, shards in (grads_by_rank or {}).items():
        named.append((name, shards, lambda r: None, dtype))
    for name, shards, truth, wider in named:
        hits: list[tuple[int, torch.dtype]] = []
        for r, t in enumerate(shards):
            d = narrowest_dtype(t, truth(r), wider=wider)
            if d is not None:
                hits.append((r, d))
        if not hits:
            continue
        narrow, own = hits[0][1], _dtype_name(wider)
        ranks = _ranges([r for r, d in hits if d == narrow])
        what = (
            f"{name} on rank {ranks}: every value of the {own} result is a {_dtype_name(narrow)} "
            f"number: {name} was computed, accumulated or cast in {_dtype_name(narrow)} on its way"
        )
        if name == "lse":
            what += " (the LSE's contract is float32, float64 for float64 inputs)"
        found.append(Finding(hits[0][0], None, what))
    return found


def _overflow_findings(
    sim: RingSimulation,
    out_by_rank: Sequence[Tensor] | None,
    lse_by_rank: Sequence[Tensor] | None,
    dtype: torch.dtype,
) -> list[Finding]:
    """NaN/inf on rows whose true LSE is beyond log(max) of the dtype: an exp overflowed."""
    found = []
    limit = math.log(torch.finfo(dtype).max)
    for rank in range(sim.world_size):
        ref_out, ref_lse = sim.local_merge(rank)
        bad = torch.zeros_like(ref_lse, dtype=torch.bool)
        if out_by_rank is not None:
            o = out_by_rank[rank].to(torch.float64).to(ref_out.device)
            bad |= (~torch.isfinite(o) & torch.isfinite(ref_out)).any(-1)
        if lse_by_rank is not None:
            lse = lse_by_rank[rank].to(torch.float64).to(ref_lse.device)
            bad |= ~torch.isfinite(lse) & torch.isfinite(ref_lse)
        if not bool(bad.any()):
            continue
        reach = float(ref_lse[bad & torch.isfinite(ref_lse)].abs().max())
        if reach > limit:
            found.append(
                Finding(
                    rank,
                    None,
                    (
                        f"rank {rank}: NaN/inf on rows whose LSE reaches {reach:.3g}, beyond "
                        f"log(max {dtype}) = {limit:.1f}: an exp of the LSE (or of raw scores) "
                        "overflowed; merge in the stable form (subtract the running maximum, or "
                        "use logsigmoid)"
                    ),
                )
            )
    return found
