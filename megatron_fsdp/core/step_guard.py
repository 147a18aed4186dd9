"""An optimizer step never runs while gradients it needs are still unreduced.

Gradient accumulation defers reductions: ``microbatch(..., is_last=False)``
for full-size gradients (``no_shard``, ``optim``), ``no_sync()`` and
``set_requires_gradient_sync(False)`` for every strategy. The accumulated
gradients then sit in a unit's flat gradient buffer, and the sharded
parameters' ``.grad`` lack them. A plain ``torch.optim`` optimizer stepped
then would update nothing (or use a partial gradient) without a word.

The engine never sees a plain optimizer (it is built after ``fully_shard``
from ``model.parameters()``), so the check is torch's global step pre-hook,
registered once at the first ``fully_shard``. Per step it reads one flag per
group of every live unit; only when one has pending gradients does it look
for that unit's parameters in the optimizer, and raise naming the module.
The same hook releases gathered weights a unit kept past the end of its
backward (they would be stale after the step), so the next forward re-gathers.
``fully_shard_optimizer`` reduces pending gradients itself before stepping
(``sync_grad_before_optimizer_step=True``), so it passes.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from typing import Any

import torch
from torch.distributed.tensor import DTensor
from torch.optim.optimizer import register_optimizer_step_pre_hook
from torch.utils.hooks import RemovableHandle

from megatron_fsdp.core.group_weights import GroupState
from megatron_fsdp.core.param_group import ParamGroup, owner_of, replaced_in
from megatron_fsdp.core.unit import FSDPUnit, TrainingState

_UNITS: weakref.WeakSet[FSDPUnit] = weakref.WeakSet()
_HANDLE: RemovableHandle | None = None

# Set on megatron_fsdp's own global step hooks: they know that a step may run on local
# shards, so they do not keep the local step from being used (optim/local_step.py).
OWN_HOOK = "_megatron_fsdp_local_step_hook"


def watch(unit: FSDPUnit) -> None:
    """Check ``unit``'s gradients before every optimizer step that holds its parameters."""
    global _HANDLE
    _UNITS.add(unit)
    if _HANDLE is None:
        _HANDLE = register_optimizer_step_pre_hook(check_before_step)


def _module_name(unit: FSDPUnit) -> str:
    """``'blocks.0' (Block)`` relative to the unit's root, or the class name before the first forward."""
    module = unit.module
    cls = type(module).__bases__[-1].__name__  # the model's own class, not its FSDP subclass
    root = unit.root_state.root.module if unit.root_state is not None else None
    if root is not None:
        for name, candidate in root.named_modules():
            if candidate is module:
                return f"'{name}' ({cls})" if name else f"the root ({cls})"
    return cls


def _address(tensor: torch.Tensor) -> int:
    local = tensor._local_tensor if isinstance(tensor, DTensor) else tensor  # not to_local(): an autograd call
    return local.data_ptr() if local.numel() else 0


def _stepped_by(optimizer: torch.optim.Optimizer) -> Callable[[ParamGroup], bool]:
    """Does ``optimizer`` hold a parameter of a group? By identity (the group owning each parameter), or by
    address: while ``fully_shard_optimizer`` steps on local shards, ``param_groups`` hold plain aliases of the
    groups' parameter shards (each its own storage slice over the main shard)."""
    owners: set[int] = set()  # id of each group owning one of the optimizer's parameters
    addresses: set[int] = set()  # storage addresses of the parameters no group owns
    for group in optimizer.param_groups:
        for param in group["params"]:
            owner = owner_of(param)
            if owner is not None:
                owners.add(id(owner[0]))
            else:
                addresses.add(_address(param))
    addresses.discard(0)

    def holds(group: ParamGroup) -> bool:
        return id(group) in owners or bool(addresses) and any(_address(p) in addresses for p in group.sharded_params)

    return holds


def _scan() -> tuple[list[FSDPUnit], list[FSDPUnit]]:
    """One pass over the live units: (with pending gradients, idle with gathered weights kept)."""
    pending: list[FSDPUnit] = []
    kept: list[FSDPUnit] = []
    idle, unsharded = TrainingState.IDLE, GroupState.UNSHARDED
    for unit in _UNITS:
        gathered = False
        for group in unit.groups:
            if group.grads_pending:
                pending.append(unit)
                break
            # gathered, or an explicit unshard(async_op=True) still to be installed
            gathered = gathered or group.state is unsharded or group._gather is not None
        else:
            if gathered and unit.state is idle:
                kept.append(unit)
    return pending, kept


def pending_units(optimizer: torch.optim.Optimizer) -> list[FSDPUnit]:
    """Units holding accumulated, unreduced gradients of parameters ``optimizer`` steps."""
    pending, _ = _scan()
    if not pending:
        return []
    holds = _stepped_by(optimizer)
    return [u for u in pending if any(g.grads_pending and holds(g) for g in u.groups)]


def check_before_step(optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
    """Step pre-hook: raise if a parameter's reduced gradient is still missing; release kept weights.

    Gathered weights kept past the step (``is_last=False`` on a ZeRO-2 last micro-batch, a
    forward without backward) would be stale after it: they are released, and the next
    forward re-gathers.
    """
    stale = replaced_in(optimizer)
    if stale:
        raise RuntimeError(
            f"this optimizer holds parameters {stale} that were replaced after fully_shard: the module now "
            "holds the replacement (which the engine took over), so a step would update tensors the model no "
            "longer uses. Build the optimizer after replacing parameters (from model.parameters())"
        )
    pending, kept = _scan()
    if not pending and not kept:
        return
    holds = _stepped_by(optimizer)
    units = [u for u in pending if any(g.grads_pending and holds(g) for g in u.groups)]
    if not units:
        for unit in kept:
            if any(holds(g) for g in unit.groups):
                unit.mark_weights_stale()
        return
    named = sorted(_module_name(u) for u in units)
    names = ", ".join(named[:4]) + (f" and {len(named) - 4} more" if len(named) > 4 else "")
    sync_off = [u for u in units if not u.requires_gradient_sync]
    hint = (
        "gradient sync is still off (set_requires_gradient_sync(True) before the last micro-batch's backward); "
        if sync_off else ""
    )
    held = [g for u in units for g in u.groups if g.partial_outer is not None]
    if any(not g.requires_all_reduce for g in held):
        hint += ("their all-reduce across replicas is still off "
                 "(set_requires_all_reduce(True) before the last micro-batch's backward); ")
    elif held:
        hint += ("their reduction across replicas (HSDP's dp_outer) was deferred by microbatch(..., is_last=False) "
                 "and has not run; ")
    raise RuntimeError(
        f"{type(optimizer).__name__}.step(): {names} still hold gradients accumulated but not reduced across "
        f"data-parallel ranks, so their .grad is missing or partial; {hint}call microbatch(..., is_last=True) on "
        "the last micro-batch, leave no_sync() (or set_requires_gradient_sync(True)) before the last backward, "
        "or reduce them first with MegatronFSDP.finish_grad_sync() (fully_shard_optimizer's step does that) "
        "before optimizer.step()"
    )


setattr(check_before_step, OWN_HOOK, True)  # it reads gradients by address, local aliases included
