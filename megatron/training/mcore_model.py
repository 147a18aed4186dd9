"""``--model-provider mcore``: megatron-core's ``GPTModel`` from the same flags (CUDA and megatron-core only).

Imported only when that provider is chosen; everything else in the front-end
runs without megatron-core.
"""

from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F
from torch import nn


def mcore_gpt_model(args: argparse.Namespace, pre_process: bool = True, post_process: bool = True) -> nn.Module:
    """Build megatron-core's GPTModel (local layer spec, no tensor/pipeline parallelism)."""
    try:
        from megatron.core import parallel_state, tensor_parallel
        from megatron.core.models.gpt import GPTModel
        from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
        from megatron.core.transformer.transformer_config import TransformerConfig
    except ImportError as error:
        raise RuntimeError("--model-provider mcore needs megatron-core: pip install megatron-core") from error
    if not torch.cuda.is_available():
        raise RuntimeError("--model-provider mcore needs a CUDA device (megatron-core's layers are CUDA-only)")
    if not parallel_state.model_parallel_is_initialized():
        parallel_state.initialize_model_parallel(tensor_model_parallel_size=1, pipeline_model_parallel_size=1)
    # megatron-core's weight init and attention dropout draw from its CUDA RNG tracker
    # ("model-parallel-rng"); Megatron-LM seeds it in initialize_megatron, which this front-end replaces.
    tensor_parallel.model_parallel_cuda_manual_seed(args.seed)
    config = TransformerConfig(
        num_layers=args.num_layers, hidden_size=args.hidden_size, ffn_hidden_size=args.ffn_hidden_size,
        num_attention_heads=args.num_attention_heads, num_query_groups=args.num_query_groups,
        init_method_std=args.init_method_std, attention_dropout=args.attention_dropout,
        hidden_dropout=args.hidden_dropout, normalization=args.normalization, gated_linear_unit=args.swiglu,
        activation_func=F.silu if args.swiglu else F.gelu, bf16=args.bf16,
        params_dtype=torch.bfloat16 if args.bf16 else torch.float32,
        calculate_per_token_loss=args.calculate_per_token_loss,
        init_model_with_meta_device=args.init_model_with_meta_device,
    )
    return GPTModel(
        config=config, transformer_layer_spec=get_gpt_layer_local_spec(), vocab_size=args.padded_vocab_size,
        max_sequence_length=args.max_position_embeddings, pre_process=pre_process, post_process=post_process,
        share_embeddings_and_output_weights=not args.untie_embeddings_and_output_weights,
        position_embedding_type=args.position_embedding_type, rotary_base=args.rotary_base,
    )
