"""Broken rings that are right on every world size up to 8 and wrong above it.

Nobody tests context parallelism above W=8, so bugs that need many ranks ship: a hop table
sized for one 8-GPU node, a flag word with one bit per ring step. Each ring here passes every
case the process-pool harness runs (W <= 8) and fails the simulated tier (``--launcher
simulated``, W=16..64) with a message that names the cause; ``meta_tests/test_large_worlds.py``
proves both. ``--impl meta_tests.broken_large_worlds:<name>`` loads one.
"""

from __future__ import annotations

from dataclasses import replace

import torch

from meta_tests.broken import Broken, by_name, ring_adapter
from ring_impl import RingAttention

__all__ = ["BROKEN_LARGE"]

#: Ranks of one node, the size the buggy tables below were written for.
NODE = 8


class HopTableOfOneNode(RingAttention):
    """allgather: the source of ring step s is read from a hop table of one 8-GPU node, indexed
    by ``s mod 8``: from step 8 on each step reads the block of eight steps earlier."""

    def transport(self, cfg):
        inner = super().transport(cfg)
        if cfg.rotate_method != "allgather":
            return inner
        return _NodeTableTransport(inner)


class _NodeTableTransport:
    def __init__(self, inner):
        self._inner = inner
        self.name, self.grad_hop = inner.name, inner.grad_hop
        self.kv_hops_share_link = inner.kv_hops_share_link

    def kv_blocks(self, kv, g, link):
        return _NodeTableBlocks(self._inner.kv_blocks(kv, g, link), g.world_size)

    def own_block_first(self, world_size):
        return self._inner.own_block_first(world_size)


class _NodeTableBlocks:
    def __init__(self, inner, world_size: int):
        self._inner, self._world_size = inner, world_size

    def block(self, step: int) -> torch.Tensor:
        if step < NODE:
            return self._inner.block(step)
        # the bug: the table's offset, s mod 8 (offset 0 is this rank's own block, kept gathered)
        return self._inner.block(step % NODE or self._world_size)


class StepFlagsInUint8(RingAttention):
    """The ring steps a rank computes are kept as bits of one uint8 flag word (bit s for step
    s): from step 8 on the bit falls off the byte, and those steps are skipped."""

    def plan(self, cfg, seq_q, seq_kv):
        plans = super().plan(cfg, seq_q, seq_kv)
        flags = torch.zeros((), dtype=torch.uint8)
        for p in plans:
            if p.blocks:
                flags |= torch.tensor(1 << p.step).to(torch.uint8)  # wraps to 0 from step 8 on
        kept = int(flags)
        return [p if kept >> p.step & 1 else replace(p, blocks=()) for p in plans]


#: ``select`` narrows both runs (simulated above 8, process pool up to 8) to the cases that
#: exercise the bug.
BROKEN_LARGE: dict[str, Broken] = by_name(
    Broken(
        "hop_table_of_one_node",
        "rotation: the hop order wrong past 8 hops (a table of one 8-GPU node)",
        r"first divergence at rank \d+, ring step (?:[89]|[1-9]\d+):[^\n]*"
        r"used the key/value block of rank \d+ instead of rank \d+",
        ring_adapter("hop_table_of_one_node", HopTableOfOneNode()),
        suites="suites/test_forward_backward.py",
        select=("-k", "allgather and f32"),
    ),
    Broken(
        "step_flags_in_uint8",
        "integer overflow: one bit per ring step in a uint8",
        r"first divergence at rank \d+, ring step (?:[89]|[1-9]\d+):[^\n]*"
        r"skipped, but \d+ query-key pairs are visible",
        ring_adapter("step_flags_in_uint8", StepFlagsInUint8()),
        suites="suites/test_forward_backward.py",
        select=("-k", "p2p and f32"),
    ),
)

globals().update({name: b.impl for name, b in BROKEN_LARGE.items()})
