"""Reliability (issue 11): accumulation never drops a step silently, replicated
parameters are all-reduced, models that differ across ranks and bad arguments raise.

Each check compares with DistributedDataParallel on the same local batches where
numbers are involved.
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Iterator

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.tensor import DTensor
from torch.nn.parallel import DistributedDataParallel as DDP

import megatron_fsdp
from megatron_fsdp import comm_stats, fsdp_no_shard, fully_shard, fully_shard_model, fully_shard_optimizer, microbatch
from tests.distributed.harness import check, device_type
from tests.distributed.shards import assert_close_sharded
from tests.models import Block, Net, global_batch, local_batch, loss_fn

SUITE = "robustness"
STRATEGIES = ("no_shard", "optim", "optim_grads", "optim_grads_params")
K = 3  # micro-batches per step


def world() -> tuple[int, int]:
    return dist.get_rank(), dist.get_world_size()


def configs() -> Iterator[tuple[str, dict]]:
    """(label, fully_shard kwargs): the four strategies on a 1-D mesh, and HSDP (dp_outer x dp_shard)."""
    _, n = world()
    for strategy in STRATEGIES:
        yield strategy, dict(sharding_strategy=strategy)
    outer = init_device_mesh(device_type(), (2, n // 2), mesh_dim_names=("dp_outer", "dp_shard"))
    yield "hsdp(optim_grads_params)", dict(sharding_strategy="optim_grads_params", mesh=outer)


def shard(model: Net, **kwargs) -> Net:
    for block in model.blocks:
        fully_shard(block, **kwargs)
    fully_shard(model.probe, **kwargs)
    fully_shard(model, **kwargs)
    return model


def expect(exc: type[Exception], fragments: tuple[str, ...], fn: Callable, *args, **kwargs) -> str:
    try:
        fn(*args, **kwargs)
    except exc as e:
        for fragment in fragments:
            assert fragment in str(e), f"message {str(e)!r} lacks {fragment!r}"
        return str(e)
    raise AssertionError(f"{getattr(fn, '__name__', fn)}: no {exc.__name__} raised")


def full(p: torch.Tensor) -> torch.Tensor:
    return p.full_tensor() if isinstance(p, DTensor) else p.detach()


def assert_matches(model: nn.Module, reference: nn.Module, what: str, rtol: float, atol: float) -> None:
    """Every parameter equals the reference's within (rtol, atol), compared shard by shard (distributed/shards.py)."""
    pairs = [(name, p, q) for (name, p), q in zip(model.named_parameters(), reference.parameters())]
    assert_close_sharded(pairs, what, rtol=rtol, atol=atol)


def ddp_accumulate(ddp: DDP, opt: torch.optim.Optimizer, step: int) -> None:
    """One DDP step over K micro-batches (no_sync except the last)."""
    rank, n = world()
    micro = global_batch(step, n, per_rank=2 * K).chunk(n)[rank].chunk(K)
    for i, batch in enumerate(micro):
        if i < K - 1:
            with ddp.no_sync():
                (loss_fn(ddp, batch) / K).backward()
        else:
            (loss_fn(ddp, batch) / K).backward()
    opt.step()
    opt.zero_grad()


def micro_batches(step: int) -> tuple[torch.Tensor, ...]:
    rank, n = world()
    return global_batch(step, n, per_rank=2 * K).chunk(n)[rank].chunk(K)


def sgd(params) -> torch.optim.Optimizer:
    return torch.optim.SGD(params, lr=0.1, momentum=0.9)


# -- 1. accumulation never leaves a step without its gradients ----------------------


@check(SUITE)
def microbatch_seed_forms_reduce_by_default() -> None:
    """microbatch(m, is_first) and microbatch(m, is_first=...) without is_last reduce every backward:
    plain torch.optim and fully_shard_optimizer both match DDP, for every strategy and HSDP.

    Each model takes one step per form (the forms in turn, a different one first for each layout, so
    every form also opens a run): each step's .grad is checked, and the weights after the three steps
    match DDP's, which holds only if every step reduced what DDP did."""
    torch.manual_seed(0)
    base = Net()
    forms: dict[str, Callable[[nn.Module, int], object]] = {
        "positional": lambda m, i: microbatch(m, i == 0),
        "keywords": lambda m, i: microbatch(m, is_first=(i == 0)),
        "positional is_last": lambda m, i: microbatch(m, i == 0, i == K - 1),
    }
    ddp = DDP(copy.deepcopy(base), find_unused_parameters=True)
    opt_ddp = sgd(ddp.parameters())
    for step in range(len(forms)):
        ddp_accumulate(ddp, opt_ddp, step)
    for index, (label, kwargs) in enumerate(configs()):
        names = list(forms)
        order = names[index % len(names):] + names[:index % len(names)]
        for wrapped in (False, True):
            model = shard(copy.deepcopy(base), **kwargs)
            opt = sgd(model.parameters())
            if wrapped:
                opt = fully_shard_optimizer(opt)
            for step, form in enumerate(order):
                for i, batch in enumerate(micro_batches(step)):
                    with forms[form](model, i):
                        (loss_fn(model, batch) / K).backward()
                missing = [k for k, p in model.named_parameters()  # the probe runs under no_grad only
                           if p.requires_grad and p.grad is None and not k.startswith("probe.")]
                assert not missing, f"{label} {form} (step {step}) wrapped={wrapped}: no .grad on {missing}"
                opt.step()
                opt.zero_grad()
            # Reductions per micro-batch vs DDP's one per step: the same sums in another order.
            assert_matches(model, ddp.module, f"{label} forms {order} wrapped={wrapped}", rtol=1e-5, atol=1e-6)
    expect(TypeError, ("is_first", "True or False"), lambda: microbatch(model, 1).__enter__())
    expect(TypeError, ("is_last",), lambda: microbatch(model, True, "yes").__enter__())


@check(SUITE)
def explicit_is_last_false_defers_then_step_raises() -> None:
    """is_last=False on every micro-batch: full-size strategies defer, HSDP defers its outer reduction, and a
    plain optimizer's step raises naming the module and microbatch(..., is_last=True); sharded-gradient
    strategies on one data-parallel dimension reduced already."""
    rank, n = world()
    torch.manual_seed(0)
    base = Net()
    for label, kwargs in configs():
        model = shard(copy.deepcopy(base), **kwargs)
        opt = sgd(model.parameters())
        before = {k: full(p).clone() for k, p in model.named_parameters()}
        for i, batch in enumerate(micro_batches(0)):
            with microbatch(model, is_first=(i == 0), is_last=False):
                (loss_fn(model, batch) / K).backward()
        # Full-size gradients defer their whole reduction; HSDP defers its outer (dp_outer) one (issue 38).
        deferred = not megatron_fsdp.STRATEGIES[kwargs["sharding_strategy"]].grads or "mesh" in kwargs
        if deferred:
            expect(RuntimeError, ("SGD.step()", "'blocks.0' (Block)", "microbatch(..., is_last=True)", "no_sync()"),
                   opt.step)
            after = {k: full(p) for k, p in model.named_parameters()}
            assert all(torch.equal(before[k], after[k]) for k in before), f"{label}: a refused step moved weights"
            # The fix the message names: a last micro-batch reduces everything, then the step runs.
            with microbatch(model, is_first=False, is_last=True):
                (loss_fn(model, micro_batches(0)[0]) * 0.0).backward()
        opt.step()  # nothing pending now
        assert any(not torch.equal(before[k], full(p)) for k, p in model.named_parameters()), label


@check(SUITE)
def no_sync_and_requires_gradient_sync_false_raise_at_plain_step() -> None:
    """Under every strategy and HSDP, a plain optimizer stepped with gradients still held back by no_sync()
    or set_requires_gradient_sync(False) raises; fully_shard_optimizer reduces them first and matches DDP."""
    rank, n = world()
    torch.manual_seed(0)
    base = Net()
    batch = local_batch(0, rank, n)
    ddp = DDP(copy.deepcopy(base), find_unused_parameters=True)
    opt_ddp = sgd(ddp.parameters())
    loss_fn(ddp, batch).backward()
    opt_ddp.step()
    for label, kwargs in configs():
        model = shard(copy.deepcopy(base), **kwargs)
        opt = sgd(model.parameters())
        with model.no_sync():
            loss_fn(model, batch).backward()
        expect(RuntimeError, ("SGD.step()", "no_sync()", "finish_grad_sync()"), opt.step)

        model = shard(copy.deepcopy(base), **kwargs)
        opt = torch.optim.AdamW(model.parameters())
        model.set_requires_gradient_sync(False)
        loss_fn(model, batch).backward()
        expect(RuntimeError, ("AdamW.step()", "set_requires_gradient_sync(True) before"), opt.step)

        model = shard(copy.deepcopy(base), **kwargs)
        opt = fully_shard_optimizer(sgd(model.parameters()))
        with model.no_sync():
            loss_fn(model, batch).backward()
        expect(RuntimeError, ("SGD.step()", "no_sync()"), opt.step, sync_grad_before_optimizer_step=False)
        opt.step()  # syncs the held-back gradients, then steps: DDP's numbers
        exact = n == 2 and label != "hsdp(optim_grads_params)"
        assert_matches(model, ddp.module, f"{label} no_sync + fully_shard_optimizer",
                       rtol=0 if exact else 1e-5, atol=0 if exact else 1e-6)


@check(SUITE)
def whole_model_no_sync_microbatches_need_finish_grad_sync() -> None:
    """fully_shard_model(sync_model_each_microbatch=False) with a plain optimizer: stepping before
    finish_grad_sync() raises for the deferring strategies; after it the step matches DDP."""
    rank, n = world()
    torch.manual_seed(0)
    base = Net()
    ddp = DDP(copy.deepcopy(base), find_unused_parameters=True)
    opt_ddp = sgd(ddp.parameters())
    ddp_accumulate(ddp, opt_ddp, 0)
    for strategy in STRATEGIES:
        model = fully_shard_model(copy.deepcopy(base), fsdp_unit_modules=[Block], zero_dp_strategy=strategy,
                                  sync_model_each_microbatch=False)
        opt = sgd(model.parameters())
        for batch in micro_batches(0):
            (loss_fn(model, batch) / K).backward()
        if not megatron_fsdp.STRATEGIES[strategy].grads:
            expect(RuntimeError, ("finish_grad_sync()", "microbatch(..., is_last=True)"), opt.step)
        model.finish_grad_sync()
        opt.step()
        assert_matches(model.module, ddp.module, f"whole-model {strategy}", rtol=1e-5, atol=1e-6)


# -- 2. replicated parameters are all-reduced, wherever they sit ---------------------


class ScalarRoot(nn.Module):
    """A root whose only parameter outside its blocks is a scalar gate."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(17, 13)
        self.blocks = nn.ModuleList([Block(), Block()])
        self.gate = nn.Parameter(torch.tensor(0.5))
        self.head = nn.Linear(13, 17)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens)
        for block in self.blocks:
            x = block(x)
        return self.head(x * self.gate)


def shard_scalar_root(model: ScalarRoot, variant: str, **kwargs) -> ScalarRoot:
    """``scalar``: the gate is the root's only own parameter; ``marked``: the root's own
    parameters are all fsdp_no_shard; ``inside``: a marked submodule inside each block unit."""
    if variant == "inside":
        for block in model.blocks:
            fsdp_no_shard(block.norm)
    for block in model.blocks:
        fully_shard(block, **kwargs)
    if variant == "marked":
        fsdp_no_shard(model.embed)
        fsdp_no_shard(model.head)
    else:
        fully_shard(model.embed, **kwargs)
        fully_shard(model.head, **kwargs)
    return fully_shard(model, **kwargs)


@check(SUITE)
def replicated_parameters_are_all_reduced_like_ddp() -> None:
    """A root owning only a 0-dim parameter, or only fsdp_no_shard parameters, becomes a unit whose
    gradients are averaged like DDP's, and marked submodules inside a unit too: several steps
    match DDP (bitwise at 2 ranks), and every rank holds the same replicated values."""
    rank, n = world()
    torch.manual_seed(0)
    base = ScalarRoot()
    steps = 4
    ddp = DDP(copy.deepcopy(base))
    opt_ddp = sgd(ddp.parameters())
    for step in range(steps):
        loss_fn(ddp, local_batch(step, rank, n)).backward()
        opt_ddp.step()
        opt_ddp.zero_grad()
    for variant in ("scalar", "marked", "inside"):
        for label, kwargs in configs():
            model = shard_scalar_root(copy.deepcopy(base), variant, **kwargs)
            assert isinstance(model, megatron_fsdp.FSDPModule), f"{variant}: the root must be a unit"
            root_groups = model.fsdp_unit.groups
            if variant != "inside":
                assert all(g.plan.name == "no_shard" for g in root_groups), (variant, [g.plan for g in root_groups])
            opt = sgd(model.parameters())
            for step in range(steps):
                comm_stats.reset()
                loss_fn(model, local_batch(step, rank, n)).backward()
                opt.step()
                opt.zero_grad()
            exact = n == 2 and not label.startswith("hsdp")
            what = f"{variant} {label}"
            assert_matches(model, ddp.module, what, rtol=0 if exact else 1e-5, atol=0 if exact else 1e-6)
            gate = model.gate.full_tensor().reshape(1)
            gates = [torch.empty_like(gate) for _ in range(n)]
            dist.all_gather(gates, gate)
            assert all(torch.equal(g, gates[0]) for g in gates), f"{what}: the gate drifted apart: {gates}"
            if variant == "inside":
                norms = model.blocks[0].fsdp_unit.groups
                assert any(g.plan.name == "no_shard" and "norm.weight" in g.refs[0].fqns for g in norms), what


@check(SUITE, world_sizes=(2,))
def scalar_root_costs_no_all_gather() -> None:
    """The replicated root unit gathers nothing: a step's all-gathers are the blocks' alone."""
    rank, n = world()
    model = shard_scalar_root(ScalarRoot(), "marked", sharding_strategy="optim_grads_params")
    loss_fn(model, local_batch(0, rank, n)).backward()  # first iteration: records the order
    comm_stats.reset()
    loss_fn(model, local_batch(1, rank, n)).backward()
    block_bytes = sum(g.layout.total_numel * g.compute_shard.element_size() for b in model.blocks
                      for g in b.fsdp_unit.groups if g.gathers)
    assert comm_stats.bytes["all_gather"] == 2 * block_bytes, (dict(comm_stats.bytes), block_bytes)
    assert model.gate.grad is not None and model.embed.weight.grad is not None


# -- 3. models that differ across ranks ------------------------------------------------


class Head(nn.Module):
    def __init__(self, rows: int, width: int = 13, dtype: torch.dtype = torch.float32) -> None:
        super().__init__()
        self.proj = nn.Linear(width, rows, dtype=dtype)


@check(SUITE)
def models_that_differ_across_ranks_raise_on_every_rank() -> None:
    """Rows, widths, dtypes, requires_grad, a missing parameter: a ValueError on every rank naming the
    parameter and each rank's view, never a silent run or a gloo abort."""
    rank, n = world()
    last = n - 1
    cases: dict[str, Callable[[], nn.Module]] = {
        "rows": lambda: Head(5 if rank == last else 4),
        "width": lambda: Head(4, width=7 if rank == last else 8),
        "dtype": lambda: Head(4, dtype=torch.float64 if rank == last else torch.float32),
        "requires_grad": lambda: Head(4).requires_grad_(rank != last),
    }
    for what, build in cases.items():
        message = expect(ValueError, ("differs across data-parallel ranks", "'proj.weight'", f"rank {last}:"),
                         fully_shard, build())
        if what == "rows":
            assert "shape (4, 13)" in message and "shape (5, 13)" in message, message
    extra = Head(4)
    if rank == last:
        extra.extra = nn.Parameter(torch.zeros(3))
    expect(ValueError, ("parameter 'extra' has", "no such parameter", "shape (3,)"), fully_shard, extra)
    marked = Head(4)
    if rank == 0:
        fsdp_no_shard(marked.proj.bias)
    expect(ValueError, ("'proj.bias'", "fsdp_no_shard"), fully_shard, marked)
    # The same model everywhere still shards, and the one before it did not leave state behind.
    assert isinstance(fully_shard(Head(4)), megatron_fsdp.FSDPModule)


@check(SUITE, world_sizes=(4,))
def models_differing_across_dp_outer_only_raise() -> None:
    """HSDP: ranks of each dp_shard group agree but the replicas differ: caught over dp_outer."""
    rank, _ = world()
    mesh = init_device_mesh(device_type(), (2, 2), mesh_dim_names=("dp_outer", "dp_shard"))
    head = Head(5 if rank >= 2 else 4)  # shard groups {0,1} and {2,3} agree internally
    expect(ValueError, ("ranks [0, 2]" if rank % 2 == 0 else "ranks [1, 3]", "'proj.weight'"),
           fully_shard, head, mesh=mesh)


# -- 4-6. meshes and arguments ------------------------------------------------------------


@check(SUITE, world_sizes=(2,))
def mesh_without_this_rank_raises() -> None:
    rank, _ = world()
    mesh = DeviceMesh(device_type(), [0])
    if rank == 0:
        assert isinstance(fully_shard(Block(), mesh=mesh), megatron_fsdp.FSDPModule)
    else:
        expect(ValueError, ("this rank (1) is not in", "over ranks [0]", "mesh"), fully_shard, Block(), mesh=mesh)


@check(SUITE, world_sizes=(2,))
def fully_shard_arguments_are_checked() -> None:
    expect(ValueError, ("reshard_after_forward=3", "factor of the dp_shard size 2", "True or False"),
           fully_shard, Block(), reshard_after_forward=3)
    expect(TypeError, ("reshard_after_forward must be True or False", "'yes'"),
           fully_shard, Block(), reshard_after_forward="yes")
    expect(TypeError, ("reshard_after_forward", "2.5"), fully_shard, Block(), reshard_after_forward=2.5)
    assert fully_shard(Block(), reshard_after_forward=None).fsdp_unit.reshard_after_forward  # FSDP2's default
    expect(TypeError, ("dp_shard_dim must be a mesh dimension name",), fully_shard, Block(), dp_shard_dim=0)
    expect(TypeError, ("dp_outer_dim",), fully_shard, Block(), dp_shard_dim="x", dp_outer_dim=1)
    expect(TypeError, ("outer_sharding_strategy must be one of",), fully_shard, Block(), outer_sharding_strategy=0)
    expect(TypeError, ("mp_policy",), fully_shard, Block(), mp_policy="bf16")
    expect(ValueError, ("sharding_strategy=True",), fully_shard, Block(), sharding_strategy=True)
    block = fully_shard(Block())
    expect(NotImplementedError, ("set_reshard_after_forward", "reshard_after_forward=2"),
           block.set_reshard_after_forward, 2)
    expect(TypeError, ("set_requires_gradient_sync", "requires_gradient_sync must be True or False"),
           block.set_requires_gradient_sync, "no")
    assert block.fsdp_unit.requires_gradient_sync and block.fsdp_unit.reshard_after_forward


@check(SUITE, world_sizes=(2,))
def unknown_keywords_are_named_by_the_per_module_form() -> None:
    message = expect(TypeError, ("'reshard_after_fwd'", "did you mean 'reshard_after_forward'", "per-module form"),
                     fully_shard, Block(), reshard_after_fwd=True)
    assert "whole-model form, which takes" not in message, message
    expect(TypeError, ("'bogus'", "per-module form takes"), fully_shard, Block(), bogus=1, zero_dp_strategy=3)
    # A fully_shard_model option still selects the whole-model form.
    model, optimizer = fully_shard(Net(), fsdp_unit_modules=[Block], zero_dp_strategy="optim")
    assert optimizer is None and isinstance(model, megatron_fsdp.MegatronFSDP)
    # With an optimizer it is the whole-model form, which names what it does not know.
    expect(TypeError, ("'reshard_after_fwd'",), fully_shard, Net(), torch.optim.SGD(Net().parameters(), lr=0.1),
           reshard_after_fwd=True)


@check(SUITE)
def groups_made_on_some_ranks_before_fully_shard_train_like_ddp() -> None:
    """A process group with some ranks only (every rank calls new_group; the others are no members) leaves
    the members belonging to more groups than the rest. torch names a group made by its members only by
    that number, so the engine's own groups (control rounds, reductions, post-forward sub-groups) waited
    for each other under different names until the store's 30-minute timeout. Each layout, made after
    such groups, trains like DDP (bitwise at 2 ranks)."""
    rank, n = world()
    dist.new_group(list(range(n - 1)))  # the last rank is no member: it belongs to fewer groups from here on
    torch.manual_seed(0)
    base = Net()
    ddp = DDP(copy.deepcopy(base), find_unused_parameters=True)  # the probe block never gets gradients
    opt_ddp = sgd(ddp.parameters())
    steps = 2
    for step in range(steps):
        loss_fn(ddp, local_batch(step, rank, n)).backward()
        opt_ddp.step()
        opt_ddp.zero_grad()
    layouts = [*configs()]
    if n == 4:
        layouts.append(("post-forward shard over 2", dict(sharding_strategy="optim_grads_params",
                                                          reshard_after_forward=2)))
    for label, kwargs in layouts:
        dist.new_group([n - 1])  # now the last rank belongs to more groups than the others
        model = shard(copy.deepcopy(base), **kwargs)
        opt = sgd(model.parameters())
        for step in range(steps):
            loss_fn(model, local_batch(step, rank, n)).backward()
            opt.step()
            opt.zero_grad()
        exact = n == 2 and not label.startswith("hsdp")
        assert_matches(model, ddp.module, label, rtol=0 if exact else 1e-5, atol=0 if exact else 1e-6)
