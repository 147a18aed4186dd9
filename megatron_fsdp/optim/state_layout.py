"""Optimizer state put back into its parameter's ragged layout after a load.

``set_optimizer_state_dict(..., options=StateDictOptions(full_state_dict=True))``
(broadcast_from_rank0 off) cuts each full state tensor with ``distribute_tensor``,
which in torch 2.13 splits at ``torch.chunk`` boundaries and labels the result plain
``Shard(0)`` whatever the parameter's placement says: ``exp_avg`` of a parameter whose
ragged shard holds 4 rows here gets 3, and the next ``step`` fails on a shape (or,
for a row count that happens to match, would mix rows of other ranks).

Each optimizer over our parameters is checked once before its first step and again
after every ``load_state_dict``: a state tensor shaped like its parameter but laid out
otherwise is re-cut into the parameter's layout (values kept, dtype kept). Every rank
walks the same parameters and keys in the same order, so the gathers this may need
match across ranks.
"""

from __future__ import annotations

import weakref

import torch
from torch.distributed.tensor import DTensor

from megatron_fsdp.core.param_group import owner_of

_checked: weakref.WeakSet[torch.optim.Optimizer] = weakref.WeakSet()


def restore_state_layout(optimizer: torch.optim.Optimizer) -> int:
    """Re-cut ``optimizer``'s state tensors that left their parameter's layout; returns how many."""
    fixed = 0
    for group in optimizer.param_groups:
        for param in group["params"]:
            owner = owner_of(param)
            state = optimizer.state.get(param)
            if owner is None or not state:
                continue
            param_group, index = owner
            for key in sorted(state, key=str):
                value = state[key]
                if not isinstance(value, DTensor) or value.shape != param.shape:
                    continue  # `step` and other scalars
                if not param_group.params[index].in_our_layout(value):
                    state[key] = param_group.params[index].relayout(value, value.dtype)
                    fixed += 1
    return fixed


def _after_load(optimizer: torch.optim.Optimizer) -> None:
    restore_state_layout(optimizer)


def check_before_step(optimizer: torch.optim.Optimizer) -> None:
    """The first step of ``optimizer``: check its state, and re-check after each later load."""
    if optimizer in _checked:
        return
    _checked.add(optimizer)
    optimizer.register_load_state_dict_post_hook(_after_load)
    restore_state_layout(optimizer)
