"""Gradient accumulation, gradient scaling and no-shard parameters (one spawned group)."""

from __future__ import annotations

import copy

import torch
from torch import nn
from torch.distributed.tensor import DTensor, Replicate
from torch.nn.parallel import DistributedDataParallel as DDP

import megatron_fsdp
from megatron_fsdp import comm_stats, fsdp_no_shard, fully_shard, microbatch
from megatron_fsdp.sharding.no_shard import is_marked_no_shard
from tests.distributed.core.engine_checks import shard_net, world
from tests.distributed.harness import check, device
from tests.models import Block, Net, global_batch, local_batch, loss_fn

SUITE = "accumulation"
STRATEGIES = ("no_shard", "optim", "optim_grads", "optim_grads_params")


def groups_of(model: nn.Module):
    return [g for m in model.modules() if isinstance(m, megatron_fsdp.FSDPModule) for g in m.fsdp_unit.groups]


def ddp_grads(model: nn.Module, batch: torch.Tensor) -> dict[str, torch.Tensor | None]:
    ddp = DDP(copy.deepcopy(model), find_unused_parameters=True)
    loss_fn(ddp, batch).backward()
    return {k: p.grad for k, p in ddp.module.named_parameters()}


def full_grads(model: nn.Module) -> dict[str, torch.Tensor | None]:
    return {k: None if p.grad is None else p.grad.full_tensor() for k, p in model.named_parameters()}


@check(SUITE)
def gradient_scaling_modes() -> None:
    rank, n = world()
    torch.manual_seed(0)
    base = Net()
    batch = local_batch(0, rank, n)
    mean = ddp_grads(base, batch)
    for strategy in ("optim_grads_params", "no_shard"):
        for scaling, factor in (("mean", 1.0), ("sum", float(n)), (0.25, 0.25 * n)):
            model = shard_net(copy.deepcopy(base), strategy, gradient_scaling=scaling)
            loss_fn(model, batch).backward()
            for name, grad in full_grads(model).items():
                if mean[name] is None:
                    assert grad is None, name
                    continue
                torch.testing.assert_close(grad, mean[name] * factor, rtol=1e-6, atol=1e-7,
                                           msg=f"{strategy} scaling={scaling} {name}")
    model = shard_net(copy.deepcopy(base), "optim_grads_params")
    model.set_gradient_scaling("sum")
    loss_fn(model, batch).backward()
    torch.testing.assert_close(full_grads(model)["blocks.0.up.weight"], mean["blocks.0.up.weight"] * n)
    try:
        fully_shard(Block(), gradient_scaling="avg")
    except ValueError as e:
        assert "gradient_scaling='avg'" in str(e) and "'sum'" in str(e)
    else:
        raise AssertionError("bad gradient_scaling accepted")


def train_with_microbatches(model: nn.Module, steps: int, k: int, use_context: bool) -> list[dict]:
    rank, n = world()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    calls = []
    for step in range(steps):
        comm_stats.reset()
        micro = global_batch(step, n, per_rank=2 * k).chunk(n)[rank].chunk(k)
        for i, batch in enumerate(micro):
            if use_context:
                with microbatch(model, is_first=(i == 0), is_last=(i == k - 1)):
                    (loss_fn(model, batch) / k).backward()
            else:
                (loss_fn(model, batch) / k).backward()
        optimizer.step()
        optimizer.zero_grad()
        calls.append(dict(comm_stats.calls))
    return calls


def single_process_adamw(base: nn.Module, steps: int, n: int, k: int) -> nn.Module:
    """``base`` trained in one process on each step's whole global batch (``k`` micro-batches per rank)."""
    single = copy.deepcopy(base)
    opt = torch.optim.AdamW(single.parameters(), lr=1e-2)
    for step in range(steps):
        loss_fn(single, global_batch(step, n, per_rank=2 * k)).backward()
        opt.step()
        opt.zero_grad()
    return single


@check(SUITE)
def microbatch_parity_and_collective_counts() -> None:
    rank, n = world()
    k, steps = 3, 3
    torch.manual_seed(0)
    base = Net()
    single = single_process_adamw(base, steps, n, k)
    for strategy in STRATEGIES:
        model = shard_net(copy.deepcopy(base), strategy)
        calls = train_with_microbatches(model, steps, k, use_context=True)
        ref = dict(single.named_parameters())
        for name, p in model.named_parameters():
            torch.testing.assert_close(p.full_tensor(), ref[name].detach(), rtol=1e-5, atol=1e-6,
                                       msg=f"{strategy} {name}")
        groups = groups_of(model)
        gathering = sum(g.gathers for g in groups)
        grad_groups = sum(bool(g._grad_indices) for g in groups)
        probe_grad_groups = sum(bool(g._grad_indices) for g in model.probe.fsdp_unit.groups)
        reducing = grad_groups - probe_grad_groups  # the probe never receives gradients
        last = calls[-1]
        if strategy in ("optim", "optim_grads"):
            # weights refreshed once per step, not once per micro-batch
            assert last.get("all_gather", 0) == gathering, (strategy, last, gathering)
        if strategy in ("no_shard", "optim"):
            assert last.get("all_reduce", 0) == reducing, (strategy, last, reducing)  # last micro-batch only
        else:
            assert last.get("reduce_scatter", 0) == k * reducing, (strategy, last, reducing)
    # Outside the context: correctness first, so ZeRO-2 refreshes weights every micro-batch.
    model = shard_net(copy.deepcopy(base), "optim_grads")
    calls = train_with_microbatches(model, 1, k, use_context=False)
    assert calls[0]["all_gather"] == k * sum(g.gathers for g in groups_of(model)), calls


@check(SUITE, world_sizes=(2,))
def microbatch_with_only_children_wrapped() -> None:
    rank, n = world()
    torch.manual_seed(0)
    base = nn.Sequential(nn.Embedding(17, 13), Block(), Block(), nn.Linear(13, 17))
    single = copy.deepcopy(base)
    model = copy.deepcopy(base)
    for child in model:
        fully_shard(child, sharding_strategy="optim")
    k = 2
    micro = global_batch(0, n, per_rank=2 * k).chunk(n)[rank].chunk(k)
    for i, batch in enumerate(micro):
        with microbatch(model, is_first=(i == 0), is_last=(i == k - 1)):
            (loss_fn(model, batch) / k).backward()
    loss_fn(single, global_batch(0, n, per_rank=2 * k)).backward()
    for (name, p), q in zip(model.named_parameters(), single.parameters()):
        torch.testing.assert_close(p.grad.full_tensor(), q.grad, rtol=1e-5, atol=1e-6, msg=name)
    assert all(u.microbatch is None for u in (c.fsdp_unit for c in model)), "flags not restored"
    try:
        with microbatch(nn.Linear(2, 2), is_first=True):
            pass
    except ValueError as e:
        assert "no fully_shard-ed module" in str(e)
    else:
        raise AssertionError("microbatch accepted a module without units")


class TowerModel(nn.Module):
    """A language model with a frozen 'vision tower' and a trainable scalar gate."""

    def __init__(self) -> None:
        super().__init__()
        self.tower = Block()
        self.tower.requires_grad_(False)
        self.net = Net(layers=2)
        self.gate = nn.Parameter(torch.tensor(0.5))  # 0-dim: replicated automatically

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.net.embed(tokens)
        x = x + self.gate * self.tower(x)
        for block in self.net.blocks:
            x = block(x)
        return self.net.head(x)


def shard_tower_model(model: TowerModel, mark: bool) -> TowerModel:
    if mark:
        fsdp_no_shard(model.tower)
        fsdp_no_shard(model.net.tiny)  # a single trainable parameter
    tower = fully_shard(model.tower)
    # an all-no-shard module is still a unit: its replicated gradients must be all-reduced
    assert isinstance(tower, megatron_fsdp.FSDPModule)
    for block in model.net.blocks:
        fully_shard(block)
    fully_shard(model)
    return model


@check(SUITE)
def no_shard_tower_same_results_fewer_collectives() -> None:
    rank, n = world()
    torch.manual_seed(0)
    base = TowerModel()
    runs = {}
    for mark in (False, True):
        model = shard_tower_model(copy.deepcopy(base), mark)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        losses, gathered = [], []
        for step in range(3):
            comm_stats.reset()
            loss = loss_fn(model, local_batch(step, rank, n))
            loss.backward()
            opt.step()
            opt.zero_grad()
            losses.append(loss.item())
            gathered.append(comm_stats.bytes["all_gather"])
        runs[mark] = (model, losses, gathered)
    (plain, plain_losses, plain_bytes), (marked, marked_losses, marked_bytes) = runs[False], runs[True]
    # Not bitwise: without hooks around the tower, autograd sums the three gradient
    # contributions to the embedding output in another order.
    torch.testing.assert_close(marked_losses, plain_losses, rtol=1e-6, atol=0)
    for (name, p), q in zip(marked.named_parameters(), plain.parameters()):
        torch.testing.assert_close(p.full_tensor(), q.full_tensor(), rtol=1e-5, atol=1e-6, msg=name)
    tower_bytes = sum(p.numel() * 4 for p in base.tower.parameters())
    assert marked_bytes[-1] <= plain_bytes[-1] - 2 * tower_bytes, (marked_bytes, plain_bytes, tower_bytes)
    assert isinstance(marked.tower.up.weight, DTensor) and marked.tower.up.weight.placements == (Replicate(),)
    assert marked.net.tiny.placements == (Replicate(),) and marked.gate.placements == (Replicate(),)
    if rank == 0:
        print(f"no-shard tower: all-gather bytes/step {plain_bytes[-1]} -> {marked_bytes[-1]}")


@check(SUITE, world_sizes=(2,))
def no_shard_mark_survives_meta_materialisation() -> None:
    with torch.device("meta"):
        tower = Block()
    fsdp_no_shard(tower)
    tower.to_empty(device=device())  # replaces every Parameter object
    assert all(is_marked_no_shard(m, p) for m in tower.modules() for p in m.parameters(recurse=False))
    assert not is_marked_no_shard(Block(), Block().up.weight)
    try:
        fsdp_no_shard("tower")
    except TypeError as e:
        assert "nn.Module or nn.Parameter" in str(e)
    else:
        raise AssertionError
