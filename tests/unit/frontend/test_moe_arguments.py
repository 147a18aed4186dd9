"""pretrain_gpt.py's Mixture-of-Experts flags: derived sizes and the combinations refused by name."""

from __future__ import annotations

import pytest
import torch

from megatron.training.arguments import ArgumentError, parse_args, validate_args
from tests.unit.frontend.mcore_helpers import small

BASE = ["--mock-data", "--vocab-size", "64"]
# GeLU experts as megatron-core 0.16.1 runs them: without biases, the bias-GeLU unfused (mcore_model.mcore_blockers)
EXPERTS = ["--disable-bias-linear", "--no-bias-gelu-fusion"]
MOE = ["--num-experts", "4", "--moe-router-topk", "2", *EXPERTS]


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
    (["--num-experts", "6", *EXPERTS, "--use-megatron-fsdp", "--expert-model-parallel-size", "4"],
     "--num-experts (6) must be divisible by --expert-model-parallel-size (4)"),
    (["--num-experts", "2", "--moe-router-topk", "3", *EXPERTS],
     "--moe-router-topk (3) must be between 1 and --num-experts (2)"),
    ([*MOE, "--expert-model-parallel-size", "2"], "--expert-model-parallel-size > 1 needs --use-megatron-fsdp"),
    ([*MOE, "--tensor-model-parallel-size", "2"],
     "--num-experts with --tensor-model-parallel-size > 1 without --sequence-parallel"),
    ([*MOE, "--context-parallel-size", "2"], "--num-experts with --context-parallel-size > 1"),
    ([*MOE, "--moe-aux-loss-coeff", "-1"], "--moe-aux-loss-coeff must be a finite number >= 0"),
    ([*MOE, "--use-megatron-fsdp", "--expert-model-parallel-size", "4", "--expert-tensor-parallel-size", "2"],
     "--expert-model-parallel-size (4) x --expert-tensor-parallel-size (2) must divide the world size (4)"),
    ([*MOE, "--expert-tensor-parallel-size", "2"],
     "--expert-tensor-parallel-size 2 other than --tensor-model-parallel-size (1) needs --expert-model-parallel-size"),
])
def test_rejected(flags, message):
    with pytest.raises(ArgumentError) as info:
        args_for(*flags)
    assert message in str(info.value)


def test_accepted_on_megatron_cores_moe_layer():
    """What megatron-core's MoELayer runs: per-token loss, expert TP under expert parallelism."""
    assert args_for(*MOE, "--calculate-per-token-loss").calculate_per_token_loss
    etp = args_for(*MOE, "--use-megatron-fsdp", "--expert-model-parallel-size", "2",
                   "--expert-tensor-parallel-size", "2")
    assert etp.expert_data_parallel_size == 1


def test_moe_gpt_trains_its_router_and_is_reproducible(one_gloo_rank):
    """megatron-core's MoE GPT builds and runs, the router gets gradients, and one seed gives the same weights
    twice."""
    flags = ("--hidden-size", "16", "--seq-length", "8", "--vocab-size", "32", "--num-experts", "4",
             "--moe-router-topk", "2", "--moe-ffn-hidden-size", "8", "--moe-aux-loss-coeff", "0.01", *EXPERTS)
    torch.manual_seed(3)
    model = small(*flags)
    layers = model.decoder.layers
    assert all(type(layer.mlp).__name__ == "MoELayer" for layer in layers)
    positions = torch.arange(8).expand(2, 8)
    losses = model(torch.randint(0, 32, (2, 8)), positions, None, labels=torch.randint(0, 32, (2, 8)))
    losses.mean().backward()
    router = layers[0].mlp.router.weight
    assert router.grad is not None and router.grad.abs().sum() > 0  # routing probabilities and aux loss
    torch.manual_seed(3)
    again = small(*flags)
    for a, b in zip(model.parameters(), again.parameters()):
        assert torch.equal(a, b)
    experts = layers[1].mlp.experts.local_experts
    assert not torch.equal(experts[0].linear_fc1.weight, experts[1].linear_fc1.weight)
