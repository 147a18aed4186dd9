"""HSDP with outer_sharding_strategy='optim' (2 x 2 mesh at 4 ranks).

Main weights, gradients and optimizer state split across all four ranks;
compute weights sharded only within dp_shard (see megatron_fsdp/sharding/outer_shard.py).
Figures (worst errors, bytes) are printed by rank 0: run pytest with ``-s``.
"""

from __future__ import annotations

import copy

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor
from torch.nn.parallel import DistributedDataParallel as DDP

import megatron_fsdp
from megatron_fsdp.checkpoint import load_state, save_state
from megatron_fsdp.comm.collectives import comm_stats
from megatron_fsdp.core.microbatch import microbatch
from megatron_fsdp.core.mixed_precision import MixedPrecisionPolicy
from megatron_fsdp.fully_shard import fully_shard
from megatron_fsdp.optim.grad_norm import clip_grad_norm_
from megatron_fsdp.sharding.no_shard import fsdp_no_shard
from megatron_fsdp.sharding.ragged_shard import RaggedShard
from tests.distributed.core.accumulation_checks import single_process_adamw
from tests.distributed.core.engine_checks import assert_close_params, expect_error, world
from tests.distributed.harness import check, device_type, shared_tmpdir
from tests.models import Net, global_batch, local_batch, loss_fn

SUITE = "hsdp_optim"
INNER = ("optim_grads_params", "optim_grads")


def hsdp_mesh():
    return init_device_mesh(device_type(), (2, 2), mesh_dim_names=("dp_outer", "dp_shard"))


def shard_outer_optim(model: Net, strategy: str = "optim_grads_params", **kwargs) -> Net:
    kwargs.setdefault("mesh", hsdp_mesh())
    kwargs.setdefault("outer_sharding_strategy", "optim")
    for block in model.blocks:
        fully_shard(block, sharding_strategy=strategy, **kwargs)
    fully_shard(model.probe, sharding_strategy=strategy, **kwargs)
    return fully_shard(model, sharding_strategy=strategy, **kwargs)


def groups_of(model: nn.Module) -> list:
    return [g for m in model.modules() if isinstance(m, megatron_fsdp.FSDPModule) for g in m.fsdp_unit.groups]


def report(text: str) -> None:
    if dist.get_rank() == 0:
        print(f"[hsdp_optim] {text}", flush=True)


def train_parity(strategy: str, steps: int = 4, mark_tiny: bool = False, **kwargs) -> tuple[float, float]:
    """Train ours, DDP and single-process side by side; return the worst relative errors."""
    rank, n = world()
    torch.manual_seed(0)
    base = Net()
    single, ddp = copy.deepcopy(base), DDP(copy.deepcopy(base), find_unused_parameters=True)
    ours = copy.deepcopy(base)
    if mark_tiny:
        fsdp_no_shard(ours.tiny)
    ours = shard_outer_optim(ours, strategy, **kwargs)
    opts = [torch.optim.AdamW(m.parameters(), lr=1e-2, weight_decay=0.1) for m in (ours, ddp, single)]
    worst_ddp = 0.0
    for step in range(steps):
        for model, batch in ((ours, local_batch(step, rank, n)), (ddp, local_batch(step, rank, n)),
                             (single, global_batch(step, n))):
            loss_fn(model, batch).backward()
        for opt in opts:
            opt.step()
            opt.zero_grad()
        worst_ddp = max(worst_ddp, assert_close_params(ours, ddp.module, exact=False, rtol=0, atol=1e-6,
                                                       what=f"outer optim {strategy} step {step} vs DDP"))
    worst_single = assert_close_params(ours, single, exact=False, rtol=1e-5, atol=1e-6,
                                       what=f"outer optim {strategy} vs single")
    return worst_ddp, worst_single


@check(SUITE, world_sizes=(4,))
def parity_with_ddp_and_single_process() -> None:
    for strategy in INNER:
        worst_ddp, worst_single = train_parity(strategy)
        report(f"{strategy}: 4 AdamW steps, worst rel. error vs DDP {worst_ddp:.2e}, vs single {worst_single:.2e}")
    # a no_shard-marked parameter (a replicated group) and named dimensions of a larger mesh
    mesh = init_device_mesh(device_type(), (2, 2, 1), mesh_dim_names=("dp_outer", "dp_shard", "tp"))
    worst_ddp, worst_single = train_parity("optim_grads_params", steps=2, mark_tiny=True, mesh=mesh,
                                           dp_shard_dim="dp_shard", dp_outer_dim="dp_outer")
    report(f"named dims + no_shard param: vs DDP {worst_ddp:.2e}, vs single {worst_single:.2e}")
    # dp_shard of size 1: plain ZeRO-1 over dp_outer (compute weights whole, no dp_shard collectives)
    mesh = init_device_mesh(device_type(), (4, 1), mesh_dim_names=("dp_outer", "dp_shard"))
    worst_ddp, worst_single = train_parity("optim_grads_params", steps=2, mesh=mesh)
    report(f"(4, 1) mesh: vs DDP {worst_ddp:.2e}, vs single {worst_single:.2e}")


@check(SUITE, world_sizes=(4,))
def bitwise_equal_to_outer_replicate_also_in_bf16() -> None:
    """At 2 x 2 both outer strategies sum the same two numbers per element: results must be bitwise equal."""
    rank, n = world()
    torch.manual_seed(0)
    base = Net()
    for policy in (None, MixedPrecisionPolicy(param_dtype=torch.bfloat16)):
        models = [shard_outer_optim(copy.deepcopy(base), outer_sharding_strategy=outer, mp_policy=policy)
                  for outer in ("optim", "no_shard")]
        opts = [torch.optim.AdamW(m.parameters(), lr=1e-2) for m in models]
        for step in range(3):
            losses = []
            for model, opt in zip(models, opts):
                loss = loss_fn(model, local_batch(step, rank, n))
                loss.backward()
                opt.step()
                opt.zero_grad()
                losses.append(loss.detach())
            assert torch.equal(*losses), (policy, step, losses)
        expected = {k: p.full_tensor() for k, p in models[1].named_parameters()}
        for name, p in models[0].named_parameters():
            assert torch.equal(p.full_tensor(), expected[name]), (policy, name)


@check(SUITE, world_sizes=(4,))
def optimizer_state_split_across_all_ranks() -> None:
    torch.manual_seed(0)
    model = shard_outer_optim(Net())
    rank, n = world()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    loss_fn(model, local_batch(0, rank, n)).backward()
    opt.step()
    local = total = 0
    for p in model.parameters():
        placement = p.placements
        assert len(placement) == 1 and isinstance(placement[0], RaggedShard), placement
        assert p.device_mesh.size() == 4 and sum(placement[0].local_sizes) == p.shape[0], placement
        if p in opt.state:
            exp_avg = opt.state[p]["exp_avg"]
            assert isinstance(exp_avg, DTensor) and exp_avg.placements == p.placements
            local += exp_avg.to_local().numel()
            total += exp_avg.numel()
    counts = torch.tensor([local])
    dist.all_reduce(counts)
    assert counts.item() == total, (counts.item(), total)  # each element held by exactly one rank
    shares = [torch.zeros(1, dtype=torch.long) for _ in range(n)]
    dist.all_gather(shares, torch.tensor([local]))
    shares = [s.item() for s in shares]
    report(f"exp_avg elements per rank {shares} of {total} (1/4 = {total / 4:.0f})")
    assert max(shares) <= 0.3 * total and min(shares) >= 0.2 * total, (shares, total)
    # compute weights: one dp_shard-sized shard per group, main piece 1/outer of it
    for g in groups_of(model):
        if g.outer is not None:
            assert g.compute_shard.numel() == 2 * g.shard.numel() == g.layout.total_numel // 2


@check(SUITE, world_sizes=(4,))
def bytes_per_step() -> None:
    rank, n = world()
    torch.manual_seed(0)
    model = shard_outer_optim(Net())
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    for step in range(2):
        comm_stats.reset()
        loss_fn(model, local_batch(step, rank, n)).backward()
        opt.step()
        opt.zero_grad()
    groups = groups_of(model)
    probe = {id(g) for g in model.probe.fsdp_unit.groups}
    inner_shard_bytes = sum(g.compute_shard.numel() * g.compute_shard.element_size() for g in groups)
    reduced = [g for g in groups if g._grad_indices and id(g) not in probe]  # the probe never gets gradients
    reduced_bytes = sum(g.compute_shard.numel() * g.compute_shard.element_size() for g in reduced)
    stats = dict(comm_stats.bytes)
    # once per step: each group's compute shard rebuilt, each reduced group's gradients scattered
    assert stats["all_gather_outer"] == inner_shard_bytes, (stats, inner_shard_bytes)
    assert stats["reduce_scatter_outer"] == reduced_bytes, (stats, reduced_bytes)
    assert comm_stats.calls["all_gather_outer"] == len(groups), dict(comm_stats.calls)
    assert stats.get("all_reduce", 0) == 0, stats  # nothing replicated across dp_outer any more
    # the dp_shard collectives are those of plain ZeRO-3 on the (unchanged) flat buffers
    total = sum(g.layout.total_numel * 4 for g in reduced)
    assert stats["reduce_scatter"] == total, (stats, total)
    report(f"bytes per step: {stats}; inner-shard bytes all groups {inner_shard_bytes}, "
           f"trainable groups {reduced_bytes}")


@check(SUITE, world_sizes=(4,))
def gradient_clipping_parity() -> None:
    rank, n = world()
    torch.manual_seed(0)
    base = Net()
    for clip in ("torch", "ours"):
        ddp = DDP(copy.deepcopy(base), find_unused_parameters=True)
        model = shard_outer_optim(copy.deepcopy(base))
        batch = local_batch(0, rank, n)
        loss_fn(model, batch).backward()
        loss_fn(ddp, batch).backward()
        if clip == "torch":
            norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5)
            norm = norm.full_tensor() if isinstance(norm, DTensor) else norm
        else:
            norm = clip_grad_norm_(model, 0.5)
        ref = torch.nn.utils.clip_grad_norm_(ddp.parameters(), 0.5)
        torch.testing.assert_close(norm, ref, rtol=1e-6, atol=0, msg=clip)
        assert ref > 0.5, "the test must actually clip"
        grads = {k: p.grad for k, p in ddp.module.named_parameters()}
        for name, p in model.named_parameters():
            if grads[name] is None:
                assert p.grad is None, name
            else:
                torch.testing.assert_close(p.grad.full_tensor(), grads[name], rtol=1e-6, atol=1e-7,
                                           msg=f"{clip} {name}")
        report(f"clip_grad_norm_ ({clip}): norm {norm.item():.6f}, DDP {ref.item():.6f}")


@check(SUITE, world_sizes=(4,))
def meta_init_bitwise_equal_to_eager() -> None:
    from megatron_fsdp.core.meta_init import materialize_meta
    from tests.distributed.core.init_checks import MetaNet

    rank, n = world()
    torch.manual_seed(3)
    eager = MetaNet()
    with torch.device("meta"):
        model = MetaNet()
    mesh = hsdp_mesh()
    for block in model.blocks:
        fully_shard(block, mesh=mesh, outer_sharding_strategy="optim")
    fully_shard(model, mesh=mesh, outer_sharding_strategy="optim")
    torch.manual_seed(3 + rank)  # every rank draws differently: data-parallel rank 0 must win everywhere
    materialize_meta(model)
    for (name, p), q in zip(model.named_parameters(), eager.parameters()):
        assert torch.equal(p.full_tensor(), q), name
    tokens = local_batch(0, rank, n)
    with torch.no_grad():  # the compute weights rebuilt from the main pieces are the same too
        assert torch.equal(model(tokens[:, :-1]), eager(tokens[:, :-1]))


@check(SUITE, world_sizes=(4,))
def microbatch_and_no_sync_accumulation() -> None:
    rank, n = world()
    k, steps = 3, 2
    torch.manual_seed(0)
    base = Net()
    single = single_process_adamw(base, steps, n, k)
    for strategy in INNER:
        model = shard_outer_optim(copy.deepcopy(base), strategy)
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
        for step in range(steps):
            comm_stats.reset()
            refreshes = sum(g.refreshes for g in groups_of(model))
            micro = global_batch(step, n, per_rank=2 * k).chunk(n)[rank].chunk(k)
            for i, batch in enumerate(micro):
                with microbatch(model, is_first=(i == 0), is_last=(i == k - 1)):
                    (loss_fn(model, batch) / k).backward()
            optimizer.step()
            optimizer.zero_grad()
        groups = groups_of(model)
        reducing = [g for g in groups if g._grad_indices and g not in model.probe.fsdp_unit.groups]
        calls = dict(comm_stats.calls)
        # compute weights rebuilt once per step; gradients reduce-scattered inside dp_shard every
        # micro-batch and across dp_outer once per step (issue 38: was every micro-batch)
        assert calls["all_gather_outer"] == len(groups), (strategy, calls)
        assert sum(g.refreshes for g in groups) - refreshes == len(groups), strategy
        assert calls["reduce_scatter_outer"] == len(reducing), (strategy, calls, len(reducing))
        assert calls["reduce_scatter"] == k * len(reducing), (strategy, calls)
        worst = assert_close_params(model, single, exact=False, rtol=1e-5, atol=1e-6, what=f"microbatch {strategy}")
        report(f"microbatch k={k} {strategy}: worst rel. error vs single {worst:.2e}, calls/step {calls}")
    # no_sync: local full gradients accumulate; the synced backward reduces the sum once
    ddp = DDP(copy.deepcopy(base), find_unused_parameters=True)
    ours = shard_outer_optim(copy.deepcopy(base))
    micro = [local_batch(s, rank, n) for s in range(3)]
    comm_stats.reset()
    for model, context in ((ours, ours.no_sync), (ddp, ddp.no_sync)):
        with context():
            for b in micro[:-1]:
                (loss_fn(model, b) / 3).backward()
        (loss_fn(model, micro[-1]) / 3).backward()
    reducing = [g for g in groups_of(ours) if g._grad_indices and g not in ours.probe.fsdp_unit.groups]
    assert comm_stats.calls["reduce_scatter_outer"] == len(reducing), dict(comm_stats.calls)
    grads = {k: p.grad for k, p in ddp.module.named_parameters()}
    for name, p in ours.named_parameters():
        if grads[name] is None:
            assert p.grad is None, name
        else:
            torch.testing.assert_close(p.grad.full_tensor(), grads[name], rtol=1e-6, atol=1e-7, msg=name)




def zero3_1d(model: Net) -> Net:
    mesh = init_device_mesh(device_type(), (dist.get_world_size(),))
    for block in model.blocks:
        fully_shard(block, mesh=mesh)
    fully_shard(model.probe, mesh=mesh)
    return fully_shard(model, mesh=mesh)


@check(SUITE, world_sizes=(4,))
def checkpoint_reshards_to_and_from_1d_zero3() -> None:
    rank, n = world()
    layouts = {"outer_optim": shard_outer_optim, "zero3_1d": zero3_1d}
    for source, target in (("outer_optim", "zero3_1d"), ("zero3_1d", "outer_optim")):
        torch.manual_seed(0)
        base = Net()
        saved = layouts[source](copy.deepcopy(base))
        opt = torch.optim.AdamW(saved.parameters(), lr=1e-2, weight_decay=0.1)
        for step in range(2):
            loss_fn(saved, local_batch(step, rank, n)).backward()
            opt.step()
            opt.zero_grad()
        torch.manual_seed(1)
        loaded = layouts[target](Net())  # different initial weights: the load must overwrite them
        opt2 = torch.optim.AdamW(loaded.parameters(), lr=1e-2, weight_decay=0.1)
        with shared_tmpdir("hsdp_optim_") as tmp:
            save_state(f"{tmp}/ckpt", saved, opt)
            load_state(f"{tmp}/ckpt", loaded, opt2)
        expected = {k: p.full_tensor() for k, p in saved.named_parameters()}
        for name, p in loaded.named_parameters():
            assert torch.equal(p.full_tensor(), expected[name]), f"{source} -> {target} {name}"
        fqn = dict((id(p), k) for k, p in loaded.named_parameters())
        ref_state = {k: opt.state[p] for k, p in saved.named_parameters() if p in opt.state}
        for p, state in opt2.state.items():
            for key in ("exp_avg", "exp_avg_sq"):
                assert torch.equal(state[key].full_tensor(), ref_state[fqn[id(p)]][key].full_tensor()), key
        for step in range(2, 4):  # training goes on identically
            for model, optimizer in ((saved, opt), (loaded, opt2)):
                loss_fn(model, local_batch(step, rank, n)).backward()
                optimizer.step()
                optimizer.zero_grad()
        expected = {k: p.full_tensor() for k, p in saved.named_parameters()}
        for name, p in loaded.named_parameters():
            torch.testing.assert_close(p.full_tensor(), expected[name], rtol=0, atol=1e-6, msg=f"resumed {name}")


@check(SUITE, world_sizes=(4,))
def bad_input_errors() -> None:
    mesh = hsdp_mesh()
    for strategy in ("optim", "no_shard"):
        expect_error(ValueError, "outer_sharding_strategy='optim' needs sharding_strategy 'optim_grads' or "
                     f"'optim_grads_params' (gradients sharded within dp_shard), got sharding_strategy={strategy!r}",
                     fully_shard, Net(), mesh=mesh, sharding_strategy=strategy, outer_sharding_strategy="optim")
    flat = init_device_mesh(device_type(), (4,))
    expect_error(ValueError, "needs an outer data-parallel dimension", fully_shard, Net(), mesh=flat,
                 outer_sharding_strategy="optim")
    expect_error(ValueError, "use one of ('no_shard', 'optim')", fully_shard, Net(), mesh=mesh,
                 outer_sharding_strategy="optim_grads")
    expect_error(ValueError, "is not a permutation", RaggedShard, 0, (1, 2), (0, 0))
    placement = RaggedShard(0, (3, 0, 2, 1), order=(0, 2, 1, 3))  # mesh rank 2's rows come second
    assert [placement.offset(r) for r in range(4)] == [0, 5, 3, 5], placement
    assert placement != RaggedShard(0, (3, 0, 2, 1)) and "order=(0, 2, 1, 3)" in repr(placement)
