"""pretrain_gpt.py's Mixture-of-Experts flags: derived sizes and the combinations refused by name."""

from __future__ import annotations

import pytest
import torch

from megatron.training.arguments import ArgumentError, parse_args, validate_args
from megatron.training.gpt_model import GPTConfig, GPTModel
from megatron_fsdp.parallel.moe import MoELayer

BASE = ["--mock-data", "--vocab-size", "64"]
MOE = ["--num-experts", "4", "--moe-router-topk", "2"]


def args_for(*flags: str, world_size: int = 4):
    return validate_args(parse_args([*BASE, *flags]), world_size)


def test_expert_data_parallel_size():
    args = args_for(*MOE, "--use-megatron-fsdp", "--expert-model-parallel-size", "2",
                    "--moe-token-dispatcher-type", "alltoall")
    assert args.expert_data_parallel_size == 2 and args.data_parallel_size == 4
    assert args_for(*MOE).expert_data_parallel_size == 4


def test_hsdp_with_expert_parallelism_is_accepted():
    """HSDP on the dense part (2 instances) beside EP2: experts over their EDP group of world / EP ranks."""
    args = args_for(*MOE, "--use-megatron-fsdp", "--expert-model-parallel-size", "2",
                    "--num-distributed-optimizer-instances", "2")
    assert args.expert_data_parallel_size == 2 and args.num_distributed_optimizer_instances == 2


@pytest.mark.parametrize("flags, message", [
    (["--expert-model-parallel-size", "2"], "--expert-model-parallel-size 2 needs --num-experts"),
    ([*MOE, "--use-megatron-fsdp", "--expert-model-parallel-size", "3"],
     "--expert-model-parallel-size (3) must be >= 1 and divide the world size (4)"),
    (["--num-experts", "6", "--use-megatron-fsdp", "--expert-model-parallel-size", "4"],
     "--num-experts (6) must be divisible by --expert-model-parallel-size (4)"),
    (["--num-experts", "2", "--moe-router-topk", "3"], "--moe-router-topk (3) must be between 1 and --num-experts (2)"),
    ([*MOE, "--expert-model-parallel-size", "2"], "--expert-model-parallel-size > 1 needs --use-megatron-fsdp"),
    ([*MOE, "--tensor-model-parallel-size", "2"], "--num-experts with --tensor-model-parallel-size > 1"),
    ([*MOE, "--context-parallel-size", "2"], "--num-experts with --context-parallel-size > 1"),
    ([*MOE, "--calculate-per-token-loss"], "--num-experts with --calculate-per-token-loss"),
    ([*MOE, "--moe-aux-loss-coeff", "-1"], "--moe-aux-loss-coeff must be a finite number >= 0"),
    ([*MOE, "--use-megatron-fsdp", "--expert-model-parallel-size", "4", "--expert-tensor-parallel-size", "2"],
     "--expert-model-parallel-size (4) x --expert-tensor-parallel-size (2) must divide the world size (4)"),
    ([*MOE, "--expert-tensor-parallel-size", "2"],
     "--expert-tensor-parallel-size 2 other than --tensor-model-parallel-size (1) needs --expert-model-parallel-size"),
    ([*MOE, "--use-megatron-fsdp", "--expert-model-parallel-size", "2", "--expert-tensor-parallel-size", "2"],
     "--num-experts with --expert-tensor-parallel-size 2 on this front-end's own GPT"),
])
def test_rejected(flags, message):
    with pytest.raises(ArgumentError) as info:
        args_for(*flags)
    assert message in str(info.value)


def test_moe_gpt_trains_its_router_and_is_reproducible():
    """The MoE GPT builds and runs, the router gets gradients, and one seed gives the same weights twice."""
    config = GPTConfig(num_layers=2, hidden_size=16, num_attention_heads=4, vocab_size=32, max_position_embeddings=8,
                       num_experts=4, moe_router_topk=2, moe_ffn_hidden_size=8, moe_aux_loss_coeff=0.01,
                       attention_dropout=0.0, hidden_dropout=0.0)
    torch.manual_seed(3)
    model = GPTModel(config)
    assert all(isinstance(layer.mlp, MoELayer) for layer in model.layers)
    losses = model(torch.randint(0, 32, (2, 8)), labels=torch.randint(0, 32, (2, 8)))
    losses.mean().backward()
    router = model.layers[0].mlp.router.weight
    assert router.grad is not None and router.grad.abs().sum() > 0  # routing probabilities and aux loss
    torch.manual_seed(3)
    again = GPTModel(config)
    for a, b in zip(model.parameters(), again.parameters()):
        assert torch.equal(a, b)
    experts = model.layers[1].mlp.local_experts
    assert not torch.equal(experts[0].fc1_weight, experts[1].fc1_weight)
