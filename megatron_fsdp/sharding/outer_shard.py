"""HSDP with ``outer_sharding_strategy="optim"``: ZeRO-2/3 inside ``dp_shard``, ZeRO-1 across ``dp_outer``.

Main weights, gradients and optimizer state are split across all
``dp_outer x dp_shard`` ranks; model (compute) weights stay sharded only
within ``dp_shard``.

Note: the invariant this file shares with ``param_group`` (storage and
collectives), ``layout`` (row-aligned equal pieces) and ``ragged_shard``
(the ``order`` of a ``RaggedShard``). With ``O = dp_outer`` and
``S = dp_shard`` sizes, a group's flat buffer is laid out for ``S * O``
equal, row-aligned pieces of ``n`` elements, ordered ``dp_shard``-major:
piece ``p = j * O + o`` is the main shard of the rank at ``(outer o, shard j)``.
Hence

- ``dp_shard`` rank ``j``'s compute shard, elements ``[j*O*n, (j+1)*O*n)``,
  is contiguous: the pieces of ``(0, j) ... (O-1, j)``, rebuilt by one
  all-gather across ``dp_outer`` (once per optimizer step);
- the all-gather of the compute shards within ``dp_shard`` yields the whole
  buffer, exactly as without outer sharding;
- gradients: the reduce-scatter within ``dp_shard`` leaves the compute-shard
  sized sum, and a reduce-scatter across ``dp_outer`` leaves piece ``p``.

Process groups always order their ranks by global rank, so the group ranks
along ``dp_outer`` and ``dp_shard`` must equal the mesh coordinates (true for
every mesh ``init_device_mesh`` builds, checked here). The optimizer sees
DTensors over a 1-D mesh of all data-parallel ranks in ascending rank order,
placed ``RaggedShard(0, rows per mesh rank, order=mesh ranks in piece order)``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

from megatron_fsdp.comm.collectives import DEFAULT_COMM, OUTER_STREAM, CommConfig, Pending, all_gather
from megatron_fsdp.comm.objects import all_gather_objects
from megatron_fsdp.sharding.mesh import DataParallelMesh

_FLAT_DIM = "_megatron_fsdp_dp"
# (device type, ranks) -> 1-D mesh; built collectively once, then shared by every group.
_FLAT_MESHES: dict[tuple[str, tuple[int, ...]], DeviceMesh] = {}


@dataclass(frozen=True)
class OuterShardGeometry:
    """Where this rank's main piece sits, and the mesh the sharded parameters live on."""

    piece: int  # this rank's piece index p = shard_rank * outer_size + outer_rank
    pieces: int  # dp_shard x dp_outer
    outer_size: int
    flat_mesh: DeviceMesh  # every data-parallel rank, ascending
    order: tuple[int, ...]  # order[p]: the flat-mesh rank holding piece p

    def sizes_by_mesh_rank(self, rows_per_piece: tuple[int, ...]) -> tuple[int, ...]:
        """Per flat-mesh rank, the rows of a parameter it holds (``rows_per_piece`` is in piece order)."""
        sizes = [0] * self.pieces
        for piece, mesh_rank in enumerate(self.order):
            sizes[mesh_rank] = rows_per_piece[piece]
        return tuple(sizes)


def outer_shard_geometry(dp: DataParallelMesh) -> OuterShardGeometry:
    """The piece layout for ``dp`` (collective on the first call for a mesh: builds the flat mesh)."""
    grid = dp.mesh.mesh.tolist()  # [outer][shard] -> global rank
    outer, shard = len(grid), len(grid[0])
    increasing = all(row == sorted(row) for row in grid) and all(
        [grid[o][j] for o in range(outer)] == sorted(grid[o][j] for o in range(outer)) for j in range(shard)
    )
    if not increasing:
        raise ValueError(
            f"outer_sharding_strategy='optim' needs a mesh whose ranks increase along dp_outer and dp_shard "
            f"(as init_device_mesh builds them); got the (dp_outer, dp_shard) ranks {grid}"
        )
    ranks = sorted(r for row in grid for r in row)
    position = {r: i for i, r in enumerate(ranks)}
    order = tuple(position[grid[o][j]] for j in range(shard) for o in range(outer))
    o, j = dp.mesh.get_coordinate()
    assert dist.get_rank(dp.outer_group) == o and dist.get_rank(dp.shard_group) == j, "group rank != mesh coordinate"
    return OuterShardGeometry(j * outer + o, outer * shard, outer, _flat_mesh(dp.mesh.device_type, tuple(ranks)), order)


def _flat_mesh(device_type: str, ranks: tuple[int, ...]) -> DeviceMesh:
    """A 1-D mesh over ``ranks`` (ascending), built collectively over the default group.

    When the data-parallel ranks are only part of the world (other mesh
    dimensions such as ``tp``), every rank must create every group, so the
    rank lists are exchanged and one 2-D mesh of all of them is built.
    """
    key = (device_type, ranks)
    if key not in _FLAT_MESHES:
        world = dist.get_world_size()
        if len(ranks) == world:
            _FLAT_MESHES[key] = DeviceMesh(device_type, list(ranks), mesh_dim_names=(_FLAT_DIM,))
        else:
            everyone: list[tuple[int, ...]] = all_gather_objects(ranks)
            rows = sorted(set(everyone))
            if any(len(row) != len(ranks) for row in rows):
                raise ValueError(f"data-parallel groups of different sizes across the world: {rows}")
            grid = DeviceMesh(device_type, torch.tensor(rows), mesh_dim_names=("_megatron_fsdp_dp_rep", _FLAT_DIM))
            _FLAT_MESHES[key] = grid[_FLAT_DIM]
    return _FLAT_MESHES[key]


def gather_compute_shard(
    compute_shard: torch.Tensor, main_piece: torch.Tensor, dp: DataParallelMesh, *, comm: CommConfig = DEFAULT_COMM
) -> Pending:
    """Start rebuilding this ``dp_shard`` rank's compute shard from the main pieces of its ``dp_outer`` peers.

    Returns the all-gather in flight (on CUDA on the ``outer`` side stream): wait for it, or
    order the inner all-gather after it with ``all_gather(..., after=)``.
    """
    source = main_piece if main_piece.dtype == compute_shard.dtype else main_piece.to(compute_shard.dtype)
    return all_gather(compute_shard, source, dp.outer_group, kind="all_gather_outer", comm=comm, stream=OUTER_STREAM)
