"""Parameters that get no gradient on any rank keep ``.grad`` as it was (None), as DDP and FSDP2 do.

Each check trains a small model whose units hold a parameter unused on every rank next to
used ones (in a block and in the root unit) and a branch whose use changes per step and
rank, with AdamW (weight decay, so a zero gradient would move a parameter), and compares
parameter values and the pattern of ``.grad is None`` with DDP(find_unused_parameters=True)
and with a single-process replica over the global batch.
"""

from __future__ import annotations

import copy

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from megatron_fsdp import fully_shard
from tests.distributed.harness import check

SUITE = "unused_params"
STEPS = 4
BATCH = 4  # per rank
WIDTH = 8


class Block(nn.Module):
    """``used`` always, ``branch`` when asked, ``never`` not at all."""

    def __init__(self) -> None:
        super().__init__()
        self.used = nn.Linear(WIDTH, WIDTH)
        self.branch = nn.Linear(WIDTH, WIDTH)
        self.never = nn.Linear(WIDTH, WIDTH)

    def forward(self, x: torch.Tensor, take_branch: bool) -> torch.Tensor:
        x = torch.tanh(self.used(x))
        return x + self.branch(x) if take_branch else x


class UnusedNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(Block() for _ in range(2))
        self.head = nn.Linear(WIDTH, 1)
        self.pooler = nn.Linear(WIDTH, WIDTH)  # in the root unit, never used (BERT's pooler in MLM)

    def forward(self, x: torch.Tensor, take_branch: bool) -> torch.Tensor:
        for block in self.blocks:
            x = block(x, take_branch)
        return self.head(x)


def branch_taken(step: int, rank: int) -> bool:
    """Step 0: rank 0 only; step 1: no rank; then every rank; then rank 0 only again."""
    return (rank == 0, False, True, rank == 0)[step % 4]


def batch(step: int, rank: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(1000 * step + rank)
    return torch.randn(BATCH, WIDTH, generator=g)


def make_optimizer(model: nn.Module) -> torch.optim.Optimizer:
    return torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)


def grad_pattern(model: nn.Module) -> dict[str, bool]:
    return {name: p.grad is None for name, p in model.named_parameters()}


def single_process(base: nn.Module, world: int, steps: int) -> tuple[nn.Module, list[dict[str, bool]]]:
    """Each rank's loss (mean over its batch) summed per rank and averaged over ranks: the data-parallel loss."""
    model = copy.deepcopy(base)
    opt = make_optimizer(model)
    patterns = []
    for step in range(steps):
        opt.zero_grad()
        loss = sum(model(batch(step, r), branch_taken(step, r)).pow(2).mean() for r in range(world)) / world
        loss.backward()
        patterns.append(grad_pattern(model))
        opt.step()
    return model, patterns


def train_sharded(base: nn.Module, strategy: str, steps: int) -> tuple[nn.Module, list[dict[str, bool]]]:
    rank = dist.get_rank()
    model = copy.deepcopy(base)
    for block in model.blocks:
        fully_shard(block, sharding_strategy=strategy)
    fully_shard(model, sharding_strategy=strategy)
    opt = make_optimizer(model)
    patterns = []
    for step in range(steps):
        opt.zero_grad()
        model(batch(step, rank), branch_taken(step, rank)).pow(2).mean().backward()
        patterns.append(grad_pattern(model))
        opt.step()
    return model, patterns


def train_ddp(base: nn.Module, steps: int) -> tuple[nn.Module, list[dict[str, bool]]]:
    rank = dist.get_rank()
    model = DDP(copy.deepcopy(base), find_unused_parameters=True)
    opt = make_optimizer(model)
    patterns = []
    for step in range(steps):
        opt.zero_grad()
        model(batch(step, rank), branch_taken(step, rank)).pow(2).mean().backward()
        patterns.append(grad_pattern(model.module))
        opt.step()
    return model.module, patterns


@check(SUITE, world_sizes=(2, 4), params={"strategy": ["no_shard", "optim", "optim_grads", "optim_grads_params"]})
def unused_parameters_keep_grad_none(strategy: str) -> None:
    torch.manual_seed(0)
    base = UnusedNet()
    world = dist.get_world_size()
    sharded, sharded_patterns = train_sharded(base, strategy, STEPS)
    ddp, ddp_patterns = train_ddp(base, STEPS)
    ref, ref_patterns = single_process(base, world, STEPS)
    assert ddp_patterns == ref_patterns, "the references disagree on which gradients are None"
    for step, (got, want) in enumerate(zip(sharded_patterns, ref_patterns)):
        wrong = sorted(name for name in want if got[name] != want[name])
        assert not wrong, f"step {step}: .grad is None differs from DDP for {wrong} (want {[want[n] for n in wrong]})"
    ddp_params = dict(ddp.named_parameters())
    for name, p in sharded.named_parameters():
        torch.testing.assert_close(p.full_tensor(), ddp_params[name].detach(), rtol=1e-6, atol=1e-7, msg=name)
    for name, p in ref.named_parameters():
        torch.testing.assert_close(ddp_params[name].detach(), p.detach(), rtol=1e-6, atol=1e-7, msg=name)


@check(SUITE, world_sizes=(2, 4), params={"strategy": ["no_shard", "optim_grads_params"]})
def no_sync_counts_gradients_of_earlier_micro_batches(strategy: str) -> None:
    """The branch is used in micro-batch 1 only (on every rank at step 0, on rank 0 only at step 1):
    its gradient, accumulated under set_requires_gradient_sync(False), is reduced and installed."""
    torch.manual_seed(0)
    base = UnusedNet()
    rank = dist.get_rank()
    model = copy.deepcopy(base)
    for block in model.blocks:
        fully_shard(block, sharding_strategy=strategy)
    fully_shard(model, sharding_strategy=strategy)
    ddp = DDP(copy.deepcopy(base), find_unused_parameters=True)
    opts = [make_optimizer(model), make_optimizer(ddp)]
    for step in range(2):
        for opt in opts:
            opt.zero_grad()
        takes = [step == 0 or rank == 0, False]  # micro-batch 1, micro-batch 2
        for micro, take in enumerate(takes):
            last = micro == len(takes) - 1
            model.set_requires_gradient_sync(last)
            model(batch(10 * step + micro, rank), take).pow(2).mean().backward()
            if last:
                ddp(batch(10 * step + micro, rank), take).pow(2).mean().backward()
            else:
                with ddp.no_sync():
                    ddp(batch(10 * step + micro, rank), take).pow(2).mean().backward()
        got, want = grad_pattern(model), grad_pattern(ddp.module)
        wrong = sorted(name for name in want if got[name] != want[name])
        assert not wrong, f"step {step}: .grad is None differs from DDP for {wrong}"
        assert not want["blocks.0.branch.weight"] and want["blocks.0.never.weight"], "the check lost its point"
        for opt in opts:
            opt.step()
    ddp_params = dict(ddp.module.named_parameters())
    for name, p in model.named_parameters():
        torch.testing.assert_close(p.full_tensor(), ddp_params[name].detach(), rtol=1e-6, atol=1e-7, msg=name)
