"""The job's parallel layout: the device mesh, the tensor-parallel group, the data-parallel group.

Ranks are laid out as Megatron lays them out, tensor parallelism fastest, then
context parallelism: the mesh is ``(dp_outer?, dp_shard, cp, tp)`` with named
dimensions (``dp_outer`` with ``--num-distributed-optimizer-instances`` > 1; ``cp``
only with ``--context-parallel-size`` > 1). FSDP shards over ``dp_shard`` x ``cp``
(the flattened ``dp_shard_cp``, replicating over ``dp_outer``) within each TP rank;
DDP reduces over the same ranks. ``get_tensor_parallel()`` and
``get_context_parallel()`` offer the groups to model providers, as Megatron's
``parallel_state`` does.

With ``--expert-model-parallel-size P`` > 1 a second mesh of ``world / (T x P)`` x ``P``
(x ``T``) ranks, ``(dp_shard, ep)``, or ``(dp_shard, ep, tp)`` with
``--expert-tensor-parallel-size T`` > 1, lays out the experts as Megatron
(megatron-core's ``parallel_state``) does: expert TP fastest, then EP (ranks
``[d * P, (d + 1) * P)`` form an EP group at ``T = 1``); expert parameters are sharded
over its ``dp_shard`` (expert data-parallel) dimension, each expert's linear layers
split over its ``tp`` (expert-TP) dimension, and ``get_expert_parallel()`` offers the EP
group (docs/moe.md). At ``P = 1`` ``T`` is the TP size (megatron-core marks experts as
expert parameters only under EP): the experts ride the dense mesh and groups.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from megatron_fsdp.parallel import ContextParallel, TensorParallel
from megatron_fsdp.parallel.expert_dispatch import ExpertParallel


@dataclass(frozen=True)
class ParallelLayout:
    """Where this rank sits: the mesh, its TP and CP groups, and its data-parallel groups.

    ``dp_group``: the ranks that read other data (same TP and CP rank), over which losses
    are averaged; ``grad_group``: the ranks gradients are reduced over (``dp_group`` x CP,
    the ranks FSDP shards over).
    """

    mesh: DeviceMesh | None
    tp: TensorParallel
    cp: ContextParallel
    dp_group: dist.ProcessGroup
    grad_group: dist.ProcessGroup
    dp_rank: int
    dp_size: int
    ep: ExpertParallel = ExpertParallel.single()
    expt_mesh: DeviceMesh | None = None  # (dp_shard, ep, tp) with expert parallelism, else None
    etp: TensorParallel | None = None  # the expert-TP group where it is not ``tp`` (the expert mesh's tp)
    expert_model_group: dist.ProcessGroup | None = None  # EP x expert TP (Megatron's tp-ep), where > EP

    @property
    def grad_group_size(self) -> int:
        return self.dp_size * self.cp.size

    @property
    def expert_tp(self) -> TensorParallel:
        """The group each expert's linear layers are split over (the dense TP group unless told otherwise)."""
        return self.tp if self.etp is None else self.etp

    @property
    def expert_norm_group(self) -> dist.ProcessGroup | None:
        """The ranks whose expert shards differ beyond the expert data-parallel mesh: EP x expert TP."""
        return self.expert_model_group if self.expert_model_group is not None else self.ep.group


_TP: TensorParallel | None = None
_CP: ContextParallel | None = None
_EP: ExpertParallel | None = None


def _groups_over(dim_size: int, fixed: int, stride: int, world: int) -> list[list[int]]:
    """Every group of ``dim_size`` ranks spaced ``stride`` apart, for each offset below ``fixed``."""
    groups = []
    for outer in range(0, world, stride * dim_size):
        for offset in range(fixed):
            groups.append([outer + offset + i * stride for i in range(dim_size)])
    return groups


def build_layout(args: argparse.Namespace, device: torch.device) -> ParallelLayout:
    """The mesh and groups of validated ``args`` (every rank calls this, in the same order)."""
    world, tp_size, cp_size = dist.get_world_size(), args.tensor_model_parallel_size, args.context_parallel_size
    dp_size, instances = world // (tp_size * cp_size), args.num_distributed_optimizer_instances
    shape, names = [dp_size, cp_size, tp_size], ["dp_shard", "cp", "tp"]
    if instances > 1:
        shape, names = [instances, dp_size // instances, cp_size, tp_size], ["dp_outer", "dp_shard", "cp", "tp"]
    mesh = init_device_mesh(device.type, tuple(shape), mesh_dim_names=tuple(names))
    if cp_size > 1:
        mesh[("dp_shard", "cp")]._flatten("dp_shard_cp")  # FSDP's shard dimension
    tp = TensorParallel.from_group(mesh.get_group("tp"), args.sequence_parallel)
    cp = ContextParallel.from_group(mesh.get_group("cp")) if cp_size > 1 else ContextParallel.single()
    rank = dist.get_rank()
    if tp_size * cp_size == 1:
        dp_group = grad_group = dist.group.WORLD
    else:  # every rank creates every group, in the same order (torch.distributed's rule for new_group)
        dp_group = grad_group = None
        for ranks in _groups_over(dp_size, tp_size * cp_size, tp_size * cp_size, world):
            group = dist.new_group(ranks)
            dp_group = group if rank in ranks else dp_group
        if cp_size == 1:
            grad_group = dp_group
        else:
            for ranks in _groups_over(dp_size * cp_size, tp_size, tp_size, world):
                group = dist.new_group(ranks)
                grad_group = group if rank in ranks else grad_group
    ep, expt_mesh, etp, expert_model_group = ExpertParallel.single(), None, None, None
    ep_size = getattr(args, "expert_model_parallel_size", 1)
    etp_size = getattr(args, "expert_tensor_parallel_size", None) or tp_size
    if ep_size > 1:
        if etp_size == 1:  # the mesh of expert parallelism alone (no tp dimension: its groups as before)
            expt_mesh = init_device_mesh(device.type, (world // ep_size, ep_size), mesh_dim_names=("dp_shard", "ep"))
            etp = TensorParallel.single()
        else:
            expt_mesh = init_device_mesh(device.type, (world // (ep_size * etp_size), ep_size, etp_size),
                                         mesh_dim_names=("dp_shard", "ep", "tp"))
            etp = TensorParallel.from_group(expt_mesh.get_group("tp"))
            # the EP x expert-TP group (Megatron's expert tensor-and-model-parallel group)
            expert_model_group = (expt_mesh[("ep", "tp")]._flatten("ep_tp").get_group() if ep_size > 1
                                  else etp.group)
        ep = ExpertParallel.from_group(expt_mesh.get_group("ep"))
    return ParallelLayout(mesh, tp, cp, dp_group, grad_group, rank // (tp_size * cp_size), dp_size, ep, expt_mesh,
                          etp, expert_model_group)


def set_tensor_parallel(tp: TensorParallel) -> None:
    global _TP
    _TP = tp


def set_context_parallel(cp: ContextParallel) -> None:
    global _CP
    _CP = cp


def set_expert_parallel(ep: ExpertParallel) -> None:
    global _EP
    _EP = ep


def get_expert_parallel() -> ExpertParallel:
    """This rank's expert-parallel group (set by ``pretrain`` before the model is built)."""
    if _EP is None:
        raise RuntimeError("get_expert_parallel() called before pretrain() built the parallel layout")
    return _EP


def get_context_parallel() -> ContextParallel:
    """This rank's context-parallel group (set by ``pretrain`` before the model is built)."""
    if _CP is None:
        raise RuntimeError("get_context_parallel() called before pretrain() built the parallel layout")
    return _CP


def get_tensor_parallel() -> TensorParallel:
    """This rank's tensor-parallel group (set by ``pretrain`` before the model is built)."""
    if _TP is None:
        raise RuntimeError("get_tensor_parallel() called before pretrain() built the parallel layout")
    return _TP
