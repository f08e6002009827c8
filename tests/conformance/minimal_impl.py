"""A vendor-style implementation that declares what it lacks: only the contiguous layout,
allgather and float32 on CPU; no LSE, no op objects, no collective schedule, no step records, no
context-parallel API, no max logit, no replicated key/value, the ring strategy only. What it
leaves undeclared (GQA, cross attention, compile, bad-input errors) it claims. Used to check N/A
reporting and the plug-in path."""

from __future__ import annotations

import ring_impl
from conformance import Capabilities


class MinimalRing:
    name = "minimal-vendor-ring"
    capabilities = Capabilities(
        layouts=frozenset({"contiguous"}),
        rotate_methods=frozenset({"allgather"}),
        dtypes=frozenset({"float32"}),
        devices=frozenset({"cpu"}),
        backward=True,
        lse=False,
        ops=frozenset(),
        collective_schedule=False,
        record_steps=False,
        context_parallel=False,
        strategies=frozenset({"ring"}),
        masks=frozenset(),
        sinks=False,
        score_mod=False,
        max_logit=False,
        replicated_kv=False,
    )

    @staticmethod
    def ring_attention(
        query,
        key,
        value,
        *,
        group=None,
        is_causal=False,
        scale=None,
        rotate_method=None,
        op=None,
        layout="contiguous",
        return_lse=False,
    ):
        assert op is None, (
            "the suite must not pass op= to an implementation that does not declare ops"
        )
        assert not return_lse, "the suite must not ask for the LSE when capabilities.lse is False"
        return ring_impl.ring_attention(
            query,
            key,
            value,
            group=group,
            is_causal=is_causal,
            scale=scale,
            rotate_method=rotate_method,
            layout=layout,
        )


IMPLEMENTATION = MinimalRing()
