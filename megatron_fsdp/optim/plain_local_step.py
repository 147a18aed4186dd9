"""Plain torch optimizers over ``fully_shard``-ed parameters step on the local shards too.

An FSDP2-style user builds ``torch.optim.AdamW(model.parameters())`` after
``fully_shard`` and never calls ``fully_shard_optimizer``. Its single-tensor loop (torch's
default on CPU) then sends a dozen element-wise ops per parameter per step through
DTensor's Python dispatch: on the 6-layer GPT of ``benchmarks/compare.py`` the step took
3-4x as long as on the local shards, the largest per-parameter Python cost of that path.

A global step pre-hook enters ``on_local_shards`` (``local_step.py``: same numbers, bit
for bit) and the matching post-hook leaves it, when all of these hold:

- the optimizer's class is one of torch's element-wise optimizers (``ELEMENTWISE``,
  exact type: a subclass or another optimizer may look across a tensor, e.g. a norm or
  a row mean, which a local shard would get wrong);
- every parameter is a sharded parameter of a live unit (not FSDP2's, not plain tensors);
- every parameter with a gradient already has state (the first step creates it through
  DTensor, as torch does), and no closure is passed;
- no step hook but these two is registered, on the optimizer or globally
  (``local_step.observed_by_hooks``): a user's hook sees the DTensors it sees under FSDP2;
- it is not a ``fully_shard_optimizer`` (that one does the same itself).

If ``step`` (or another post-hook) raises between the hooks, ``param_groups`` and
``state`` keep the local aliases until the next ``step``, ``state_dict()`` or
``load_state_dict()`` of that optimizer puts them back (its pre-hooks), so checkpoints
and later steps never see them.
"""

from __future__ import annotations

import contextlib
import weakref
from typing import Any

import torch
from torch.distributed.tensor import DTensor
from torch.optim.optimizer import register_optimizer_step_post_hook, register_optimizer_step_pre_hook
from torch.utils.hooks import RemovableHandle

from megatron_fsdp.core.param_group import owner_of
from megatron_fsdp.core.step_guard import OWN_HOOK
from megatron_fsdp.optim.local_step import on_local_shards, steppable_locally
from megatron_fsdp.optim.optimizer import _WRAPPED  # fully_shard_optimizer's marker
from megatron_fsdp.optim.state_layout import check_before_step

ELEMENTWISE: tuple[type[torch.optim.Optimizer], ...] = (
    torch.optim.SGD, torch.optim.Adam, torch.optim.AdamW, torch.optim.Adagrad, torch.optim.Adamax,
    torch.optim.NAdam, torch.optim.RAdam, torch.optim.RMSprop,
)

_active: weakref.WeakKeyDictionary[torch.optim.Optimizer, contextlib.AbstractContextManager] = (
    weakref.WeakKeyDictionary()
)
_state_dict_hooked: weakref.WeakSet[torch.optim.Optimizer] = weakref.WeakSet()
_handles: list[RemovableHandle] = []


def enable() -> None:
    """Register the global hooks once (called by ``fully_shard``)."""
    if not _handles:
        _handles.append(register_optimizer_step_pre_hook(_before_step))
        _handles.append(register_optimizer_step_post_hook(_after_step))


def _put_back(optimizer: torch.optim.Optimizer, *_: Any) -> None:
    context = _active.pop(optimizer, None)
    if context is not None:
        context.__exit__(None, None, None)


def _ours(optimizer: torch.optim.Optimizer) -> bool:
    """Every parameter is a sharded parameter of a live unit."""
    params = [p for group in optimizer.param_groups for p in group["params"]]
    if not params or not all(isinstance(p, DTensor) for p in params):
        return False
    return all(owner_of(p) is not None for p in params)


def _before_step(optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
    _put_back(optimizer)  # a previous step that raised
    check_before_step(optimizer)  # state cut at torch.chunk boundaries by a full-state load
    if type(optimizer) not in ELEMENTWISE or getattr(optimizer, _WRAPPED, None) is not None:
        return
    if len(args) > 1 or kwargs.get("closure") is not None:  # args[0] is the optimizer itself
        return
    if not _ours(optimizer) or not steppable_locally(optimizer):
        return
    if optimizer not in _state_dict_hooked:
        optimizer.register_state_dict_pre_hook(_put_back, prepend=True)  # before any user hook
        optimizer.register_load_state_dict_pre_hook(_put_back, prepend=True)
        _state_dict_hooked.add(optimizer)
    context = on_local_shards(optimizer)
    context.__enter__()
    _active[optimizer] = context


def _after_step(optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
    _put_back(optimizer)


for _hook in (_before_step, _after_step):
    setattr(_hook, OWN_HOOK, True)  # local_step.observed_by_hooks: these know the local window
