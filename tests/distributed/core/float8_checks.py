"""torchao float8 training under fully_shard: FSDP2's all-gather extension (one spawned group per world size).

torchao's ``convert_to_float8_training(..., Float8LinearConfig(enable_fsdp_float8_all_gather=True))``
makes each ``Float8Linear`` weight a ``WeightWithDynamicFloat8CastTensor``, whose
``fsdp_pre_all_gather`` casts this rank's rows to float8 before the all-gather
(core/gather_extension.py). The shim skips this suite when torchao is not installed.
"""

from __future__ import annotations

import copy

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict, set_model_state_dict
from torch.distributed.fsdp import CPUOffloadPolicy
from torchao.float8 import Float8LinearConfig, convert_to_float8_training, precompute_float8_dynamic_scale_for_fsdp
from torchao.float8.float8_linear import Float8Linear
from torchao.float8.float8_training_tensor import Float8TrainingTensor
from torchao.float8.fsdp_utils import WeightWithDynamicFloat8CastTensor

from megatron_fsdp import MixedPrecisionPolicy, comm_stats, fully_shard
from tests.distributed.core.engine_checks import expect_error, world
from tests.distributed.harness import check

SUITE = "float8"
STEPS = 4


def blocks(bias: bool = True) -> nn.Sequential:
    """Three blocks of two linears each (two float8 weights per unit, of different shapes)."""
    torch.manual_seed(0)
    return nn.Sequential(*[
        nn.Sequential(nn.Linear(64, 128, bias=bias), nn.ReLU(), nn.Linear(128, 64, bias=bias)) for _ in range(3)
    ])


def float8(model: nn.Module) -> nn.Module:
    return convert_to_float8_training(model, config=Float8LinearConfig(enable_fsdp_float8_all_gather=True))


def shard(model: nn.Sequential, **kwargs) -> nn.Sequential:
    for block in model:
        fully_shard(block, **kwargs)
    fully_shard(model, **kwargs)
    return model


def batch(step: int, rank: int, n: int) -> torch.Tensor:
    return torch.randn(16, 64, generator=torch.Generator().manual_seed(1000 + step * n + rank))


def compute_weight_types(model: nn.Module) -> list[type]:
    """Run on every Float8Linear's forward: the type of the weight it computes with."""
    seen: list[type] = []
    for module in model.modules():
        if isinstance(module, Float8Linear):
            module.register_forward_pre_hook(lambda m, _args: seen.append(type(m.weight)))
    return seen


@check(SUITE, params={"precompute": [False, True]})
def float8_gather_matches_ddp(precompute: bool) -> None:
    """Float8 all-gather under fully_shard == DDP with the same recipe: bitwise at 2 ranks, 1e-6 at 4.

    At 4 ranks the plain (bias) gradients' sum runs in another order than DDP's bucket.
    """
    rank, n = world()
    base = float8(blocks())
    ours = shard(copy.deepcopy(base))
    ddp = nn.parallel.DistributedDataParallel(copy.deepcopy(base))
    seen = compute_weight_types(ours)
    opt, opt_ref = (torch.optim.AdamW(m.parameters(), lr=1e-2, weight_decay=0.1) for m in (ours, ddp))
    weights = [m.weight for m in ours.modules() if isinstance(m, Float8Linear)]
    for step in range(STEPS):
        for model in (ours, ddp):
            model(batch(step, rank, n)).square().mean().backward()
        for o in (opt, opt_ref):
            o.step()
            o.zero_grad()
        if precompute:
            precompute_float8_dynamic_scale_for_fsdp(ours)
            for w in weights:  # set on our sharded parameters, from the whole weight's amax
                scale = w._local_tensor._precomputed_scale
                amax = w.full_tensor().abs().max().to(torch.float64).clamp(min=1e-12)
                assert scale is not None and torch.equal(scale, (torch.finfo(torch.float8_e4m3fn).max / amax).float())
        for (name, p), q in zip(ours.named_parameters(), ddp.module.parameters()):
            if n == 2:
                assert torch.equal(p.full_tensor(), q.detach()), f"step {step} {name}"
            else:
                torch.testing.assert_close(p.full_tensor(), q.detach(), rtol=0, atol=1e-6, msg=f"step {step} {name}")
    assert seen and all(t is Float8TrainingTensor for t in seen), set(seen)  # computed with the gathered float8
    for w in weights:  # the sharded parameter keeps torchao's class (its optimizer path, precompute)
        assert isinstance(w._local_tensor, WeightWithDynamicFloat8CastTensor), type(w._local_tensor)


@check(SUITE)
def float8_gather_moves_a_quarter_of_fp32_bytes() -> None:
    """The weights' all-gather bytes of one step: 0.25x fp32, 0.5x bf16, 1 byte per element per gather."""
    rank, n = world()
    numel = sum(p.numel() for p in blocks(bias=False).parameters())
    gathered = {}
    for name, model, policy in (
        ("fp32", blocks(bias=False), None),
        ("bf16", blocks(bias=False), MixedPrecisionPolicy(param_dtype=torch.bfloat16)),
        ("float8", float8(blocks(bias=False)), None),
    ):
        model = shard(model, mp_policy=policy)
        comm_stats.reset()
        model(batch(0, rank, n)).float().square().mean().backward()
        gathered[name] = comm_stats.bytes["all_gather"]
    assert gathered["float8"] == 2 * numel, (gathered, numel)  # forward and backward gathers, float8
    assert gathered["float8"] * 4 == gathered["fp32"] and gathered["float8"] * 2 == gathered["bf16"], gathered
    if rank == 0:
        print(f"float8 all-gather bytes per step: {gathered} (float8/fp32 = {gathered['float8'] / gathered['fp32']})")


@check(SUITE, world_sizes=(2,))
def float8_gather_refuses_what_it_does_not_support() -> None:
    """CPU offload with a float8 all-gather would gather the wrong bytes: refused, naming it."""
    model = float8(blocks())
    expect_error(NotImplementedError, ("all-gather hooks", "WeightWithDynamicFloat8CastTensor", "CPU offload"),
                 fully_shard, model[0], offload_policy=CPUOffloadPolicy())
    dist.barrier()


@check(SUITE, world_sizes=(2,))
def float8_zero2_parity_and_full_state_dict_round_trip() -> None:
    """ZeRO-2 (no weight gather: torchao casts in forward) equals DDP bitwise; a full state dict holds the
    fp32 main weights as plain tensors and loads into a fresh float8 model bitwise."""
    rank, n = world()
    base = float8(blocks())
    ddp = nn.parallel.DistributedDataParallel(copy.deepcopy(base))
    for strategy in ("optim_grads", "optim_grads_params"):
        ours = shard(copy.deepcopy(base), sharding_strategy=strategy)
        ddp.module.load_state_dict(base.state_dict())
        opt, opt_ref = (torch.optim.AdamW(m.parameters(), lr=1e-2, weight_decay=0.1) for m in (ours, ddp))
        for step in range(2):
            for model in (ours, ddp):
                model(batch(step, rank, n)).square().mean().backward()
            for o in (opt, opt_ref):
                o.step()
                o.zero_grad()
        for (name, p), q in zip(ours.named_parameters(), ddp.module.parameters()):
            assert torch.equal(p.full_tensor(), q.detach()), f"{strategy} {name}"
        full = get_model_state_dict(ours, options=StateDictOptions(full_state_dict=True))
        assert all(type(v) is torch.Tensor and v.dtype == torch.float32 for v in full.values()), strategy
        fresh = shard(float8(blocks()), sharding_strategy=strategy)
        set_model_state_dict(fresh, full, options=StateDictOptions(full_state_dict=True))
        for (name, p), q in zip(fresh.named_parameters(), ddp.module.parameters()):
            assert torch.equal(p.full_tensor(), q.detach()), f"{strategy} reloaded {name}"
        x = batch(99, rank, n)
        assert torch.equal(fresh(x), ours(x)), strategy
