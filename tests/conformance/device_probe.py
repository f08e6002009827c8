"""A kernel and an implementation that record the device of the tensors they are handed, then
stop the case (:class:`Probed`): how ``test_session_device.py`` sees where each suite puts its
baseline's and its ranks' tensors without running any attention."""

from __future__ import annotations

import torch

from ring_impl.ops.contract import ALL_DTYPES, OpCapabilities


class Probed(Exception):
    """Raised by the probes with the devices they were handed."""

    def __init__(self, where: str, devices: tuple[str, ...]) -> None:
        super().__init__(f"{where} was handed tensors on {devices}")
        self.devices = devices


def _devices(*tensors) -> tuple[str, ...]:
    return tuple(str(t.device.type) for t in tensors if isinstance(t, torch.Tensor))


class ProbeOp:
    """An attention op that takes every device (``meta`` included) and raises :class:`Probed`."""

    name = "device_probe"
    capabilities = OpCapabilities(
        devices=frozenset({"cpu", "cuda", "meta"}),
        dtypes=ALL_DTYPES,
        gqa=True,
        masks=True,
        lse_grad=True,
        score_mod=True,
    )

    def forward(self, query, key, value, *, is_causal, scale, attn_mask=None, score_mod=None):
        raise Probed("the baseline's kernel", _devices(query, key, value, attn_mask))

    def backward(self, grad_out, query, key, value, out, lse, **options):
        raise Probed("the baseline's kernel backward", _devices(grad_out, query, key, value))


class ProbeImplementation:
    """An implementation whose ``ring_attention``
    raises :class:`Probed` with its inputs' devices."""

    name = "device-probe"

    @staticmethod
    def ring_attention(query, key, value, **kwargs):
        handed = (query, key, value, kwargs.get("sinks"), kwargs.get("cu_seqlens"))
        raise Probed("ring_attention", _devices(*handed))

    @staticmethod
    def balanced_layout(balancer, mask, seq_len, world_size):
        """ring_impl's balancers: a layout is positions, built on the host before any tensor
        reaches ring_attention."""
        from conformance.adapters.ring_impl import RingImplAdapter

        return RingImplAdapter.balanced_layout(balancer, mask, seq_len, world_size)


PROBE_OP = ProbeOp()
IMPLEMENTATION = ProbeImplementation()
