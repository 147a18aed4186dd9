"""Pre-train megatron-core's GPTModel with Megatron-LM's flags on megatron_fsdp (or DDP without --use-megatron-fsdp).

    torchrun --nproc-per-node 2 pretrain_gpt.py --mock-data --vocab-size 128 \\
        --use-megatron-fsdp --data-parallel-sharding-strategy optim_grads_params

See docs/megatron.md for every flag.
"""

from __future__ import annotations

import gc
import sys

import torch
import torch.distributed as dist
from torch import nn

from megatron.training.errors import UsageError, exit_on_usage_error
from megatron.training.global_vars import get_args
from megatron.training.initialize import print_rank_0
from megatron.training.training import pretrain


def model_provider(pre_process: bool = True, post_process: bool = True) -> nn.Module:
    """megatron-core's ``GPTModel`` as the flags describe it (``megatron/training/mcore_model.py``).

    ``validate_args`` has checked that megatron-core can run the configuration here (and stopped,
    naming each cause, where it cannot).
    """
    from megatron.training.mcore_model import describe_mcore_model, mcore_gpt_model

    model = mcore_gpt_model(get_args(), pre_process, post_process)
    print_rank_0(f"building {describe_mcore_model(model.config)}")
    return model


def forward_step(batch: dict, model: nn.Module) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token losses of one micro-batch and the mask of tokens that count (the attention mask: None, causal)."""
    losses = model(batch["tokens"], batch["position_ids"], None, labels=batch["labels"])
    return losses, batch["loss_mask"]


def main(argv: list[str] | None = None) -> None:
    """Train; a user error at start-up (``UsageError``) is printed once, without a traceback, and every rank
    exits 1. Other exceptions are bugs and keep their traceback."""
    try:
        pretrain(model_provider, forward_step, argv)
    except UsageError as error:
        exit_on_usage_error(error)
    # Finished gloo work freed at interpreter exit can abort the process; collect it first.
    gc.collect()
    if dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1:])
