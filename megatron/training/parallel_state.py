"""The job's parallel layout, derived from megatron-core's ``parallel_state``: one set of process groups per job.

``pretrain`` initializes megatron-core's ``parallel_state`` (``initialize_model_parallel``
with TP, CP, EP, expert TP and ``--num-distributed-optimizer-instances``, Megatron's
default order ``tp-cp-ep-dp-pp``; on CPU through ``mcore_cpu_compat``) and seeds
megatron-core's RNG tracker, as Megatron-LM's ``initialize_megatron`` does
(``mcore_model.initialize_mcore_parallel``). ``build_layout`` then derives what the
front-end and the engine need FROM those groups, creating no communicator of its own:

- the dense mesh ``(dp_outer?, dp_shard, tp)``, under context parallelism
  ``(dp_outer?, dp_shard_cp, tp)`` (TP fastest, then CP, then DP, so one instance's
  data-parallel x CP ranks form one dimension: FSDP's shard dimension, Megatron-FSDP's
  ``dp_shard_cp``; ``dp_outer`` with ``--num-distributed-optimizer-instances`` > 1), is
  ``DeviceMesh.from_group`` over megatron-core's groups of each dimension (its TP group, its
  partial data-parallel-with-CP group, its inter-instance group). No dimension is flattened:
  torch's ``_flatten`` would make a communicator of its own. CP's group is megatron-core's
  (``layout.cp``), used by the CP attention and the batch split, not by FSDP;
- with ``--expert-model-parallel-size P`` > 1 the expert mesh ``(dp_shard, ep[, tp])``
  of ``world / (T x P)`` x ``P`` (x ``T``) ranks (expert TP fastest, then EP) over its
  expert-data-parallel, expert-model-parallel and expert-TP groups; the EP x expert-TP
  group (``expert_model_group``) is megatron-core's expert tensor-and-model-parallel
  group. Expert parameters are sharded over its ``dp_shard``, each expert's linear layers
  split over its ``tp`` (docs/moe.md). At ``P = 1`` the experts ride the dense mesh and groups.

Each mesh dimension's group is looked up among megatron-core's by its ranks; a
dimension megatron-core has no group for (``dp_outer`` with expert parallelism, where
megatron-core's inter-instance group is the experts') gets its groups made here, on
every rank in the same order. ``TensorParallel``
(megatron_fsdp.parallel) and ``GroupOfRanks`` (CP, EP) wrap megatron-core's
groups for the loop and the backends (model providers read megatron-core's
``parallel_state``, as in Megatron-LM).
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

from megatron_fsdp.comm.objects import all_gather_objects
from megatron_fsdp.parallel import TensorParallel


@dataclass(frozen=True)
class GroupOfRanks:
    """A context- or expert-parallel group of megatron-core's: its size and this rank's index in it (``group``
    None: size 1, no collectives)."""

    group: dist.ProcessGroup | None
    size: int = 1
    rank: int = 0

    @classmethod
    def single(cls) -> GroupOfRanks:
        return cls(None, 1, 0)

    @classmethod
    def from_group(cls, group: dist.ProcessGroup) -> GroupOfRanks:
        return cls(group, dist.get_world_size(group), dist.get_rank(group))


@dataclass(frozen=True)
class ParallelLayout:
    """Where this rank sits: the mesh, its TP and CP groups, and its data-parallel groups.

    ``dp_group``: the ranks that read other data (same TP and CP rank), over which losses
    are averaged; ``grad_group``: the ranks gradients are reduced over (``dp_group`` x CP,
    the ranks FSDP shards over).
    """

    mesh: DeviceMesh | None
    tp: TensorParallel
    cp: GroupOfRanks
    dp_group: dist.ProcessGroup
    grad_group: dist.ProcessGroup
    dp_rank: int
    dp_size: int
    ep: GroupOfRanks = GroupOfRanks.single()
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


_MESH_GROUPS: dict[int, dist.ProcessGroup] = {}  # the groups of every mesh built here, by id


def mesh_groups() -> dict[int, dist.ProcessGroup]:
    """The process groups of the meshes ``mesh_from_groups`` built in this process, by ``id`` (kept alive by
    ``mcore_model.destroy_mcore_parallel``)."""
    return _MESH_GROUPS


def mcore_groups() -> dict[tuple[int, ...], dist.ProcessGroup]:
    """megatron-core's process groups of this rank (its ``parallel_state`` globals), by their ranks.

    The gloo copies (``*_GLOO``) and the all-gather duplicates (``*_AG``) are left out: a mesh's
    collectives run on the default backend's group of those ranks.
    """
    from megatron.core import parallel_state

    found: dict[tuple[int, ...], dist.ProcessGroup] = {}
    for name, value in vars(parallel_state).items():
        if not name.startswith("_") or "GLOO" in name or name.endswith("_AG"):
            continue
        for group in value if isinstance(value, (list, tuple)) else (value,):
            if isinstance(group, dist.ProcessGroup):
                found.setdefault(tuple(dist.get_process_group_ranks(group)), group)
    return found


def _dim_groups(ranks: torch.Tensor, dim: int, known: dict[tuple[int, ...], dist.ProcessGroup],
                named: dist.ProcessGroup | None = None) -> dist.ProcessGroup:
    """This rank's group along ``dim`` of the rank grid ``ranks``: ``named`` (megatron-core's group for the
    dimension) where it holds those ranks, else megatron-core's group of those ranks, else one made here.

    Every rank takes the same branch (decided together); where groups are made, every group of
    the dimension is, on every rank in the same order (torch.distributed's rule for ``new_group``).
    """
    rows = ranks.movedim(dim, -1).reshape(-1, ranks.shape[dim]).tolist()
    me = dist.get_rank()
    mine = next(tuple(row) for row in rows if me in row)
    group = named if named is not None and tuple(dist.get_process_group_ranks(named)) == mine else known.get(mine)
    if all(all_gather_objects(group is not None)):  # one branch on every rank, even where a layout differs
        return group
    group = None
    for row in rows:
        made = dist.new_group(row)
        known[tuple(row)] = made
        group = made if me in row else group
    return group


def mesh_from_groups(device_type: str, shape: tuple[int, ...], names: tuple[str, ...],
                     known: dict[tuple[int, ...], dist.ProcessGroup],
                     named: dict[str, dist.ProcessGroup] | None = None) -> DeviceMesh:
    """A mesh of ``shape`` over ranks ``0..n-1`` (row-major) whose dimensions' groups are ``known``'s.

    ``named``: the group to take for a dimension (by name) where its ranks are this rank's of that
    dimension. No dimension is flattened (torch's ``_flatten`` would make a group of its own): a
    dimension over several of Megatron's is one dimension of the mesh, on megatron-core's group.
    """
    named = named or {}
    ranks = torch.arange(int(torch.tensor(shape).prod())).reshape(shape)
    groups = [_dim_groups(ranks, d, known, named.get(names[d])) for d in range(len(shape))]
    _MESH_GROUPS.update((id(g), g) for g in groups)
    return DeviceMesh.from_group(groups, device_type, mesh=ranks, mesh_dim_names=names)


def build_layout(args: argparse.Namespace, device: torch.device) -> ParallelLayout:
    """megatron-core's ``parallel_state`` for validated ``args`` (initialized, its tracker seeded), and the
    layout derived from its groups (every rank calls this, in the same order)."""
    from megatron.core import parallel_state as mpu

    from .mcore_model import initialize_mcore_parallel

    initialize_mcore_parallel(args, args.seed)
    known = mcore_groups()
    world, tp_size, cp_size = dist.get_world_size(), args.tensor_model_parallel_size, args.context_parallel_size
    dp_size, instances = world // (tp_size * cp_size), args.num_distributed_optimizer_instances
    # FSDP's shard dimension: one instance's data-parallel ranks, times CP under CP (``dp_shard_cp``, Megatron-FSDP's
    # name): megatron-core's (partial) data-parallel-with-CP group. TP fastest, then CP, then DP: (dp_shard, cp)
    # are adjacent in the rank grid, so their product is one dimension of it.
    shard_name = "dp_shard_cp" if cp_size > 1 else "dp_shard"
    shape, names = (dp_size * cp_size, tp_size), (shard_name, "tp")
    if instances > 1:
        shape, names = (instances, dp_size * cp_size // instances, tp_size), ("dp_outer", shard_name, "tp")
    # where two of megatron-core's groups hold the same ranks (DP and DP x CP at CP 1, TP and expert TP), each
    # dimension takes the group megatron-core names for it
    named = {"tp": mpu.get_tensor_model_parallel_group(),
             shard_name: mpu.get_data_parallel_group(with_context_parallel=True, partial_data_parallel=True)}
    if instances > 1:
        named["dp_outer"] = mpu.get_inter_distributed_optimizer_instance_group()
    mesh = mesh_from_groups(device.type, shape, names, known, named)
    tp = TensorParallel.from_group(mpu.get_tensor_model_parallel_group(), args.sequence_parallel)
    cp = GroupOfRanks.from_group(mpu.get_context_parallel_group()) if cp_size > 1 else GroupOfRanks.single()
    dp_group = mpu.get_data_parallel_group()  # same TP and CP rank: the ranks that read other data
    grad_group = mpu.get_data_parallel_group(with_context_parallel=True)
    ep, expt_mesh, etp, expert_model_group = GroupOfRanks.single(), None, None, None
    ep_size = getattr(args, "expert_model_parallel_size", 1)
    etp_size = getattr(args, "expert_tensor_parallel_size", None) or tp_size
    if ep_size > 1:
        named = {"dp_shard": mpu.get_expert_data_parallel_group(), "ep": mpu.get_expert_model_parallel_group(),
                 "tp": mpu.get_expert_tensor_parallel_group()}
        if etp_size == 1:  # the mesh of expert parallelism alone (no tp dimension)
            expt_mesh = mesh_from_groups(device.type, (world // ep_size, ep_size), ("dp_shard", "ep"), known, named)
            etp = TensorParallel.single()
        else:
            expt_mesh = mesh_from_groups(device.type, (world // (ep_size * etp_size), ep_size, etp_size),
                                         ("dp_shard", "ep", "tp"), known, named)
            etp = TensorParallel.from_group(mpu.get_expert_tensor_parallel_group())
            # the EP x expert-TP group (Megatron's expert tensor-and-model-parallel group)
            expert_model_group = mpu.get_expert_tensor_and_model_parallel_group()
        ep = GroupOfRanks.from_group(mpu.get_expert_model_parallel_group())
    return ParallelLayout(mesh, tp, cp, dp_group, grad_group, dist.get_rank(dp_group), dp_size, ep, expt_mesh,
                          etp, expert_model_group)
