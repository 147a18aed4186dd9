"""Pre-train a GPT with Megatron-LM's flags on megatron_fsdp (or DDP without --use-megatron-fsdp).

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
from megatron.training.gpt_model import GPTConfig, GPTModel
from megatron.training.initialize import print_rank_0
from megatron.training.megatron_flags import moe_layer_pattern
from megatron.training.parallel_state import get_context_parallel, get_expert_parallel, get_tensor_parallel
from megatron.training.training import pretrain
from megatron_fsdp.parallel.moe import set_aux_loss_scale


def model_provider(pre_process: bool = True, post_process: bool = True) -> nn.Module:
    """The GPT the flags describe: megatron-core's ``GPTModel`` or the project's own (``--model-provider``).

    ``validate_args`` resolved ``--model-provider auto`` into ``args.model_provider``
    and the reason, which the start-up line prints.
    """
    args = get_args()
    if args.model_provider == "mcore":
        from megatron.training.mcore_model import describe_mcore_model, mcore_gpt_model

        model = mcore_gpt_model(args, pre_process, post_process)
        print_rank_0(f"building {describe_mcore_model(model.config)}: {args.model_provider_reason}")
        return model
    print_rank_0(f"building the project's own GPT (megatron/training/gpt_model.py): {args.model_provider_reason}")
    model = GPTModel(GPTConfig(
        num_layers=args.num_layers, hidden_size=args.hidden_size, ffn_hidden_size=args.ffn_hidden_size,
        num_attention_heads=args.num_attention_heads, num_query_groups=args.num_query_groups,
        vocab_size=args.padded_vocab_size, max_position_embeddings=args.max_position_embeddings,
        position_embedding_type=args.position_embedding_type, normalization=args.normalization,
        swiglu=args.swiglu, untie_embeddings_and_output_weights=args.untie_embeddings_and_output_weights,
        init_method_std=args.init_method_std, attention_dropout=args.attention_dropout,
        hidden_dropout=args.hidden_dropout, rotary_base=args.rotary_base, num_experts=args.num_experts,
        moe_router_topk=args.moe_router_topk, moe_ffn_hidden_size=args.moe_ffn_hidden_size,
        moe_aux_loss_coeff=args.moe_aux_loss_coeff, kv_channels=args.kv_channels,
        layernorm_epsilon=args.layernorm_epsilon, add_bias_linear=args.add_bias_linear,
        qk_layernorm=args.qk_layernorm,
        moe_layer_pattern=tuple(moe_layer_pattern(args)) if args.num_experts is not None else None,
    ), tp=get_tensor_parallel(), cp=get_context_parallel(), ep=get_expert_parallel())
    set_aux_loss_scale(model, 1.0 / args.num_microbatches)  # Megatron's: per micro-batch, as the lm loss
    return model


def forward_step(batch: dict, model: nn.Module) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token losses of one micro-batch and the mask of tokens that count."""
    if get_args().model_provider == "mcore":  # megatron-core's forward takes an attention mask (causal: None)
        losses = model(batch["tokens"], batch["position_ids"], None, labels=batch["labels"])
    else:
        losses = model(batch["tokens"], batch["position_ids"], labels=batch["labels"])
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
