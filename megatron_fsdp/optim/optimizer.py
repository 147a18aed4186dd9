"""``fully_shard_optimizer``: a torch optimizer that drives the engine's per-step duties.

The optimizer must be built on the sharded parameters (``model.parameters()``
of a ``MegatronFSDP`` / ``fully_shard``-ed model, or let
``fully_shard(model, optimizer, ...)`` re-point an existing one). It steps the
sharded main weights in place; the engine only needs to be told when
gradients must be complete and when the weights changed. That is what the
extended methods do (the reference's signatures)::

    optimizer.step(closure=None, *, sync_grad_before_optimizer_step=True,
                   install_optimized_model_weights=True, check_for_nan_in_grad=None)
    optimizer.zero_grad(set_to_none=True, *, zero_grad_buffer=True)

- ``sync_grad_before_optimizer_step``: reduce gradients still accumulating
  (e.g. under ``no_sync``) and wait for every reduction in flight, so each
  ``.grad`` is the complete data-parallel gradient.
- ``install_optimized_model_weights``: after the step, release gathered weights
  and refresh the compute (e.g. bf16) copies from the updated main weights now.
  With False the refresh is left to the next forward's all-gather (the weights
  are still marked stale: a forward never runs on pre-step weights).
- ``zero_grad_buffer``: also drop gradients accumulated but not reduced yet.

How: the instance's bound ``step``/``zero_grad`` are replaced by wrappers that
call the originals (no torch class is modified; ``type(optimizer)`` is
unchanged, and an LR scheduler created later wraps our ``step`` as usual).
Nothing is stepped at set-up: the optimizer's state (and its step counter) is
untouched until the first real ``step()``.
"""

from __future__ import annotations

import contextlib
import types
from typing import Any

import torch

from megatron_fsdp.core.steps import (
    discard_grad_buffers,
    finish_grad_sync,
    install_weights,
    named_sharded_parameters,
    units_of_params,
)
from megatron_fsdp.optim.grad_norm import check_grads_finite
from megatron_fsdp.optim.local_step import on_local_shards, steppable_locally
from megatron_fsdp.optim.state_layout import check_before_step

_WRAPPED = "_megatron_fsdp_optimizer"


def _optimizer_params(optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
    return [p for group in optimizer.param_groups for p in group["params"]]


def fully_shard_optimizer(
    optimizer: torch.optim.Optimizer,
    *,
    preproc_state_dict_for_dcp_ckpt: bool = True,
    check_for_nan_in_grad: bool = False,
    step_on_local_shards: bool = True,
) -> torch.optim.Optimizer:
    """Give ``optimizer`` the FSDP-aware ``step``/``zero_grad`` described in the module docstring.

    Args:
        optimizer: a ``torch.optim.Optimizer`` whose parameters are all sharded
            parameters of ``fully_shard``-ed modules.
        preproc_state_dict_for_dcp_ckpt: accepted for the reference's API; the
            optimizer state of DTensor parameters is already in the form
            ``torch.distributed.checkpoint`` saves and re-shards, so there is
            nothing to pre-process either way.
        check_for_nan_in_grad: after the gradient sync in ``step``, raise on
            every rank (naming the parameters) if a reduced gradient holds
            NaN/Inf; the optimizer does not step then.
        step_on_local_shards: run the optimizer's math on the local shards of the
            DTensor parameters and state (``megatron_fsdp.local_step``): the same
            numbers bit for bit, without DTensor's per-op dispatch. A parameter's
            first step, and a step with a closure, use the plain DTensor path.

    Returns:
        ``optimizer`` itself (wrapped once; calling again only updates the options).
    """
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise TypeError(f"fully_shard_optimizer expects a torch.optim.Optimizer, got {type(optimizer).__name__}")
    params = _optimizer_params(optimizer)
    foreign = [p for p in params if getattr(p, "_megatron_fsdp_unit", None) is None]
    if foreign:
        shapes = ", ".join(str(tuple(p.shape)) for p in foreign[:5])
        raise ValueError(
            f"fully_shard_optimizer: {len(foreign)} of {len(params)} optimizer parameters are not sharded "
            f"parameters of a fully_shard-ed module (shapes {shapes}{', ...' if len(foreign) > 5 else ''}); build the "
            "optimizer on model.parameters() after fully_shard_model(...), or re-point an existing one with "
            "megatron_fsdp.fully_shard(model, optimizer, ...)"
        )
    options = {"check_for_nan_in_grad": bool(check_for_nan_in_grad),
               "preproc_state_dict_for_dcp_ckpt": bool(preproc_state_dict_for_dcp_ckpt),
               "step_on_local_shards": bool(step_on_local_shards)}
    if getattr(optimizer, _WRAPPED, None) is not None:
        getattr(optimizer, _WRAPPED).update(options)
        return optimizer
    setattr(optimizer, _WRAPPED, options)
    original_step, original_zero_grad = optimizer.step, optimizer.zero_grad

    def step(
        self: torch.optim.Optimizer,
        closure: Any = None,
        *,
        sync_grad_before_optimizer_step: bool = True,
        install_optimized_model_weights: bool = True,
        check_for_nan_in_grad: bool | None = None,
        **kwargs: Any,
    ) -> Any:
        units = units_of_params(_optimizer_params(self))
        if check_for_nan_in_grad is None:
            check_for_nan_in_grad = getattr(self, _WRAPPED)["check_for_nan_in_grad"]

        def prepare() -> None:
            if sync_grad_before_optimizer_step:
                finish_grad_sync(units)
            if check_for_nan_in_grad:
                check_grads_finite(named_sharded_parameters(units))

        check_before_step(self)  # before on_local_shards hides the parameters behind local aliases
        if closure is None:
            prepare()
            local = getattr(self, _WRAPPED)["step_on_local_shards"] and steppable_locally(self)
            with on_local_shards(self) if local else contextlib.nullcontext():
                result = original_step(**kwargs)
        else:
            def closure_then_sync() -> Any:  # gradients exist only once the closure's backward ran
                loss = closure()
                prepare()
                return loss

            result = original_step(closure_then_sync, **kwargs)
        install_weights(units, eager=install_optimized_model_weights)
        return result

    def zero_grad(self: torch.optim.Optimizer, set_to_none: bool = True, *, zero_grad_buffer: bool = True) -> None:
        original_zero_grad(set_to_none)
        if zero_grad_buffer:
            discard_grad_buffers(units_of_params(_optimizer_params(self)), reduced=False)

    step.__doc__ = f"{type(optimizer).__name__}.step with megatron_fsdp's gradient sync and weight install."
    zero_grad.__doc__ = f"{type(optimizer).__name__}.zero_grad that can also drop megatron_fsdp's unreduced gradients."
    optimizer.step = types.MethodType(step, optimizer)
    optimizer.zero_grad = types.MethodType(zero_grad, optimizer)
    return optimizer
