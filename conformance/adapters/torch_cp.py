"""PyTorch's own context parallel (``torch.distributed.tensor.experimental``) under test.

Use it with ``--impl conformance.adapters.torch_cp:IMPLEMENTATION`` (or ``RING_IMPL=...``).

How it runs
-----------
CPU
    PyTorch's public ``context_parallel`` does not run on CPU (``NotImplementedError: Operator
    aten._scaled_dot_product_flash_attention_for_cpu.default does not have a sharding strategy
    registered``), so the adapter calls the functions that public path dispatches to, PyTorch's
    templated ring ``_templated_ring_attention`` and ``_templated_ring_attention_backward``
    (``torch.distributed.tensor.experimental._context_parallel._attention``), with the CPU flash
    kernel (``aten._scaled_dot_product_flash_attention_for_cpu`` and its backward), inside one
    ``torch.autograd.Function`` so gradients reach query, key and value. PyTorch's merge, causal
    plan, rotations and gradient ring are used unchanged.
CUDA
    The public API: ``context_parallel(mesh, ...)`` patches ``F.scaled_dot_product_attention``
    and the DTensor dispatcher routes the SDPA kernels to the same templated ring. The adapter
    enters it around the forward and again around the backward (an autograd.Function that keeps
    the inner graph), because the suites call backward after ``ring_attention`` has returned.
    ``return_lse=True`` calls the SDPA kernel op PyTorch's SDPA would pick (flash for bf16/fp16,
    memory-efficient otherwise) on DTensors inside the same context, since
    ``F.scaled_dot_product_attention`` returns no LSE. Not run here (the project's CI has no
    GPU): the first GPU run is its test.

Options are PyTorch's process-wide ``_cp_options``; the adapter sets them for each call and
restores them afterwards:

- ``layout="contiguous"`` -> ``enable_load_balance=False``; ``layout="head_tail"`` ->
  ``enable_load_balance=True``. PyTorch's load balancer (``_HeadTailLoadBalancer`` in torch 2.13)
  cuts the sequence into ``2W`` chunks and gives rank ``r`` chunks ``r`` and ``2W-1-r`` in that
  order, which is exactly this project's ``head_tail``; its ring then takes the first half of the
  local key/value (or the second half of the queries) per step, as ring_impl's plan does. No
  other layout exists in PyTorch.
- ``rotate_method`` -> ``_cp_options.rotate_method`` (what ``set_rotate_method`` sets):
  ``"allgather"`` (PyTorch's default) or ``"alltoall"``. PyTorch has no ``p2p``.
- ``convert_to_f32`` stays PyTorch's default (True) unless the adapter is built with
  ``TorchContextParallel(convert_to_f32=False)``.

What it supports, measured on CPU + gloo with torch 2.13 by
``python ci/check_ring_numerics.py --world-sizes 2 4
--impl conformance.adapters.torch_cp:IMPLEMENTATION``
(batch 2, 4 heads, 8 rows per layout chunk, head_dim 16; errors are max |X - float64 reference|
and, in brackets, the same for single-process CPU flash in the same dtype):

- float32, bfloat16, float16: out, LSE and gradients as accurate as single-process CPU flash
  (W=4 float32 causal head_tail: out 3.6e-7 [4.4e-7], dk 6.9e-7 [6.0e-7]; bfloat16: out 9.6e-3
  [5.7e-3]; float16 causal: dv 3.1e-3 [3.1e-3]), causal and non-causal, both layouts where
  PyTorch allows them, both rotations.
- float64: accepted, but merged and accumulated in float32 (``convert_to_f32=True``, PyTorch's
  default): W=4 out 2.2e-7 .. 4.0e-7, lse up to 6.0e-7, grads up to 6.0e-7, against about 1e-15
  for single-process CPU flash in float64 (even W=1 rounds: the merger casts every partial to
  float32). Declared, so the suites report it failing. ``NO_F32_CONVERSION`` below
  (``convert_to_f32=False``) agrees to 3.6e-15.
- non-causal attention with ``head_tail``: PyTorch raises ``RuntimeError: Load balancing
  requires `is_causal=True``` on every rank, before any collective. The public API turns load
  balancing on by default whenever the sequence divides by ``2W``, so with default options it
  rejects non-causal SDPA. Non-causal attention works with ``contiguous``.
- GQA (fewer key/value heads): works on CPU; the CPU flash kernel in torch 2.13 maps query head
  ``h`` to key/value head ``h // group`` itself (forward and backward), and PyTorch's ring moves
  only the ``heads_kv`` heads. On CUDA the adapter passes ``enable_gqa`` to SDPA.
- cross attention (non-causal, seq_kv != seq_q, ``contiguous``): works.
- a key/value every rank holds whole (cross-attention text tokens, ``replicated_kv``): not in
  PyTorch. Its SDPA handler wraps query, key and value alike as sequence shards
  (``DTensor.from_local(..., [Shard(2)])``) and ``context_parallel(buffers=...)`` shards every
  buffer it is given, so the ring would rotate each rank's whole copy and every query would see
  W copies; declared lacking (``replicated_kv=False``).
- a value head dim other than query's (multi-head latent attention): its CPU kernel raises "Q/K/V
  should have the same head size" (declared, ``value_head_dim=False``).
- LSE: returned (``return_lse=True``) in the kernel's LSE dtype, not differentiable: PyTorch's
  ring backward takes no LSE gradient (declared, ``lse_grad=False``).
- ``torch.compile(fullgraph=True)``: not supported. Dynamo stops in PyTorch's backward, which
  passes the kernel's ``out`` argument by keyword: ``Unsupported: Attempted to call op with
  non-contiguous `out=` tensor`` (aten._scaled_dot_product_flash_attention_for_cpu_backward).
- bad input on one rank: PyTorch checks nothing across ranks, so a rank with a different shape
  leaves the others waiting in a collective. Declared lacking (``input_errors=False``).
- ``p2p`` rotation, attention ops other than its own kernel (``ops=frozenset()``), a
  ``context_parallel`` API that runs on CPU (``context_parallel=False``, no ``api_module``),
  per-step partials (``record_steps=False``), the per-head max logit (``max_logit=False``: its ring
  returns none): not in PyTorch; declared lacking, so those cases are N/A (anything left
  undeclared would be claimed and tested).

Collective schedule (counted with :class:`harness.accounting.CollectiveLog`; equal to
:meth:`TorchContextParallel.collective_schedule` for W = 1, 2, 4): forward ``allgather``: one
all-gather of the packed key/value (``kv`` bytes); ``alltoall``: ``W-1`` all-to-alls of ``kv``.
Backward: the key/value again as in forward, plus the dK/dV accumulators, always by all-to-all:
``W`` calls of ``dkv`` bytes (float32 elements with ``convert_to_f32``). That is one hop more than
a ring needs (the first hop carries only the owner's own contribution); even at W=1 PyTorch
sends the accumulator to itself once.
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.distributed as dist

from conformance.implementation import Capabilities

__all__ = ["IMPLEMENTATION", "TorchContextParallel", "cp_options"]

LAYOUTS = ("contiguous", "head_tail")
ROTATE_METHODS = ("allgather", "alltoall")

# The kernels the CPU path runs; module attributes so a benchmark can wrap them (timing).
FLASH_FORWARD = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default
FLASH_BACKWARD = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward.default


def _attention_module():
    from torch.distributed.tensor.experimental._context_parallel import _attention

    return _attention


def _set_options(
    load_balance: bool, rotate_method: str, convert_to_f32: bool | None
) -> tuple[Any, Any, Any]:
    """Set PyTorch's global CP options; return the previous (load_balance, rotate, convert)."""
    att = _attention_module()
    opts = att._cp_options
    previous = (opts.enable_load_balance, opts.rotate_method, opts.convert_to_f32)
    opts.enable_load_balance = load_balance
    opts.rotate_method = (
        att._RotateMethod.ALL_GATHER
        if rotate_method == "allgather"
        else att._RotateMethod.ALL_TO_ALL
    )
    if convert_to_f32 is not None:
        opts.convert_to_f32 = convert_to_f32
    return previous


def _restore_options(previous: tuple[Any, Any, Any]) -> None:
    opts = _attention_module()._cp_options
    opts.enable_load_balance, opts.rotate_method, opts.convert_to_f32 = previous


class cp_options:
    """``with cp_options(load_balance=..., rotate_method=...):``
    PyTorch's _cp_options for a block."""

    def __init__(
        self, *, load_balance: bool, rotate_method: str, convert_to_f32: bool | None = None
    ):
        self._args = (load_balance, rotate_method, convert_to_f32)
        self._previous: tuple[Any, Any, Any] | None = None

    def __enter__(self) -> None:
        self._previous = _set_options(*self._args)

    def __exit__(self, *exc: object) -> None:
        assert self._previous is not None
        _restore_options(self._previous)


def _resolve_group(group) -> dist.ProcessGroup:
    if group is None:
        if not dist.is_initialized():
            raise RuntimeError(
                "torch_cp: call torch.distributed.init_process_group first, or pass group="
            )
        return dist.group.WORLD  # type: ignore[return-value]
    if isinstance(group, dist.ProcessGroup):
        return group
    from torch.distributed.device_mesh import DeviceMesh

    if isinstance(group, DeviceMesh) and group.ndim == 1:
        return group.get_group()
    raise TypeError(
        "torch_cp: group must be None, a ProcessGroup or a 1-D DeviceMesh, not "
        f"{type(group).__name__}"
    )


# ------------------------------------------------------------------------------------------
# CPU: PyTorch's templated ring with the CPU flash kernel.
# ------------------------------------------------------------------------------------------


class _TemplatedRing(torch.autograd.Function):
    """PyTorch's ring forward and backward; (out, lse) with gradients for query, key, value."""

    @staticmethod
    def forward(
        ctx, query, key, value, group, is_causal, scale, load_balance, rotate_method, convert_to_f32
    ):
        att = _attention_module()
        previous = _set_options(load_balance, rotate_method, convert_to_f32)
        try:
            out, lse = att._templated_ring_attention(
                group,
                2,
                FLASH_FORWARD,
                query,
                key,
                value,
                is_causal=is_causal,
                dropout_p=0.0,
                scale=scale,
            )[:2]
        finally:
            _restore_options(previous)
        ctx.save_for_backward(query, key, value, out, lse)
        ctx.args = (group, is_causal, scale, load_balance, rotate_method, convert_to_f32)
        ctx.mark_non_differentiable(lse)
        return out, lse

    @staticmethod
    def backward(ctx, grad_out, grad_lse):
        query, key, value, out, lse = ctx.saved_tensors
        group, is_causal, scale, load_balance, rotate_method, convert_to_f32 = ctx.args
        att = _attention_module()
        previous = _set_options(load_balance, rotate_method, convert_to_f32)
        try:
            dq, dk, dv = att._templated_ring_attention_backward(
                group,
                2,
                FLASH_BACKWARD,
                grad_out.contiguous(),
                "grad_out",
                query,
                key,
                value,
                out,
                lse,
                is_causal=is_causal,
                dropout_p=0.0,
                scale=scale,
            )[:3]
        finally:
            _restore_options(previous)
        return dq, dk, dv, None, None, None, None, None, None


# ------------------------------------------------------------------------------------------
# CUDA: the public context_parallel API. Untested in this project's CI (no GPU).
# ------------------------------------------------------------------------------------------


class _PublicContextParallel:
    """``context_parallel`` entered for one call with the options of that call."""

    def __init__(
        self,
        mesh,
        global_seq: int,
        device: torch.device,
        load_balance: bool,
        rotate_method: str,
        convert_to_f32: bool | None,
    ):
        self.mesh, self.global_seq, self.device = mesh, global_seq, device
        self.options = (load_balance, rotate_method, convert_to_f32)

    def __enter__(self) -> None:
        from torch.distributed.tensor.experimental import context_parallel

        self._previous = _set_options(*self.options)
        # context_parallel shards its buffers itself and decides on load balancing from the
        # first buffer's global length: a dummy buffer of the global length carries that.
        dummy = torch.empty(1, 1, self.global_seq, device=self.device)
        self._cm = context_parallel(
            self.mesh, buffers=[dummy], buffer_seq_dims=[2], no_restore_buffers={dummy}
        )
        self._cm.__enter__()

    def __exit__(self, *exc: Any) -> None:
        try:
            self._cm.__exit__(*exc)
        finally:
            _restore_options(self._previous)


def _cuda_sdpa(query, key, value, mesh, is_causal, scale, return_lse):
    """Local (out, lse or None) of the SDPA call inside an entered context_parallel."""
    import torch.nn.functional as F

    gqa = key.shape[1] != query.shape[1]
    if not return_lse:
        out = F.scaled_dot_product_attention(
            query, key, value, is_causal=is_causal, scale=scale, enable_gqa=gqa
        )
        return out, None
    if gqa:
        raise NotImplementedError(
            "torch_cp on CUDA: return_lse with fewer key/value heads (GQA) has no SDPA kernel op"
        )
    from torch.distributed.tensor import DTensor, Shard

    q, k, v = (
        DTensor.from_local(t, mesh, [Shard(2)], run_check=False) for t in (query, key, value)
    )
    if query.dtype in (torch.float16, torch.bfloat16):
        res = torch.ops.aten._scaled_dot_product_flash_attention(
            q, k, v, 0.0, is_causal, False, scale=scale
        )
    else:
        res = torch.ops.aten._scaled_dot_product_efficient_attention(
            q, k, v, None, True, 0.0, is_causal, scale=scale
        )
    return res[0].to_local(), res[1].to_local()


class _CudaContextParallel(torch.autograd.Function):
    @staticmethod
    def forward(ctx, query, key, value, cp, is_causal, scale, return_lse):
        with torch.enable_grad():
            leaves = tuple(t.detach().requires_grad_() for t in (query, key, value))
            with cp:
                out, lse = _cuda_sdpa(*leaves, cp.mesh, is_causal, scale, return_lse)
        ctx.graph = (leaves, out)
        ctx.cp = cp
        if lse is None:
            lse = out.new_empty(0)
        ctx.mark_non_differentiable(lse)
        return out.detach(), lse.detach()

    @staticmethod
    def backward(ctx, grad_out, grad_lse):
        leaves, out = ctx.graph
        with ctx.cp:
            grads = torch.autograd.grad(out, leaves, grad_out)
        ctx.graph = None
        return (*grads, None, None, None, None)


# ------------------------------------------------------------------------------------------
# The implementation object.
# ------------------------------------------------------------------------------------------


class TorchContextParallel:
    """PyTorch's context parallel in the protocol of :mod:`conformance.implementation`."""

    def __init__(self, *, convert_to_f32: bool | None = None, name: str = "torch_cp"):
        self.name = name
        self.convert_to_f32 = convert_to_f32
        self.capabilities = Capabilities(
            layouts=frozenset(LAYOUTS),
            rotate_methods=frozenset(ROTATE_METHODS),
            dtypes=frozenset({"float64", "float32", "bfloat16", "float16"}),
            devices=frozenset({"cpu", "cuda"}),
            ops=frozenset(),  # PyTorch picks its kernel; a vendor kernel cannot be plugged in
            backward=True,
            lse=True,
            # PyTorch's ring backward takes no LSE gradient (_templated_ring_attention_backward
            # has grad_out only) and its public SDPA returns no LSE: the LSE is an output only.
            lse_grad=False,
            gqa=True,
            cross_attention=True,
            # Its CPU kernel (aten's CPU flash attention, torch 2.13) raises "Q/K/V should have the
            # same head size" for a value head dim of its own, on one rank and on the ring alike
            value_head_dim=False,
            compile=False,
            input_errors=False,
            context_parallel=False,  # no api_module: PyTorch's API does not run on CPU
            collective_schedule=True,
            record_steps=False,  # PyTorch's ring exposes no per-step partials
            strategies=frozenset({"ring"}),  # its ring only: no Ulysses or hybrid
            masks=frozenset(),  # only through flex attention on CUDA
            sinks=False,
            score_mod=False,  # PyTorch's ring runs SDPA kernels, which take no score_mod
            balancers=frozenset(),  # head_tail is PyTorch's only load balancer
            max_logit=False,  # its ring returns no max logit (and SDPA has no such output)
            uneven_shards=False,  # context_parallel shards by equal chunks only (no lengths)
            packed=False,  # its ring takes (batch, heads, seq, dim) only: no cu_seqlens
            multi_mask_layouts=False,  # no balancers (above)
            # A key/value every rank holds whole (cross-attention text tokens) has no place in
            # PyTorch's context parallel: context_parallel(buffers=...) shards every buffer it is
            # given on its sequence dim, and its SDPA handler (sdpa_input_fn) wraps query, key and
            # value alike as DTensor.from_local(..., [Shard(seq_dim)]), so the ring rotates each
            # rank's whole copy as a shard and every query sees W copies.
            replicated_kv=False,
        )
        self.baseline_op = "auto"

    def ring_attention(
        self,
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
        """Local output (and LSE) of PyTorch's ring; arguments as
        :func:`ring_impl.ring_attention`."""
        if op is not None:
            raise ValueError(
                "torch_cp: PyTorch's context parallel picks its own kernel; op= is not supported"
            )
        if layout not in LAYOUTS:
            raise ValueError(f"torch_cp: unknown layout {layout!r}; PyTorch implements {LAYOUTS}")
        rotate_method = rotate_method or "allgather"
        if rotate_method not in ROTATE_METHODS:
            raise NotImplementedError(
                f"torch_cp: PyTorch's context parallel has no rotate_method {rotate_method!r}; it "
                f"has {ROTATE_METHODS}"
            )
        pg = _resolve_group(group)
        scale = float(scale) if scale is not None else 1.0 / math.sqrt(query.shape[-1])
        load_balance = layout == "head_tail"
        if query.device.type == "cuda":
            from torch.distributed.device_mesh import DeviceMesh

            mesh = DeviceMesh.from_group(pg, "cuda")
            cp = _PublicContextParallel(
                mesh,
                query.shape[2] * dist.get_world_size(pg),
                query.device,
                load_balance,
                rotate_method,
                self.convert_to_f32,
            )
            out, lse = _CudaContextParallel.apply(
                query, key, value, cp, bool(is_causal), scale, return_lse
            )
        else:
            out, lse = _TemplatedRing.apply(
                query,
                key,
                value,
                pg,
                bool(is_causal),
                scale,
                load_balance,
                rotate_method,
                self.convert_to_f32,
            )
        return (out, lse) if return_lse else out

    def collective_schedule(
        self, world_size, rotate_method, *, batch, heads_kv, seq_kv, head_dim, dtype, compiled=False
    ):
        """``{phase: {kind: {"calls", "bytes"}}}`` of one forward and backward
        (see the module docstring)."""
        elems = 2 * batch * heads_kv * seq_kv * head_dim
        kv = elems * dtype.itemsize
        convert = (
            _attention_module()._cp_options.convert_to_f32
            if self.convert_to_f32 is None
            else self.convert_to_f32
        )
        dkv = elems * (4 if convert else dtype.itemsize)
        w = world_size
        fwd: dict[str, dict[str, int]] = {}
        bwd: dict[str, dict[str, int]] = {"all_to_all": {"calls": w, "bytes": w * dkv}}
        if w > 1:
            if rotate_method == "allgather":
                fwd["all_gather"] = {"calls": 1, "bytes": kv}
                bwd["all_gather"] = {"calls": 1, "bytes": kv}
            else:
                fwd["all_to_all"] = {"calls": w - 1, "bytes": (w - 1) * kv}
                bwd["all_to_all"] = {"calls": 2 * w - 1, "bytes": (w - 1) * kv + w * dkv}
        return {"forward": fwd, "backward": bwd}


IMPLEMENTATION = TorchContextParallel()

#: PyTorch's ring with ``_cp_options.convert_to_f32 = False``: merges and accumulates in the input
#: dtype, which makes float64 exact and bfloat16/float16 worse (merged in 16 bits).
NO_F32_CONVERSION = TorchContextParallel(
    convert_to_f32=False, name="torch_cp[convert_to_f32=False]"
)
