"""FSDP2's idioms on ``megatron_fsdp.fully_shard``: the same code, only the import changed.

Scenarios follow PyTorch's FSDP2 tests (test/distributed/_composable/fsdp/); each is
compared with a reference that holds the same weights unsharded.
"""

from __future__ import annotations

import copy
import io

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch._dynamo.utils import counters
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_optimizer_state_dict,
    set_optimizer_state_dict,
)
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard as torch_fully_shard
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor

from megatron_fsdp import fully_shard
from megatron_fsdp.optim.local_step import observed_by_hooks
from tests.distributed.harness import check, device, device_type, shared_tmpdir
from tests.models import ResidualMLP as MLP

SUITE = "fsdp2_idioms"
STRATEGIES = ("optim_grads_params", "optim_grads", "optim", "no_shard")


def make_model() -> nn.Sequential:
    return nn.Sequential(nn.Linear(7, 12), MLP(), MLP(), nn.Linear(12, 5))


def full_copy(model: nn.Module) -> nn.Module:
    """A plain model holding ``model``'s current (gathered) weights."""
    plain = make_model()
    plain.load_state_dict({k: v.full_tensor() if isinstance(v, DTensor) else v
                           for k, v in model.state_dict().items()})
    return plain


@check(SUITE)
def meta_device_init_with_to_empty_and_reset_parameters() -> None:
    """torchtitan's recipe: build on meta, fully_shard, to_empty, reset_parameters: train on those weights."""
    rank = dist.get_rank()
    for strategy in STRATEGIES:
        torch.manual_seed(0)
        with torch.device("meta"):
            model = make_model()
        for block in model[1:3]:
            fully_shard(block, sharding_strategy=strategy)
        fully_shard(model, sharding_strategy=strategy)
        model.to_empty(device=device())
        torch.manual_seed(42)
        for module in model.modules():
            if hasattr(module, "reset_parameters"):
                module.reset_parameters()
        assert all(isinstance(p, DTensor) and not p.is_meta for p in model.parameters()), strategy
        reference = full_copy(model)
        opts = [torch.optim.AdamW(m.parameters(), lr=1e-2) for m in (model, reference)]
        for step in range(3):
            g = torch.Generator().manual_seed(step)
            x = torch.randn(4 * dist.get_world_size(), 7, generator=g)
            local = x.chunk(dist.get_world_size())[rank]
            losses = []
            for m, opt, batch in ((model, opts[0], local), (reference, opts[1], x)):
                opt.zero_grad()
                loss = m(batch).square().mean()  # ours: gradients averaged over the ranks' equal batches
                loss.backward()
                if m is model:
                    loss = loss.detach().clone()
                    dist.all_reduce(loss)
                    loss /= dist.get_world_size()
                losses.append(loss)
                opt.step()
            torch.testing.assert_close(losses[0], losses[1], rtol=1e-5, atol=1e-6,
                                       msg=f"{strategy} step {step}: the forward must use the initialised weights")
        for (name, p), q in zip(model.named_parameters(), reference.parameters()):
            torch.testing.assert_close(p.full_tensor(), q, rtol=1e-5, atol=1e-6, msg=f"{strategy} {name}")


@check(SUITE, world_sizes=(2,))
def module_to_after_fully_shard_keeps_the_shards() -> None:
    """``model.to(same device)`` / ``float()`` after fully_shard change nothing; a new dtype is refused."""
    torch.manual_seed(0)
    model = make_model()
    base = copy.deepcopy(model)
    for block in model[1:3]:
        fully_shard(block)
    fully_shard(model)
    model.to(device()).float()
    x = torch.randn(3, 7)
    torch.testing.assert_close(model(x), base(x))
    try:
        model.to(torch.float64)
    except NotImplementedError as exc:
        assert "before fully_shard" in str(exc), exc
    else:
        raise AssertionError("casting a sharded module must raise")


@check(SUITE)
def each_parameter_finds_its_group_by_identity_only() -> None:
    """The optimizer hooks' registry (``param_group.owner_of``), after a training step: each sharded
    parameter names its group and index; a clone, a deep copy or another tensor is not ours."""
    from megatron_fsdp.core import param_group

    model = make_model()
    for block in model[1:3]:
        fully_shard(block)
    fully_shard(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model(torch.randn(3, 7)).sum().backward()
    opt.step()
    params = list(model.parameters())
    for index, param in enumerate(params):
        owner = param_group.owner_of(param)
        assert owner is not None and owner[0].sharded_params[owner[1]] is param, f"parameter {index}: {owner}"
        assert param_group.owner_of(param.detach().clone()) is None, f"a clone of parameter {index} is not ours"
    assert param_group.owner_of(copy.deepcopy(params[0])) is None, "a deep copy is not ours"
    assert param_group.owner_of(torch.zeros(3)) is None


def _sharded(strategy: str) -> nn.Sequential:
    torch.manual_seed(0)
    model = make_model()
    for block in model[1:3]:
        fully_shard(block, sharding_strategy=strategy)
    fully_shard(model, sharding_strategy=strategy)
    return model


def _train_step(model: nn.Module, opt: torch.optim.Optimizer, step: int) -> None:
    g = torch.Generator().manual_seed(100 + step)
    x = torch.randn(2 * dist.get_world_size(), 7, generator=g).chunk(dist.get_world_size())[dist.get_rank()]
    model(x.to(device())).pow(2).mean().backward()
    opt.step()
    opt.zero_grad()


@check(SUITE, params={"broadcast": [False, True]})
def full_optimizer_state_dict_loads_into_a_fresh_optimizer(broadcast: bool) -> None:
    """set_optimizer_state_dict(full_state_dict=True) then train: bitwise the uninterrupted run.

    torch cuts full state at torch.chunk boundaries (plain Shard(0)); our ragged shards hold
    other row counts, so without the re-cut the next step failed on a shape.
    """
    options = StateDictOptions(full_state_dict=True, broadcast_from_rank0=broadcast)
    for strategy in ("optim_grads_params", "optim"):
        model = _sharded(strategy)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
        for step in range(2):
            _train_step(model, opt, step)
        saved = copy.deepcopy(get_optimizer_state_dict(model, opt, options=options))  # `step` tensors alias
        weights = copy.deepcopy(model.state_dict())  # shard views at rank-dependent offsets (failed in torch 2.13)
        pickled = io.BytesIO()
        torch.save({"model": model.state_dict(), "grads": [p.grad for p in model.parameters()]}, pickled)
        pickled.seek(0)
        restored = torch.load(pickled, weights_only=False)["model"]
        for key, value in model.state_dict().items():
            assert torch.equal(restored[key].to_local(), value.to_local()), key
        for key, value in model.state_dict().items():
            assert weights[key].placements == value.placements, key
            local = value.to_local()
            assert weights[key].to_local().data_ptr() != local.data_ptr() or not local.numel(), key
            assert torch.equal(weights[key].to_local(), value.to_local()), key
        for step in range(2, 4):
            _train_step(model, opt, step)
        expected = [p.full_tensor() for p in model.parameters()]

        resumed = _sharded(strategy)
        resumed.load_state_dict(weights)
        fresh = torch.optim.AdamW(resumed.parameters(), lr=1e-2, weight_decay=0.1)
        if broadcast and dist.get_rank() != 0:
            saved = {}
        set_optimizer_state_dict(resumed, fresh, saved, options=options)
        for param in resumed.parameters():
            for key, value in fresh.state[param].items():
                if isinstance(value, DTensor) and value.dim():
                    assert value.to_local().shape == param.to_local().shape, (strategy, key)
        for step in range(2, 4):
            _train_step(resumed, fresh, step)
        for (name, got), want in zip(resumed.named_parameters(), expected):
            torch.testing.assert_close(got.full_tensor(), want, rtol=0, atol=0, msg=f"{strategy} {name}")


class _WithEmpty(nn.Module):
    """Parameters with no elements beside ordinary ones: (5, 9, 0) has rows but no elements."""

    def __init__(self) -> None:
        super().__init__()
        self.inner = nn.Linear(7, 6)
        self.outer = nn.Linear(6, 3)
        self.rows_no_elements = nn.Parameter(torch.zeros(5, 9, 0))
        self.no_rows = nn.Parameter(torch.zeros(0, 4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.outer(torch.relu(self.inner(x))) + self.rows_no_elements.sum() + self.no_rows.sum()


@check(SUITE)
def parameters_without_elements_train_save_and_load() -> None:
    """Zero-element parameters (5, 9, 0) and (0, 4): shard, full_tensor, train, DCP round trip."""
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    reference = _WithEmpty()
    model = copy.deepcopy(reference)
    fully_shard(model.inner)
    fully_shard(model)
    shapes = {n: tuple(p.shape) for n, p in model.named_parameters()}
    assert shapes["rows_no_elements"] == (5, 9, 0) and shapes["no_rows"] == (0, 4), shapes
    for name, param in model.named_parameters():
        assert param.full_tensor().shape == dict(reference.named_parameters())[name].shape, name
    opts = [torch.optim.AdamW(m.parameters(), lr=1e-2) for m in (model, reference)]
    for step in range(3):
        x = torch.randn(2 * world, 7, generator=torch.Generator().manual_seed(step))
        for m, opt, batch in ((model, opts[0], x.chunk(world)[rank]), (reference, opts[1], x)):
            m(batch.to(device())).pow(2).mean().backward()
            opt.step()
            opt.zero_grad()
    for (name, got), want in zip(model.named_parameters(), reference.parameters()):
        torch.testing.assert_close(got.full_tensor().cpu(), want.detach(), rtol=1e-5, atol=1e-6, msg=name)
    torch.manual_seed(1)
    other = _WithEmpty()
    fully_shard(other.inner)
    fully_shard(other)
    state = other.state_dict()
    with shared_tmpdir("empty-params") as directory:
        dcp.save(model.state_dict(), checkpoint_id=directory)
        dcp.load(state, checkpoint_id=directory)
    other.load_state_dict(state)
    for (name, got), want in zip(other.named_parameters(), model.parameters()):
        torch.testing.assert_close(got.full_tensor(), want.full_tensor(), rtol=0, atol=0, msg=name)


@check(SUITE)
def main_grad_follows_zero_grad() -> None:
    """Megatron-LM reads ``main_grad`` of the sharded parameters: after ``zero_grad()`` and a
    backward that leaves a unit without gradient, it must not hold last step's gradient."""

    class Branchy(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a = nn.Linear(4, 4)
            self.b = nn.Linear(4, 4)

        def forward(self, x: torch.Tensor, use_b: bool) -> torch.Tensor:
            x = self.a(x)
            return self.b(x) if use_b else x

    torch.manual_seed(0)
    model = Branchy()
    fully_shard(model.a)
    fully_shard(model.b)
    fully_shard(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    x = torch.randn(2, 4, device=device())
    model(x, True).sum().backward()
    for name, param in model.named_parameters():
        assert getattr(param, "main_grad", None) is param.grad, f"{name}: main_grad is not .grad after backward"
    opt.step()
    opt.zero_grad()
    loss = model(x, False).sum()
    for name, param in model.named_parameters():  # nothing holds last step's gradients through this step
        assert getattr(param, "main_grad", None) is None, f"{name}: main_grad kept after zero_grad"
    loss.backward()
    for name, param in model.named_parameters():
        if name.startswith("b."):
            assert param.grad is None and getattr(param, "main_grad", None) is None, f"{name}: stale main_grad"
        else:
            assert param.main_grad is param.grad, name


# -- user code that treats a sharded parameter as an ordinary DTensor (issue 26) -------------
# Each runs the same code on our fully_shard, on torch's FSDP2 and (where it applies) on one
# process holding the whole model. Small parameters make our rows ragged: an Embedding(2, 8)
# sits on one rank, a Linear(8, 3) elsewhere.


def _small_model() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Embedding(2, 8), nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 3))


def _both_sharded() -> dict[str, nn.Module]:
    """``{"ours": ..., "fsdp2": ...}``: the same weights, sharded per Linear and at the root."""
    mesh = init_device_mesh(device_type(), (dist.get_world_size(),))
    models = {}
    for name, shard in (("ours", fully_shard), ("fsdp2", lambda m: torch_fully_shard(m, mesh=mesh))):
        model = _small_model().to(device())
        shard(model[1])
        shard(model)
        models[name] = model
    return models


def _small_step(model: nn.Module, opt: torch.optim.Optimizer, step: int, sharded: bool) -> None:
    world = dist.get_world_size()
    tokens = torch.randint(0, 2, (2 * world, 5), generator=torch.Generator().manual_seed(step))
    if sharded:
        tokens = tokens.chunk(world)[dist.get_rank()]
    model(tokens.to(device())).square().mean().backward()
    opt.step()
    opt.zero_grad()


def _assert_same(got: nn.Module, want: nn.Module, what: str, rtol: float = 0.0, atol: float = 0.0) -> None:
    for (name, p), q in zip(got.named_parameters(), want.parameters()):
        q = q.full_tensor() if isinstance(q, DTensor) else q
        torch.testing.assert_close(p.full_tensor(), q.detach(), rtol=rtol, atol=atol, msg=f"{what}: {name}")


@check(SUITE)
def copy_from_distribute_tensor_and_assign_load_exact_values() -> None:
    """torch's loading idioms: ``p.copy_(distribute_tensor(full, p.device_mesh, p.placements))``
    and ``load_state_dict({k: distribute_tensor(...)}, assign=True)``: the values land bitwise,
    and training on them gives FSDP2's numbers. ``distribute_tensor`` cuts even torch.chunk
    pieces; ours hold ragged rows, so the copy re-lays the source out instead of broadcasting
    a 1-row piece into a 2-row shard."""
    torch.manual_seed(7)
    full = {k: torch.randn_like(v) for k, v in _small_model().state_dict().items()}
    for recipe in ("copy_", "assign"):
        models = _both_sharded()
        for model in models.values():
            if recipe == "copy_":
                with torch.no_grad():
                    for name, p in model.named_parameters():
                        p.copy_(distribute_tensor(full[name].to(device()), p.device_mesh, p.placements))
            else:
                params = dict(model.named_parameters())
                model.load_state_dict({k: distribute_tensor(full[k].to(device()), p.device_mesh, p.placements)
                                       for k, p in params.items()}, assign=True)
                if model is models["ours"]:  # the values went into our shards; the parameters stay ours
                    assert all(p is params[k] for k, p in model.named_parameters())
            for name, p in model.named_parameters():
                assert torch.equal(p.full_tensor().cpu(), full[name]), f"{recipe}: {name} did not load"
        reference = _small_model()
        reference.load_state_dict(full)
        opts = {k: torch.optim.AdamW(m.parameters(), lr=1e-2) for k, m in models.items()}
        ref_opt = torch.optim.AdamW(reference.parameters(), lr=1e-2)
        for step in range(3):
            for key, model in models.items():
                _small_step(model, opts[key], step, sharded=True)
            _small_step(reference, ref_opt, step, sharded=False)
        _assert_same(models["ours"], models["fsdp2"], f"{recipe}: ours vs FSDP2", rtol=1e-6, atol=1e-7)
        _assert_same(models["ours"], reference.to(device()), f"{recipe}: ours vs one process", rtol=1e-5, atol=1e-6)


@check(SUITE)
def derived_tensors_gather_and_checkpoint_like_fsdp2() -> None:
    """``full_tensor()`` of ``p.detach().clone()``, ``p * 2``, ``p.to(bfloat16)``, an EMA copy
    updated with ``lerp_``, ``redistribute`` to ``Shard(0)`` and ``Replicate()``, and ``dcp.save``
    of cloned parameters: each equals FSDP2's (the RaggedShard placement survives the ops)."""
    models = _both_sharded()
    emas = {k: {n: p.detach().clone() for n, p in m.named_parameters()} for k, m in models.items()}
    whole = {n: p.full_tensor().clone() for n, p in models["ours"].named_parameters()}  # the EMA on full tensors
    opts = {k: torch.optim.SGD(m.parameters(), lr=0.1) for k, m in models.items()}
    for step in range(3):
        for key, model in models.items():
            _small_step(model, opts[key], step, sharded=True)
            with torch.no_grad():
                for name, p in model.named_parameters():
                    emas[key][name].lerp_(p, 0.25)
                    if key == "ours":
                        whole[name].lerp_(p.full_tensor(), 0.25)
    derived = {
        "clone": lambda p: p.detach().clone(),
        "times two": lambda p: p * 2,
        "bfloat16": lambda p: p.to(torch.bfloat16),
        "sum with clone": lambda p: p.detach() + p.detach().clone(),
        "to Shard(0)": lambda p: p.redistribute(placements=[Shard(0)]),
        "to Replicate": lambda p: p.redistribute(placements=[Replicate()]),
    }
    for key, model in models.items():  # the same ops on the whole tensor, bitwise, as FSDP2 gives
        for name, p in model.named_parameters():
            full = p.full_tensor()
            for what, fn in derived.items():
                got = fn(p).full_tensor()
                want = full.detach() if what.startswith("to ") else fn(full.detach())
                assert torch.equal(got, want), f"{key}: full_tensor() of {what} of {name} is not {what} of the whole"
    ours, fsdp2 = (dict(models[k].named_parameters()) for k in ("ours", "fsdp2"))
    for name in ours:
        assert torch.equal(emas["ours"][name].full_tensor(), whole[name]), f"EMA of {name}"
        torch.testing.assert_close(emas["ours"][name].full_tensor(), emas["fsdp2"][name].full_tensor(),
                                   rtol=1e-6, atol=1e-7, msg=f"EMA of {name}: ours vs FSDP2")
        as_shard = ours[name].redistribute(placements=[Shard(0)])
        assert type(as_shard.placements[0]) is Shard, as_shard.placements
    with shared_tmpdir("derived-dcp") as directory:
        saved = {n: p.detach().clone() for n, p in models["ours"].named_parameters()}
        dcp.save(saved, checkpoint_id=directory)
        fresh = _both_sharded()["fsdp2"]  # cross-load into FSDP2's layout: the rows must be where DCP says
        target = {n: p.detach().clone() for n, p in fresh.named_parameters()}
        dcp.load(target, checkpoint_id=directory)
    for name, value in target.items():
        assert torch.equal(value.full_tensor(), ours[name].full_tensor()), f"dcp of cloned {name}"


@check(SUITE)
def optimizer_step_hooks_see_dtensors_as_under_fsdp2() -> None:
    """A grad clip in ``register_step_pre_hook`` and an EMA in ``register_step_post_hook`` see
    the DTensor parameters (the global norm, whole-parameter EMA), as under FSDP2: the local
    step (plain local shards) is not used while a user's hook can observe it, and is used again
    once the hooks are removed."""
    models = _both_sharded()
    reference = _small_model()
    emas: dict[str, dict[str, torch.Tensor]] = {}
    seen: dict[str, set] = {}

    def install(key: str, model: nn.Module, opt: torch.optim.Optimizer) -> list:
        emas[key] = {n: p.detach().clone() for n, p in model.named_parameters()}
        seen[key] = set()
        params = dict(model.named_parameters())

        def pre(optimizer, args, kwargs) -> None:
            seen[key].update(isinstance(p, DTensor) for g in optimizer.param_groups for p in g["params"])
            torch.nn.utils.clip_grad_norm_([p for p in params.values() if p.grad is not None], max_norm=0.05)

        def post(optimizer, args, kwargs) -> None:
            with torch.no_grad():
                for n, p in params.items():
                    emas[key][n].lerp_(p, 0.5)

        return [opt.register_step_pre_hook(pre), opt.register_step_post_hook(post)]

    opts = {k: torch.optim.AdamW(m.parameters(), lr=1e-2) for k, m in models.items()}
    opts["one"] = torch.optim.AdamW(reference.parameters(), lr=1e-2)
    everything = {**models, "one": reference}
    handles = [h for k, m in everything.items() for h in install(k, m, opts[k])]
    assert observed_by_hooks(opts["ours"])
    for step in range(4):
        for key, model in everything.items():
            _small_step(model, opts[key], step, sharded=key != "one")
    assert seen["ours"] == {True}, "a step hook saw local shards where FSDP2 shows DTensors"
    _assert_same(models["ours"], models["fsdp2"], "clip + EMA hooks: ours vs FSDP2", rtol=1e-6, atol=1e-7)
    _assert_same(models["ours"], reference.to(device()), "clip + EMA hooks: ours vs one process", rtol=1e-5, atol=1e-6)
    for name, ema in emas["ours"].items():
        torch.testing.assert_close(ema.full_tensor(), emas["fsdp2"][name].full_tensor(), rtol=1e-6, atol=1e-7,
                                   msg=f"EMA of {name}")
    for handle in handles:
        handle.remove()
    assert not observed_by_hooks(opts["ours"]), "without hooks the local step must be used again"


class _Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(8, 16)
        self.b = nn.Linear(16, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.b(torch.relu(self.a(x)))


@check(SUITE, params={"fullgraph": [False, True]})
def compile_blocks_after_fully_shard_without_graph_breaks(fullgraph: bool) -> None:
    """``block.compile()`` after ``fully_shard`` (torchtitan's order): no more graph breaks than
    FSDP2 (counted by ``torch._dynamo.utils.counters``; our hooks run eagerly, as FSDP2's do),
    ``fullgraph=True`` compiles, and training matches FSDP2 and the uncompiled run."""
    mesh = init_device_mesh(device_type(), (dist.get_world_size(),))
    shards = {"ours": fully_shard, "fsdp2": lambda m: torch_fully_shard(m, mesh=mesh), "eager": fully_shard}
    breaks, models = {}, {}
    for key, shard in shards.items():
        torch.manual_seed(0)
        model = nn.Sequential(_Block(), _Block()).to(device())
        for block in model:
            shard(block)
        shard(model)
        torch._dynamo.reset()
        counters.clear()
        if key != "eager":
            for block in model:
                block.compile(backend="eager", fullgraph=fullgraph)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        for step in range(3):
            x = torch.randn(4, 8, generator=torch.Generator().manual_seed(10 * step + dist.get_rank()))
            model(x.to(device())).square().mean().backward()
            opt.step()
            opt.zero_grad()
        breaks[key] = sum(counters["graph_break"].values())
        models[key] = model
    torch._dynamo.reset()
    assert breaks["ours"] <= breaks["fsdp2"], f"graph breaks: ours {breaks['ours']}, FSDP2 {breaks['fsdp2']}"
    _assert_same(models["ours"], models["eager"], "compiled vs eager", rtol=1e-6, atol=1e-7)
    _assert_same(models["ours"], models["fsdp2"], "ours vs FSDP2 compiled", rtol=1e-6, atol=1e-7)
