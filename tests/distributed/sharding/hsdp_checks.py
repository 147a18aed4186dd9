"""HSDP (2 x 2 mesh at 4 ranks): shard inside dp_shard, replicate across dp_outer."""

from __future__ import annotations

import copy

import torch
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Replicate
from torch.nn.parallel import DistributedDataParallel as DDP

from megatron_fsdp import RaggedShard, comm_stats, fully_shard, fully_shard_model, microbatch
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


def _outer_traffic_of_a_step(model: Net, opt: torch.optim.Optimizer, outer: str, step: int, micro: int,
                             is_last: bool | None) -> tuple[int, int, dict[str, torch.Tensor]]:
    """One optimizer step over ``micro`` micro-batches; the dp_outer group's calls and bytes, and the
    gradients the step saw (full tensors)."""
    rank, n = world()
    comm_stats.reset()
    for m in range(micro):
        last = (m == micro - 1) if is_last is not None else None
        with microbatch(model, is_first=m == 0, is_last=last):
            loss_fn(model, local_batch(step * 8 + m, rank, n)).backward()
    grads = {name: p.grad.full_tensor() for name, p in model.named_parameters() if p.grad is not None}
    opt.step()
    opt.zero_grad()
    return comm_stats.group_calls[outer], comm_stats.group_bytes[outer], grads


@check(SUITE, world_sizes=(4,), params={"strategy": ["optim_grads_params", "optim_grads", "optim", "no_shard"],
                                        "outer": ["no_shard"]})
@check(SUITE, world_sizes=(4,), params={"strategy": ["optim_grads_params", "optim_grads"], "outer": ["optim"]})
def hsdp_outer_reduction_once_per_step(strategy: str, outer: str) -> None:
    """Under microbatch(..., is_last=False) the dp_outer reduction runs once per optimizer step:
    its calls and bytes per step are the same for 1 to 8 micro-batches, where reducing every
    micro-batch (is_last=None) grows them linearly; the gradients the step sees equal that path's,
    bitwise at one micro-batch (the same sums in the same order), else within 1e-6 relative
    (norm; fp32 sums of 2 replicas x n micro-batches in another order)."""
    mesh = init_device_mesh(device_type(), (2, 2), mesh_dim_names=("dp_outer", "dp_shard"))
    outer_name = mesh.get_group("dp_outer").group_name
    torch.manual_seed(0)
    base = Net()
    deferred, per_micro = {}, {}
    for micro in (1, 2, 4, 8):
        traffic = []
        for is_last in (True, None):  # True: say which micro-batch is last (deferred); None: reduce every one
            model = shard_hsdp(copy.deepcopy(base), strategy, mesh=mesh, outer_sharding_strategy=outer)
            opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
            _outer_traffic_of_a_step(model, opt, outer_name, 0, micro, is_last)  # warm-up step
            traffic.append(_outer_traffic_of_a_step(model, opt, outer_name, 1, micro, is_last))
        (calls, nbytes, grads), (ref_calls, ref_bytes, ref_grads) = traffic
        deferred[micro], per_micro[micro] = (calls, nbytes), (ref_calls, ref_bytes)
        assert grads.keys() == ref_grads.keys(), (sorted(grads), sorted(ref_grads))
        for name, grad in grads.items():
            if micro == 1:
                assert torch.equal(grad, ref_grads[name]), f"{strategy}/{outer} {name}: one micro-batch differs"
            else:
                err = ((grad - ref_grads[name]).norm() / ref_grads[name].norm().clamp_min(1e-12)).item()
                assert err <= 1e-6, f"{strategy}/{outer} {name} at {micro} micro-batches: relative error {err}"
    assert deferred[1][0] > 0, f"{strategy}/{outer}: no traffic recorded on dp_outer ({outer_name})"
    assert all(deferred[m] == deferred[1] for m in deferred), (strategy, outer, deferred)
    # the per-micro-batch path's outer reductions grow with the micro-batches (what deferral saves)
    assert per_micro[8][0] > per_micro[1][0] and per_micro[1] == deferred[1], (strategy, outer, per_micro, deferred)
    if world()[0] == 0:
        print(f"hsdp outer per step {strategy}/{outer}: deferred {deferred}, per micro-batch {per_micro}")


@check(SUITE, world_sizes=(4,), params={"outer": ["no_shard", "optim"]})
def hsdp_deferred_outer_reduction_guards_the_step(outer: str) -> None:
    """An optimizer step after non-last micro-batches only (the outer reduction deferred, never run)
    raises, naming the cause; the step's last micro-batch then reduces everything, as one
    micro-batch of the summed batches would (1e-6 relative)."""
    rank, n = world()
    mesh = init_device_mesh(device_type(), (2, 2), mesh_dim_names=("dp_outer", "dp_shard"))
    torch.manual_seed(0)
    base = Net()
    model = shard_hsdp(copy.deepcopy(base), "optim_grads_params", mesh=mesh, outer_sharding_strategy=outer)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    for m in range(2):
        with microbatch(model, is_first=m == 0, is_last=False):
            loss_fn(model, local_batch(m, rank, n)).backward()
    expect_error(RuntimeError, "was deferred by microbatch(..., is_last=False) and has not run", opt.step)
    with microbatch(model, is_first=False, is_last=True):
        loss_fn(model, local_batch(2, rank, n)).backward()
    ddp = DDP(copy.deepcopy(base), find_unused_parameters=True)
    for m in range(3):
        loss_fn(ddp, local_batch(m, rank, n)).backward()
    ref = dict(ddp.module.named_parameters())
    for name, p in model.named_parameters():
        if p.grad is None:
            assert ref[name].grad is None, name
            continue
        expected = ref[name].grad
        err = ((p.grad.full_tensor() - expected).norm() / expected.norm().clamp_min(1e-12)).item()
        assert err <= 1e-6, f"{outer} {name}: relative error {err}"
    opt.step()


@check(SUITE, world_sizes=(4,), params={"outer": [0, "optim"]})
def hsdp_whole_model_api_reduces_outer_once_per_step(outer: str | int) -> None:
    """fully_shard_model(..., sync_model_each_microbatch=False): backwards accumulate, finish_grad_sync
    reduces across dp_outer once (the same calls and bytes for 1 and 4 micro-batches); gradients equal
    the per-micro-batch path's (sync_model_each_microbatch=True) within 1e-6 relative."""
    rank, n = world()
    mesh = init_device_mesh(device_type(), (2, 2), mesh_dim_names=("dp_outer", "dp_shard"))
    outer_name = mesh.get_group("dp_outer").group_name
    torch.manual_seed(0)
    base = Net()
    seen = {}
    for micro in (1, 4):
        grads = []
        for sync_each in (False, True):
            model = fully_shard_model(copy.deepcopy(base), fsdp_unit_modules=[Block], device_mesh=mesh,
                                      dp_shard_dim="dp_shard", dp_outer_dim="dp_outer", zero_dp_strategy=3,
                                      outer_dp_sharding_strategy=outer, sync_model_each_microbatch=sync_each)
            comm_stats.reset()
            for m in range(micro):
                loss_fn(model, local_batch(m, rank, n)).backward()
            model.finish_grad_sync()
            if not sync_each:
                seen[micro] = (comm_stats.group_calls[outer_name], comm_stats.group_bytes[outer_name])
            grads.append({k: p.grad.full_tensor() for k, p in model.module.named_parameters() if p.grad is not None})
        assert grads[0].keys() == grads[1].keys()
        for k, g in grads[0].items():
            err = ((g - grads[1][k]).norm() / grads[1][k].norm().clamp_min(1e-12)).item()
            assert err <= 1e-6, f"{outer} {k} at {micro} micro-batches: relative error {err}"
    assert seen[1][0] > 0 and seen[1] == seen[4], (outer, seen)


@check(SUITE, world_sizes=(4,), params={"outer": ["no_shard", "optim"]})
def hsdp_deferred_outer_partial_in_the_policys_precision(outer: str) -> None:
    """With bf16 gradient communication and fp32 main gradients, the dp_shard-reduced parts of non-last
    micro-batches are summed in fp32 (main_grads_dtype), and the step's gradients match reducing every
    micro-batch within 1e-2 relative (bf16 communication: 8 mantissa bits, another order of roundings)."""
    from megatron_fsdp import MixedPrecisionPolicy
    from megatron_fsdp.core.lookup import units_of

    rank, n = world()
    mesh = init_device_mesh(device_type(), (2, 2), mesh_dim_names=("dp_outer", "dp_shard"))
    policy = MixedPrecisionPolicy(main_grads_dtype=torch.float32, grad_comm_dtype=torch.bfloat16)
    torch.manual_seed(0)
    base = Net()
    grads = []
    for is_last in (True, None):
        model = shard_hsdp(copy.deepcopy(base), "optim_grads_params", mesh=mesh, outer_sharding_strategy=outer,
                           mp_policy=policy)
        for m in range(4):
            last = (m == 3) if is_last is not None else None
            with microbatch(model, is_first=m == 0, is_last=last):
                loss_fn(model, local_batch(m, rank, n)).backward()
            if is_last is not None and m == 2:
                held = [g.partial_outer for u in units_of(model) for g in u.groups if g.partial_outer is not None]
                assert held and all(p.dtype == torch.float32 for p in held), [p.dtype for p in held]
        grads.append({k: p.grad.full_tensor() for k, p in model.named_parameters() if p.grad is not None})
    assert grads[0].keys() == grads[1].keys()
    for k, g in grads[0].items():
        err = ((g - grads[1][k]).norm() / grads[1][k].norm().clamp_min(1e-12)).item()
        assert err <= 1e-2, f"{outer} {k}: relative error {err}"
