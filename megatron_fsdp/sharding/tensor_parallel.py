"""Torch-native tensor parallelism under ``fully_shard``: the 2-D (TP, DP) sharded parameter.

A module parallelized with ``torch.distributed.tensor.parallel.parallelize_module``
holds DTensor parameters over a 1-D TP mesh. ``fully_shard`` lays out each such
parameter's TP-local tensor in its flat buffer and shards that over data
parallelism as usual; this module keeps what is needed to hand the module a
DTensor over the TP mesh again (``TensorParallelSpec``) and builds the mesh the
sharded parameter lives on.

The sharded parameter is a DTensor over a ``(tp, dp)`` mesh (in this order, built
from the existing process groups with ``DeviceMesh.from_group``) placed
``(<TP placement>, RaggedShard(0, ...))``: DTensor applies shardings in mesh-dim
order, and ours nests in that order: TP splits the global tensor first, data
parallelism then splits each TP-local tensor's rows. So ``ColwiseParallel``'s
``Shard(0)`` and our dim-0 ``RaggedShard`` compose without FSDP2's
``_StridedShard``; ``full_tensor()``, DCP chunk offsets and redistribution follow
from DTensor's own left-to-right rules (``compute_local_shape_and_global_offset``).

Limits, each refused with a message: TP meshes of more than one dimension,
placements other than ``Shard``/``Replicate`` (``Partial``, ``_StridedShard``), TP
shards of unequal size, HSDP (an outer data-parallel dimension) beside TP, and a
data-parallel mesh that shares ranks with the TP mesh.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset
from torch.distributed.tensor.placement_types import Placement

from megatron_fsdp.comm.objects import all_gather_objects
from megatron_fsdp.sharding.mesh import DataParallelMesh, mesh_ranks

TP_DIM_NAME = "tp"  # the sharded mesh's dimension names, unless the given meshes name theirs
DP_DIM_NAME = "dp"

# (device type, TP ranks, DP ranks) -> the (tp, dp) mesh: every unit of a model shares one object.
_SHARDED_MESHES: dict[tuple[str, tuple[int, ...], tuple[int, ...]], DeviceMesh] = {}


@dataclass(frozen=True)
class TensorParallelSpec:
    """How a parameter was tensor-parallel before ``fully_shard``: its TP mesh, placements and global geometry."""

    mesh: DeviceMesh
    placements: tuple[Placement, ...]
    shape: torch.Size  # the global (whole-model) shape
    stride: tuple[int, ...]  # the global stride
    local_shape: tuple[int, ...]  # this TP rank's piece: what the flat buffer holds

    def as_dtensor(self, local: torch.Tensor) -> DTensor:
        """``local`` (this TP rank's piece, e.g. a view of the gathered buffer) as the module's TP DTensor."""
        return DTensor.from_local(
            local, self.mesh, self.placements, run_check=False, shape=self.shape, stride=self.stride
        )

    def local_of(self, full: torch.Tensor) -> torch.Tensor:
        """This TP rank's piece of ``full`` (a tensor of the global shape), a view."""
        local_shape, offset = compute_local_shape_and_global_offset(self.shape, self.mesh, self.placements)
        for dim, (size, start) in enumerate(zip(local_shape, offset)):
            if size != full.size(dim):
                full = full.narrow(dim, start, size)
        return full

    def local_grad(self, grad: torch.Tensor) -> torch.Tensor:
        """The local tensor of a gradient that arrived as a DTensor, in the parameter's TP placement.

        A replicated weight (a norm under ``SequenceParallel``) gets a ``Partial`` gradient
        from sharded activations; it is summed over TP first, as FSDP2 does.
        """
        if not isinstance(grad, DTensor):
            return grad
        if tuple(grad.placements) != self.placements or grad.device_mesh != self.mesh:
            grad = grad.redistribute(self.mesh, self.placements)
        return grad.to_local()


def tensor_parallel_spec(fqn: str, param: torch.Tensor) -> TensorParallelSpec | None:
    """The TP spec of a DTensor parameter (``None`` for a plain one); refuses what the engine cannot hold."""
    if not isinstance(param, DTensor):
        return None
    mesh, placements = param.device_mesh, tuple(param.placements)
    where = f"fully_shard: parameter '{fqn}' is a DTensor on mesh {mesh} with placements {placements}"
    if getattr(param, "_megatron_fsdp_sharded", False):
        raise ValueError(f"{where}: it is already sharded by fully_shard")
    if mesh.ndim != 1:
        raise NotImplementedError(
            f"{where}: only tensor parallelism over a 1-D mesh (parallelize_module(module, mesh['tp'], plan)) "
            "composes with fully_shard"
        )
    for placement in placements:
        if type(placement) not in (Shard, Replicate):
            raise NotImplementedError(
                f"{where}: only Shard and Replicate tensor-parallel placements compose with fully_shard, "
                f"not {placement!r}"
            )
        if type(placement) is Shard and param.shape[placement.dim] % mesh.size() != 0:
            raise NotImplementedError(
                f"{where}: dim {placement.dim} of size {param.shape[placement.dim]} does not split evenly over "
                f"{mesh.size()} tensor-parallel ranks; fully_shard needs equal TP shards (pick sizes divisible "
                "by the TP size)"
            )
    return TensorParallelSpec(
        mesh, placements, param.shape, tuple(param.stride()), tuple(param.to_local().shape)
    )


def check_dp_mesh_for_tp(fqn: str, spec: TensorParallelSpec, dp: DataParallelMesh) -> None:
    """The data-parallel mesh must be the other dimension of a (dp, tp) mesh: no shared ranks, no HSDP."""
    tp_ranks, dp_ranks = set(mesh_ranks(spec.mesh)), set(mesh_ranks(dp.mesh))
    if len(tp_ranks & dp_ranks) > 1 or dp.has_outer:
        names = tuple(dp.mesh.mesh_dim_names or ())
        if len(tp_ranks & dp_ranks) > 1:
            raise ValueError(
                f"fully_shard: parameter '{fqn}' is tensor-parallel over ranks {sorted(tp_ranks)}, and the mesh "
                f"given to fully_shard (dimensions {names or 'unnamed'}, ranks {mesh_ranks(dp.mesh)}) shares "
                "ranks with it; pass only the data-parallel dimension: fully_shard(module, mesh=mesh['dp']) "
                "after parallelize_module(module, mesh['tp'], plan)"
            )
        raise NotImplementedError(
            f"fully_shard: parameter '{fqn}' is tensor-parallel; HSDP (a 2-D data-parallel mesh {names}) "
            "beside torch-native tensor parallelism is not supported: pass a 1-D data-parallel mesh (mesh['dp'])"
        )
    if spec.mesh.device_type != dp.mesh.device_type:
        raise ValueError(
            f"fully_shard: parameter '{fqn}' is tensor-parallel on a {spec.mesh.device_type} mesh, the "
            f"data-parallel mesh is {dp.mesh.device_type}; build both from one init_device_mesh"
        )


def sharded_mesh(spec: TensorParallelSpec, dp: DataParallelMesh) -> DeviceMesh:
    """The ``(tp, dp)`` mesh of the sharded parameter, from the existing TP and data-parallel groups.

    The first call for a pair of meshes exchanges the data-parallel ranks over the TP
    group (one small collective, at ``fully_shard`` time, in the same order on every rank).
    """
    device_type = dp.mesh.device_type
    tp_ranks, dp_ranks = tuple(mesh_ranks(spec.mesh)), tuple(mesh_ranks(dp.mesh))
    key = (device_type, tp_ranks, dp_ranks)
    tp_group, dp_group = spec.mesh.get_group(0), dp.shard_group
    cached = _SHARDED_MESHES.get(key)
    if cached is not None and getattr(cached, "_dim_group_names", None) != [tp_group.group_name, dp_group.group_name]:
        # the groups of an earlier layout over the same ranks (a process that lays out its groups again, e.g.
        # megatron-core's parallel_state destroyed and initialized anew): the mesh is made over this one's
        del _SHARDED_MESHES[key]
    if key not in _SHARDED_MESHES:
        grid = all_gather_objects(list(dp_ranks), tp_group)
        column = [row[dp_ranks.index(dist.get_rank())] for row in grid]
        if column != list(tp_ranks):
            raise ValueError(
                f"fully_shard: the tensor-parallel ranks {list(tp_ranks)} and the data-parallel ranks per TP "
                f"rank {grid} do not form a grid; build both meshes from one init_device_mesh((dp, tp))"
            )
        names = ((spec.mesh.mesh_dim_names or (TP_DIM_NAME,))[0], (dp.mesh.mesh_dim_names or (DP_DIM_NAME,))[0])
        if names[0] == names[1]:
            names = (TP_DIM_NAME, DP_DIM_NAME)
        _SHARDED_MESHES[key] = DeviceMesh.from_group(
            [tp_group, dp_group], device_type, mesh=torch.tensor(grid, dtype=torch.int), mesh_dim_names=names
        )
    return _SHARDED_MESHES[key]
