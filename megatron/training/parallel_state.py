"""The job's parallel layout: the device mesh, the tensor-parallel group, the data-parallel group.

Ranks are laid out as Megatron lays them out, tensor parallelism fastest: the
mesh is ``(dp_outer?, dp_shard, tp)`` with named dimensions (``dp_outer`` with
``--num-distributed-optimizer-instances`` > 1). FSDP shards over ``dp_shard``
(replicating over ``dp_outer``) within each TP rank; DDP reduces over the whole
data-parallel group. ``get_tensor_parallel()`` offers the group to model
providers, as Megatron's ``parallel_state`` does.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from megatron_fsdp.parallel import TensorParallel


@dataclass(frozen=True)
class ParallelLayout:
    """Where this rank sits: the mesh, its TP group, and its data-parallel group (every DP rank of its TP rank)."""

    mesh: DeviceMesh
    tp: TensorParallel
    dp_group: dist.ProcessGroup
    dp_rank: int
    dp_size: int


_TP: TensorParallel | None = None


def build_layout(args: argparse.Namespace, device: torch.device) -> ParallelLayout:
    """The mesh and groups of validated ``args`` (every rank calls this, in the same order)."""
    world, tp_size = dist.get_world_size(), args.tensor_model_parallel_size
    dp_size, instances = world // tp_size, args.num_distributed_optimizer_instances
    if instances > 1:
        mesh = init_device_mesh(device.type, (instances, dp_size // instances, tp_size),
                                mesh_dim_names=("dp_outer", "dp_shard", "tp"))
    else:
        mesh = init_device_mesh(device.type, (dp_size, tp_size), mesh_dim_names=("dp_shard", "tp"))
    tp = TensorParallel.from_group(mesh.get_group("tp"), args.sequence_parallel)
    if tp_size == 1:
        dp_group = dist.group.WORLD
    else:  # every rank creates every group, in the same order (torch.distributed's rule for new_group)
        groups = [dist.new_group([d * tp_size + t for d in range(dp_size)]) for t in range(tp_size)]
        dp_group = groups[dist.get_rank() % tp_size]
    return ParallelLayout(mesh, tp, dp_group, dist.get_rank() // tp_size, dp_size)


def set_tensor_parallel(tp: TensorParallel) -> None:
    global _TP
    _TP = tp


def get_tensor_parallel() -> TensorParallel:
    """This rank's tensor-parallel group (set by ``pretrain`` before the model is built)."""
    if _TP is None:
        raise RuntimeError("get_tensor_parallel() called before pretrain() built the parallel layout")
    return _TP
