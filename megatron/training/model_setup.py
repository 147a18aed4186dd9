"""Model-side settings from the flags: padded vocabulary, the DDP config, Megatron's AdamW groups."""

from __future__ import annotations

import argparse

import torch
from torch import nn

from megatron_fsdp.api.config import DistributedDataParallelConfig

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
    """Megatron's groups: no weight decay for biases and norm weights (1-D parameters)."""
    decay, no_decay = [], []
    for param in model.parameters():
        if param.requires_grad:
            (no_decay if param.dim() <= 1 else decay).append(param)
    return [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]


def build_adamw(args: argparse.Namespace, model: nn.Module) -> torch.optim.Optimizer:
    """AdamW with Megatron's hyper-parameter flags over ``model``'s parameters (the backend may wrap it)."""
    return torch.optim.AdamW(
        _param_groups(model, args.weight_decay), lr=args.lr, betas=(args.adam_beta1, args.adam_beta2),
        eps=args.adam_eps, weight_decay=args.weight_decay,
    )
