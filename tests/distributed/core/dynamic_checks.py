"""Units that run on some ranks only (data-dependent execution) train exactly like DDP.

A small mixture of experts: each expert is its own unit, and every rank routes its
tokens by a rule that differs between ranks and steps, so an expert gets tokens on one
rank and none on another, the order in which experts run differs between ranks, an
expert may run on no rank in a step, or twice on one rank and once on another. The
reference is ``DistributedDataParallel(find_unused_parameters=True)`` on the same
batches: bitwise at 2 ranks (a sum of two numbers does not depend on order), within
1e-6 at 4.
"""

from __future__ import annotations

import copy

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.nn.parallel import DistributedDataParallel as DDP

from megatron_fsdp import comm_stats, fully_shard
from tests.distributed.harness import check, device_type

SUITE = "dynamic"
EXPERTS, DIM, TOKENS, STEPS = 4, 8, 6, 6
STRATEGIES = ("no_shard", "optim", "optim_grads", "optim_grads_params")


class Expert(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(DIM, DIM)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.fc(x))


class MoE(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(DIM, DIM)
        self.experts = nn.ModuleList(Expert() for _ in range(EXPERTS))
        self.out = nn.Linear(DIM, DIM)

    def forward(self, x: torch.Tensor, plan: list[tuple[int, list[int]]]) -> torch.Tensor:
        h = self.inp(x)
        y = torch.zeros_like(h)
        for expert, tokens in plan:  # only the experts the plan names run, in its order
            index = torch.tensor(tokens)
            y = y.index_add(0, index, self.experts[expert](h[index]))
        return self.out(y)


def route(case: str, rank: int, step: int) -> list[tuple[int, list[int]]]:
    """Which expert gets which tokens, in which order, on ``rank`` at ``step``."""
    order = [(e + rank + step) % EXPERTS for e in range(EXPERTS)]
    if rank % 2:
        order.reverse()  # experts first run in another order on odd ranks
    if case == "skip":  # one expert idle on each rank, a different one per rank
        used = [e for e in order if e != (step + rank) % EXPERTS]
    elif case == "none":  # one expert idle on every rank
        used = [e for e in order if e != step % EXPERTS]
    else:  # "twice": one expert runs twice on even ranks, once on odd ones
        used = order + ([step % EXPERTS] if rank % 2 == 0 else [])
    plan = []
    for i, expert in enumerate(used):  # tokens dealt round-robin over the calls
        tokens = [t for t in range(TOKENS) if t % len(used) == i]
        if tokens:
            plan.append((expert, tokens))
    return plan


def batch(rank: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(100 * step + rank)
    return torch.randn(TOKENS, DIM, generator=g), torch.randn(TOKENS, DIM, generator=g)


def shard(model: MoE, strategy: str, mesh=None, **kwargs) -> MoE:
    for expert in model.experts:
        fully_shard(expert, mesh=mesh, sharding_strategy=strategy, **kwargs)
    return fully_shard(model, mesh=mesh, sharding_strategy=strategy, **kwargs)


def train_both(case: str, strategy: str, optimizer: str = "sgd", mesh=None, **kwargs) -> None:
    rank, n = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    base = MoE()
    ddp = DDP(copy.deepcopy(base), find_unused_parameters=True)
    ours = shard(copy.deepcopy(base), strategy, mesh, **kwargs)
    make = (lambda p: torch.optim.SGD(p, lr=0.1)) if optimizer == "sgd" else (
        lambda p: torch.optim.AdamW(p, lr=0.01, weight_decay=0.1))
    opts = [make(ours.parameters()), make(ddp.parameters())]
    for step in range(STEPS):
        x, target = batch(rank, step)
        plan = route(case, rank, step)
        for model, opt in zip((ours, ddp), opts):
            opt.zero_grad()
            loss = nn.functional.mse_loss(model(x, plan), target)
            loss.backward()
        reference = dict(ddp.module.named_parameters())
        for name, param in ours.named_parameters():
            expected = reference[name]
            what = f"{case} {strategy} step {step} {name}"
            assert (param.grad is None) == (expected.grad is None), f"{what}: grad None-ness differs"
            if expected.grad is not None:
                compare(param.grad.full_tensor(), expected.grad, n, what + " grad")
        for opt in opts:
            opt.step()
        for name, param in ours.named_parameters():
            compare(param.full_tensor(), reference[name], n, f"{case} {strategy} step {step} {name}")


def compare(actual: torch.Tensor, expected: torch.Tensor, world: int, what: str) -> None:
    if world == 2:
        assert torch.equal(actual, expected), f"{what}: max diff {(actual - expected).abs().max().item():.3g}"
    else:
        torch.testing.assert_close(actual, expected, rtol=1e-6, atol=1e-6, msg=what)


@check(SUITE, params={"routing": ["none"], "optimizer": ["adamw"]})
@check(SUITE, params={"routing": ["skip", "twice"]})
def routed_experts_match_ddp(routing: str, optimizer: str = "sgd") -> None:
    """Gradients (None where DDP's are) and weights as DDP's, with every strategy; ``routing``: see route()."""
    for strategy in STRATEGIES:
        train_both(routing, strategy, optimizer=optimizer)


@check(SUITE, world_sizes=(4,))
def hsdp_with_idle_experts_matches_ddp() -> None:
    mesh = init_device_mesh(device_type(), (2, 2), mesh_dim_names=("dp_outer", "dp_shard"))
    for strategy in ("optim_grads", "optim_grads_params"):
        for outer in ("no_shard", "optim"):
            for case in ("skip", "twice"):
                train_both(case, strategy, mesh=mesh, outer_sharding_strategy=outer)


@check(SUITE)
def whole_model_api_with_idle_experts_matches_ddp() -> None:
    """fully_shard_model + fully_shard_optimizer (Megatron-FSDP's API) on the same routing."""
    from megatron_fsdp import fully_shard_model, fully_shard_optimizer

    rank, n = dist.get_rank(), dist.get_world_size()
    for strategy in (3, 1):
        for case in ("skip", "twice", "none"):
            torch.manual_seed(0)
            base = MoE()
            ddp = DDP(copy.deepcopy(base), find_unused_parameters=True)
            model = fully_shard_model(copy.deepcopy(base), fsdp_unit_modules=[Expert], zero_dp_strategy=strategy)
            opts = [fully_shard_optimizer(torch.optim.SGD(model.parameters(), lr=0.1)),
                    torch.optim.SGD(ddp.parameters(), lr=0.1)]
            for step in range(STEPS):
                x, target = batch(rank, step)
                for m, opt in zip((model, ddp), opts):
                    opt.zero_grad()
                    nn.functional.mse_loss(m(x, route(case, rank, step)), target).backward()
                    opt.step()
            reference = dict(ddp.module.named_parameters())
            for name, param in model.named_parameters():
                compare(param.full_tensor(), reference[name], n, f"whole-model ZeRO-{strategy} {case} {name}")


@check(SUITE)
def zero3_keep_weights_after_forward_with_idle_experts() -> None:
    train_both("skip", "optim_grads_params", reshard_after_forward=False)
    train_both("twice", "optim_grads_params", reshard_after_forward=False)


@check(SUITE, world_sizes=(2,))
def extra_collectives_of_idle_units_are_counted() -> None:
    """What an idle expert costs: its collectives where another rank used it, nothing where none did.

    Expert 0 runs on rank 0 only, expert 3 on no rank: rank 1 still takes part in expert
    0's all-gathers (forward and backward) and reduces zeros for it; expert 3 is gathered
    and reduced nowhere and keeps ``grad is None``. Besides, one control round closes the
    forward and one the backward.
    """
    rank = dist.get_rank()
    model = shard(MoE(), "optim_grads_params")
    x, target = batch(rank, 0)
    plan = [(0, [0, 1]), (1, [2, 3]), (2, [4, 5])] if rank == 0 else [(1, [0, 1, 2]), (2, [3, 4, 5])]
    for _ in range(2):  # the first step agrees the orders
        nn.functional.mse_loss(model(x, plan), target).backward()
    comm_stats.reset()
    nn.functional.mse_loss(model(x, plan), target).backward()
    expert = sum(g.layout.total_numel * 4 for g in model.experts[0].fsdp_unit.groups)
    root = sum(g.layout.total_numel * 4 for g in model.fsdp_unit.groups)
    assert comm_stats.bytes["all_gather"] == root + 2 * 3 * expert, dict(comm_stats.bytes)
    assert comm_stats.bytes["reduce_scatter"] == root + 3 * expert, dict(comm_stats.bytes)
    assert comm_stats.calls["control"] == 2, dict(comm_stats.calls)
    assert model.experts[3].fc.weight.grad is None


@check(SUITE, world_sizes=(2,))
def collectives_out_of_step_raise_on_every_rank() -> None:
    """The closing round compares what each rank issued: a difference raises everywhere, not later."""
    rank = dist.get_rank()
    model = shard(MoE(), "optim_grads_params")
    x, target = batch(rank, 0)
    schedule = model.fsdp_unit.root_state.schedule if model.fsdp_unit.root_state else None
    assert schedule is None  # built by the first forward
    nn.functional.mse_loss(model(x, route("skip", rank, 0)), target).backward()
    schedule = model.fsdp_unit.root_state.schedule

    def one_more_gather_here(*_):  # as if this rank had issued an all-gather the other did not
        if rank == 1:
            schedule._gather_log.append(0)

    model.experts[1].register_forward_pre_hook(one_more_gather_here)
    try:
        model(x, route("skip", rank, 1))
    except RuntimeError as exc:
        assert "collectives out of step across ranks under MoE" in str(exc), exc
    else:
        raise AssertionError("ranks that issued different all-gathers must raise")
