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
from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist

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
        dist.all_reduce(probe, op=dist.ReduceOp.MAX, group=group)
        if int(probe[0]) == fingerprint and int(probe[1]) == -fingerprint:
            continue
        per_rank: list[Any] = [None] * dist.get_world_size(group)
        dist.all_gather_object(per_rank, signatures, group=group)
        ranks = dist.get_process_group_ranks(group)
        raise ValueError(
            f"fully_shard({module_name}): the model differs across data-parallel ranks {ranks}: "
            f"{describe_difference(ranks, per_rank)}. Every data-parallel rank must build the same module (same "
            "parameter names, shapes, dtypes, requires_grad and fsdp_no_shard marks) before fully_shard"
        )
