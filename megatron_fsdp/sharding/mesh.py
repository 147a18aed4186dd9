"""Data-parallel meshes: which mesh dimension shards and which replicates (HSDP).

Users pass either a 1-D mesh (shard over it), a 2-D mesh ``(dp_outer,
dp_shard)``, or a larger named mesh plus the names of the dimensions to use
(``dp_shard_dim="dp_shard_cp"``, ``dp_outer_dim="dp_outer"``), so a mesh that
also has ``tp``/``cp`` dimensions can be passed as it is. Everything is
translated here into a ``DataParallelMesh``: a 1-D ``(shard,)`` or 2-D
``(outer, shard)`` mesh that the engine's DTensors are placed on.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

from megatron_fsdp.sharding.strategy import OUTER_STRATEGY_NAMES

OUTER_STRATEGIES = OUTER_STRATEGY_NAMES


@dataclass(frozen=True)
class DataParallelMesh:
    """The data-parallel part of a mesh: ``mesh`` is ``(shard,)`` or ``(outer, shard)``.

    ``outer_optim``: main weights and optimizer state are sharded across the
    outer dimension too (``outer_sharding_strategy="optim"``); otherwise the
    outer dimension replicates.
    """

    mesh: DeviceMesh
    outer_optim: bool = False

    @property
    def has_outer(self) -> bool:
        return self.mesh.ndim == 2

    @property
    def shard_group(self) -> dist.ProcessGroup:
        return self.mesh.get_group(self.mesh.ndim - 1)

    @property
    def shard_size(self) -> int:
        return self.mesh.size(self.mesh.ndim - 1)

    @property
    def shard_rank(self) -> int:
        return self.mesh.get_local_rank(self.mesh.ndim - 1)

    @property
    def outer_group(self) -> dist.ProcessGroup | None:
        return self.mesh.get_group(0) if self.has_outer else None

    @property
    def outer_size(self) -> int:
        return self.mesh.size(0) if self.has_outer else 1

    @property
    def size(self) -> int:
        """All data-parallel ranks (gradients are averaged over this many)."""
        return self.shard_size * self.outer_size


def _names(mesh: DeviceMesh) -> tuple[str, ...]:
    return tuple(mesh.mesh_dim_names or ())


def resolve_mesh(
    mesh: DeviceMesh, dp_shard_dim: str | None = None, dp_outer_dim: str | None = None
) -> DataParallelMesh:
    """Pick the data-parallel dimensions of ``mesh`` (see module docstring)."""
    if not isinstance(mesh, DeviceMesh):
        raise TypeError(f"mesh must be a torch.distributed DeviceMesh, got {type(mesh).__name__}")
    check_rank_in_mesh(mesh)
    names = _names(mesh)
    if dp_shard_dim is None and dp_outer_dim is None:
        if mesh.ndim in (1, 2):
            return DataParallelMesh(mesh)
        raise ValueError(
            f"mesh has {mesh.ndim} dimensions {names or ''}; name the data-parallel ones with "
            "dp_shard_dim=... (and dp_outer_dim=... for HSDP), or pass a 1-D or 2-D (dp_outer, dp_shard) mesh"
        )
    if dp_shard_dim is None:
        raise ValueError(f"dp_outer_dim={dp_outer_dim!r} needs dp_shard_dim too (the dimension that shards)")
    for argument, name in (("dp_shard_dim", dp_shard_dim), ("dp_outer_dim", dp_outer_dim)):
        if name is not None and name not in names and not _is_flattened(mesh, name):
            raise ValueError(
                f"{argument}={name!r} is not a dimension of the mesh; its dimensions are {names or '(unnamed)'}"
            )
    if dp_outer_dim is None:
        return DataParallelMesh(mesh[dp_shard_dim])
    if dp_outer_dim == dp_shard_dim:
        raise ValueError(f"dp_outer_dim and dp_shard_dim are both {dp_shard_dim!r}; they must differ")
    if dp_outer_dim in names and dp_shard_dim in names and names.index(dp_outer_dim) > names.index(dp_shard_dim):
        raise ValueError(
            f"dp_outer_dim={dp_outer_dim!r} must come before dp_shard_dim={dp_shard_dim!r} in the mesh "
            f"(mesh dimensions: {names})"
        )
    return DataParallelMesh(mesh[(dp_outer_dim, dp_shard_dim)])


def mesh_ranks(mesh: DeviceMesh) -> list[int]:
    """The global ranks of ``mesh``, row-major."""
    return [int(r) for r in mesh.mesh.flatten().tolist()]


def check_rank_in_mesh(mesh: DeviceMesh, argument: str = "mesh") -> None:
    """ValueError naming the mesh and this rank if this rank is not one of its ranks.

    (Without it, DeviceMesh.get_group fails later with a bare IndexError.)
    """
    if mesh.get_coordinate() is None:
        names = f" with dimensions {_names(mesh)}" if _names(mesh) else ""
        raise ValueError(
            f"{argument}: this rank ({dist.get_rank()}) is not in the {mesh.device_type} DeviceMesh of shape "
            f"{tuple(mesh.shape)}{names} over ranks {mesh_ranks(mesh)}; every rank that calls fully_shard must be "
            "part of the mesh it passes (build the mesh over all data-parallel ranks, e.g. init_device_mesh)"
        )


def _is_flattened(mesh: DeviceMesh, name: str) -> bool:
    """A dimension made with ``mesh[...]._flatten(name)`` (e.g. ``dp_shard_cp``)."""
    try:
        mesh[name]
    except (KeyError, RuntimeError, ValueError):
        return False
    return True


def resolve_outer_strategy(outer_sharding_strategy: str, dp_mesh: DataParallelMesh) -> str:
    if outer_sharding_strategy not in OUTER_STRATEGIES:
        raise ValueError(
            f"outer_sharding_strategy={outer_sharding_strategy!r} is not valid; use one of {OUTER_STRATEGIES}"
        )
    if outer_sharding_strategy != "no_shard" and not dp_mesh.has_outer:
        raise ValueError(
            f"outer_sharding_strategy={outer_sharding_strategy!r} needs an outer data-parallel dimension: "
            "pass a 2-D (dp_outer, dp_shard) mesh or dp_outer_dim=..."
        )
    return outer_sharding_strategy
