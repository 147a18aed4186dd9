"""A float8 weight all-gather for any model: ``MixedPrecisionPolicy(gather_dtype=torch.float8_e4m3fn)``.

Before a group's all-gather, every parameter's rows of the main shard are scaled by one
factor per parameter, agreed across the shard group (``finfo(gather_dtype).max / amax``
with ``amax`` the whole parameter's, one small ``MAX`` all-reduce for all parameters of
the group), clamped to the float8 range and cast: the gather moves 1 byte per element,
sent as ``uint8`` (the same bytes; gloo has no float8 type). Once it landed, each
parameter's gathered bytes are dequantized (divided by its scale) into the group's
compute-dtype buffer, whose views the module computes with, so autograd, gradients and
the optimizer's main weights are those of an unquantized gather. The forward and backward
gathers of a step quantize the same weights with the same scale, so backward computes
with what forward did.

Error: each weight is rounded to float8 once per gather, relative ``2**-4`` (e4m3) or
``2**-3`` (e5m2) at most in the normal range, plus half the smallest subnormal divided by
the scale below it (``error_bound``); per tensor, not per block (MXFP8's 32-element block
scales are not built).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from megatron_fsdp.comm.collectives import CommConfig, all_reduce_max
from megatron_fsdp.core.fsdp_param import FSDPParam

GATHER_DTYPE = torch.uint8  # what the collective sees of the float8 payload
SCALE_KIND = "all_gather_scale"  # comm_stats kind of the scale agreement
_MANTISSA_BITS = {torch.float8_e4m3fn: 3, torch.float8_e5m2: 2}


def quantization_scale(amax: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``finfo(dtype).max / amax`` in float32 (computed in float64, as torchao does), 1 for an all-zero tensor."""
    amax = amax.to(torch.float64)
    scale = torch.where(amax > 0, torch.finfo(dtype).max / amax.clamp(min=torch.finfo(torch.float32).tiny), 1.0)
    return scale.to(torch.float32)


def quantize(values: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``values`` scaled, clamped to ``dtype``'s range and cast to it."""
    limit = torch.finfo(dtype).max
    return (values.to(torch.float32) * scale).clamp_(-limit, limit).to(dtype)


def dequantize(payload: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The float8 ``payload`` back in ``dtype``."""
    return (payload.to(torch.float32) / scale).to(dtype)


def error_bound(values: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Per element, how far ``dequantize(quantize(values))`` may be from ``values`` (in float32): half a
    unit in the last place of ``dtype`` relative, or half its smallest subnormal step, over the scale."""
    finfo = torch.finfo(dtype)
    relative = 2.0 ** -(_MANTISSA_BITS[dtype] + 1)
    smallest_subnormal = finfo.smallest_normal * 2.0 ** -_MANTISSA_BITS[dtype]
    return values.abs().to(torch.float32) * relative + smallest_subnormal / 2 / scale


class QuantizedGather:
    """The float8 all-gather of one group: quantize this rank's rows, dequantize the gathered buffer."""

    def __init__(
        self, params: list[FSDPParam], dtype: torch.dtype, compute_dtype: torch.dtype, device: torch.device,
        process_group: dist.ProcessGroup,
    ) -> None:
        self.params = params
        self.dtype = dtype
        self.compute_dtype = compute_dtype
        self.device = device
        self.process_group = process_group
        self.layout = params[0].geometry.layout
        self.scales = torch.ones(len(params), dtype=torch.float32, device=device)

    @property
    def total_numel(self) -> int:
        """Bytes of the gathered buffer (``uint8`` elements)."""
        return self.layout.total_numel

    def gather_input(self, main_shard: torch.Tensor, comm: CommConfig) -> torch.Tensor:
        """This rank's float8 shard as ``uint8``, with the scales agreed (a blocking all-reduce: every rank
        that takes part in the group's all-gather calls this at the same point)."""
        with torch.no_grad():
            amax = torch.zeros(len(self.params), dtype=torch.float32, device=self.device)
            views = [p.shard_view(main_shard) for p in self.params]
            for index, view in enumerate(views):
                if view.numel():
                    amax[index] = view.detach().abs().max().to(torch.float32)
            all_reduce_max(amax, self.process_group, comm=comm, kind=SCALE_KIND)
            self.scales = quantization_scale(amax, self.dtype)
            payload = torch.zeros(self.layout.shard_numel, dtype=self.dtype, device=self.device)
            for index, (param, view) in enumerate(zip(self.params, views)):
                if view.numel():
                    param.shard_view(payload).copy_(quantize(view, self.scales[index], self.dtype))
        return payload.view(GATHER_DTYPE)

    def dequantize_into(self, gathered: torch.Tensor, unsharded: torch.Tensor) -> None:
        """Write every parameter's dequantized weights from the gathered bytes into the compute buffer."""
        payload = gathered.view(self.dtype)
        with torch.no_grad():
            for index, param in enumerate(self.params):
                param.slot_view(unsharded).copy_(
                    dequantize(param.slot_view(payload), self.scales[index], self.compute_dtype))
