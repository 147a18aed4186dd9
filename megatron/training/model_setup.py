"""Model-side settings from the flags: padded vocabulary, the DDP config, Megatron's AdamW groups and the
learning-rate schedule (megatron-core's ``OptimizerParamScheduler``, with the front-end's user-facing checks)."""

from __future__ import annotations

import argparse
from typing import Any

import torch
from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler
from torch import nn

from megatron_fsdp.api.config import DistributedDataParallelConfig

from .errors import UsageValueError
from .tokenizer import build_tokenizer


def pad_vocab_size(args: argparse.Namespace) -> int:
    """The embedding rows: the tokenizer's vocabulary padded to a multiple of --make-vocab-size-divisible-by
    times --tensor-model-parallel-size, as Megatron (each TP rank holds an equal slice)."""
    vocab = build_tokenizer(args).vocab_size
    multiple = max(args.make_vocab_size_divisible_by, 1) * getattr(args, "tensor_model_parallel_size", 1)
    return ((vocab + multiple - 1) // multiple) * multiple


def ddp_config_from_args(args: argparse.Namespace) -> DistributedDataParallelConfig:
    """Megatron-LM's mapping of command-line flags to ``DistributedDataParallelConfig``."""
    # Megatron-LM reduces bf16 gradients in fp32 unless --grad-reduce-in-bf16.
    grad_in_fp32 = args.accumulate_allreduce_grads_in_fp32 or (args.bf16 and not args.grad_reduce_in_bf16)
    return DistributedDataParallelConfig(
        grad_reduce_in_fp32=grad_in_fp32,
        overlap_grad_reduce=args.overlap_grad_reduce,
        overlap_param_gather=args.overlap_param_gather,
        use_distributed_optimizer=args.use_distributed_optimizer,
        num_distributed_optimizer_instances=args.num_distributed_optimizer_instances,
        # The training loop checks every iteration's (global) loss and grad norm itself and names the
        # iteration and the parameters; the engine's check would fire first, without the iteration.
        check_for_nan_in_grad=False,
        average_in_collective=args.ddp_average_in_collective,
        use_megatron_fsdp=args.use_megatron_fsdp,
        data_parallel_sharding_strategy=args.data_parallel_sharding_strategy,
        outer_dp_sharding_strategy=args.outer_dp_sharding_strategy,
        nccl_ub=args.use_nccl_ub,
        fsdp_double_buffer=args.fsdp_double_buffer,
        # --megatron-fsdp-main-params-dtype fp32 (the default): fp32 main weights beside bf16 model weights
        preserve_fp32_weights=getattr(args, "preserve_fp32_weights", True),
        bucket_size=getattr(args, "ddp_bucket_size", None),
        suggested_communication_unit_size=getattr(args, "suggested_communication_unit_size", None),
    )


def _param_groups(model: nn.Module, weight_decay: float) -> list[dict]:
    """Megatron's groups: no weight decay for biases and norm weights (1-D parameters).

    Each carries Megatron-LM's ``wd_mult`` and ``lr_mult``: megatron-core's scheduler writes
    ``weight_decay = wd * wd_mult`` into every group at every step, so the no-decay group's
    ``wd_mult`` is 0.
    """
    decay, no_decay = [], []
    for param in model.parameters():
        if param.requires_grad:
            (no_decay if param.dim() <= 1 else decay).append(param)
    return [{"params": decay, "weight_decay": weight_decay, "wd_mult": 1.0, "lr_mult": 1.0},
            {"params": no_decay, "weight_decay": 0.0, "wd_mult": 0.0, "lr_mult": 1.0}]


def build_adamw(args: argparse.Namespace, model: nn.Module) -> torch.optim.Optimizer:
    """AdamW with Megatron's hyper-parameter flags over ``model``'s parameters (the backend may wrap it)."""
    return torch.optim.AdamW(
        _param_groups(model, args.weight_decay), lr=args.lr, betas=(args.adam_beta1, args.adam_beta2),
        eps=args.adam_eps, weight_decay=args.weight_decay,
    )


# (state-dict keys, the flag that sets the value): the schedule's shape, compared at --load. The first key
# is megatron-core's; the second the one this project's own scheduler saved before megatron-core's was used.
SCHEDULE_FLAGS = (
    (("max_lr", "max_lr"), "--lr"), (("min_lr", "min_lr"), "--min-lr"),
    (("lr_warmup_steps", "warmup_steps"), "--lr-warmup-iters"),
    (("lr_decay_steps", "decay_steps"), "--lr-decay-iters (default --train-iters)"),
    (("lr_decay_style", "decay_style"), "--lr-decay-style"),
    (("start_wd", "start_wd"), "--weight-decay"), (("end_wd", "end_wd"), "--weight-decay"),
)


def build_optimizer_param_scheduler(
    args: argparse.Namespace, optimizer: torch.optim.Optimizer
) -> OptimizerParamScheduler:
    """megatron-core's ``OptimizerParamScheduler`` for the flags, as Megatron-LM's ``get_optimizer_param_scheduler``.

    Counted in iterations (one ``step(increment=1)`` per optimizer step), where Megatron-LM counts
    samples (iterations x --global-batch-size): the learning rates are the same with a fixed
    global batch, and checkpoints of this project saved before keep their meaning. Weight decay
    is constant (``--weight-decay``; Megatron-LM's ``--start-weight-decay`` and friends are not
    flags here). megatron-core asserts what ``validate_args`` has already checked with a message
    (``--lr-warmup-iters`` < ``--lr-decay-iters``, ``--min-lr`` <= ``--lr``); the contradiction of
    ``--override-opt_param-scheduler`` and ``--use-checkpoint-opt_param-scheduler`` is said here.
    """
    if args.override_opt_param_scheduler and args.use_checkpoint_opt_param_scheduler:
        raise UsageValueError("--override-opt_param-scheduler and --use-checkpoint-opt_param-scheduler "
                              "contradict each other (this run's schedule or the checkpoint's): give one")
    return OptimizerParamScheduler(
        optimizer, init_lr=0.0, max_lr=args.lr, min_lr=args.min_lr, lr_warmup_steps=args.lr_warmup_iters,
        lr_decay_steps=args.lr_decay_iters, lr_decay_style=args.lr_decay_style,
        start_wd=args.weight_decay, end_wd=args.weight_decay, wd_incr_steps=args.lr_decay_iters,
        wd_incr_style="constant", use_checkpoint_opt_param_scheduler=args.use_checkpoint_opt_param_scheduler,
        override_opt_param_scheduler=args.override_opt_param_scheduler,
        wsd_decay_steps=args.lr_wsd_decay_iters, lr_wsd_decay_style=args.lr_wsd_decay_style,
    )


def _saved(state: dict[str, Any], keys: tuple[str, str]) -> Any:
    return state[keys[0]] if keys[0] in state else state.get(keys[1])


def schedule_mismatch(scheduler: OptimizerParamScheduler, state: dict[str, Any]) -> list[str]:
    """``FLAG saved (x) vs now (y)`` for each value of the schedule's shape that differs from ``state``'s."""
    now = scheduler.state_dict()
    differ = []
    for keys, flag in SCHEDULE_FLAGS:
        saved = _saved(state, keys)
        if saved is not None and saved != now[keys[0]]:
            differ.append(f"{flag} {saved} (saved) vs {now[keys[0]]} (now)")
    return differ


def check_scheduler_state(scheduler: OptimizerParamScheduler, state: dict[str, Any], where: str) -> None:
    """Refuse ``state`` (a checkpoint's, at ``where``) whose schedule differs, unless a flag chose a side.

    megatron-core's ``load_state_dict`` asserts the same (Megatron-LM's rule); this says which flag
    differs, with both values and the two ways out, before it runs.
    """
    if scheduler.override_opt_param_scheduler or scheduler.use_checkpoint_opt_param_scheduler:
        return
    differ = schedule_mismatch(scheduler, state)
    if differ:
        raise UsageValueError(
            f"{where}: the checkpoint's learning-rate schedule differs from this run's flags: {'; '.join(differ)}. "
            "Pass the saved values (to train longer than the schedule planned, give the same --lr-decay-iters "
            "when starting and resuming), or --use-checkpoint-opt_param-scheduler to continue the saved "
            "schedule, or --override-opt_param-scheduler to switch to this run's (Megatron-LM's rule)"
        )
