"""megatron-core's GPTModel as pretrain_gpt.py builds it, for the front-end's unit tests (on conftest.py's
``one_gloo_rank``)."""

from __future__ import annotations


def small(*flags: str):
    """megatron-core's GPTModel from the flags (1 rank): 2 layers, hidden 32, 4 heads, vocabulary 50, no dropout;
    later flags override these."""
    from megatron.training.arguments import parse_args, validate_args
    from megatron.training.mcore_model import mcore_gpt_model

    args = validate_args(parse_args(["--mock-data", "--vocab-size", "50", "--num-layers", "2", "--hidden-size", "32",
                                     "--num-attention-heads", "4", "--seq-length", "16", "--attention-dropout", "0",
                                     "--hidden-dropout", "0", *flags]), 1)
    args.padded_vocab_size = 50
    return mcore_gpt_model(args)
