"""Front-end checkpoints: ``--save/--load/--save-interval`` on ``megatron_fsdp.checkpoint``.

The model, optimizer, scheduler, RNG states and data position are saved in
Megatron's layout (``DIR/iter_0000010/`` + ``DIR/latest_checkpointed_iteration.txt``)
as sharded DCP files that load at any number of ranks and any strategy.
"""

from __future__ import annotations

import argparse
import os

import torch
from torch import nn

from .initialize import print_rank_0
from .optimizer_param_scheduler import OptimizerParamScheduler


def unwrap_model(model: nn.Module) -> nn.Module:
    """The user's module under DDP / FullyShardedDataParallel / MegatronFSDP wrappers."""
    from megatron_fsdp.module import FSDPModule

    while hasattr(model, "module") and isinstance(model.module, nn.Module) and not isinstance(model, FSDPModule):
        model = model.module
    return model


def save(args: argparse.Namespace, iteration: int, model: nn.Module, optimizer: torch.optim.Optimizer,
         scheduler: OptimizerParamScheduler) -> None:
    from megatron_fsdp.checkpoint import save_checkpoint

    extra = {
        "scheduler": scheduler.state_dict(),
        "consumed_train_samples": args.consumed_train_samples,
        "consumed_valid_samples": args.consumed_valid_samples,
        "args": {k: v for k, v in vars(args).items() if isinstance(v, (int, float, str, bool, type(None)))},
    }
    path = save_checkpoint(args.save, iteration, unwrap_model(model), optimizer, extra=extra)
    print_rank_0(f"  successfully saved checkpoint from iteration {iteration:7d} to {path}")


def load(args: argparse.Namespace, model: nn.Module, optimizer: torch.optim.Optimizer,
         scheduler: OptimizerParamScheduler) -> int:
    """Resume from ``--load``; returns the iteration to continue from (0 for a fresh start or --finetune)."""
    tracker = os.path.join(args.load, "latest_checkpointed_iteration.txt")
    if not os.path.isfile(tracker):
        print_rank_0(f"WARNING: could not find the checkpoint tracker {tracker}; training from scratch")
        return 0
    from megatron_fsdp.checkpoint import load_checkpoint

    finetune = args.finetune
    loaded = load_checkpoint(
        args.load, unwrap_model(model), None if (finetune or args.no_load_optim) else optimizer,
        load_optimizer=not (finetune or args.no_load_optim), load_rng=not (finetune or args.no_load_rng),
    )
    print_rank_0(f"  successfully loaded checkpoint from {args.load} at iteration {loaded.iteration}")
    if finetune:
        return 0
    extra = loaded.extra or {}
    args.consumed_train_samples = int(extra.get("consumed_train_samples", 0))
    args.consumed_valid_samples = int(extra.get("consumed_valid_samples", 0))
    if "scheduler" in extra and not args.no_load_optim:
        scheduler.load_state_dict(extra["scheduler"])
    else:
        scheduler.num_steps = loaded.iteration
        scheduler.step(0)
    return loaded.iteration
