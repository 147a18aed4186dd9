"""Mixture-of-Experts with expert parallelism on the FSDP engine, against EP1 and one process.

A small MoE network (dense input and output layers, blocks of norm + ``MoELayer``) is
trained for several AdamW steps three ways from one seed:

- ``reference``: one process, every expert local, every rank's batch run in turn
  (loss: the mean of the ranks' losses, as data parallelism averages them);
- ``EP1``: every rank holds every expert; experts sharded (ZeRO-3) over all ranks;
- ``EP2``: ranks ``[0, 1]`` and ``[2, 3]`` are the EP groups (Megatron's layout), each
  rank holds half the experts, sharded over its expert data-parallel group
  (``{0, 2}`` or ``{1, 3}``); dense parameters sharded over all four ranks.

Batches differ per rank and per step; one step has a single token per rank, so
some local experts get no token on some rank (they run on an empty batch, their
gradient there is zero) while the same expert gets tokens on its EDP peer: the
check asserts this happened.
fp32; tolerance 1e-5 relative to the largest value.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import init_device_mesh

from megatron_fsdp import fully_shard
from megatron_fsdp.api.fully_shard_model import expert_modules, fully_shard_model
from megatron_fsdp.optim.grad_norm import get_grad_norm
from megatron_fsdp.optim.optimizer import fully_shard_optimizer
from tests.distributed.harness import check
from tests.expert_dispatch import ExpertParallel, combine, dispatch
from tests.moe_layer import MoELayer, expert_parameters

SUITE = "moe"
RTOL = 1e-5
HIDDEN, EXPERTS, TOPK, FFN, LAYERS = 8, 8, 2, 12, 2
STEPS = 10
EMPTY_STEP = 3  # one token per rank: most experts get none somewhere


class _Collective(torch.autograd.Function):
    """Identity whose forward and backward each run a blocking all-reduce over every rank.

    Stands for a model's own collective (a TP all-reduce) between units, on a group of
    its own (the model's, not the engine's): a rank that enters it waits there for
    every other rank.
    """

    @staticmethod
    def forward(ctx, x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
        ctx.group = group
        dist.all_reduce(torch.zeros(1), group=group)
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        dist.all_reduce(torch.zeros(1), group=ctx.group)
        return grad, None


class Block(nn.Module):
    def __init__(self, ep: ExpertParallel, layer: int, skip: bool = False,
                 collective: dist.ProcessGroup | None = None) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(HIDDEN)
        self.moe = MoELayer(HIDDEN, EXPERTS, TOPK, FFN, std=0.5, output_std=0.3, aux_loss_coeff=0.01,
                            layer_number=layer, ep=ep, skip_empty_experts=skip)
        self.collective = collective

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.moe(self.norm(x))
        return x + (out if self.collective is None else _Collective.apply(out, self.collective))


class MoENet(nn.Module):
    def __init__(self, ep: ExpertParallel, skip: bool = False, collective: dist.ProcessGroup | None = None) -> None:
        super().__init__()
        self.inp = nn.Linear(HIDDEN, HIDDEN)
        self.blocks = nn.ModuleList(Block(ep, i, skip, collective) for i in range(LAYERS))
        self.out = nn.Linear(HIDDEN, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.inp(x)
        for block in self.blocks:
            x = block(x)
        return self.out(x)


def _batch(step: int, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Rank- and step-dependent batches ``[1, tokens, hidden]`` (one token on ``EMPTY_STEP``)."""
    g = torch.Generator().manual_seed(100 * step + rank)
    tokens = 1 if step == EMPTY_STEP else 3 + (rank + step) % 4
    return torch.randn(1, tokens, HIDDEN, generator=g), torch.randn(1, tokens, 1, generator=g)


def _set_aux_scale(model: nn.Module, scale: float) -> None:
    for module in model.modules():
        if isinstance(module, MoELayer):
            module.aux_loss_scale = scale


@functools.cache
def _reference(world: int, skip: bool = False) -> tuple[list[float], dict[str, torch.Tensor], float]:
    """One process: losses per step, final weights, the last step's gradient norm.

    ``skip``: experts no token reached do not run, so an expert no rank's batch reached
    has no gradient (AdamW leaves it alone), as under FSDP. Computed once per (world, skip) in a
    rank's process and shared by the checks (it depends on nothing else; callers only read it).
    """
    torch.manual_seed(1234)
    model = MoENet(ExpertParallel.single(), skip=skip)
    _set_aux_scale(model, 1.0 / world)  # each rank's auxiliary loss, averaged over ranks like its lm loss
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.01)
    losses, norm = [], 0.0
    for step in range(STEPS):
        optimizer.zero_grad(set_to_none=True)
        total = 0.0
        for rank in range(world):
            x, y = _batch(step, rank)
            loss = F.mse_loss(model(x), y) / world
            loss.backward()
            total += loss.item()
        norm = torch.sqrt(sum((p.grad ** 2).sum() for p in model.parameters() if p.grad is not None)).item()
        optimizer.step()
        losses.append(total)
    return losses, {n: p.detach().clone() for n, p in model.named_parameters()}, norm


@dataclass(frozen=True)
class Setup:
    """How the model is sharded: EP size, API, stages, HSDP, whether empty experts are skipped."""

    ep: int
    whole_model: bool = True
    skip: bool = False
    zero: str | int = 3  # zero_dp_strategy of fully_shard_model (whole model only)
    hsdp: bool = False  # dense part over (dp_outer, dp_shard) = (2, world / 2)
    outer: str = "no_shard"  # outer_dp_sharding_strategy with HSDP


def _meshes(setup: Setup):
    world, ep_size = dist.get_world_size(), setup.ep
    if setup.hsdp:
        dense = init_device_mesh("cpu", (2, world // 2), mesh_dim_names=("dp_outer", "dp_shard"))
    else:
        dense = init_device_mesh("cpu", (world,), mesh_dim_names=("dp_shard",))
    experts = init_device_mesh("cpu", (world // ep_size, ep_size), mesh_dim_names=("dp_shard", "ep"))
    ep = ExpertParallel.from_group(experts.get_group("ep")) if ep_size > 1 else ExpertParallel.single()
    return dense, experts, ep


def _build(setup: Setup):
    dense, experts, ep = _meshes(setup)
    torch.manual_seed(1234)
    model = MoENet(ep, skip=setup.skip, collective=dist.new_group() if setup.skip else None)
    if setup.whole_model:
        wrapped = fully_shard_model(model, fsdp_unit_modules=[Block], device_mesh=dense, expt_device_mesh=experts,
                                    dp_shard_dim="dp_shard", dp_outer_dim="dp_outer" if setup.hsdp else None,
                                    zero_dp_strategy=setup.zero, outer_dp_sharding_strategy=setup.outer,
                                    preserve_fp32_weights=False)
        module = wrapped.module
    else:
        for expert in expert_modules(model):
            fully_shard(expert, mesh=experts["dp_shard"], gradient_scaling=1.0 / dist.get_world_size())
        for block in model.blocks:
            fully_shard(block, mesh=dense)
        module = fully_shard(model, mesh=dense)
    optimizer = fully_shard_optimizer(torch.optim.AdamW(module.parameters(), lr=0.01))
    return module, optimizer, ep


def _global_grad_norm(model: nn.Module, ep: ExpertParallel) -> float:
    """Each parameter once: dense shards over the dense group, expert shards over EDP and then EP."""
    expert = {id(p) for p in expert_parameters(model)}
    dense = [p for p in model.parameters() if id(p) not in expert]
    experts = [p for p in model.parameters() if id(p) in expert]
    dense_sq = get_grad_norm(dense) ** 2
    expert_sq = get_grad_norm(experts, model_parallel_group=ep.group if ep.size > 1 else None) ** 2
    return float((dense_sq + expert_sq).sqrt())


def _skipped_here_ran_there(model: nn.Module) -> bool:
    """Some local expert (same unit index on every rank) got no token on one rank and some on another."""
    empty = torch.tensor([[int(n == 0) for n in m.last_rows_per_local_expert]
                          for m in model.modules() if isinstance(m, MoELayer)])
    lowest, highest = empty.clone(), empty.clone()
    dist.all_reduce(lowest, op=dist.ReduceOp.MIN)
    dist.all_reduce(highest, op=dist.ReduceOp.MAX)
    return bool(((lowest == 0) & (highest == 1)).any())


def _train(setup: Setup) -> tuple[list[float], nn.Module, float, bool, ExpertParallel]:
    model, optimizer, ep = _build(setup)
    skip = setup.skip
    world, rank = dist.get_world_size(), dist.get_rank()
    losses, norm, skipped = [], 0.0, False
    for step in range(STEPS):
        optimizer.zero_grad(set_to_none=True)
        x, y = _batch(step, rank)
        loss = F.mse_loss(model(x).float(), y)
        loss.backward()
        for module in model.modules():
            if isinstance(module, MoELayer):
                local = module.ep.local_experts(EXPERTS)
                received = module.last_rows_per_local_expert
                skipped |= not skip and step == EMPTY_STEP and any(n == 0 for n in received) and len(local) > 0
                assert len(received) == len(local)
        if skip:
            skipped |= _skipped_here_ran_there(model)
        total = loss.detach().clone() / world
        dist.all_reduce(total)
        losses.append(total.item())
        norm = _global_grad_norm(model, ep)
        optimizer.step()
    return losses, model, norm, skipped, ep


def _full_weights(model: nn.Module, ep: ExpertParallel) -> dict[str, torch.Tensor]:
    """Every weight in full, experts under their global names (gathered over EDP, then across EP)."""
    out = {}
    for name, param in model.named_parameters():
        full = param.full_tensor() if hasattr(param, "full_tensor") else param.detach()
        if ".local_experts." in name:
            prefix, rest = name.split(".local_experts.")
            local, attr = rest.split(".", 1)
            pieces = [torch.empty_like(full) for _ in range(ep.size)]
            if ep.size > 1:
                dist.all_gather(pieces, full.contiguous(), group=ep.group)
            else:
                pieces = [full]
            per_rank = EXPERTS // ep.size
            for r, piece in enumerate(pieces):
                out[f"{prefix}.local_experts.{r * per_rank + int(local)}.{attr}"] = piece
        else:
            out[name] = full
    return out


def _close(actual: torch.Tensor | float, expected: torch.Tensor | float, what: str) -> float:
    """Max difference relative to the largest expected value; raises above ``RTOL``."""
    actual, expected = torch.as_tensor(actual).float(), torch.as_tensor(expected).float()
    scale = expected.abs().max().clamp(min=1e-12)
    error = ((actual - expected).abs().max() / scale).item()
    assert error <= RTOL, f"{what}: max relative difference {error:.3g} > {RTOL}"
    return error


def _compare(setup: Setup) -> float:
    """Train under ``setup`` and compare losses, the last gradient norm and every final weight with one process.

    Asserts that some expert got no token on some rank (the empty-expert step, or
    with ``skip`` an expert unit skipped on one rank and run on another). Returns the
    largest relative difference seen.
    """
    ref_losses, ref_weights, ref_norm = _reference(dist.get_world_size(), skip=setup.skip)
    losses, model, norm, skipped, group = _train(setup)
    flags = torch.tensor([int(skipped)])
    dist.all_reduce(flags)
    assert flags.item() > 0, "no rank had a local expert without tokens (skipped here and run elsewhere with skip)"
    worst = 0.0
    for step, (a, b) in enumerate(zip(losses, ref_losses)):
        worst = max(worst, _close(a, b, f"loss at step {step}"))
    worst = max(worst, _close(norm, ref_norm, "gradient norm of the last step"))
    weights = _full_weights(model, group)
    assert set(weights) == set(ref_weights), sorted(set(weights) ^ set(ref_weights))
    for name, expected in ref_weights.items():
        worst = max(worst, _close(weights[name], expected, f"weight {name} after {STEPS} steps"))
    if dist.get_rank() == 0:  # the measured figure, for docs/moe.md (pytest -s shows it)
        print(f"moe {setup}: max relative difference {worst:.3g}", flush=True)
    return worst


@check(SUITE, world_sizes=(4,), params={"ep": [1, 2], "api": ["per_module", "whole_model"]})
def parity(ep: int, api: str) -> None:
    """EP1 and EP2 under ZeRO-3 match one process over several steps, an empty-expert step included."""
    _compare(Setup(ep, whole_model=api == "whole_model"))


@check(SUITE, world_sizes=(2, 4), params={"ep": [1, 2], "api": ["per_module", "whole_model"]})
def skipped_experts(ep: int, api: str) -> None:
    """Experts no token reached do not run (their units' hooks do not fire), between blocking collectives.

    Routing depends on each rank's batch, so an expert unit runs on one rank and is
    skipped on its peer within the same step; a blocking all-reduce of the model
    follows every MoE layer in forward and backward (beside EP2's all-to-alls).
    Experts have equal sizes: collectives issued in different orders would pair
    one expert's gradients with another's, so every weight is compared.
    """
    _compare(Setup(ep, whole_model=api == "whole_model", skip=True))


@check(SUITE, world_sizes=(4,), params={"outer": ["no_shard", "optim"], "skip": [False, True]})
def hsdp_parity(outer: str, skip: bool) -> None:
    """EP2 with the dense part under HSDP (2 replicas x 2 shards), experts over EDP, against one process."""
    _compare(Setup(2, hsdp=True, outer=outer, skip=skip))


@check(SUITE, world_sizes=(4,), params={"zero": ["no_shard", "optim", "optim_grads"]})
def stage_parity(zero: str) -> None:
    """EP2 with the other sharding stages (dense and expert units alike) against one process."""
    _compare(Setup(2, zero=zero))


@check(SUITE, world_sizes=(4,))
def dispatch_round_trip() -> None:
    """Dispatch then combine with identity experts returns each token times the sum of its k probabilities."""
    ep = ExpertParallel.from_group(init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "ep")).get_group("ep"))
    g = torch.Generator().manual_seed(dist.get_rank())
    x = torch.randn(5, HIDDEN, generator=g, requires_grad=True)
    indices = torch.stack([torch.randperm(EXPERTS, generator=g)[:TOPK] for _ in range(5)])
    probs = torch.rand(5, TOPK, generator=g)
    grouped, plan = dispatch(x, indices, EXPERTS, ep)
    out = combine(grouped * 2.0, probs, plan, ep, 5)
    _close(out.detach(), x.detach() * 2.0 * probs.sum(1, keepdim=True), "round trip")
    out.sum().backward()
    _close(x.grad, (2.0 * probs.sum(1, keepdim=True)).expand(5, HIDDEN), "gradient of the round trip")
