"""Tensor- and sequence-parallel regions: Megatron's forward/backward pairs of collectives.

Each region is an autograd function whose backward is the forward's conjugate:

============================  ==========================  ===========================
region                        forward                     backward
============================  ==========================  ===========================
``copy_to``                   identity                    all-reduce
``reduce_from``               all-reduce                  identity
``scatter_to``                split the last dim          all-gather the last dim
``gather_from``               all-gather the last dim     split the last dim
``scatter_to_sequence``       split the sequence dim      all-gather the sequence dim
``gather_from_sequence``      all-gather the sequence     reduce-scatter the sequence
``reduce_scatter_to_sequence``reduce-scatter the sequence all-gather the sequence
============================  ==========================  ===========================

Activations are ``[batch, sequence, hidden]``, so the sequence dim is 1 (Megatron's
is 0: it keeps the sequence first). With a group of size 1 every region is the identity.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from megatron_fsdp.comm.collectives import _all_gather_flat, _reduce_scatter_flat
from megatron_fsdp.comm.lending import on_aliases
from megatron_fsdp.parallel.comm_bytes import record
from megatron_fsdp.parallel.tp_group import TensorParallel

SEQUENCE_DIM = 1


def _all_reduce(x: torch.Tensor, tp: TensorParallel) -> torch.Tensor:
    x = x.contiguous().clone()  # never reduce into a tensor autograd saved
    record("tp_all_reduce", x)
    on_aliases(dist.all_reduce, x, group=tp.group)
    return x


def _split(x: torch.Tensor, tp: TensorParallel, dim: int) -> torch.Tensor:
    width = tp.divide(x.shape[dim], f"dimension {dim} of an activation of shape {tuple(x.shape)}")
    return x.narrow(dim, tp.rank * width, width).contiguous()


def gather_along(x: torch.Tensor, group: dist.ProcessGroup | None, size: int, dim: int, kind: str = "tp"
                 ) -> torch.Tensor:
    """Every rank's ``x`` of ``group`` (``size`` ranks) concatenated along ``dim``, in rank order.

    ``kind``: which parallelism the bytes count under (``comm_bytes``).
    """
    x = x.movedim(dim, 0).contiguous()
    out = torch.empty((size * x.shape[0], *x.shape[1:]), dtype=x.dtype, device=x.device)
    record(f"{kind}_all_gather", out)
    on_aliases(_all_gather_flat, out, x, group=group)
    return out.movedim(0, dim)


def reduce_scatter_along(x: torch.Tensor, group: dist.ProcessGroup | None, size: int, dim: int, kind: str = "tp"
                         ) -> torch.Tensor:
    """``x`` summed over ``group``; this rank keeps its ``1/size`` slice along ``dim`` (which must divide)."""
    x = x.movedim(dim, 0).contiguous()
    record(f"{kind}_reduce_scatter", x)
    out = torch.empty((x.shape[0] // size, *x.shape[1:]), dtype=x.dtype, device=x.device)
    on_aliases(_reduce_scatter_flat, out, x, group=group)
    return out.movedim(0, dim)


def _gather(x: torch.Tensor, tp: TensorParallel, dim: int) -> torch.Tensor:
    return gather_along(x, tp.group, tp.size, dim)


def _reduce_scatter(x: torch.Tensor, tp: TensorParallel, dim: int) -> torch.Tensor:
    tp.divide(x.shape[dim], f"dimension {dim} of an activation of shape {tuple(x.shape)}")
    return reduce_scatter_along(x, tp.group, tp.size, dim)


class _CopyTo(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, tp: TensorParallel) -> torch.Tensor:
        ctx.tp = tp
        return x

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return _all_reduce(grad, ctx.tp), None


class _ReduceFrom(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, tp: TensorParallel) -> torch.Tensor:
        return _all_reduce(x, tp)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return grad, None


class _ScatterTo(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, tp: TensorParallel, dim: int) -> torch.Tensor:
        ctx.tp, ctx.dim = tp, dim
        return _split(x, tp, dim)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        return _gather(grad, ctx.tp, ctx.dim), None, None


class _GatherFrom(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, tp: TensorParallel, dim: int) -> torch.Tensor:
        ctx.tp, ctx.dim = tp, dim
        return _gather(x, tp, dim)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        return _split(grad, ctx.tp, ctx.dim), None, None


class _GatherFromSequence(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, tp: TensorParallel) -> torch.Tensor:
        ctx.tp = tp
        return _gather(x, tp, SEQUENCE_DIM)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return _reduce_scatter(grad, ctx.tp, SEQUENCE_DIM), None


class _ReduceScatterToSequence(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, tp: TensorParallel) -> torch.Tensor:
        ctx.tp = tp
        return _reduce_scatter(x, tp, SEQUENCE_DIM)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return _gather(grad, ctx.tp, SEQUENCE_DIM), None


def copy_to_tensor_parallel_region(x: torch.Tensor, tp: TensorParallel) -> torch.Tensor:
    return x if tp.size == 1 else _CopyTo.apply(x, tp)


def reduce_from_tensor_parallel_region(x: torch.Tensor, tp: TensorParallel) -> torch.Tensor:
    return x if tp.size == 1 else _ReduceFrom.apply(x, tp)


def scatter_to_tensor_parallel_region(x: torch.Tensor, tp: TensorParallel) -> torch.Tensor:
    return x if tp.size == 1 else _ScatterTo.apply(x, tp, x.dim() - 1)


def gather_from_tensor_parallel_region(x: torch.Tensor, tp: TensorParallel) -> torch.Tensor:
    return x if tp.size == 1 else _GatherFrom.apply(x, tp, x.dim() - 1)


def scatter_to_sequence_parallel_region(x: torch.Tensor, tp: TensorParallel) -> torch.Tensor:
    return x if tp.size == 1 else _ScatterTo.apply(x, tp, SEQUENCE_DIM)


def gather_from_sequence_parallel_region(x: torch.Tensor, tp: TensorParallel) -> torch.Tensor:
    return x if tp.size == 1 else _GatherFromSequence.apply(x, tp)


def reduce_scatter_to_sequence_parallel_region(x: torch.Tensor, tp: TensorParallel) -> torch.Tensor:
    return x if tp.size == 1 else _ReduceScatterToSequence.apply(x, tp)
