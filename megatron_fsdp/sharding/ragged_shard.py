"""``RaggedShard``: a DTensor placement for dim-0 shards of arbitrary row counts.

Stock ``Shard(0)`` assumes ``torch.chunk`` boundaries. Our flat-buffer layout
gives each rank whole rows of a parameter, but not chunk-many, so stock DTensor
code would mis-gather our shards (docs/design.md section 3).
This placement records every rank's row count and overrides the placement
hooks that DTensor's redistribution and DCP's chunk metadata go through.

It compares equal to ``Shard(dim)`` so that sharding propagation treats
element-wise work on our shards (what optimizers and norms do) as local work;
its hash differs. That keeps Python dicts apart, but not torch's C++ dispatch cache,
which confirms hits with ``==`` alone: the DTensors the library makes carry a
``RaggedSpec`` (``ragged_spec.py``) that is never equal to a plain-``Shard`` spec.

PyTorch's propagation rules give an op's output a plain ``Shard(0)``; our
parameters and gradients are ``RaggedDTensor``s (``ragged_dtensor.py``), whose
dispatch gives the placement back and re-lays out operands in other layouts.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.placement_types import Shard

from megatron_fsdp.comm.collectives import _all_gather_flat
from megatron_fsdp.comm.lending import wait_lent

# torch 2.13 renamed the functional all-gather; 2.11 only has the old name.
_funcol_all_gather = getattr(funcol, "all_gather_single", None) or funcol.all_gather_tensor


def _all_gather(tensor: torch.Tensor, dim: int, mesh: DeviceMesh, mesh_dim: int) -> torch.Tensor:
    """Every mesh rank's ``tensor`` (equal shapes) concatenated along ``dim``, in mesh order.

    Functional collectives while compiling (traceable); in eager mode the plain collective on
    lent tensors (comm/lending.py), which full state dicts and ``full_tensor()`` reach: a
    functional collective's tensors are released by gloo's worker thread, racing the exit.
    """
    if torch.compiler.is_compiling():
        gathered = _funcol_all_gather(tensor, dim, (mesh, mesh_dim))
        return gathered.wait() if isinstance(gathered, funcol.AsyncCollectiveTensor) else gathered
    group = mesh.get_group(mesh_dim)
    world = mesh.size(mesh_dim)
    tensor = tensor.contiguous()
    out = tensor.new_empty((world * tensor.size(0), *tensor.shape[1:]) if tensor.dim() else (world,))
    wait_lent(_all_gather_flat, out, tensor, group=group)
    return out if dim == 0 else torch.cat(out.chunk(world), dim=dim)


def _all_reduce(tensor: torch.Tensor, reduce_op: str, mesh: DeviceMesh, mesh_dim: int) -> torch.Tensor:
    """``tensor`` reduced over the mesh dim (``reduce_op``: a functional-collective name such as "sum")."""
    if torch.compiler.is_compiling():
        reduced = funcol.all_reduce(tensor.contiguous(), reduce_op, (mesh, mesh_dim))
        return reduced.wait() if isinstance(reduced, funcol.AsyncCollectiveTensor) else reduced
    reduced = tensor.contiguous().clone()
    op = getattr(dist.ReduceOp, reduce_op.upper())
    wait_lent(dist.all_reduce, reduced, op=op, group=mesh.get_group(mesh_dim))
    return reduced


class RaggedShard(Shard):
    """Shard on ``dim`` where mesh rank ``r`` holds ``local_sizes[r]`` consecutive slices.

    ``order`` (default: mesh order) lists the mesh ranks in the order their
    pieces follow one another along ``dim``. HSDP with an outer ``optim``
    strategy needs it: pieces are laid out ``dp_shard``-major over a mesh whose
    (process-group) order is ``dp_outer``-major (see ``outer_shard``).
    """

    def __init__(self, dim: int, local_sizes: Sequence[int], order: Sequence[int] | None = None) -> None:
        super().__init__(dim)
        # map/range rather than per-element Python: one of these per parameter, world-size long.
        sizes = tuple(map(int, local_sizes))
        order = tuple(range(len(sizes))) if order is None else tuple(map(int, order))
        if order != tuple(range(len(sizes))) and sorted(order) != list(range(len(sizes))):
            raise ValueError(f"RaggedShard order {order} is not a permutation of the {len(sizes)} mesh ranks")
        object.__setattr__(self, "local_sizes", sizes)
        object.__setattr__(self, "order", order)

    # -- identity ---------------------------------------------------------------
    def __eq__(self, other: object) -> bool:
        if isinstance(other, RaggedShard):
            return self.dim == other.dim and self.local_sizes == other.local_sizes and self.order == other.order
        return isinstance(other, Shard) and type(other) is Shard and other.dim == self.dim

    def __ne__(self, other: object) -> bool:
        return not self.__eq__(other)

    def __hash__(self) -> int:
        return hash(("RaggedShard", self.dim, self.local_sizes, self.order))

    @property
    def _in_mesh_order(self) -> bool:
        return self.order == tuple(range(len(self.local_sizes)))

    def __repr__(self) -> str:
        order = "" if self._in_mesh_order else f", order={self.order}"
        return f"RaggedShard(dim={self.dim}, local_sizes={self.local_sizes}{order})"

    __str__ = __repr__

    def __reduce__(self):
        return (RaggedShard, (self.dim, self.local_sizes, self.order))

    def __deepcopy__(self, memo):
        return RaggedShard(self.dim, self.local_sizes, self.order)

    # -- geometry ---------------------------------------------------------------
    def offset(self, rank: int) -> int:
        """First slice held by mesh rank ``rank``: the slices of the ranks before it in ``order``."""
        return sum(self.local_sizes[r] for r in self.order[: self.order.index(rank)])

    def _check(self, dim_size: int, num_chunks: int) -> None:
        if num_chunks != len(self.local_sizes) or dim_size != sum(self.local_sizes):
            raise RuntimeError(
                f"{self!r} describes {sum(self.local_sizes)} slices over "
                f"{len(self.local_sizes)} ranks, but the tensor has {dim_size} slices "
                f"on dim {self.dim} over {num_chunks} ranks"
            )

    def _local_shard_size_and_offset(self, curr_local_size, num_chunks, rank, **_):
        self._check(int(curr_local_size), num_chunks)
        return self.local_sizes[rank], self.offset(rank)

    def _narrow(self, tensor: torch.Tensor, index: int) -> torch.Tensor:
        return tensor.narrow(self.dim, self.offset(index), self.local_sizes[index])

    # -- data movement ----------------------------------------------------------
    def _to_replicate_tensor(
        self,
        local_tensor: torch.Tensor,
        mesh: DeviceMesh,
        mesh_dim: int,
        current_logical_shape: Sequence[int],
    ) -> torch.Tensor:
        num_chunks = mesh.size(mesh_dim=mesh_dim)
        self._check(int(current_logical_shape[self.dim]), num_chunks)
        if math.prod(current_logical_shape) == 0:
            # Nothing to gather (e.g. a (5, 9, 0) parameter); every rank knows the shape.
            return local_tensor.new_empty(tuple(map(int, current_logical_shape)))
        biggest = max(self.local_sizes)
        pad = biggest - local_tensor.size(self.dim)
        if pad:
            pad_shape = list(local_tensor.shape)
            pad_shape[self.dim] = pad
            local_tensor = torch.cat([local_tensor, local_tensor.new_zeros(pad_shape)], self.dim)
        gathered = _all_gather(local_tensor, self.dim, mesh, mesh_dim)
        pieces = torch.split(gathered, biggest, dim=self.dim)  # in mesh (process-group) order
        return torch.cat(
            [pieces[r].narrow(self.dim, 0, self.local_sizes[r]) for r in self.order], dim=self.dim
        )

    def _replicate_to_shard(self, local_tensor, mesh, mesh_dim, shard_index, **_):
        self._check(local_tensor.size(self.dim), mesh.size(mesh_dim=mesh_dim))
        return self._narrow(local_tensor, int(shard_index)).clone()

    def _shard_tensor(self, tensor, mesh, mesh_dim, src_data_rank=0):
        # Every rank holds ``tensor``; ``src_data_rank`` broadcasting is the
        # caller's concern for ragged layouts (our loaders pass identical data).
        coordinate = mesh.get_coordinate()
        if coordinate is None:
            return tensor.new_empty(0, requires_grad=tensor.requires_grad)
        return self._replicate_to_shard(tensor, mesh, mesh_dim, coordinate[mesh_dim])

    def _reduce_shard_tensor(self, tensor, mesh, reduce_op, mesh_dim):
        reduced = _all_reduce(tensor, reduce_op, mesh, mesh_dim)
        return self._narrow(reduced, mesh.get_local_rank(mesh_dim)).clone()

    def _split_tensor(self, tensor, num_chunks, *, with_padding=True, contiguous=True):
        raise NotImplementedError(
            f"{self!r}: padded torch.chunk splitting does not apply to ragged shards; "
            "redistribute to Replicate() first"
        )

    def _to_new_shard_dim(self, *args, **kwargs):
        raise NotImplementedError(
            f"{self!r}: moving a ragged shard to another tensor dim is not supported; "
            "redistribute to Replicate() first"
        )


def shard_sizes(tensor: DTensor, mesh_dim: int) -> list[int]:
    """Every mesh rank's local size along the dim ``tensor`` is sharded on at ``mesh_dim`` (a collective)."""
    placement = tensor.placements[mesh_dim]
    local = torch.tensor([tensor.to_local().size(placement.dim)], device=tensor.device)
    return _all_gather(local, 0, tensor.device_mesh, mesh_dim).tolist()


def _chunked_size(tensor: DTensor, mesh_dim: int, rank: int) -> int:
    """The local size along ``tensor.placements[mesh_dim].dim`` of the rank at ``rank`` on ``mesh_dim``
    (this rank's coordinate elsewhere), when every shard is cut as DTensor cuts it: in mesh-dim order,
    ``torch.chunk`` for ``Shard``, the recorded sizes for ``RaggedShard`` (nested shardings of one dim, 2-D TP)."""
    coordinate = list(tensor.device_mesh.get_coordinate())
    coordinate[mesh_dim] = rank
    dim = tensor.placements[mesh_dim].dim
    size = tensor.size(dim)
    for md, placement in enumerate(tensor.placements):
        if not isinstance(placement, Shard) or placement.dim != dim:
            continue
        if isinstance(placement, RaggedShard):
            size = placement.local_sizes[coordinate[md]]
            continue
        n = tensor.device_mesh.size(md)
        chunk = -(-size // n)
        size = max(0, min(size, chunk * (coordinate[md] + 1)) - chunk * coordinate[md])
    return size


def full_tensor(tensor: torch.Tensor) -> torch.Tensor:
    """The whole tensor behind ``tensor`` (a DTensor or a plain tensor).

    Unlike ``DTensor.full_tensor()`` this refuses a ``Shard`` DTensor whose local
    shard sizes disagree with ``torch.chunk`` (one derived from a ragged shard
    by an out-of-place op) instead of returning silently wrong data.
    """
    if not isinstance(tensor, DTensor):
        return tensor
    mesh = tensor.device_mesh
    for mesh_dim, placement in enumerate(tensor.placements):
        if type(placement) is Shard:
            sizes = shard_sizes(tensor, mesh_dim)
            expected = [_chunked_size(tensor, mesh_dim, r) for r in range(mesh.size(mesh_dim))]
            if sizes != expected:
                raise RuntimeError(
                    f"DTensor with placement {placement} has local sizes {sizes} "
                    f"on mesh dim {mesh_dim}, not torch.chunk's {expected}: it was derived "
                    "from a RaggedShard parameter by an out-of-place op; gather the "
                    "parameter (or its gradient / optimizer state) instead"
                )
    return tensor.full_tensor()



def without_storage_offset(local: torch.Tensor) -> torch.Tensor:
    """``local`` (a view into a flat buffer) as a tensor over the same memory at storage offset 0.

    torch gives a DTensor the storage offset of its local tensor (pytorch#167597, "never
    rank dependent"), but our shard views sit at offsets that differ by rank and parameter.
    The wrapper, which has no storage, then reports a non-null ``data_ptr``, and
    ``copy.deepcopy``, ``torch.save`` and pickling of the DTensor (``state_dict()`` entries,
    ``.grad``) fail with "invalid python storage". A slice of the untyped storage aliases
    the same bytes (writes either way are seen) and keeps the flat buffer alive.
    """
    if local.storage_offset() == 0:
        return local
    if local.numel() == 0:
        return local.new_empty(local.shape)
    start = local.storage_offset() * local.element_size()
    extent = (sum((n - 1) * s for n, s in zip(local.shape, local.stride())) + 1) * local.element_size()
    storage = local.untyped_storage()[start : start + extent]
    return local.new_empty(0).set_(storage, 0, local.shape, local.stride())
