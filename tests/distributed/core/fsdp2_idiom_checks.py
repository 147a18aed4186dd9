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
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_optimizer_state_dict,
    set_optimizer_state_dict,
)
from torch.distributed.tensor import DTensor

from megatron_fsdp import fully_shard
from tests.distributed.harness import check, device, shared_tmpdir
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
