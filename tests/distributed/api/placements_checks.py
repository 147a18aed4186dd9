"""The placements API (``megatron_fsdp.experimental``, Megatron-LM main's "Megatron-FSDP v2") on gloo ranks.

Each preset trains like DDP and like one process; HSDP and HFSDP accumulate micro-batches with one
outer reduction per step; nested, tied and frozen parameters; the context's roots and orders; a
checkpoint round trip that the engine's and FSDP2's readers also take; and the misuse errors.
"""

from __future__ import annotations

import copy

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.state_dict import (
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard as fsdp2_fully_shard
from torch.distributed.tensor import DTensor
from torch.nn.parallel import DistributedDataParallel as DDP

from megatron_fsdp import comm_stats, load_state
from megatron_fsdp import fully_shard as engine_fully_shard
from megatron_fsdp.core.lookup import unit_of, units_of
from megatron_fsdp.experimental import (
    PRESETS,
    FsdpModule,
    MixedPrecisionPolicy,
    Partial,
    Placements,
    Replicate,
    Shard,
    fully_shard,
    fully_shard_context,
    fully_shard_optimizer,
    load_checkpoint,
    microbatch,
    save_checkpoint,
    zero3,
)
from tests.distributed.core.engine_checks import assert_close_params, expect_error, make_optimizer, world
from tests.distributed.harness import check, device, device_type, shared_tmpdir
from tests.models import Block, Net, global_batch, local_batch, loss_fn

SUITE = "placements"
STEPS = 4


def dp_mesh():
    return init_device_mesh(device_type(), (dist.get_world_size(),))


def hsdp_mesh():
    return init_device_mesh(device_type(), (2, dist.get_world_size() // 2), mesh_dim_names=("outer", "inner"))


def shard_net(model: Net, mesh, placements: Placements, **kwargs):
    """Blocks, the probe block and then the root (which owns the tied embedding/head), in one context."""
    with fully_shard_context(device()) as context:
        for block in model.blocks:
            fully_shard(block, mesh, placements, **kwargs)
        fully_shard(model.probe, mesh, placements, **kwargs)
        fully_shard(model, mesh, placements, **kwargs)
    return model, context


@check(SUITE, params={"preset": ["zero3"], "optimizer": ["adamw"]})
@check(SUITE, params={"preset": ["no_shard", "zero1", "zero2", "zero3"], "optimizer": ["sgd"]})
def preset_parity(preset: str, optimizer: str) -> None:
    """Each 1-D preset trains ``Net`` (tied, frozen, reused and no_grad blocks) like DDP (bitwise at 2 ranks,
    atol 1e-6 at 4) and like one process on the global batch (rtol 1e-5, atol 1e-6)."""
    rank, n = world()
    torch.manual_seed(0)
    base = Net()
    single = copy.deepcopy(base)
    ddp = DDP(copy.deepcopy(base), find_unused_parameters=True)
    ours, _ = shard_net(copy.deepcopy(base), dp_mesh(), PRESETS[preset]())
    opt_single = make_optimizer(optimizer, single.parameters())
    opt_ddp = make_optimizer(optimizer, ddp.parameters())
    opt_ours = make_optimizer(optimizer, ours.parameters())
    fully_shard_optimizer(opt_ours)
    for step in range(STEPS):
        batch = local_batch(step, rank, n)
        for model, opt, data in ((ours, opt_ours, batch), (ddp, opt_ddp, batch),
                                 (single, opt_single, global_batch(step, n))):
            loss_fn(model, data).backward()
            opt.step()
            opt.zero_grad()
        assert_close_params(ours, ddp.module, exact=(n == 2), rtol=0, atol=1e-6, what=f"{preset} step {step}")
    assert_close_params(ours, single, exact=False, rtol=1e-5, atol=1e-6, what=f"{preset} vs one process")


def _outer_calls(mesh) -> int:
    return comm_stats.group_calls[mesh.get_group(0).group_name]


@check(SUITE, world_sizes=(4,), params={"preset": ["hfsdp"], "micro_batches": [3], "set_to_none": [False]})
@check(SUITE, world_sizes=(4,), params={"preset": ["hsdp", "hfsdp"], "micro_batches": [1, 3]})
def hsdp_accumulation(preset: str, micro_batches: int, set_to_none: bool = True) -> None:
    """HSDP/HFSDP on a 2x2 mesh with ``microbatch(ctx, is_last)`` trains like one process on the global batch
    (rtol 1e-5, atol 1e-6), and the outer-axis collectives per step do not grow with the micro-batch count."""
    rank, n = world()
    torch.manual_seed(0)
    base = nn.Sequential(Block(), Block(), nn.Linear(13, 5))
    single = copy.deepcopy(base)
    ours = copy.deepcopy(base)
    mesh = hsdp_mesh()
    with fully_shard_context(device()) as context:
        for layer in ours:
            fully_shard(layer, mesh, PRESETS[preset]())
        fully_shard(ours, mesh, PRESETS[preset]())
    opt = torch.optim.SGD(ours.parameters(), lr=0.1, momentum=0.9)
    fully_shard_optimizer(opt)
    opt_single = torch.optim.SGD(single.parameters(), lr=0.1, momentum=0.9)
    per_step = []
    for step in range(STEPS):
        g = torch.Generator().manual_seed(step)
        x = torch.randn(n * micro_batches * 2, 13, generator=g).to(device())
        opt.zero_grad(set_to_none=set_to_none)
        before = _outer_calls(mesh)
        mine = x.chunk(n)[rank].chunk(micro_batches)
        for i, chunk in enumerate(mine):
            with microbatch(context, is_last=i == micro_batches - 1):
                (ours(chunk).square().mean() / micro_batches).backward()
        per_step.append(_outer_calls(mesh) - before)
        opt.step()
        opt_single.zero_grad()
        single(x).square().mean().backward()
        opt_single.step()
    assert_close_params(ours, single, exact=False, rtol=1e-5, atol=1e-6, what=f"{preset} x{micro_batches}")
    # per step and trainable unit: HSDP one outer all-reduce, HFSDP one outer reduce-scatter and one outer
    # all-gather of the updated main weights, whatever the micro-batch count (step 0 has no weights to refresh)
    trainable = sum(1 for unit in units_of(ours) if any(g.requires_grad for g in unit.groups))
    per_unit = 1 if preset == "hsdp" else 2
    assert trainable == 3 and per_step[1:] == [per_unit * trainable] * (STEPS - 1), per_step


@check(SUITE, world_sizes=(2,))
def outer_reduction_waits_for_the_last_micro_batch() -> None:
    """Inside ``microbatch(ctx, is_last=False)`` no HSDP outer collective runs; the last micro-batch runs them."""
    mesh = init_device_mesh(device_type(), (2, 1), mesh_dim_names=("outer", "inner"))
    model = nn.Sequential(nn.Linear(6, 6), nn.Linear(6, 2))
    with fully_shard_context(device()) as context:
        fully_shard(model, mesh, PRESETS["hsdp"]())
    x = torch.randn(4, 6, device=device())
    model(x).sum().backward()  # a first step outside the context (its reduction is not deferred)
    model.zero_grad()
    before = _outer_calls(mesh)
    with microbatch(context, is_last=False):
        model(x).sum().backward()
        model(x).sum().backward()
    assert _outer_calls(mesh) == before, "an outer reduction ran before the last micro-batch"
    with microbatch(context, is_last=True):
        model(x).sum().backward()
    assert _outer_calls(mesh) > before


@check(SUITE, world_sizes=(2,))
def nested_tied_and_frozen_parameters() -> None:
    """Each module owns the parameters no sharded child owns; a tied weight is one parameter under both names;
    a frozen group has no gradient storage; a parameterless parent trains."""
    model, _ = shard_net(Net(), dp_mesh(), zero3())
    root_groups = model.parameter_groups
    names = sorted(fqn for g in root_groups for p in g.fsdp_parameters for fqn in p.fqns)
    assert names == ["embed.weight", "frozen.bias", "frozen.weight", "head.weight", "tiny"], names
    (tied,) = [p for g in root_groups for p in g.fsdp_parameters if len(p.fqns) == 2]
    assert tied.fqns == ("embed.weight", "head.weight") and model.head.weight is model.embed.weight
    frozen = [g for g in root_groups if not g.requires_grad]
    assert len(frozen) == 1 and frozen[0].main_grad is None
    block_names = [p.fqns for g in model.blocks[0].parameter_groups for p in g.fsdp_parameters]
    assert ("up.weight",) in block_names and all(not f[0].startswith("blocks") for f in block_names)
    assert len(list(model.parameters())) == len({id(p) for p in model.parameters()})

    parent = nn.Sequential(nn.Linear(4, 4, bias=False), nn.Linear(4, 2, bias=False))
    with fully_shard_context(device()):
        fully_shard(parent[0], dp_mesh(), zero3())
        fully_shard(parent[1], dp_mesh(), zero3())
        fully_shard(parent, dp_mesh(), zero3())
    assert parent.parameter_groups == ()
    opt = torch.optim.SGD(parent.parameters(), lr=0.1)
    parent(torch.randn(3, 4, device=device())).sum().backward()
    opt.step()
    assert all(isinstance(p.grad, DTensor) for p in parent.parameters())


@check(SUITE, world_sizes=(2,))
def context_roots_names_and_orders() -> None:
    """Roots, names and the forward/backward orders are fixed on leaving the block, across sibling roots."""
    model = nn.Module()
    model.left = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4))
    model.right = nn.Linear(4, 4)
    with fully_shard_context(device()) as context:
        fully_shard(model.left[1], dp_mesh(), zero3())
        fully_shard(model.left, dp_mesh(), zero3())
        fully_shard(model.right, dp_mesh(), zero3())
        assert not context.is_finalized
    assert context.roots == (model.left, model.right)
    assert model.left.is_root() and model.right.is_root() and not model.left[1].is_root()
    assert (model.left.name, model.left[1].name, model.right.name) == ("", "1", "")
    assert context.forward_order == [model.left, model.left[1], model.right]
    assert context.backward_order == [model.right, model.left, model.left[1]]
    assert isinstance(model.left, FsdpModule) and model.left.context is context
    x = torch.randn(2, 4, device=device())
    out = model.right(model.left(x))
    assert model.left.phase is FsdpModule.Phase.RESTING
    out.sum().backward()
    assert all(isinstance(p, DTensor) for p in model.parameters())


class _TwoLayers(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.first, self.second = nn.Linear(4, 4), nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.relu(self.second(torch.relu(self.first(x))))


class _RecordedRanges:
    """``torch.cuda.nvtx.range_push``/``range_pop`` replaced by a recorder (they raise on a CPU build)."""

    def __enter__(self) -> list[tuple[str, str]]:
        self.events: list[tuple[str, str]] = []
        self.stack: list[str] = []
        self.saved = (torch.cuda.nvtx.range_push, torch.cuda.nvtx.range_pop)

        def push(label: str) -> None:
            self.stack.append(label)
            self.events.append(("push", label))

        def pop() -> None:
            self.events.append(("pop", self.stack.pop()))

        torch.cuda.nvtx.range_push, torch.cuda.nvtx.range_pop = push, pop
        return self.events

    def __exit__(self, *exc: object) -> None:
        torch.cuda.nvtx.range_push, torch.cuda.nvtx.range_pop = self.saved


def _ranges(*spans: tuple[str, str, list]) -> list[tuple[str, str]]:
    """Nested spans ``(name, phase, inner spans)`` as the push/pop events they make."""
    events = []
    for name, phase, inner in spans:
        events.append(("push", f"MFSDP {name} {phase}"))
        events.extend(_ranges(*inner))
        events.append(("pop", f"MFSDP {name} {phase}"))
    return events


@check(SUITE, world_sizes=(2,))
def nvtx_ranges_per_module_pass() -> None:
    """Each FsdpModule pass is one NVTX range named after the module (``<root>`` for roots), nested as the
    modules are: backward ranges close when the module's input gradients are computed, or at the end of
    the backward when none is needed; a frozen module outside the backward graph has no backward range."""
    model = _TwoLayers()
    with fully_shard_context(device()):
        fully_shard(model.first, dp_mesh(), zero3())
        fully_shard(model.second, dp_mesh(), zero3())
        fully_shard(model, dp_mesh(), zero3())
    x = torch.randn(2, 4, device=device())
    with _RecordedRanges() as events:
        model(x).sum().backward()
    forward = ("<root>", "forward", [("first", "forward", []), ("second", "forward", [])])
    backward = ("<root>", "backward", [("second", "backward", []), ("first", "backward", [])])
    assert events == _ranges(forward, backward), events

    frozen = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4))  # first one frozen, fed data: no gradient flows back
    frozen[0].requires_grad_(False)
    with fully_shard_context(device()):
        fully_shard(frozen[0], dp_mesh(), zero3())
        fully_shard(frozen[1], dp_mesh(), zero3())
    with _RecordedRanges() as events:
        for _ in range(2):  # siblings roots, two iterations: balanced every time
            frozen(x).sum().backward()
    one = _ranges(("<root>", "forward", []), ("<root>", "forward", []), ("<root>", "backward", []))
    assert events == one + one, events
    with _RecordedRanges() as events, torch.no_grad():
        frozen(x)
    assert events == _ranges(("<root>", "forward", []), ("<root>", "forward", [])), events


@check(SUITE, world_sizes=(2,))
def grad_divisor_divides_the_averaged_gradient() -> None:
    """``grad_divisor=4`` gives a quarter of the averaged gradient (rtol 1e-6)."""
    grads = []
    for divisor in (1, 4):
        torch.manual_seed(3)
        model = nn.Sequential(nn.Linear(5, 7), nn.Linear(7, 3))
        with fully_shard_context(device()):
            fully_shard(model, dp_mesh(), zero3(), grad_divisor=divisor)
        rank, _ = world()
        model(torch.full((2, 5), float(rank + 1), device=device())).square().sum().backward()
        grads.append([p.grad.full_tensor() for p in model.parameters()])
    for one, four in zip(*grads):
        torch.testing.assert_close(four, one / 4, rtol=1e-6, atol=0)


@check(SUITE, world_sizes=(2,))
def mixed_precision_defaults() -> None:
    """A bf16 model keeps fp32 main weights and reduces and accumulates bf16 gradients by default (the engine
    hands ``.grad`` to the optimizer in the main weights' dtype); a plain Adam's losses track a bf16 model's
    (atol 3e-3, bf16's resolution at these values)."""
    torch.manual_seed(2026)
    base = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4)).to(dtype=torch.bfloat16)
    reference = copy.deepcopy(base)
    model = copy.deepcopy(base)
    with fully_shard_context(device()):
        fully_shard(model[0], dp_mesh(), zero3())
        fully_shard(model[2], dp_mesh(), zero3())
    assert all(p.dtype == torch.float32 for p in model.parameters())
    groups = [g for layer in (model[0], model[2]) for g in unit_of(layer).groups]
    assert all((g.compute_dtype, g.dtype, g.grad_dtype) == (torch.bfloat16, torch.float32, torch.bfloat16)
               for g in groups)  # compute, main weights, main gradients
    opt = torch.optim.Adam(model.parameters(), lr=0.01)
    fully_shard_optimizer(opt)
    opt_ref = torch.optim.Adam(reference.parameters(), lr=0.01)
    x = torch.randn(3, 8, device=device(), dtype=torch.bfloat16)
    target = torch.randn(3, 4, device=device(), dtype=torch.bfloat16)
    for _ in range(3):
        loss = nn.functional.mse_loss(model(x).float(), target.float())
        ref = nn.functional.mse_loss(reference(x).float(), target.float())
        torch.testing.assert_close(loss, ref, rtol=0, atol=3e-3)
        loss.backward()
        ref.backward()
        assert all(p.grad.dtype == torch.float32 for p in model.parameters())
        opt.step()
        opt_ref.step()
        opt.zero_grad()
        opt_ref.zero_grad()
    same = copy.deepcopy(base)
    with fully_shard_context(device()):
        fully_shard(same, dp_mesh(), zero3(), mixed_precision_policy=MixedPrecisionPolicy(main_params_dtype=None))
    assert all(p.dtype == torch.bfloat16 for p in same.parameters())


def _tiny() -> nn.Module:
    return nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))


def _build(placements: Placements, zero: bool) -> tuple[nn.Module, torch.optim.Optimizer]:
    model = _tiny()
    if zero:
        for p in model.parameters():
            nn.init.zeros_(p)
    with fully_shard_context(device()):
        fully_shard(model[0], dp_mesh(), placements)
        fully_shard(model[2], dp_mesh(), placements)
    opt = torch.optim.Adam(model.parameters(), lr=0.02)
    fully_shard_optimizer(opt)
    return model, opt


def _full_state(model: nn.Module, opt: torch.optim.Optimizer) -> dict[str, torch.Tensor]:
    names = {id(p): n for n, p in model.named_parameters()}
    out = {f"model.{n}": (p.full_tensor() if isinstance(p, DTensor) else p).detach().clone()
           for n, p in model.named_parameters()}
    for p, state in opt.state.items():
        for key, value in state.items():
            out[f"state.{names[id(p)]}.{key}"] = (value.full_tensor() if isinstance(value, DTensor) else value).clone()
    return out


def _assert_same(expected: dict[str, torch.Tensor], actual: dict[str, torch.Tensor], what: str) -> None:
    assert expected.keys() == actual.keys(), f"{what}: {sorted(expected.keys() ^ actual.keys())}"
    for key, value in expected.items():
        torch.testing.assert_close(actual[key], value, rtol=0, atol=0, msg=f"{what} {key}")


@check(SUITE)
def checkpoint_round_trip() -> None:
    """``save_checkpoint`` writes ``model.*`` and ``optimizer.*`` keys of global shapes; ``load_checkpoint`` restores
    them bit for bit into other placements; the engine's ``load_state`` and FSDP2's ``dcp.load`` read them too."""
    rank, n = world()
    torch.manual_seed(11)
    model, opt = _build(zero3(), zero=False)
    x = torch.randn(4, 8, device=device()) + rank
    for _ in range(2):
        model(x).square().mean().backward()
        opt.step()
        opt.zero_grad()
    saved = _full_state(model, opt)
    with shared_tmpdir() as tmp:
        save_checkpoint(model, opt, tmp)
        keys = FileSystemReader(tmp).read_metadata().state_dict_metadata
        assert "model.0.weight" in keys and "optimizer.state.2.bias.exp_avg" in keys
        assert "optimizer.param_groups.0.lr" in keys and not any(k.startswith("optim.") for k in keys)
        assert tuple(keys["model.0.weight"].size) == (16, 8)

        for placements in (zero3(), PRESETS["zero1"]()):
            loaded, loaded_opt = _build(placements, zero=True)
            load_checkpoint(loaded, loaded_opt, tmp)
            _assert_same(saved, _full_state(loaded, loaded_opt), f"load_checkpoint into {placements.optimizer}")
            y = torch.randn(2, 8, device=device())
            torch.testing.assert_close(loaded(y), model(y), rtol=0, atol=0)  # the compute weights follow

        engine = _tiny()
        engine_fully_shard(engine, sharding_strategy="optim_grads")
        engine_opt = torch.optim.Adam(engine.parameters(), lr=0.02)
        load_state(tmp, engine, engine_opt)
        _assert_same(saved, _full_state(engine, engine_opt), "megatron_fsdp.load_state")

        fsdp2 = _tiny()
        for p in fsdp2.parameters():
            nn.init.zeros_(p)
        fsdp2_fully_shard(fsdp2[0], mesh=dp_mesh())
        fsdp2_fully_shard(fsdp2[2], mesh=dp_mesh())
        fsdp2_fully_shard(fsdp2, mesh=dp_mesh())
        fsdp2_opt = torch.optim.Adam(fsdp2.parameters(), lr=0.02)
        for p in fsdp2.parameters():  # optimizer state for dcp.load to fill
            p.grad = torch.zeros_like(p)
        fsdp2_opt.step()
        state = {"model": get_model_state_dict(fsdp2), "optimizer": get_optimizer_state_dict(fsdp2, fsdp2_opt)}
        dcp.load(state, checkpoint_id=tmp)
        set_model_state_dict(fsdp2, state["model"])
        set_optimizer_state_dict(fsdp2, fsdp2_opt, state["optimizer"])
        _assert_same(saved, _full_state(fsdp2, fsdp2_opt), "FSDP2 dcp.load")


class _Ctx(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inner = nn.Linear(4, 4)
        self.bias = nn.Parameter(torch.zeros(4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.inner(x) + self.bias


@check(SUITE, world_sizes=(2,))
def misuse_errors() -> None:
    """Megatron-LM v2's error types and messages for misuse, and the placements refused with the presets named."""
    mesh = dp_mesh()
    expect_error(RuntimeError, "inside fully_shard_context", fully_shard, nn.Linear(4, 4), mesh, zero3())
    model = nn.Linear(4, 4)
    with fully_shard_context(device()) as context:
        fully_shard(model, mesh, zero3())
        expect_error(RuntimeError, "Exit fully_shard_context", model, torch.ones(2, 4, device=device()))
        expect_error(RuntimeError, "Exit fully_shard_context", microbatch(context, is_last=True).__enter__)
        expect_error(ValueError, "already managed by FSDP", fully_shard, model, mesh, zero3())
        try:
            with fully_shard_context(device()):
                raise AssertionError("a nested context opened")
        except RuntimeError as error:
            assert "does not support nesting" in str(error)
    model(torch.ones(2, 4, device=device()))
    expect_error(RuntimeError, "load_state_dict(assign=True)", model.load_state_dict,
                 nn.Linear(4, 4).state_dict(), assign=True)
    model.load_state_dict(nn.Linear(4, 4).state_dict())  # an in-place load is fine

    nested = _Ctx()
    with fully_shard_context(device()):
        fully_shard(nested.inner, mesh, zero3())
    with fully_shard_context(device()):
        expect_error(ValueError, "another fully_shard_context", fully_shard, nested, mesh, zero3())
        engine_sharded = nn.Linear(4, 4)
        engine_fully_shard(engine_sharded)
        expect_error(ValueError, "already managed by FSDP", fully_shard, engine_sharded, mesh, zero3())
        expect_error(ValueError, "a model uses one of the entry points", fully_shard,
                     nn.Sequential(engine_sharded), mesh, zero3())
        expect_error(NotImplementedError, "Unsupported dtype: torch.float64", fully_shard,
                     nn.Linear(4, 4).double(), mesh, zero3())
        expect_error(ValueError, "grad_divisor must be positive", fully_shard, nn.Linear(4, 4), mesh, zero3(),
                     grad_divisor=0)
        expect_error(NotImplementedError, ("not supported", "zero3 (S, S, S)", "hfsdp"), fully_shard,
                     nn.Linear(4, 4), mesh, Placements([0], [Shard(0)], [Partial("avg")], [Replicate()]))
        expect_error(NotImplementedError, "only dim-0 Shard", fully_shard, nn.Linear(4, 4), mesh,
                     Placements([0], [Shard(1)], [Shard(0)], [Shard(0)]))
        tied = nn.Module()
        tied.a, tied.b = nn.Linear(4, 4, bias=False), nn.Linear(4, 4, bias=False)
        tied.b.weight = tied.a.weight
        fully_shard(tied.a, mesh, zero3())
        expect_error(ValueError, "already owned by another FsdpModule", fully_shard, tied.b, mesh, zero3())
    expect_error(TypeError, "is_last must be True or False", microbatch(context, is_last=1).__enter__)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    fully_shard_optimizer(opt)
    expect_error(ValueError, "already applied", fully_shard_optimizer, opt)
    expect_error(NotImplementedError, "closures", opt.step, lambda: None)
    expect_error(ValueError, "use_symmetric_memory=True needs a CUDA device",
                 fully_shard_context(torch.device("cpu"), use_symmetric_memory=True).__enter__)
