"""The tensor-parallel group of a rank, Megatron's parameter attributes, and splitting full weights.

Ranks are laid out as Megatron lays them out: tensor parallelism varies fastest,
so ranks ``[d * T, (d + 1) * T)`` form data-parallel rank ``d``'s TP group and
ranks ``{t, t + T, t + 2T, ...}`` form TP rank ``t``'s data-parallel group.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist


@dataclass(frozen=True)
class TensorParallel:
    """A tensor-parallel group: its size, this rank's index in it, and whether sequence parallelism is on."""

    group: dist.ProcessGroup | None  # None: size 1 (no collectives)
    size: int = 1
    rank: int = 0
    sequence_parallel: bool = False

    @classmethod
    def single(cls) -> TensorParallel:
        """No tensor parallelism: every layer is the plain one."""
        return cls(None, 1, 0, False)

    @classmethod
    def from_group(cls, group: dist.ProcessGroup, sequence_parallel: bool = False) -> TensorParallel:
        size = dist.get_world_size(group)
        if sequence_parallel and size == 1:
            sequence_parallel = False  # Megatron turns it off at TP 1: nothing to split
        return cls(group, size, dist.get_rank(group), sequence_parallel)

    def divide(self, numerator: int, what: str) -> int:
        """``numerator / size``, or an error naming ``what`` (a flag) when it does not divide."""
        if numerator % self.size:
            raise ValueError(f"{what} ({numerator}) must be divisible by --tensor-model-parallel-size ({self.size})")
        return numerator // self.size


def set_tensor_model_parallel_attributes(tensor: torch.Tensor, is_parallel: bool, partition_dim: int,
                                         stride: int = 1, segments: Sequence[int] | None = None) -> None:
    """Megatron's attributes: ``tensor_model_parallel``, ``partition_dim``, ``partition_stride``.

    ``segments`` (full sizes along ``partition_dim`` of parts split separately, as in
    ``take_partition``) is kept as ``partition_segments``: checkpoints need it to place
    a fused weight's slice in the full tensor (``megatron_fsdp.checkpoint.model_parallel``).
    """
    tensor.tensor_model_parallel = is_parallel
    tensor.partition_dim = partition_dim
    tensor.partition_stride = stride
    if segments is not None:
        tensor.partition_segments = tuple(segments)


def take_partition(
    full: torch.Tensor, tp: TensorParallel, dim: int, segments: Sequence[int] | None = None
) -> torch.Tensor:
    """This rank's slice of ``full`` along ``dim``.

    ``segments`` (sizes along ``dim`` summing to it) splits each segment separately
    and concatenates this rank's pieces: a fused QKV weight ``[Q | K | V]`` gives
    each rank its heads' Q, K and V rows, as the unfused layers would.
    """
    segments = [full.shape[dim]] if segments is None else list(segments)
    if sum(segments) != full.shape[dim]:
        raise ValueError(f"segments {segments} do not add up to dimension {dim} of size {full.shape[dim]}")
    pieces = []
    for part in full.split(segments, dim=dim):
        width = tp.divide(part.shape[dim], f"a partition of size {part.shape[dim]}")
        pieces.append(part.narrow(dim, tp.rank * width, width))
    return torch.cat(pieces, dim=dim) if len(pieces) > 1 else pieces[0]
