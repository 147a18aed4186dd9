"""Checks at the API edge: argument types, and the same model on every data-parallel rank.

``fully_shard`` takes a handful of arguments whose wrong values used to be
silently reinterpreted (``reshard_after_forward=2`` behaved as True). Every
argument is checked here once, with an error that names it and says what is
valid.

Data-parallel ranks must hold the same parameters (names, shapes, dtypes,
``requires_grad``, no-shard marks): otherwise the flat buffers differ and the
collectives either mix unrelated values (silently) or abort the process (gloo
``EnforceNotMet``). DDP checks this at construction; ``fully_shard`` does it per
call with one all-reduce of two 64-bit integers (a fingerprint's max and
negated min), and gathers the details only when they differ. Under torch's
fake process group the all-reduce returns its input, which reads as "equal".
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import Shard

from megatron_fsdp.comm.lending import on_aliases
from megatron_fsdp.comm.objects import all_gather_objects
from megatron_fsdp.core.fsdp2_classes import is_fsdp2_instance

_FINGERPRINT_MASK = (1 << 62) - 1  # non-negative and negatable without int64 overflow


def check_bool(argument: str, value: Any, *, where: str = "fully_shard") -> bool:
    """``value`` if it is a bool; TypeError naming ``argument`` otherwise."""
    if not isinstance(value, bool):
        raise TypeError(f"{where}: {argument} must be True or False, got {value!r} ({type(value).__name__})")
    return value


def check_reshard_after_forward(value: Any, *, where: str = "fully_shard", allow_int: bool = False) -> bool | int:
    """True/False, or with ``allow_int`` a positive int (FSDP2's post-forward sub-group size).

    Whether the int divides the shard-group size is checked once the mesh is known
    (``post_forward_shard.check_post_forward_size``).
    """
    if isinstance(value, int) and not isinstance(value, bool):
        if not allow_int:
            raise NotImplementedError(
                f"{where}: reshard_after_forward={value!r}: the post-forward sub-group size (FSDP2's int form) is "
                "set once, by fully_shard(module, reshard_after_forward=N); here use True (free gathered weights "
                "after forward) or False (keep them)"
            )
        if value < 1:
            raise ValueError(
                f"{where}: reshard_after_forward={value}: an int must be a positive factor of the dp_shard size "
                "(the post-forward sub-group size); or use True or False"
            )
        return value
    return check_bool("reshard_after_forward", value, where=where)


def resolve_reshard_after_forward(value: Any, *, where: str = "fully_shard", allow_int: bool = False) -> bool | int:
    """FSDP2's default ``None`` (True for non-root units, False for the root) is True here.

    The root unit never reshards after forward whatever the flag (its weights are
    needed first in backward), so ``None`` and ``True`` behave alike on every unit.
    """
    return True if value is None else check_reshard_after_forward(value, where=where, allow_int=allow_int)


def check_ignored_params(value: Any) -> set[int]:
    """FSDP2's ``ignored_params``: a set (or other iterable) of parameters; their ids."""
    if value is None:
        return set()
    if isinstance(value, (torch.Tensor, nn.Module, str)) or not isinstance(value, Iterable):
        raise TypeError(
            f"fully_shard: ignored_params must be a set of nn.Parameter (or None), got {type(value).__name__}"
        )
    ids = set()
    for param in value:
        if not isinstance(param, nn.Parameter):
            raise TypeError(f"fully_shard: ignored_params holds a {type(param).__name__}; it takes nn.Parameter only")
        ids.add(id(param))
    return ids


def check_shard_placement(fn: Callable[[nn.Parameter], Any] | None, named_params: Iterable[tuple[str, Any]]) -> None:
    """FSDP2's ``shard_placement_fn``: only dim-0 sharding (``None`` or ``Shard(0)``) is what we build.

    Our layout gives each rank whole dim-0 rows (``RaggedShard(0)``, docs/design.md
    section 3), the equivalent of FSDP2's default ``Shard(0)``. Any other answer is
    refused, naming the parameter, rather than silently sharded on dim 0.
    """
    if fn is None:
        return
    if not callable(fn):
        raise TypeError(f"fully_shard: shard_placement_fn must be callable or None, got {type(fn).__name__}")
    for name, param in named_params:
        placement = fn(param)
        if placement is None:
            continue
        if isinstance(placement, Shard):
            if placement.dim == 0 or (param.dim() > 0 and placement.dim == -param.dim()):
                continue
            raise NotImplementedError(
                f"fully_shard: shard_placement_fn returned Shard({placement.dim}) for parameter '{name}' "
                f"(shape {tuple(param.shape)}); only dim-0 sharding is implemented (None or Shard(0)): "
                "megatron_fsdp shards whole rows of dim 0"
            )
        if type(placement).__name__ == "ShardPlacementResult":
            raise NotImplementedError(
                f"fully_shard: shard_placement_fn returned a ShardPlacementResult (a per-parameter mesh) for "
                f"parameter '{name}'; per-parameter meshes are not implemented: return None or Shard(0)"
            )
        raise TypeError(
            f"fully_shard: shard_placement_fn returned {placement!r} for parameter '{name}'; expected None or "
            "a torch.distributed.tensor.Shard"
        )


def _single_name(field: str, value: Any) -> str | None:
    if value is None or isinstance(value, str):
        return value
    names = tuple(value)
    if len(names) == 1 and isinstance(names[0], str):
        return names[0]
    raise NotImplementedError(
        f"fully_shard: dp_mesh_dims.{field}={value!r}: flattening several mesh dimensions into one "
        "data-parallel dimension is not implemented; name one dimension (or flatten the mesh first)"
    )


def resolve_dp_mesh_dims(
    dp_mesh_dims: Any, dp_shard_dim: str | None, dp_outer_dim: str | None
) -> tuple[str | None, str | None]:
    """FSDP2's ``DataParallelMeshDims(shard=, replicate=)`` as our ``(dp_shard_dim, dp_outer_dim)``."""
    if dp_mesh_dims is None:
        return dp_shard_dim, dp_outer_dim
    if not is_fsdp2_instance(dp_mesh_dims, "DataParallelMeshDims"):
        raise TypeError(
            f"fully_shard: dp_mesh_dims must be a torch.distributed.fsdp.DataParallelMeshDims, got "
            f"{type(dp_mesh_dims).__name__} (or use dp_shard_dim=/dp_outer_dim=)"
        )
    if dp_shard_dim is not None or dp_outer_dim is not None:
        raise ValueError(
            "fully_shard: pass dp_mesh_dims or dp_shard_dim/dp_outer_dim, not both (they name the same dimensions)"
        )
    shard = _single_name("shard", dp_mesh_dims.shard)
    replicate = _single_name("replicate", dp_mesh_dims.replicate)
    if shard is None:
        raise NotImplementedError(
            f"fully_shard: dp_mesh_dims with replicate={replicate!r} and no shard dimension (FSDP2's replicate-only "
            f"data parallelism): use dp_shard_dim={replicate!r} with sharding_strategy='no_shard'"
        )
    return shard, replicate


def check_optional_name(argument: str, value: Any) -> str | None:
    """A mesh dimension name (str) or None."""
    if value is not None and not isinstance(value, str):
        raise TypeError(f"fully_shard: {argument} must be a mesh dimension name (str) or None, got {value!r}")
    return value


def param_signature(fqn: str, param: torch.Tensor, replicated: bool) -> tuple:
    """What must agree across data-parallel ranks for one parameter."""
    return (fqn, tuple(param.shape), str(param.dtype), bool(param.requires_grad), bool(replicated))


def _fingerprint(signatures: Sequence[tuple]) -> int:
    digest = hashlib.blake2b(repr(list(signatures)).encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") & _FINGERPRINT_MASK


def _describe(signature: tuple | None) -> str:
    if signature is None:
        return "no such parameter"
    _, shape, dtype, requires_grad, replicated = signature
    extra = ", fsdp_no_shard" if replicated else ""
    return f"shape {shape}, {dtype}, requires_grad={requires_grad}{extra}"


def describe_difference(ranks: Sequence[int], per_rank: Sequence[Sequence[tuple]]) -> str:
    """The first parameter (in registration order) whose signature differs, with every rank's view."""
    by_name = [{sig[0]: sig for sig in sigs} for sigs in per_rank]
    order = list(dict.fromkeys(sig[0] for sigs in per_rank for sig in sigs))
    for name in order:
        views = [names.get(name) for names in by_name]
        if any(view != views[0] for view in views):
            detail = "; ".join(f"rank {rank}: {_describe(view)}" for rank, view in zip(ranks, views))
            return f"parameter '{name}' has {detail}"
    listed = "; ".join(f"rank {rank}: {[sig[0] for sig in sigs]}" for rank, sigs in zip(ranks, per_rank))
    return f"the parameters are registered in a different order ({listed})"


def check_same_across_ranks(
    module_name: str, signatures: list[tuple], groups: Sequence[dist.ProcessGroup], device: torch.device
) -> None:
    """Raise ValueError on every rank of ``groups`` if ``signatures`` differ between them.

    One all-reduce per group when they agree; on a difference, the signatures are
    gathered and the first differing parameter is named with every rank's view.
    """
    fingerprint = _fingerprint(signatures)
    for group in groups:
        if dist.get_world_size(group) == 1:
            continue
        probe = torch.tensor([fingerprint, -fingerprint], dtype=torch.int64, device=device)
        on_aliases(dist.all_reduce, probe, op=dist.ReduceOp.MAX, group=group)
        if int(probe[0]) == fingerprint and int(probe[1]) == -fingerprint:
            continue
        per_rank = all_gather_objects(signatures, group)
        ranks = dist.get_process_group_ranks(group)
        raise ValueError(
            f"fully_shard({module_name}): the model differs across data-parallel ranks {ranks}: "
            f"{describe_difference(ranks, per_rank)}. Every data-parallel rank must build the same module (same "
            "parameter names, shapes, dtypes, requires_grad and fsdp_no_shard marks) before fully_shard"
        )
