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
the scale below it (``error_bound``); per tensor.

``MixedPrecisionPolicy(gather_format="mxfp8")``: MXFP8 instead (the OCP MX layout, as torchao's
``MXTensor.to_mx(w, torch.float8_e4m3fn, block_size=32)`` with its default ``FLOOR`` scaling, the OCP
spec's): each run of 32 consecutive elements along the last dim gets its own power-of-two scale,
``2**(floor(log2(amax_block)) - 8)`` stored as a ``float8_e8m0fnu`` byte, and its elements divided by it,
clamped to +-448 and cast to e4m3 (round to nearest even). A block's scale is local, so no all-reduce:
the e4m3 payload takes the group's all-gather and the scales a second, small one (1 byte per 32
elements, padded to the largest rank's count), both dequantized after. Parameters whose blocks do not
fall whole on every rank (last dim not a multiple of 32, a 0-dim tensor, or a 1-dim one whose shard
boundaries are not on a block boundary) take the per-tensor path above (e4m3, with its all-reduce).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from megatron_fsdp.comm.collectives import CommConfig, all_gather, all_reduce_max
from megatron_fsdp.core.fsdp_param import FSDPParam
from megatron_fsdp.sharding.layout import FlatLayout

GATHER_DTYPE = torch.uint8  # what the collective sees of the float8 payload
SCALE_KIND = "all_gather_scale"  # comm_stats kind of the scale agreement
BLOCK_SCALE_KIND = "all_gather_block_scales"  # comm_stats kind of MXFP8's scale gather
MX_BLOCK = 32  # elements per MXFP8 scale (OCP MX)
MX_DTYPE = torch.float8_e4m3fn  # MXFP8's elements
_E4M3_MAX_POW2 = 8  # floor(log2(448)): the largest power of two e4m3 holds
_E8M0_BIAS = 127
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


def mx_quantize(values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """MXFP8 of ``values`` (numel a multiple of 32): the e4m3 elements (flat) and one biased e8m0 exponent
    per 32 as ``uint8``, as torchao's ``to_mx`` (FLOOR) computes them, bit for bit."""
    blocks = values.detach().reshape(-1, MX_BLOCK).to(torch.float32)
    amax = blocks.abs().amax(dim=1, keepdim=True)
    # floor(log2(amax)) read from the float32 exponent bits (a power of two, no rounding); NaN -> 255
    exponent = (torch.bitwise_right_shift(amax.view(torch.int32), 23) & 0xFF) - _E8M0_BIAS
    biased = (exponent - _E4M3_MAX_POW2).clamp(-_E8M0_BIAS, _E8M0_BIAS + 1) + _E8M0_BIAS
    biased = torch.where(amax.isnan(), 255, biased)
    # 2**-127 is a float32 subnormal: like torchao, divide by the smallest normal at the bottom instead
    scale = torch.bitwise_left_shift(biased.to(torch.int32), 23).view(torch.float32).clamp(
        min=torch.finfo(torch.float32).tiny)
    limit = torch.finfo(MX_DTYPE).max
    payload = (blocks / scale).clamp_(-limit, limit).to(MX_DTYPE)
    return payload.reshape(-1), biased.reshape(-1).to(torch.uint8)


def mx_dequantize(payload: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """MXFP8 elements (flat e4m3) times ``2**(scale - 127)`` per 32 (255: NaN), in float32 (exact), as ``dtype``."""
    factor = torch.pow(2.0, scales.to(torch.float32) - _E8M0_BIAS)
    factor = torch.where(scales == 255, float("nan"), factor)
    return (payload.to(torch.float32).reshape(-1, MX_BLOCK) * factor.reshape(-1, 1)).reshape(-1).to(dtype)


def block_scalable(layout: FlatLayout, index: int) -> bool:
    """Parameter ``index`` is cut into whole 32-element blocks along its last dim on every rank."""
    slot = layout.slots[index]
    if not slot.shape or slot.shape[-1] % MX_BLOCK:
        return False
    for rank in range(layout.world_size):  # rows are whole; a 1-dim parameter's rows are single elements
        piece = layout.piece(index, rank)
        if (piece.row_start * slot.row_numel) % MX_BLOCK or (piece.row_count * slot.row_numel) % MX_BLOCK:
            return False
    return True


class QuantizedGather:
    """The float8 all-gather of one group: quantize this rank's rows, dequantize the gathered buffer.

    ``block_scaled`` (``gather_format="mxfp8"``): the parameters ``block_scalable`` allows are MXFP8,
    the others per-tensor ``dtype``.
    """

    def __init__(
        self, params: list[FSDPParam], dtype: torch.dtype, compute_dtype: torch.dtype, device: torch.device,
        process_group: dist.ProcessGroup, block_scaled: bool = False,
    ) -> None:
        self.params = params
        self.dtype = dtype
        self.compute_dtype = compute_dtype
        self.device = device
        self.process_group = process_group
        self.layout = params[0].geometry.layout
        self.scales = torch.ones(len(params), dtype=torch.float32, device=device)
        self.mx = [block_scaled and block_scalable(self.layout, p.index) for p in params]
        # Where each MXFP8 parameter's scales sit in every rank's scale shard (ragged: padded to the
        # largest), and for each, which gathered scales are its blocks' in order.
        counts = [[0] * len(params) for _ in range(self.layout.world_size)]
        for rank, row in enumerate(counts):
            for index, param in enumerate(params):
                if self.mx[index]:
                    piece = self.layout.piece(param.index, rank)
                    row[index] = piece.row_count * param.slot.row_numel // MX_BLOCK
        self.scale_shard_numel = max(sum(row) for row in counts)
        self.scale_offsets = [[sum(row[:i]) for i in range(len(params))] for row in counts]
        self.scale_index = [
            torch.cat([torch.arange(r * self.scale_shard_numel + self.scale_offsets[r][i],
                                    r * self.scale_shard_numel + self.scale_offsets[r][i] + counts[r][i])
                       for r in range(self.layout.world_size)]).to(device) if mx else None
            for i, mx in enumerate(self.mx)
        ]
        self.gathered_scales = torch.zeros(self.layout.world_size * self.scale_shard_numel, dtype=torch.uint8,
                                           device=device)

    @property
    def total_numel(self) -> int:
        """Bytes of the gathered buffer (``uint8`` elements)."""
        return self.layout.total_numel

    def gather_input(self, main_shard: torch.Tensor, comm: CommConfig) -> torch.Tensor:
        """This rank's float8 shard as ``uint8``, with the scales agreed (a blocking all-reduce: every rank
        that takes part in the group's all-gather calls this at the same point)."""
        with torch.no_grad():
            views = [p.shard_view(main_shard) for p in self.params]
            payload = torch.zeros(self.layout.shard_numel, dtype=self.dtype, device=self.device)
            if not all(self.mx):  # per-tensor scales, agreed across the group
                amax = torch.zeros(len(self.params), dtype=torch.float32, device=self.device)
                for index, view in enumerate(views):
                    if view.numel() and not self.mx[index]:
                        amax[index] = view.detach().abs().max().to(torch.float32)
                all_reduce_max(amax, self.process_group, comm=comm, kind=SCALE_KIND)
                self.scales = quantization_scale(amax, self.dtype)
            if any(self.mx):  # block scales: local, gathered beside the payload (waited for here)
                rank = self.params[0].geometry.shard_rank
                local = torch.zeros(self.scale_shard_numel, dtype=torch.uint8, device=self.device)
                for index, (param, view) in enumerate(zip(self.params, views)):
                    if self.mx[index] and view.numel():
                        elements, scales = mx_quantize(view)
                        param.shard_view(payload).view(-1).copy_(elements)
                        local.narrow(0, self.scale_offsets[rank][index], scales.numel()).copy_(scales)
                all_gather(self.gathered_scales, local, self.process_group, kind=BLOCK_SCALE_KIND, comm=comm).wait()
            for index, (param, view) in enumerate(zip(self.params, views)):
                if view.numel() and not self.mx[index]:
                    param.shard_view(payload).copy_(quantize(view, self.scales[index], self.dtype))
        return payload.view(GATHER_DTYPE)

    def dequantize_into(self, gathered: torch.Tensor, unsharded: torch.Tensor) -> None:
        """Write every parameter's dequantized weights from the gathered bytes into the compute buffer."""
        payload = gathered.view(self.dtype)
        with torch.no_grad():
            for index, param in enumerate(self.params):
                if self.mx[index]:
                    scales = self.gathered_scales[self.scale_index[index]]
                    param.slot_view(unsharded).view(-1).copy_(
                        mx_dequantize(param.slot_view(payload), scales, self.compute_dtype))
                else:
                    param.slot_view(unsharded).copy_(
                        dequantize(param.slot_view(payload), self.scales[index], self.compute_dtype))
