"""Build, wrap and optimise the model: the front-end's part of Megatron's ``setup_model_and_optimizer``."""

from __future__ import annotations

import argparse
import contextlib
from collections.abc import Callable

import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from megatron_fsdp.api.config import DistributedDataParallelConfig

from .initialize import print_rank_0


def pad_vocab_size(args: argparse.Namespace) -> int:
    """The embedding rows: the tokenizer's vocabulary padded to --make-vocab-size-divisible-by, as Megatron."""
    from .tokenizer import build_tokenizer

    vocab = build_tokenizer(args).vocab_size
    multiple = max(args.make_vocab_size_divisible_by, 1)
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
    )


def build_model(args: argparse.Namespace, model_provider: Callable[..., nn.Module], device: torch.device) -> nn.Module:
    """Build with ``model_provider`` (on the meta device if asked), then wrap in FSDP or DDP."""
    meta = args.use_megatron_fsdp and args.init_model_with_meta_device
    with torch.device("meta") if meta else contextlib.nullcontext():
        model = model_provider(pre_process=True, post_process=True)
    n_params = sum(p.numel() for p in model.parameters())
    print_rank_0(f" > number of parameters on (data-parallel) rank 0: {n_params}")
    if not args.use_megatron_fsdp:
        model.to(device)
        return DDP(model, device_ids=[device.index] if device.type == "cuda" else None)
    if args.bf16:
        model.to(torch.bfloat16)  # compute weights; fp32 main weights kept by preserve_fp32_weights
    if not meta:
        model.to(device)
    from megatron_fsdp.mcore import FullyShardedDataParallel

    # Units: the adapter's default, the model's TransformerLayer class (ours or megatron-core's).
    return FullyShardedDataParallel(args, ddp_config_from_args(args), model)


def _param_groups(model: nn.Module, weight_decay: float) -> list[dict]:
    """Megatron's groups: no weight decay for biases and norm weights (1-D parameters)."""
    decay, no_decay = [], []
    for param in model.parameters():
        if param.requires_grad:
            (no_decay if param.dim() <= 1 else decay).append(param)
    return [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]


def build_optimizer(args: argparse.Namespace, model: nn.Module) -> torch.optim.Optimizer:
    """AdamW with Megatron's hyper-parameter flags; on FSDP, driven by ``fully_shard_optimizer``."""
    optimizer = torch.optim.AdamW(
        _param_groups(model, args.weight_decay), lr=args.lr, betas=(args.adam_beta1, args.adam_beta2),
        eps=args.adam_eps, weight_decay=args.weight_decay,
    )
    if args.use_megatron_fsdp:
        from megatron_fsdp.optim.optimizer import fully_shard_optimizer

        optimizer = fully_shard_optimizer(optimizer)
    return optimizer
