"""``fully_shard_optimizer(optimizer)``: a torch optimizer over placements-API parameters, in place.

Under ``MixedPrecisionPolicy``'s defaults a bf16 model's sharded parameters (the optimizer's main
weights) are fp32 while its gradients stay bf16; torch's optimizers refuse such a pair. The hooks
this adds cast each such gradient to its parameter's dtype for the step and put the original back
after it (not with ``precision_aware=True``: an optimizer that takes the gradients as they are),
then make the next forward gather the updated main weights.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from megatron_fsdp.core.param_group import owner_of
from megatron_fsdp.experimental.module import containing_parameter_group

__all__ = ["fully_shard_optimizer"]

_MARK = "_megatron_fsdp_experimental_optimizer"


def _set_grad(param: nn.Parameter, grad: torch.Tensor) -> None:
    param.grad = None  # a gradient of another dtype cannot replace the current one directly
    param.grad_dtype = grad.dtype
    param.grad = grad


def fully_shard_optimizer(optimizer: torch.optim.Optimizer, *, precision_aware: bool = False) -> None:
    """Add step hooks to ``optimizer`` (in place) for parameters sharded by the placements API.

    Args:
        optimizer: a ``torch.optim.Optimizer`` over ``model.parameters()`` after ``fully_shard``.
        precision_aware: the optimizer steps gradients whose dtype differs from its parameters'
            itself (no casting).

    Raises:
        TypeError: ``optimizer`` not a torch optimizer; at a step, a parameter that is not an
            ``nn.Parameter``.
        ValueError: ``fully_shard_optimizer`` already applied to it.
        NotImplementedError: at a step, a ``closure``.
    """
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise TypeError(f"fully_shard_optimizer expects a torch.optim.Optimizer, got {type(optimizer).__name__}")
    if getattr(optimizer, _MARK, False):
        raise ValueError("fully_shard_optimizer was already applied to this optimizer.")
    cast: list[tuple[nn.Parameter, torch.Tensor]] = []

    def before(opt: torch.optim.Optimizer, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        closure = kwargs.get("closure", args[1] if len(args) > 1 else None)  # args[0] is the optimizer
        if closure is not None:
            raise NotImplementedError("fully_shard_optimizer does not support optimizer.step closures.")
        cast.clear()
        for group in opt.param_groups:
            for param in group["params"]:
                if not isinstance(param, nn.Parameter):
                    raise TypeError(
                        "fully_shard_optimizer expected optimizer param groups to contain nn.Parameter values, "
                        f"got {type(param)!r}."
                    )
                if precision_aware or param.grad is None or param.grad.dtype == param.dtype:
                    continue
                if owner_of(param) is None:
                    continue
                cast.append((param, param.grad))
                _set_grad(param, param.grad.to(dtype=param.dtype))

    def after(opt: torch.optim.Optimizer, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        for param, grad in cast:
            _set_grad(param, grad)
        cast.clear()
        groups = {}
        for group in opt.param_groups:
            for param in group["params"]:
                if (found := containing_parameter_group(param)) is not None:
                    groups[id(found)] = found
        for found in groups.values():  # the compute weights follow the updated main weights, once a group
            found.sync_model_weight_from_main_weight()

    optimizer.register_step_pre_hook(before)
    optimizer.register_step_post_hook(after)
    setattr(optimizer, _MARK, True)
