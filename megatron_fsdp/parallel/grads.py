"""Gradient bookkeeping that tensor parallelism adds: sequence-parallel sums and the parameters of the norm."""

from __future__ import annotations

from collections.abc import Iterable

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from megatron_fsdp.comm.lending import on_aliases
from megatron_fsdp.parallel.comm_bytes import record
from megatron_fsdp.parallel.tp_group import TensorParallel


def _local(grad: torch.Tensor) -> torch.Tensor:
    return grad.to_local() if isinstance(grad, DTensor) else grad


def allreduce_sequence_parallel_grads(params: Iterable[torch.Tensor], tp: TensorParallel) -> None:
    """Sum over TP the gradients of parameters marked ``sequence_parallel`` (norms, row-parallel biases).

    Under sequence parallelism each TP rank computes them from its part of the
    sequence only (Megatron's ``_allreduce_layernorm_grads``). Call after the
    data-parallel reduction: TP-replicated parameters have the same data-parallel
    layout on every TP rank, so their local shards line up. One all-reduce for all.
    """
    if tp.size == 1 or not tp.sequence_parallel:
        return
    grads = [_local(p.grad) for p in params if getattr(p, "sequence_parallel", False) and p.grad is not None]
    if not grads:
        return
    flat = torch.cat([g.reshape(-1) for g in grads])
    record("tp_all_reduce", flat)
    on_aliases(dist.all_reduce, flat, group=tp.group)
    offset = 0
    for grad in grads:
        grad.copy_(flat[offset:offset + grad.numel()].view_as(grad))
        offset += grad.numel()


def params_for_grad_norm(params: Iterable[torch.Tensor], tp: TensorParallel) -> list[torch.Tensor]:
    """The parameters whose gradients enter the global norm once: TP-split ones on every TP rank,
    TP-replicated ones on TP rank 0 only (their contributions are then summed over TP)."""
    return [p for p in params if tp.rank == 0 or getattr(p, "tensor_model_parallel", False)]
