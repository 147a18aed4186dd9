"""``Placements``: Megatron-LM main's placement-based description of a sharding, and its validation.

Megatron-LM's ``megatron_fsdp.experimental`` (its "Megatron-FSDP v2") describes how a module is
sharded not by a strategy name but by three DTensor placements per data-parallel mesh axis: where
the compute weights live (``parameter``), where a backward leaves the gradients (``gradient``) and
where the optimizer's main weights and state live (``optimizer``). The placements are torch's own
``Replicate()``, ``Shard(0)`` and ``Partial("avg")``.

This module checks a ``Placements`` against the rules of that API (the error types are that API's:
``ValueError`` for malformed input, ``TypeError`` for a placement of another kind,
``NotImplementedError`` for a well-formed request that is not supported) and maps each accepted
combination onto one engine configuration of this library: a ``sharding_strategy`` for the
innermost (last) mesh axis and, on a 2-D mesh, an ``outer_sharding_strategy`` for the outer one
(docs/api.md, "The placements API").
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

from torch.distributed import DeviceMesh
from torch.distributed.tensor import Partial, Replicate, Shard
from torch.distributed.tensor.placement_types import Placement

__all__ = [
    "PRESETS",
    "EngineMapping",
    "MeshAxis",
    "Partial",
    "Placements",
    "Replicate",
    "Shard",
    "hfsdp",
    "hsdp",
    "map_placements",
    "no_shard",
    "validate_dp_axes",
    "zero1",
    "zero2",
    "zero3",
]

MeshAxis = int | str


@dataclasses.dataclass(frozen=True)
class Placements:
    """Per-data-parallel-axis placements of the compute weights, the gradients and the optimizer state.

    ``dp_axes`` names (or indexes) the mesh axes that form the data-parallel mesh, in mesh order;
    each of ``parameter``, ``gradient`` and ``optimizer`` holds one placement per axis, in the same
    order. Use torch's ``Shard(0)`` to shard, ``Replicate()`` to replicate and ``Partial("avg")``
    for a gradient that is still to be averaged over that axis.

    Raises:
        ValueError: a placement list whose length differs from ``len(dp_axes)``.
    """

    dp_axes: Sequence[MeshAxis]
    parameter: Sequence[Placement]
    gradient: Sequence[Placement]
    optimizer: Sequence[Placement]

    def __post_init__(self) -> None:
        """Check that every placement list has one entry per data-parallel axis."""
        count = len(self.dp_axes)
        for name, placements in (("parameter", self.parameter), ("gradient", self.gradient),
                                 ("optimizer", self.optimizer)):
            if len(placements) != count:
                raise ValueError(f"Expected {count} {name} placements, got {len(placements)}.")


def no_shard(axis: MeshAxis = 0) -> Placements:
    """DDP on a 1-D mesh: replicated weights, averaged gradients, replicated optimizer state."""
    return Placements([axis], [Replicate()], [Partial("avg")], [Replicate()])


def zero1(axis: MeshAxis = 0) -> Placements:
    """ZeRO-1 on a 1-D mesh: replicated weights and gradients, sharded optimizer state."""
    return Placements([axis], [Replicate()], [Partial("avg")], [Shard(0)])


def zero2(axis: MeshAxis = 0) -> Placements:
    """ZeRO-2 on a 1-D mesh: replicated weights, sharded gradients and optimizer state."""
    return Placements([axis], [Replicate()], [Shard(0)], [Shard(0)])


def zero3(axis: MeshAxis = 0) -> Placements:
    """ZeRO-3 (FSDP) on a 1-D mesh: weights, gradients and optimizer state sharded."""
    return Placements([axis], [Shard(0)], [Shard(0)], [Shard(0)])


def hsdp(outer: MeshAxis = 0, inner: MeshAxis = 1) -> Placements:
    """HSDP on a 2-D ``(outer, inner)`` mesh: ZeRO-3 within ``inner``, replicas across ``outer``."""
    return Placements([outer, inner], [Replicate(), Shard(0)], [Partial("avg"), Shard(0)],
                      [Replicate(), Shard(0)])


def hfsdp(outer: MeshAxis = 0, inner: MeshAxis = 1) -> Placements:
    """"HFSDP": HSDP whose optimizer state (and main weights) are also sharded across ``outer``."""
    return Placements([outer, inner], [Replicate(), Shard(0)], [Partial("avg"), Shard(0)],
                      [Shard(0), Shard(0)])


PRESETS = {"no_shard": no_shard, "zero1": zero1, "zero2": zero2, "zero3": zero3, "hsdp": hsdp, "hfsdp": hfsdp}

# One axis's (parameter, gradient, optimizer) kinds: R(eplicate), P(artial), S(hard).
_INNER = {"RPR": "no_shard", "RPS": "optim", "RSS": "optim_grads", "SSS": "optim_grads_params"}
_OUTER = {"RPR": "no_shard", "RPS": "optim"}
_PRESET_TEXT = (
    "the supported placements are, per (parameter, gradient, optimizer): 1-D no_shard (R, P, R), "
    "zero1 (R, P, S), zero2 (R, S, S), zero3 (S, S, S); 2-D hsdp (R,S | P,S | R,S) and "
    "hfsdp (R,S | P,S | S,S), or on a 2-D mesh any inner (last) axis of the 1-D list with an outer "
    "axis (R, P, R) or, where the inner gradient is sharded, (R, P, S); R = Replicate(), "
    "P = Partial('avg'), S = Shard(0) (megatron_fsdp.experimental.PRESETS)"
)


@dataclasses.dataclass(frozen=True)
class EngineMapping:
    """The engine configuration a ``Placements`` maps to."""

    sharding_strategy: str
    outer_sharding_strategy: str  # "no_shard" on a 1-D mesh


def _axis_index(mesh: DeviceMesh, axis: MeshAxis) -> int:
    if isinstance(axis, bool) or not isinstance(axis, (int, str)):
        raise TypeError(f"A mesh axis is an int or a dim name, got {axis!r}.")
    if isinstance(axis, int):
        index = axis + mesh.ndim if axis < 0 else axis
        if not 0 <= index < mesh.ndim:
            raise ValueError(f"Mesh axis {axis} is out of bounds for mesh ndim {mesh.ndim}.")
        return index
    names = mesh.mesh_dim_names
    if names is None or axis not in names:
        raise ValueError(f"Mesh axis {axis!r} is not present in mesh dim names {names}.")
    return names.index(axis)


def validate_dp_axes(mesh: DeviceMesh, dp_axes: Sequence[MeshAxis]) -> None:
    """Check ``dp_axes`` against ``mesh``: distinct, in mesh order, and every axis of the mesh.

    Raises:
        ValueError: an axis not in the mesh, a repeated axis, or axes out of mesh order.
        NotImplementedError: ``dp_axes`` that are not all of the mesh's axes (a mesh with other,
            non-data-parallel axes: pass its data-parallel sub-mesh instead).
    """
    indices = tuple(_axis_index(mesh, axis) for axis in dp_axes)
    if len(set(indices)) != len(indices):
        raise ValueError(f"Data-parallel axes must be distinct, got {dp_axes!r}.")
    if indices != tuple(sorted(indices)):
        raise ValueError(f"Data-parallel axes must be in mesh-axis order, got {dp_axes!r}.")
    if indices != tuple(range(mesh.ndim)):
        raise NotImplementedError("MFSDP currently requires dp_axes to match every mesh axis in mesh order.")


def _kind(role: str, placement: Placement) -> str:
    if type(placement) is Replicate:
        return "R"
    if type(placement) is Shard:
        if placement.dim != 0:
            raise NotImplementedError(f"MFSDP currently supports only dim-0 Shard placements, got {placement!r}.")
        return "S"
    if type(placement) is Partial:
        if placement.reduce_op != "avg":
            raise NotImplementedError(
                f"{role} placement {placement!r}: only Partial('avg') gradients are supported; {_PRESET_TEXT}."
            )
        return "P"
    raise TypeError(f"Unsupported {role} placement: {placement!r} (expected Replicate(), Shard(0) or Partial('avg')).")


def map_placements(placements: Placements, mesh: DeviceMesh) -> EngineMapping:
    """Validate ``placements`` on ``mesh`` and return the engine configuration they describe.

    Raises:
        TypeError: ``placements`` not a ``Placements``, or a placement of another kind.
        ValueError: axes as in ``validate_dp_axes``; a ``Shard`` placement before a non-``Shard``
            one in a role (shards must be the innermost axes, so each rank's piece is one range).
        NotImplementedError: ``Shard(d)`` with ``d != 0``, a ``Partial`` other than ``"avg"``, a
            mesh of more than 2 data-parallel axes, or a combination this engine does not run; the
            message names the supported ones.
    """
    if not isinstance(placements, Placements):
        raise TypeError(f"placements must be a megatron_fsdp.experimental.Placements, got {type(placements).__name__}")
    validate_dp_axes(mesh, placements.dp_axes)
    roles = (("parameter", placements.parameter), ("gradient", placements.gradient),
             ("optimizer", placements.optimizer))
    kinds = {role: [_kind(role, p) for p in values] for role, values in roles}
    for role, row in kinds.items():
        if "S" in row and any(k != "S" for k in row[row.index("S"):]):
            raise ValueError(
                f"Shard placements must be a suffix of the {role} placement list so each local buffer is a "
                f"contiguous global-buffer range, got {list(getattr(placements, role))!r}."
            )
    if mesh.ndim > 2:
        raise NotImplementedError(f"a {mesh.ndim}-axis data-parallel mesh is not supported; {_PRESET_TEXT}.")
    per_axis = ["".join(kinds[role][axis] for role, _ in roles) for axis in range(mesh.ndim)]
    inner = _INNER.get(per_axis[-1])
    outer = "no_shard" if mesh.ndim == 1 else _OUTER.get(per_axis[0])
    if inner is None or outer is None:
        raise NotImplementedError(f"placements {_describe(placements)} are not supported; {_PRESET_TEXT}.")
    if outer == "optim" and inner in ("no_shard", "optim"):
        raise NotImplementedError(
            f"placements {_describe(placements)}: an outer optimizer Shard(0) needs the inner gradient "
            f"sharded (zero2 or zero3 inside); {_PRESET_TEXT}."
        )
    return EngineMapping(inner, outer)


def _describe(placements: Placements) -> str:
    return (f"(parameter={list(placements.parameter)!r}, gradient={list(placements.gradient)!r}, "
            f"optimizer={list(placements.optimizer)!r})")
