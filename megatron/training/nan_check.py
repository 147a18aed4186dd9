"""The error of an iteration whose loss or gradient norm is NaN/Inf, naming the parameters at fault."""

from __future__ import annotations

import torch
from torch import nn

from megatron.training.reduce import all_reduce

from .config import TrainingConfig


class NonFiniteLossError(RuntimeError):
    """An iteration's loss or gradient norm was NaN/Inf (with --check-for-nan-in-loss-and-grad, the default)."""


NAN_CAUSES = (
    "Likely causes: a learning rate too high for this model (lower --lr, or lengthen --lr-warmup-iters), "
    "loose or no gradient clipping (--clip-grad), overflow in low precision (--bf16; this front-end uses no "
    "loss scaling, the loss scale is always 1.0), too large initial weights (--init-method-std), or corrupt "
    "input data"
)


def nonfinite_grad_names(module: nn.Module, device: torch.device) -> list[str]:
    """Parameters of ``module`` whose gradient holds NaN/Inf on any rank (one all-reduce; call on every rank)."""
    named = list(module.named_parameters())
    flags = torch.zeros(len(named), device=device)
    for i, (_, param) in enumerate(named):
        if param.grad is not None:
            grad = param.grad.to_local() if hasattr(param.grad, "to_local") else param.grad
            flags[i] = (~torch.isfinite(grad)).any().float()
    all_reduce(flags)
    return [name for (name, _), bad in zip(named, flags.tolist()) if bad > 0]


def nan_error(config: TrainingConfig, module: nn.Module, device: torch.device, iteration: int, loss: float,
              norm: float, lr: float) -> NonFiniteLossError:
    """The error to raise on every rank (``module``: the user's, for its own parameter names)."""
    names = nonfinite_grad_names(module, device)
    where = f" in {len(names)} parameter(s): {', '.join(names[:8])}{' ...' if len(names) > 8 else ''}" if names else ""
    return NonFiniteLossError(
        f"iteration {iteration}: lm loss {loss}, grad norm {norm} (NaN/Inf gradients{where or ': none'}); "
        f"learning rate {lr:.6E} (--lr {config.lr}, --clip-grad {config.clip_grad}). {NAN_CAUSES}. To skip such "
        "iterations instead, pass --no-check-for-nan-in-loss-and-grad"
    )
