"""``fsdp_no_shard``: keep chosen parameters replicated.

A frozen vision tower inside a sharded language model gains nothing from
sharding and pays an all-gather per use. Marked parameters go into a
replicated group of the unit that owns them: no all-gather, no reduce-scatter,
and gradients (if any) all-reduced and averaged like DDP's. ``fully_shard`` on
a module whose parameters are all marked (or 0-dim) still makes it a unit, with
the ``no_shard`` plan: replicated means all-reduced, and a module left unwrapped
would never have its gradients reduced if no enclosing unit follows (the root).
"""

from __future__ import annotations

from torch import nn

_MARK = "_megatron_fsdp_no_shard"


def fsdp_no_shard(target: nn.Module | nn.Parameter) -> nn.Module | nn.Parameter:
    """Mark a module (all its parameters, present and future) or one parameter as replicated."""
    if isinstance(target, nn.Parameter):
        setattr(target, _MARK, True)
    elif isinstance(target, nn.Module):
        # The module carries the mark too, so it survives parameters being
        # replaced (e.g. by meta-device materialisation).
        for module in target.modules():
            module.__dict__[_MARK] = True
        for param in target.parameters():
            setattr(param, _MARK, True)
    else:
        raise TypeError(f"fsdp_no_shard expects an nn.Module or nn.Parameter, got {type(target).__name__}")
    return target


def is_marked_no_shard(owner: nn.Module, param: nn.Parameter) -> bool:
    return bool(getattr(param, _MARK, False) or owner.__dict__.get(_MARK, False))
