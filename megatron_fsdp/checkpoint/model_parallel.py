"""Checkpoint entries of tensor-parallel slices and expert-parallel experts, under the unsplit model's names.

With Megatron-style tensor parallelism each rank holds a slice of some weights
(``tensor_model_parallel`` parameters, split along ``partition_dim``). A checkpoint
stores them as the tensors of the model *without* tensor parallelism: same names,
full (TP-1) shapes, and for fused weights the TP-1 layout. A fused weight is not
one contiguous slice: a QKV weight ``[Q | K | V]`` holds ``[Q_t | K_t | V_t]`` on
TP rank ``t`` and a SwiGLU ``fc1`` ``[gate_t | up_t]`` (``partition_segments``
lists the segments' full sizes along ``partition_dim``; megatron-core's equal
segments are its ``partition_stride``, 2 for a gated ``fc1``; its QKV weight is
``[Q_g | K_g | V_g]`` per query group ``g``, so whole groups are a contiguous
slice: stride 1). Each rank therefore
contributes one DCP chunk per segment it holds rows of, at that segment's global
offsets, so a checkpoint saved at one TP size loads at any other (and at TP 1)
and the full export is the TP-1 model's weights.

Expert parallelism renames instead of slicing: an expert's parameters are named
by the expert's global index (the caller's ``rename``), so the names do not
depend on the expert-parallel size. Expert tensor parallelism slices as TP does,
over the expert TP group (``etp_size``): the entries are whole experts.

``ChunkedTensor`` is the DCP value of such an entry: it has the full shape and
holds views of this rank's real (FSDP-sharded) storage, so a save writes only
those rows and a load reads straight into them. ``staged_copy`` turns any entry
into one holding host copies instead (a save that runs in the background).
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, MetadataIndex, TensorProperties
from torch.distributed.checkpoint.planner import TensorWriteData, WriteItem, WriteItemType
from torch.distributed.tensor import DTensor
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset


@dataclass(frozen=True)
class ModelParallel:
    """What the checkpoint needs of the model-parallel layout (default: none; entries are unchanged).

    ``tp_size`` / ``tp_rank``: this rank's tensor-parallel group. Parameters with
    ``tensor_model_parallel = True`` are saved as the full tensor along
    ``partition_dim``. ``rename``: parameter FQN -> checkpoint name (expert
    parallelism: local expert index -> global one); must be one-to-one.
    ``etp_size`` / ``etp_rank``: the expert tensor-parallel group (expert
    parameters' slices are over it).
    """

    tp_size: int = 1
    tp_rank: int = 0
    rename: Callable[[str], str] | None = None
    etp_size: int = 1
    etp_rank: int = 0

    def name(self, fqn: str) -> str:
        return fqn if self.rename is None else self.rename(fqn)

    def group_of(self, param: torch.Tensor) -> tuple[int, int]:
        """``(size, rank)`` of the tensor-parallel group ``param`` is split over: the expert TP group for
        expert parameters (``allreduce = False``), the dense one otherwise."""
        if not getattr(param, "allreduce", True):
            return self.etp_size, self.etp_rank
        return self.tp_size, self.tp_rank

    def is_sliced(self, param: torch.Tensor) -> bool:
        """True for a TP-sharded parameter (its checkpoint entry is the full tensor).

        Expert parameters (``allreduce = False``) are split over the expert TP group, not
        the dense one: megatron-core marks them ``tensor_model_parallel`` even where that
        group has one rank (``--expert-tensor-parallel-size 1`` under TP: whole experts,
        saved as they are).
        """
        return self.group_of(param)[0] > 1 and bool(getattr(param, "tensor_model_parallel", False))


NO_MODEL_PARALLEL = ModelParallel()


@dataclass(frozen=True)
class TensorParallelSlice:
    """How a TP rank's parameter sits in the full tensor: ``dim``, segment full sizes, TP size and rank."""

    dim: int
    segments: tuple[int, ...]  # full sizes along ``dim`` of the parts split separately (one: not fused)
    size: int
    rank: int

    @classmethod
    def of(cls, param: torch.Tensor, layout: ModelParallel, name: str) -> TensorParallelSlice:
        """The slice of ``param`` (Megatron's ``partition_dim`` / ``partition_stride`` attributes, or ours,
        ``partition_segments``, which names unequal segments and wins over the stride)."""
        dim = int(getattr(param, "partition_dim", 0))
        if not 0 <= dim < param.dim():
            raise ValueError(f"parameter {name}: partition_dim {dim} is not a dimension of its shape "
                             f"{tuple(param.shape)}")
        local = param.shape[dim]
        size, rank = layout.group_of(param)
        segments = getattr(param, "partition_segments", None)
        if segments is None:
            # megatron-core's stride S: the full tensor is S equal parts, each split over TP on its own (its
            # _initialize_affine_weight_cpu takes pieces rank, rank + T, ...: a gated fc1's [gate_t | up_t])
            stride = int(getattr(param, "partition_stride", 1))
            if stride < 1 or local % stride:
                raise ValueError(f"parameter {name}: partition_stride {stride} does not divide its dimension {dim} "
                                 f"of local size {local}")
            segments = (local * size // stride,) * stride
        else:
            segments = tuple(int(s) for s in segments)
        if any(s % size for s in segments) or sum(segments) != local * size:
            raise ValueError(
                f"parameter {name}: partition_segments {segments} do not split its dimension {dim} of local size "
                f"{local} into {size} equal tensor-parallel parts each"
            )
        return cls(dim, segments, size, rank)

    def full_shape(self, local_shape: Sequence[int]) -> tuple[int, ...]:
        shape = list(local_shape)
        shape[self.dim] = sum(self.segments)
        return tuple(shape)

    def chunks(self, local: torch.Tensor, offsets: Sequence[int]) -> list[tuple[tuple[int, ...], torch.Tensor]]:
        """``(global offsets, view of local)`` per non-empty piece of ``local``.

        ``local`` is the block of the TP rank's tensor that starts at ``offsets`` (its
        data-parallel shard: ``offsets`` are within the TP-local tensor).
        """
        start, length = offsets[self.dim], local.shape[self.dim]
        out = []
        local_begin = full_begin = 0  # where segment s starts in the TP-local and in the full tensor
        for full in self.segments:
            width = full // self.size
            lo, hi = max(start, local_begin), min(start + length, local_begin + width)
            if hi > lo and local.numel() > 0:
                where = list(offsets)
                where[self.dim] = full_begin + self.rank * width + (lo - local_begin)
                out.append((tuple(where), local.narrow(self.dim, lo - start, hi - lo)))
            local_begin += width
            full_begin += full
        return out


def local_block(value: torch.Tensor) -> tuple[torch.Tensor, tuple[int, ...]]:
    """This rank's stored block of ``value`` (a DTensor's local shard) and its offsets in ``value``."""
    if isinstance(value, DTensor):
        _, offsets = compute_local_shape_and_global_offset(value.shape, value.device_mesh, value.placements)
        return value.to_local(), tuple(int(o) for o in offsets)
    return value, (0,) * value.dim()


class ChunkedTensor(torch.Tensor):
    """A DCP value of full shape ``shape`` of which this rank holds ``chunks`` (views of real storage).

    Implements DCP's checkpointable hooks (``__create_write_items__``,
    ``__create_chunk_list__``, ``__get_tensor_shard__``); it has no data of its own,
    and any other operation on it raises. ``source`` is the value it was made from
    (what a load hands back to the model or optimizer, after DCP read into the views).
    """

    @staticmethod
    def __new__(cls, shape: Sequence[int], chunks: list[tuple[tuple[int, ...], torch.Tensor]],
                source: torch.Tensor) -> ChunkedTensor:
        local = source.to_local() if isinstance(source, DTensor) else source
        return torch.Tensor._make_wrapper_subclass(cls, tuple(shape), dtype=local.dtype, device=local.device)

    def __init__(self, shape: Sequence[int], chunks: list[tuple[tuple[int, ...], torch.Tensor]],
                 source: torch.Tensor) -> None:
        self.chunks = chunks
        self.source = source

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):  # noqa: ANN001, ANN206 - torch's protocol
        raise TypeError(f"{func} on a ChunkedTensor: it only carries checkpoint chunks (use .source)")

    def __repr__(self) -> str:  # type: ignore[override]
        return f"ChunkedTensor(shape={tuple(self.shape)}, chunks={[(o, tuple(t.shape)) for o, t in self.chunks]})"

    def _storage_chunks(self) -> list[ChunkStorageMetadata]:
        return [ChunkStorageMetadata(offsets=torch.Size(o), sizes=t.shape) for o, t in self.chunks]

    def __create_write_items__(self, fqn: str, obj: Any) -> list[WriteItem]:
        properties = TensorProperties.create_from_tensor(self.chunks[0][1]) if self.chunks else None
        return [
            WriteItem(index=MetadataIndex(fqn, chunk.offsets), type=WriteItemType.SHARD,
                      tensor_data=TensorWriteData(chunk=chunk, properties=properties, size=self.shape))
            for chunk in self._storage_chunks()
        ]

    def __create_chunk_list__(self) -> list[ChunkStorageMetadata]:
        return self._storage_chunks()

    def __get_tensor_shard__(self, index: MetadataIndex) -> torch.Tensor:
        for offsets, tensor in self.chunks:
            if index.offset is not None and torch.Size(offsets) == index.offset:
                return tensor
        raise ValueError(f"{index.fqn}: this rank holds no chunk at offsets {index.offset}")


def checkpoint_value(value: Any, param: torch.Tensor, layout: ModelParallel, name: str) -> Any:
    """What the checkpoint holds for ``value`` (``param`` itself or a state of its shape): full-shape chunks
    for a TP-sharded parameter, ``value`` unchanged otherwise."""
    if not (layout.is_sliced(param) and isinstance(value, torch.Tensor) and value.shape == param.shape):
        return value
    tp_slice = TensorParallelSlice.of(param, layout, name)
    local, offsets = local_block(value)
    return ChunkedTensor(tp_slice.full_shape(value.shape), tp_slice.chunks(local, offsets), value)


def full_shape(param: torch.Tensor, layout: ModelParallel, name: str) -> tuple[int, ...]:
    """The shape ``param`` has in the checkpoint."""
    if not layout.is_sliced(param):
        return tuple(param.shape)
    return TensorParallelSlice.of(param, layout, name).full_shape(param.shape)


def source_of(value: Any) -> Any:
    """The model's or optimizer's own value behind a checkpoint value."""
    return value.source if isinstance(value, ChunkedTensor) else value


def staged_copy(value: Any) -> Any:
    """A host copy of a checkpoint value, for a save written after training moved on (``async_save_checkpoint``).

    Tensors are copied to CPU memory; a DTensor or ``ChunkedTensor`` becomes a ``ChunkedTensor``
    of the same full shape holding copies of this rank's blocks at their offsets (DCP writes it
    as it writes the original); anything else is deep-copied.
    """
    if isinstance(value, (ChunkedTensor, DTensor)):
        if isinstance(value, ChunkedTensor):
            blocks = value.chunks
        else:
            local, offsets = local_block(value)
            blocks = [(offsets, local)] if local.numel() else []
        chunks = [(offsets, block.detach().to("cpu", copy=True)) for offsets, block in blocks]
        return ChunkedTensor(value.shape, chunks, torch.empty(0, dtype=value.dtype))
    if isinstance(value, torch.Tensor):
        return value.detach().to("cpu", copy=True)
    return copy.deepcopy(value)
