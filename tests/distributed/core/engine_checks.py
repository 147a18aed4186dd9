"""Checks of the core engine, run inside one spawned gloo group (see harness)."""

from __future__ import annotations

import copy

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor
from torch.nn.parallel import DistributedDataParallel as DDP

import megatron_fsdp
from megatron_fsdp import EngineOptions, RaggedShard, comm_stats, fully_shard
from megatron_fsdp.core.lookup import units_of
from tests.distributed.harness import check, device_type
from tests.models import Block, Net, global_batch, local_batch, loss_fn

SUITE = "engine"
STEPS = 6


def shard_net(model: Net, strategy: str, **kwargs) -> Net:
    for block in model.blocks:
        fully_shard(block, sharding_strategy=strategy, **kwargs)
    fully_shard(model.probe, sharding_strategy=strategy, **kwargs)
    fully_shard(model, sharding_strategy=strategy, **kwargs)
    return model


def world() -> tuple[int, int]:
    return dist.get_rank(), dist.get_world_size()


def make_optimizer(kind: str, params):
    if kind == "adamw":
        return torch.optim.AdamW(params, lr=1e-2, weight_decay=0.1)
    if kind == "adamw_fused":
        return torch.optim.AdamW(params, lr=1e-2, weight_decay=0.1, fused=True)
    if kind == "adamw_single":
        return torch.optim.AdamW(params, lr=1e-2, weight_decay=0.1, foreach=False)
    return torch.optim.SGD(params, lr=0.1, momentum=0.9)


def assert_close_params(
    sharded: nn.Module, reference: nn.Module, *, exact: bool, rtol: float = 0, atol: float = 0, what: str = ""
) -> float:
    worst = 0.0
    ref = dict(reference.named_parameters())
    for name, param in sharded.named_parameters():
        full = param.full_tensor() if isinstance(param, DTensor) else param
        expected = ref[name].detach()
        if exact:
            assert torch.equal(full, expected), f"{what} {name}: max diff {(full - expected).abs().max().item()}"
        else:
            err = ((full - expected).norm() / expected.norm().clamp_min(1e-12)).item()
            worst = max(worst, err)
            torch.testing.assert_close(full, expected, rtol=rtol, atol=atol, msg=f"{what} {name}")
    return worst


def run_parity(strategy: str, optimizer: str = "adamw", **kwargs) -> None:
    rank, n = world()
    torch.manual_seed(0)
    base = Net()
    single = copy.deepcopy(base)
    ddp = DDP(copy.deepcopy(base), find_unused_parameters=True)
    ours = shard_net(copy.deepcopy(base), strategy, **kwargs)
    assert [k for k, _ in ours.named_parameters()] == [k for k, _ in base.named_parameters()]
    opt_single = make_optimizer(optimizer, single.parameters())
    opt_ddp = make_optimizer(optimizer, ddp.parameters())
    opt_ours = make_optimizer(optimizer, ours.parameters())
    for step in range(STEPS):
        batch = local_batch(step, rank, n)
        loss = loss_fn(ours, batch)
        loss.backward()
        opt_ours.step()
        opt_ours.zero_grad()
        loss_ddp = loss_fn(ddp, batch)
        loss_ddp.backward()
        opt_ddp.step()
        opt_ddp.zero_grad()
        loss_fn(single, global_batch(step, n)).backward()
        opt_single.step()
        opt_single.zero_grad()
        if n == 2 and optimizer != "adamw_fused":
            assert loss.item() == loss_ddp.item(), f"step {step}: loss {loss.item()} vs DDP {loss_ddp.item()}"
            assert_close_params(ours, ddp.module, exact=True, what=f"{strategy} step {step} vs DDP")
        else:
            assert_close_params(ours, ddp.module, exact=False, rtol=0, atol=1e-6, what=f"{strategy} step {step} vs DDP")
    worst = assert_close_params(ours, single, exact=False, rtol=1e-5, atol=1e-6, what=f"{strategy} vs single-process")
    if rank == 0:
        print(f"parity {strategy}/{optimizer} n={n}: worst per-tensor relative L2 error vs single-process {worst:.2e}")


@check(SUITE, world_sizes=(2,), params={"strategy": ["optim_grads"], "optimizer": ["adamw_single"]})
@check(SUITE, params={"strategy": ["optim_grads_params"], "optimizer": ["adamw_fused", "sgd"]})
@check(SUITE, params={"strategy": ["optim_grads_params"], "reshard_after_forward": [False]})
@check(SUITE, params={"strategy": ["no_shard", "optim", "optim_grads", "optim_grads_params"]})
def parity(strategy: str, optimizer: str = "adamw", **fully_shard_options: object) -> None:
    """Trains like DDP and like one process with this strategy, optimizer and options (tolerances: run_parity)."""
    run_parity(strategy, optimizer=optimizer, **fully_shard_options)


@check(SUITE)
def zero_row_shards_exist() -> None:
    """The parity model really gives some rank zero rows of some parameter."""
    model = shard_net(Net(), "optim_grads_params")
    empty = torch.tensor([sum(p.to_local().numel() == 0 for p in model.parameters())])
    dist.all_reduce(empty)
    assert empty.item() > 0
    placements = {type(p.placements[0]) for p in model.parameters()}
    assert placements == {RaggedShard}, placements


@check(SUITE)
def zero_copy_views() -> None:
    """Sharded params view the group's shard; unsharded params view the gathered buffer."""
    model = shard_net(Net(), "optim_grads_params")
    for group in model.blocks[0].fsdp_unit.groups:
        lo = group.shard.data_ptr()
        hi = lo + group.shard.numel() * group.shard.element_size()
        for p in group.sharded_params:
            local = p.to_local()
            assert local.numel() == 0 or lo <= local.data_ptr() < hi
    seen = []
    block = model.blocks[0]
    handle = block.up.register_forward_pre_hook(lambda m, a: seen.append((m.weight.data_ptr(), type(m.weight))))
    loss_fn(model, local_batch(0, *world())).backward()
    handle.remove()
    group = block.fsdp_unit.groups[0]
    assert seen and seen[0][1] is nn.Parameter
    # the buffer is freed after backward; the view offset is what we can still check
    slot = next(s for s, r in zip(group.layout.slots, group.refs) if r.fqn == "up.weight")
    assert group.unsharded_params[[r.fqn for r in group.refs].index("up.weight")].storage_offset() == slot.offset


@check(SUITE, world_sizes=(2,))
def original_parameters_are_released() -> None:
    import gc
    import weakref

    block = Block()
    original = weakref.ref(block.up.weight)
    fully_shard(block)
    gc.collect()
    assert original() is None, "fully_shard keeps the unsharded original parameter alive"


@check(SUITE)
def nothing_live_after_backward() -> None:
    model = shard_net(Net(), "optim_grads_params")
    loss_fn(model, local_batch(0, *world())).backward()
    for module in model.modules():
        if isinstance(module, megatron_fsdp.FSDPModule):
            for group in module.fsdp_unit.groups:
                assert group.grad_buffer is None, module
                assert not group.unsharded.allocated, module
                assert group.state.value == "sharded"
    for p in model.parameters():
        assert isinstance(p, DTensor)
        assert (p.grad is None) == (not p.requires_grad) or model.probe.up.weight is p or p.grad is None


@check(SUITE)
def dtensor_full_state_dict_and_full_tensor() -> None:
    torch.manual_seed(0)
    base = Net()
    model = shard_net(copy.deepcopy(base), "optim_grads_params")
    assert list(model.state_dict().keys()) == list(base.state_dict().keys())
    full = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True))
    expected = base.state_dict()
    assert full.keys() == expected.keys()
    for key, value in expected.items():
        assert torch.equal(full[key], value), key
    for (name, p), q in zip(model.named_parameters(), base.parameters()):
        assert torch.equal(p.full_tensor(), q), name
        assert torch.equal(megatron_fsdp.full_tensor(p), q), name


@check(SUITE)
def dtensor_clip_grad_norm() -> None:
    rank, n = world()
    torch.manual_seed(0)
    base = Net()
    ddp = DDP(copy.deepcopy(base), find_unused_parameters=True)
    model = shard_net(copy.deepcopy(base), "optim_grads_params")
    batch = local_batch(0, rank, n)
    loss_fn(model, batch).backward()
    loss_fn(ddp, batch).backward()
    ours = torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5)
    ref = torch.nn.utils.clip_grad_norm_(ddp.parameters(), 0.5)
    ours = ours.full_tensor() if isinstance(ours, DTensor) else ours
    torch.testing.assert_close(ours, ref, rtol=1e-6, atol=0)
    grads = dict((k, p.grad) for k, p in ddp.module.named_parameters())
    for name, p in model.named_parameters():
        if p.grad is not None:
            torch.testing.assert_close(p.grad.full_tensor(), grads[name], rtol=1e-6, atol=1e-7)


@check(SUITE)
def derived_ragged_tensor_is_refused() -> None:
    model = shard_net(Net(), "optim_grads_params")
    n = dist.get_world_size()
    ragged = [p for p in model.parameters() if list(p.placements[0].local_sizes) != chunk_sizes(p.shape[0], n)]
    assert ragged, "expected a parameter whose rows do not follow torch.chunk"
    param = ragged[0]
    derived = param * 2 + 1
    if isinstance(derived.placements[0], RaggedShard):  # propagation kept our placement
        assert torch.equal(megatron_fsdp.full_tensor(derived), param.full_tensor() * 2 + 1)
        return
    try:
        megatron_fsdp.full_tensor(derived)
    except RuntimeError as e:
        assert "out-of-place" in str(e)
    else:
        raise AssertionError("full_tensor accepted a mis-laid-out derived DTensor")


def chunk_sizes(rows: int, n: int) -> list[int]:
    sizes = [t.size(0) for t in torch.empty(rows, 0).chunk(n)]
    return sizes + [0] * (n - len(sizes))


def expected_bytes(model: nn.Module) -> tuple[int, int]:
    """ZeRO-3 minimum for one step: gathers (twice for non-root units) and reduce-scatters."""
    gather = reduce = 0
    for module in model.modules():
        if isinstance(module, megatron_fsdp.FSDPModule):
            unit = module.fsdp_unit
            for group in unit.groups:
                nbytes = group.layout.total_numel * group.shard.element_size()
                used = module is not model.probe
                times = 1 if unit.is_root or not used else 2
                gather += times * nbytes
                if group.requires_grad and used:
                    reduce += nbytes
    return gather, reduce


@check(SUITE)
def bytes_match_zero3_minimum() -> None:
    model = shard_net(Net(), "optim_grads_params")
    batch = local_batch(0, *world())
    loss_fn(model, batch).backward()  # lazy init
    comm_stats.reset()
    loss_fn(model, batch).backward()
    gather, reduce = expected_bytes(model)
    # blocks[0] runs twice per forward: one more gather (backward finds it still unsharded
    # between its two backward calls, because its gradients are not complete yet)
    extra = sum(g.layout.total_numel * 4 for g in model.blocks[0].fsdp_unit.groups)
    assert comm_stats.bytes["all_gather"] == gather + extra, (dict(comm_stats.bytes), gather + extra)
    assert comm_stats.bytes["reduce_scatter"] == reduce, (dict(comm_stats.bytes), reduce)
    assert set(comm_stats.bytes) == {"all_gather", "reduce_scatter", "control"}
    # one control round closes the forward and one the backward (docs/design.md): once every
    # rank follows the agreed gather order, nothing is gathered off it
    assert comm_stats.calls["control"] == 2, dict(comm_stats.calls)


@check(SUITE)
def bytes_per_strategy() -> None:
    batch = local_batch(0, *world())
    for strategy, kinds in [("no_shard", {"all_reduce"}), ("optim", {"all_gather", "all_reduce"}),
                            ("optim_grads", {"all_gather", "reduce_scatter"})]:
        model = shard_net(Net(), strategy)
        loss_fn(model, batch).backward()
        comm_stats.reset()
        loss_fn(model, batch).backward()
        assert set(comm_stats.bytes) == kinds | {"control"}, (strategy, dict(comm_stats.bytes))
        assert comm_stats.calls["control"] == 2, (strategy, dict(comm_stats.calls))
        if "all_gather" in kinds:  # gathered once per step, not per use
            params = sum(g.layout.total_numel * 4 for m in model.modules()
                         if isinstance(m, megatron_fsdp.FSDPModule) for g in m.fsdp_unit.groups)
            assert comm_stats.bytes["all_gather"] == params, (strategy, dict(comm_stats.bytes), params)


@check(SUITE)
def no_sync_accumulation_matches_big_batch() -> None:
    rank, n = world()
    for strategy in ("optim_grads_params", "optim_grads", "optim", "no_shard"):
        torch.manual_seed(0)
        base = Net()
        ddp = DDP(copy.deepcopy(base), find_unused_parameters=True)
        ours = shard_net(copy.deepcopy(base), strategy)
        micro = [local_batch(s, rank, n) for s in range(3)]
        with ours.no_sync():
            for b in micro[:-1]:
                (loss_fn(ours, b) / 3).backward()
        (loss_fn(ours, micro[-1]) / 3).backward()
        with ddp.no_sync():
            for b in micro[:-1]:
                (loss_fn(ddp, b) / 3).backward()
        (loss_fn(ddp, micro[-1]) / 3).backward()
        grads = dict((k, p.grad) for k, p in ddp.module.named_parameters())
        for name, p in ours.named_parameters():
            if grads[name] is None:
                assert p.grad is None, name
                continue
            torch.testing.assert_close(p.grad.full_tensor(), grads[name], rtol=1e-6, atol=1e-7,
                                       msg=f"{strategy} {name}")


def expect_error(exc: type[Exception], fragment: str | tuple[str, ...], fn, *args, **kwargs) -> None:
    """``fn(*args, **kwargs)`` raises ``exc`` whose message holds ``fragment`` (each of them, given several)."""
    fragments = (fragment,) if isinstance(fragment, str) else fragment
    try:
        fn(*args, **kwargs)
    except exc as e:
        for part in fragments:
            assert part in str(e), f"message {str(e)!r} lacks {part!r}"
    else:
        raise AssertionError(f"{getattr(fn, '__name__', fn)}: no {exc.__name__} raised")


@check(SUITE, world_sizes=(4,))
def bad_input_errors() -> None:
    expect_error(ValueError, "valid: 'no_shard'", fully_shard, Block(), sharding_strategy="zero4")
    mesh3d = init_device_mesh(device_type(), (2, 2, 1))
    expect_error(ValueError, "name the data-parallel ones", fully_shard, Block(), mesh=mesh3d)
    mixed = Block()
    mixed.up.to("meta")
    expect_error(ValueError, "mixed devices", fully_shard, mixed)
    twice = fully_shard(Block())
    expect_error(ValueError, "already applied", fully_shard, twice)
    scalar = nn.Module()
    scalar.w = nn.Parameter(torch.tensor(1.0))
    # a module whose only parameter is 0-dim is a unit with one replicated group (all-reduced, never gathered)
    scalar = fully_shard(scalar)
    assert isinstance(scalar, megatron_fsdp.FSDPModule)
    assert [g.plan.name for g in scalar.fsdp_unit.groups] == ["no_shard"]

    tied = Net()
    fully_shard(tied.embed)
    expect_error(ValueError, "fully_shard([module_a, module_b])", fully_shard, tied)

    model = shard_net(Net(), "optim_grads_params")
    model.blocks[2].up.weight = nn.Parameter(torch.randn(5, 5))
    expect_error(RuntimeError, "'up.weight' was replaced", loss_fn, model, local_batch(0, *world()))


@check(SUITE, world_sizes=(2,))
def unshard_reshard_api() -> None:
    torch.manual_seed(0)
    base = Block()
    block = fully_shard(copy.deepcopy(base))
    block.unshard()
    assert type(block.up.weight) is nn.Parameter and torch.equal(block.up.weight, base.up.weight)
    block.reshard()
    assert isinstance(block.up.weight, DTensor)
    block.set_reshard_after_forward(False)
    block.set_requires_gradient_sync(False)
    assert not block.fsdp_unit.reshard_after_forward and not block.fsdp_unit.requires_gradient_sync
    assert type(block).__name__ == "FSDPBlock" and isinstance(block, Block)


class CheckpointedBlock(Block):
    """A block whose forward is recomputed in backward (activation checkpointing)."""

    reentrant = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        from torch.utils.checkpoint import checkpoint

        return checkpoint(super().forward, x, use_reentrant=self.reentrant)


@check(SUITE)
def activation_checkpointing_neither_regathers_nor_reshards_early() -> None:
    rank, n = world()
    x = torch.randn(2 * n, 5, 13, generator=torch.Generator().manual_seed(5)).chunk(n)[rank].requires_grad_()
    torch.manual_seed(0)
    plain = nn.Sequential(*[Block() for _ in range(3)])
    reference = shard_net_blocks(copy.deepcopy(plain))
    comm_stats.reset()
    reference(x).square().mean().backward()
    expected_calls = dict(comm_stats.calls)
    for reentrant in (False, True):
        model = copy.deepcopy(plain)
        for block in model:
            block.__class__ = CheckpointedBlock
        CheckpointedBlock.reentrant = reentrant
        model = shard_net_blocks(model)
        comm_stats.reset()
        model(x).square().mean().backward()
        assert dict(comm_stats.calls) == expected_calls, (reentrant, dict(comm_stats.calls), expected_calls)
        for (name, p), q in zip(model.named_parameters(), reference.parameters()):
            torch.testing.assert_close(p.grad.full_tensor(), q.grad.full_tensor(), rtol=1e-6, atol=1e-7,
                                       msg=f"reentrant={reentrant} {name}")


def shard_net_blocks(model: nn.Sequential) -> nn.Sequential:
    for block in model:
        fully_shard(block)
    return fully_shard(model)


@check(SUITE, world_sizes=(2,))
def prefetch_gathers_the_next_unit_ahead_of_use() -> None:
    model = shard_net(Net(), "optim_grads_params")
    batch = local_batch(0, *world())
    loss_fn(model, batch).backward()  # the first iteration records the forward order
    seen = {}

    def in_flight_or_gathered(tag, module=model.blocks[1]):
        group = module.fsdp_unit.groups[0]

        def hook(*_):
            seen.setdefault(tag, group._gather is not None or group.state.value == "unsharded")
        return hook

    handles = [model.blocks[0].up.register_forward_pre_hook(in_flight_or_gathered("forward")),
               model.blocks[2].up.register_forward_pre_hook(in_flight_or_gathered("then", model.blocks[0])),
               model.blocks[2].up.register_full_backward_pre_hook(in_flight_or_gathered("backward"))]
    comm_stats.reset()
    loss_fn(model, batch).backward()
    for h in handles:
        h.remove()
    # while blocks[0] computes its forward, blocks[1]'s all-gather is already issued, and
    # while blocks[2] does, that of blocks[0]'s second call; while blocks[2] computes its
    # backward, blocks[1]'s backward all-gather is issued too
    assert seen == {"forward": True, "then": True, "backward": True}, seen
    model.set_prefetch_depth(0)
    loss_fn(model, batch).backward()
    model.blocks[0].up.register_forward_pre_hook(in_flight_or_gathered("off"))
    loss_fn(model, batch).backward()
    assert seen["off"] is False, "set_prefetch_depth(0) must disable prefetching"
    expect_error(ValueError, "non-negative int", model.set_prefetch_depth, -1)
    model.set_prefetch_depth(1)
    comm_stats.reset()
    loss_fn(model, batch).backward()
    gather, _ = expected_bytes(model)
    extra = sum(g.layout.total_numel * 4 for g in model.blocks[0].fsdp_unit.groups)
    assert comm_stats.bytes["all_gather"] == gather + extra, "prefetching must not add all-gathers"


@check(SUITE, world_sizes=(2,))
def step_after_a_forward_without_backward_is_seen() -> None:
    """Weights a no-grad forward left gathered must not survive an optimizer step."""
    rank, n = world()
    for strategy in ("optim_grads_params", "optim_grads", "optim", "no_shard"):
        torch.manual_seed(0)
        base = Net()
        plain, ours = copy.deepcopy(base), shard_net(copy.deepcopy(base), strategy)
        opts = [torch.optim.SGD(m.parameters(), lr=0.5) for m in (ours, plain)]
        batch = local_batch(0, 0, 1)  # the same batch on every rank: DDP-free reference
        for model in (ours, plain):
            loss_fn(model, batch).backward()
            with torch.no_grad():
                model(batch)  # e.g. an evaluation between backward and step
        for opt in opts:
            opt.step()
        with torch.no_grad():
            torch.testing.assert_close(ours(batch), plain(batch), rtol=1e-5, atol=1e-5, msg=strategy)


@check(SUITE, world_sizes=(2,))
def optimizer_built_after_evaluation_trains_right() -> None:
    """An evaluation forward (no_grad) leaves the modules holding their sharded parameters.

    An optimizer built right after it gets the sharded parameters, never gathered views.
    """
    for strategy in ("optim_grads_params", "optim_grads", "optim", "no_shard"):
        torch.manual_seed(0)
        base = Net()
        plain, ours = copy.deepcopy(base), shard_net(copy.deepcopy(base), strategy)
        batch = local_batch(0, 0, 1)  # the same batch on every rank: DDP-free reference
        with torch.no_grad():
            ours(batch)
        assert all(isinstance(p, DTensor) for p in ours.parameters()), strategy
        opts = [torch.optim.AdamW(m.parameters(), lr=0.05) for m in (ours, plain)]
        for step in range(3):
            for model, opt in zip((ours, plain), opts):
                opt.zero_grad()
                loss_fn(model, local_batch(step, 0, 1)).backward()
                opt.step()
        with torch.no_grad():
            torch.testing.assert_close(ours(batch), plain(batch), rtol=1e-5, atol=1e-5, msg=strategy)


@check(SUITE)
def load_full_and_sharded_state_dicts() -> None:
    from torch.distributed.checkpoint.state_dict import set_model_state_dict

    rank, n = world()
    torch.manual_seed(0)
    source = Net()
    expected = {k: v.clone() for k, v in source.state_dict().items()}
    batch = local_batch(0, rank, n)
    for strategy in ("optim_grads_params", "no_shard"):
        for how in ("set_model_state_dict", "broadcast_from_rank0", "load_state_dict", "sharded"):
            torch.manual_seed(1)  # different initial weights
            model = shard_net(Net(), strategy)
            loss_fn(model, batch)  # leaves the root gathered: the load must make it stale
            if how == "set_model_state_dict":
                # (set_model_state_dict replaces the values of the dict it is given)
                set_model_state_dict(model, dict(expected), options=StateDictOptions(full_state_dict=True))
            elif how == "broadcast_from_rank0":
                full = dict(expected) if rank == 0 else {}
                set_model_state_dict(model, full, options=StateDictOptions(full_state_dict=True,
                                                                          broadcast_from_rank0=True))
            elif how == "load_state_dict":
                model.load_state_dict(expected)
            else:
                donor = shard_net(copy.deepcopy(source), strategy)
                model.load_state_dict(donor.state_dict())
            for name, p in model.named_parameters():
                assert torch.equal(p.full_tensor(), expected[name]), (strategy, how, name)
            with torch.no_grad():
                torch.testing.assert_close(model(batch), source(batch), msg=f"{strategy} {how}")
    model = shard_net(Net(), "optim_grads_params")
    wrong = dict(expected, **{"blocks.0.up.weight": torch.zeros(3, 3)})
    expect_error(RuntimeError, "loading 'blocks.0.up.weight'", model.load_state_dict, wrong)


@check(SUITE, world_sizes=(2,))
def parameter_attributes_are_carried() -> None:
    """Attributes training loops read (weight-decay groups, TP flags) survive sharding."""
    block = Block()
    block.up.weight.sequence_parallel = True
    block.up.weight.partition_dim = 0
    block.norm.weight.is_embedding_or_output_parameter = False
    block.down.bias.my_lr_multiplier = 0.1
    fully_shard(block)
    params = dict(block.named_parameters())
    assert params["up.weight"].sequence_parallel is True and params["up.weight"].partition_dim == 0
    assert params["norm.weight"].is_embedding_or_output_parameter is False
    assert params["down.bias"].my_lr_multiplier == 0.1
    block.unshard()  # the compute-time parameters carry them too
    assert block.up.weight.sequence_parallel is True and type(block.up.weight) is nn.Parameter
    block.reshard()


@check(SUITE, world_sizes=(2,))
def two_models_with_different_options_train_apart() -> None:
    """Two roots in one process, options apart (pool, gloo fast paths, reductions in flight): both
    train bitwise like DDP, and each root's ``fsdp_comm_stats`` counts only its own collectives."""
    rank, n = world()
    torch.manual_seed(0)
    base = Net()
    ddp = DDP(copy.deepcopy(base), find_unused_parameters=True)
    fast = EngineOptions(buffer_pool=True, gloo_fast_paths=True, max_reduces_in_flight=2)
    plain = EngineOptions(buffer_pool=False, gloo_fast_paths=False, max_reduces_in_flight=0)
    a = shard_net(copy.deepcopy(base), "optim_grads_params", options=fast)
    b = copy.deepcopy(base)
    for block in b.blocks:
        fully_shard(block)  # no options: they take the root's
    fully_shard(b.probe)
    fully_shard(b, options=plain)
    for model, options in ((a, fast), (b, plain)):
        units = units_of(model)
        assert all(u.options == options and u.comm is model.fsdp_unit.comm for u in units), options
        assert all(u.pool.wanted is options.buffer_pool for u in units), options
    assert a.fsdp_comm_stats is not b.fsdp_comm_stats
    opts = [make_optimizer("adamw", m.parameters()) for m in (a, b, ddp)]
    for step in range(STEPS):
        batch = local_batch(step, rank, n)
        comm_stats.reset()
        a.fsdp_comm_stats.reset()
        b.fsdp_comm_stats.reset()
        losses = [loss_fn(m, batch) for m in (a, b)]  # forwards interleaved, then both backwards
        for loss in losses:
            loss.backward()
        mine_a, mine_b = a.fsdp_comm_stats, b.fsdp_comm_stats
        assert mine_a.bytes + mine_b.bytes == comm_stats.bytes, (dict(mine_a.bytes), dict(mine_b.bytes))
        assert mine_a.calls + mine_b.calls == comm_stats.calls, (dict(mine_a.calls), dict(mine_b.calls))
        assert mine_a.bytes == mine_b.bytes, "the fast paths move the same bytes"
        if step > 0:  # after the lazy init: the ZeRO-3 minimum of one model, not of two
            gather, reduce = expected_bytes(a)
            extra = sum(g.layout.total_numel * 4 for g in a.blocks[0].fsdp_unit.groups)
            assert mine_a.bytes["all_gather"] == gather + extra, (dict(mine_a.bytes), gather + extra)
            assert mine_a.bytes["reduce_scatter"] == reduce, (dict(mine_a.bytes), reduce)
            assert mine_a.calls["control"] == 2, dict(mine_a.calls)
        loss_ddp = loss_fn(ddp, batch)
        loss_ddp.backward()
        for opt in opts:
            opt.step()
            opt.zero_grad()
        for model, loss in zip((a, b), losses):
            assert loss.item() == loss_ddp.item(), f"step {step}: loss {loss.item()} vs DDP {loss_ddp.item()}"
            assert_close_params(model, ddp.module, exact=True, what=f"{model.fsdp_options} step {step} vs DDP")


@check(SUITE, world_sizes=(2,))
def units_under_one_root_agree_on_options() -> None:
    """A unit given options that its root overrides in a field that matters is refused, naming the field."""
    model = Net()
    fully_shard(model.blocks[0], options=EngineOptions(max_reduces_in_flight=0, prefetch_depth=3))
    fully_shard(model.blocks[1], options=EngineOptions(max_reduces_in_flight=0, prefetch_depth=0))  # depth: per unit
    fully_shard(model.blocks[2])
    expect_error(ValueError, "max_reduces_in_flight=2 here, 0 there", fully_shard, model)
    assert not isinstance(model, megatron_fsdp.FSDPModule), "refused before anything changed"
    fully_shard(model, options=EngineOptions(max_reduces_in_flight=0))
    assert model.blocks[0].fsdp_unit.prefetch_depth == 3 and model.blocks[1].fsdp_unit.prefetch_depth == 0
    assert model.blocks[2].fsdp_unit.options.max_reduces_in_flight == 0  # not given: the root's
    assert model.fsdp_unit.prefetch_depth == 1
    expect_error(TypeError, "EngineOptions", fully_shard, nn.Linear(2, 2), options={"buffer_pool": False})
