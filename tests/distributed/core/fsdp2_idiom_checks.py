"""FSDP2's idioms on ``megatron_fsdp.fully_shard``: the same code, only the import changed.

Scenarios follow PyTorch's FSDP2 tests (test/distributed/_composable/fsdp/); each is
compared with a reference that holds the same weights unsharded.
"""

from __future__ import annotations

import copy

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

from megatron_fsdp import fully_shard
from tests.distributed.harness import check, device
from tests.models import ResidualMLP as MLP

SUITE = "fsdp2_idioms"
STRATEGIES = ("optim_grads_params", "optim_grads", "optim", "no_shard")


def make_model() -> nn.Sequential:
    return nn.Sequential(nn.Linear(7, 12), MLP(), MLP(), nn.Linear(12, 5))


def full_copy(model: nn.Module) -> nn.Module:
    """A plain model holding ``model``'s current (gathered) weights."""
    plain = make_model()
    plain.load_state_dict({k: v.full_tensor() if isinstance(v, DTensor) else v
                           for k, v in model.state_dict().items()})
    return plain


@check(SUITE)
def meta_device_init_with_to_empty_and_reset_parameters() -> None:
    """torchtitan's recipe: build on meta, fully_shard, to_empty, reset_parameters: train on those weights."""
    rank = dist.get_rank()
    for strategy in STRATEGIES:
        torch.manual_seed(0)
        with torch.device("meta"):
            model = make_model()
        for block in model[1:3]:
            fully_shard(block, sharding_strategy=strategy)
        fully_shard(model, sharding_strategy=strategy)
        model.to_empty(device=device())
        torch.manual_seed(42)
        for module in model.modules():
            if hasattr(module, "reset_parameters"):
                module.reset_parameters()
        assert all(isinstance(p, DTensor) and not p.is_meta for p in model.parameters()), strategy
        reference = full_copy(model)
        opts = [torch.optim.AdamW(m.parameters(), lr=1e-2) for m in (model, reference)]
        for step in range(3):
            g = torch.Generator().manual_seed(step)
            x = torch.randn(4 * dist.get_world_size(), 7, generator=g)
            local = x.chunk(dist.get_world_size())[rank]
            losses = []
            for m, opt, batch in ((model, opts[0], local), (reference, opts[1], x)):
                opt.zero_grad()
                loss = m(batch).square().mean()  # ours: gradients averaged over the ranks' equal batches
                loss.backward()
                if m is model:
                    loss = loss.detach().clone()
                    dist.all_reduce(loss)
                    loss /= dist.get_world_size()
                losses.append(loss)
                opt.step()
            torch.testing.assert_close(losses[0], losses[1], rtol=1e-5, atol=1e-6,
                                       msg=f"{strategy} step {step}: the forward must use the initialised weights")
        for (name, p), q in zip(model.named_parameters(), reference.parameters()):
            torch.testing.assert_close(p.full_tensor(), q, rtol=1e-5, atol=1e-6, msg=f"{strategy} {name}")


@check(SUITE, world_sizes=(2,))
def module_to_after_fully_shard_keeps_the_shards() -> None:
    """``model.to(same device)`` / ``float()`` after fully_shard change nothing; a new dtype is refused."""
    torch.manual_seed(0)
    model = make_model()
    base = copy.deepcopy(model)
    for block in model[1:3]:
        fully_shard(block)
    fully_shard(model)
    model.to(device()).float()
    x = torch.randn(3, 7)
    torch.testing.assert_close(model(x), base(x))
    try:
        model.to(torch.float64)
    except NotImplementedError as exc:
        assert "before fully_shard" in str(exc), exc
    else:
        raise AssertionError("casting a sharded module must raise")
