"""HSDP (2 x 2 mesh at 4 ranks): shard inside dp_shard, replicate across dp_outer."""

from __future__ import annotations

import copy

import torch
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Replicate
from torch.nn.parallel import DistributedDataParallel as DDP

from megatron_fsdp import RaggedShard, comm_stats, fully_shard
from tests.distributed.core.engine_checks import assert_close_params, expect_error, world
from tests.distributed.harness import check, device_type
from tests.models import Block, Net, global_batch, local_batch, loss_fn

SUITE = "hsdp"


def shard_hsdp(model: Net, strategy: str, **kwargs) -> Net:
    for block in model.blocks:
        fully_shard(block, sharding_strategy=strategy, **kwargs)
    fully_shard(model.probe, sharding_strategy=strategy, **kwargs)
    return fully_shard(model, sharding_strategy=strategy, **kwargs)


def parity(strategy: str, **kwargs) -> None:
    rank, n = world()
    torch.manual_seed(0)
    base = Net()
    single, ddp = copy.deepcopy(base), DDP(copy.deepcopy(base), find_unused_parameters=True)
    ours = shard_hsdp(copy.deepcopy(base), strategy, **kwargs)
    opts = [torch.optim.AdamW(m.parameters(), lr=1e-2) for m in (ours, ddp, single)]
    for step in range(4):
        batch = local_batch(step, rank, n)
        for model, batch_ in ((ours, batch), (ddp, batch), (single, global_batch(step, n))):
            loss_fn(model, batch_).backward()
        for opt in opts:
            opt.step()
            opt.zero_grad()
        assert_close_params(ours, ddp.module, exact=False, rtol=0, atol=1e-6, what=f"HSDP {strategy} step {step}")
    assert_close_params(ours, single, exact=False, rtol=1e-5, atol=1e-6, what=f"HSDP {strategy} vs single")


@check(SUITE, world_sizes=(4,))
def hsdp_parity_every_inner_strategy() -> None:
    mesh = init_device_mesh(device_type(), (2, 2), mesh_dim_names=("dp_outer", "dp_shard"))
    for strategy in ("optim_grads_params", "optim_grads", "optim", "no_shard"):
        parity(strategy, mesh=mesh)


@check(SUITE, world_sizes=(4,))
def hsdp_named_dims_in_a_larger_mesh() -> None:
    mesh = init_device_mesh(device_type(), (2, 2, 1), mesh_dim_names=("dp_outer", "dp_shard", "tp"))
    parity("optim_grads_params", mesh=mesh, dp_shard_dim="dp_shard", dp_outer_dim="dp_outer")
    model = fully_shard(Block(), mesh=mesh, dp_shard_dim="dp_shard", dp_outer_dim="dp_outer")
    placements = model.up.weight.placements
    assert placements[0] == Replicate() and isinstance(placements[1], RaggedShard), placements
    # shard over every dp rank of a named mesh: 1-D over the named dimension
    flat = init_device_mesh(device_type(), (4, 1), mesh_dim_names=("dp_shard", "tp"))
    model = fully_shard(Block(), mesh=flat, dp_shard_dim="dp_shard")
    assert len(model.up.weight.placements[0].local_sizes) == 4


@check(SUITE, world_sizes=(4,))
def hsdp_bytes() -> None:
    rank, n = world()
    mesh = init_device_mesh(device_type(), (2, 2), mesh_dim_names=("dp_outer", "dp_shard"))
    model = shard_hsdp(Net(), "optim_grads_params", mesh=mesh)
    batch = local_batch(0, rank, n)
    loss_fn(model, batch).backward()
    comm_stats.reset()
    loss_fn(model, batch).backward()
    scattered = comm_stats.bytes["reduce_scatter"]
    # the outer all-reduce moves each reduced shard: 1/dp_shard of what was reduce-scattered
    assert comm_stats.bytes["all_reduce"] * 2 == scattered, dict(comm_stats.bytes)


@check(SUITE, world_sizes=(4,))
def hsdp_bad_input() -> None:
    mesh = init_device_mesh(device_type(), (2, 2, 1), mesh_dim_names=("dp_outer", "dp_shard", "tp"))
    expect_error(ValueError, "its dimensions are ('dp_outer', 'dp_shard', 'tp')", fully_shard, Block(),
                 mesh=mesh, dp_shard_dim="dp_shard_cp")
    expect_error(ValueError, "dp_outer_dim='outer' is not a dimension", fully_shard, Block(),
                 mesh=mesh, dp_shard_dim="dp_shard", dp_outer_dim="outer")
    expect_error(ValueError, "needs dp_shard_dim", fully_shard, Block(), mesh=mesh, dp_outer_dim="dp_outer")
    expect_error(ValueError, "must come before", fully_shard, Block(), mesh=mesh, dp_shard_dim="dp_outer",
                 dp_outer_dim="dp_shard")
    mesh2 = init_device_mesh(device_type(), (2, 2))
    expect_error(ValueError, "use one of ('no_shard', 'optim')", fully_shard, Block(), mesh=mesh2,
                 outer_sharding_strategy="optim_grads")
    flat = init_device_mesh(device_type(), (4,))
    expect_error(ValueError, "needs an outer data-parallel dimension", fully_shard, Block(), mesh=flat,
                 outer_sharding_strategy="optim")
    expect_error(ValueError, "needs sharding_strategy 'optim_grads' or 'optim_grads_params'", fully_shard, Block(),
                 mesh=mesh2, sharding_strategy="optim", outer_sharding_strategy="optim")


@check(SUITE, world_sizes=(4,))
def hsdp_meta_init_agrees_across_replicas() -> None:
    from megatron_fsdp import materialize_meta
    from tests.distributed.core.init_checks import MetaNet

    rank, _ = world()
    mesh = init_device_mesh(device_type(), (2, 2), mesh_dim_names=("dp_outer", "dp_shard"))
    torch.manual_seed(3)
    eager = MetaNet()
    with torch.device("meta"):
        model = MetaNet()
    for block in model.blocks:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    torch.manual_seed(3 + rank)  # every rank draws differently; global rank 0 must win everywhere
    materialize_meta(model)
    for (name, p), q in zip(model.named_parameters(), eager.parameters()):
        assert torch.equal(p.full_tensor(), q), name
