"""FSDP2 port, part of the ``fsdp2_port`` suite: test_fully_shard_autograd.py and test_fully_shard_frozen.py.

See ``fsdp2_port_checks`` for how the scenarios are ported.
"""

from __future__ import annotations

import collections
import copy
import itertools

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed._composable import checkpoint

from megatron_fsdp import fully_shard
from tests.distributed.core.fsdp2_port_models import (
    MLP,
    SUITE,
    DoubleLinear,
    assert_equal,
    assert_sharded_parity,
    ddp_reference,
    rank_world,
    train_against,
)
from tests.distributed.harness import check

# -- test_fully_shard_autograd.py ---------------------------------------------------------


def global_and_local_input(global_batch: int, dim: int, local_batch: int) -> tuple[torch.Tensor, torch.Tensor]:
    rank, _ = rank_world()
    global_inp = torch.rand((global_batch, dim))  # the same on all ranks (seeded alike)
    return global_inp, global_inp[rank * local_batch:(rank + 1) * local_batch].detach()


@check(SUITE)
def unused_forward_output() -> None:
    """test_unused_forward_output: both outputs in the loss for 3 iterations, then only the first."""
    _, world = rank_world()
    for reshard_after_forward in (True, False):
        what = f"reshard_after_forward={reshard_after_forward}"
        torch.manual_seed(42)
        local_batch, dim = 2, 24
        model = DoubleLinear(dim=dim, use_second_linear=True)
        ref_model = copy.deepcopy(model)
        fully_shard(model.lin1, reshard_after_forward=reshard_after_forward)
        fully_shard(model, reshard_after_forward=reshard_after_forward)
        ref_optim = torch.optim.Adam(ref_model.parameters(), lr=1e-2)
        optim = torch.optim.Adam(model.parameters(), lr=1e-2)
        torch.manual_seed(1)  # same on all ranks
        for iter_idx in range(10):
            global_inp, local_inp = global_and_local_input(world * local_batch, dim, local_batch)
            out1, out2 = model(local_inp)
            loss = (out1 * out2).sum() if iter_idx < 3 else out1.sum()
            loss.backward()
            optim.step()
            ref_out1, ref_out2 = ref_model(global_inp)
            ref_loss = (ref_out1 * ref_out2).sum() if iter_idx < 3 else ref_out1.sum()
            ref_loss.backward()
            for param in ref_model.parameters():  # the global sum's gradient over the mean of local ones
                if param.grad is not None:
                    param.grad.div_(world)
            ref_optim.step()
            loss = loss.detach()
            dist.all_reduce(loss)
            assert_equal(loss, ref_loss, f"{what} iter {iter_idx}: loss")
            optim.zero_grad(set_to_none=bool(iter_idx % 2))
            ref_optim.zero_grad(set_to_none=bool(iter_idx % 2))
            assert_sharded_parity(ref_model, model, f"{what} iter {iter_idx}")


def run_global_vs_local(model: nn.Module, ref_model: nn.Module, dim: int, what: str) -> None:
    """The loop of test_unused_forward_module and test_nontensor_activations."""
    _, world = rank_world()
    local_batch = 2
    ref_optim = torch.optim.Adam(ref_model.parameters(), lr=1e-2)
    optim = torch.optim.Adam(model.parameters(), lr=1e-2)
    torch.manual_seed(1)
    for iter_idx in range(10):
        global_inp, local_inp = global_and_local_input(world * local_batch, dim, local_batch)
        losses = []
        for _model, inp in ((ref_model, global_inp), (model, local_inp)):
            losses.append(_model(inp).sum())
            losses[-1].backward()
        for param in ref_model.parameters():
            if param.grad is not None:
                param.grad.div_(world)
        loss = losses[1].detach()
        dist.all_reduce(loss)
        assert_equal(loss, losses[0], f"{what} iter {iter_idx}: loss")
        assert_sharded_parity(ref_model, model, f"{what} iter {iter_idx}")
        for _optim in (optim, ref_optim):
            _optim.step()
            _optim.zero_grad(set_to_none=bool(iter_idx % 2))


@check(SUITE)
def unused_forward_module() -> None:
    """test_unused_forward_module: a sharded module (lin2) never called; its gradients stay None."""
    for reshard_after_forward in (True, False):
        torch.manual_seed(42)
        dim = 24
        model = DoubleLinear(dim=dim, use_second_linear=False)
        ref_model = copy.deepcopy(model)
        fully_shard(model.lin1, reshard_after_forward=reshard_after_forward)
        fully_shard(model.lin2, reshard_after_forward=reshard_after_forward)
        fully_shard(model, reshard_after_forward=reshard_after_forward)
        run_global_vs_local(model, ref_model, dim, f"reshard_after_forward={reshard_after_forward}")


NT = collections.namedtuple("NT", "x y")


class ContainerModule(nn.Module):
    """test_nontensor_activations' Module: computes on element 0 of a list/namedtuple/tuple/dict."""

    def __init__(self, dim: int) -> None:
        super().__init__()
        self.lin1 = nn.Linear(dim, dim)
        self.lin2 = nn.Linear(dim, dim)

    def _forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.relu(self.lin2(F.relu(self.lin1(x))))

    def forward(self, inp):  # noqa: ANN001, ANN201 - a container in, the same kind out
        if isinstance(inp, list):
            return [self._forward(inp[0])]
        if isinstance(inp, NT):
            return NT(self._forward(inp.x), inp.y)
        if isinstance(inp, tuple):
            return (self._forward(inp[0]),)
        return {"x": self._forward(inp["x"])}


class ToContainer(nn.Module):
    def __init__(self, kind: str) -> None:
        super().__init__()
        self.kind = kind

    def forward(self, x: torch.Tensor):  # noqa: ANN201
        return {"list": lambda: [x], "namedtuple": lambda: NT(x, torch.ones_like(x)),
                "tuple": lambda: (x,), "dict": lambda: {"x": x}}[self.kind]()


class FromContainer(nn.Module):
    def forward(self, x) -> torch.Tensor:  # noqa: ANN001
        return x["x"] if isinstance(x, dict) else x[0]


@check(SUITE)
def nontensor_activations() -> None:
    """test_nontensor_activations: sharded modules take and return list/namedtuple/tuple/dict."""
    for kind in ("list", "namedtuple", "tuple", "dict"):
        torch.manual_seed(42)
        dim = 24
        model = nn.Sequential(ToContainer(kind), ContainerModule(dim), ContainerModule(dim), ContainerModule(dim),
                              FromContainer())
        ref_model = copy.deepcopy(model)
        for module in model:
            if any(True for _ in module.parameters()):
                fully_shard(module)  # the original also wraps the parameterless ones; ours has nothing to shard there
        fully_shard(model)
        run_global_vs_local(model, ref_model, dim, kind)


# -- test_fully_shard_frozen.py -----------------------------------------------------------


@check(SUITE)
def train_mixed_requires_grad_per_group() -> None:
    """test_train_mixed_requires_grad_per_group: only biases train (BitFit), frozen before or after fully_shard, +AC."""
    rank, _ = rank_world()
    num_mlps, lin_dim = 3, 32
    for reshard_after_forward, use_ac, freeze_after_init in itertools.product((False, True), (False, True),
                                                                              (False, True)):
        what = f"reshard_after_forward={reshard_after_forward} ac={use_ac} freeze_after_init={freeze_after_init}"
        torch.manual_seed(42)
        model = nn.Sequential(*[MLP(lin_dim) for _ in range(num_mlps)])
        if not freeze_after_init:
            for name, param in model.named_parameters():
                if "bias" not in name:
                    param.requires_grad_(False)
        ref_model = ddp_reference(model, find_unused_parameters=freeze_after_init)
        ref_optim = torch.optim.Adam(ref_model.parameters(), lr=1e-2)
        for mlp in model:
            if use_ac:
                checkpoint(mlp)
            fully_shard(mlp, reshard_after_forward=reshard_after_forward)
        fully_shard(model, reshard_after_forward=reshard_after_forward)
        optim = torch.optim.Adam(model.parameters(), lr=1e-2)
        if freeze_after_init:
            for name, param in itertools.chain(model.named_parameters(), ref_model.named_parameters()):
                if "bias" not in name:
                    param.requires_grad_(False)
        torch.manual_seed(42 + rank + 1)
        for iter_idx in range(10):
            inp = torch.randn((8, lin_dim))
            losses = []
            for _model, _optim in ((ref_model, ref_optim), (model, optim)):
                _optim.zero_grad(set_to_none=(iter_idx % 2 == 0))
                losses.append(_model(inp).sum())
                losses[-1].backward()
                _optim.step()
            assert_sharded_parity(ref_model, model, f"{what} iter {iter_idx}")
            assert_equal(losses[1], losses[0], f"{what} iter {iter_idx}: loss")


@check(SUITE)
def train_mixed_requires_grad_across_groups() -> None:
    """test_train_mixed_requires_grad_across_groups: six linears, each its own root; a no_grad iteration; unfreezing.

    The original's helper freezes ``seq[i % 2]`` for even ``i`` (only the first linear);
    this port freezes every even-indexed linear, as its comment ("interleave frozen ->
    non-frozen") intends, which covers the original's case and more.
    """
    rank, _ = rank_world()
    num_linears, lin_dim = 6, 32
    for reshard_after_forward, unfreeze in itertools.product((False, True), (False, True)):
        what = f"reshard_after_forward={reshard_after_forward} unfreeze={unfreeze}"
        torch.manual_seed(42)
        modules: list[nn.Module] = []
        for _ in range(num_linears):
            modules += [nn.Linear(lin_dim, lin_dim), nn.ReLU()]
        model = nn.Sequential(*modules)
        ref_model = ddp_reference(model, find_unused_parameters=True)
        for module in model.modules():
            if isinstance(module, nn.Linear):
                fully_shard(module, reshard_after_forward=reshard_after_forward)
        ref_optim = torch.optim.Adam(ref_model.parameters(), lr=1e-2)
        optim = torch.optim.Adam(model.parameters(), lr=1e-2)

        def set_requires_grad(seq: nn.Module, requires_grad: bool) -> None:
            for i in range(0, 2 * num_linears, 4):  # linears 0, 2, 4 of the six
                for param in seq[i].parameters():
                    param.requires_grad_(requires_grad)

        set_requires_grad(model, False)
        set_requires_grad(ref_model.module, False)
        num_iters, no_grad_iter_idx = 3, 1
        torch.manual_seed(42 + rank)
        inp = torch.randn((8, lin_dim))
        for iter_idx in range(num_iters):
            losses = []
            for _model, _optim in ((ref_model, ref_optim), (model, optim)):
                if unfreeze and iter_idx == num_iters - 1:
                    set_requires_grad(_model.module if _model is ref_model else _model, True)
                if iter_idx == no_grad_iter_idx:
                    with torch.no_grad():
                        losses.append(_model(inp).sum())
                else:
                    losses.append(_model(inp).sum())
                    losses[-1].backward()
                    _optim.step()
                    _optim.zero_grad(set_to_none=(iter_idx % 2 == 0))
            assert_equal(losses[1], losses[0], f"{what} iter {iter_idx}: loss")
        assert_sharded_parity(ref_model, model, what)


@check(SUITE)
def multi_forward_mixed_requires_grad() -> None:
    """test_multi_forward_mixed_requires_grad: trainable and frozen modules called 3 times, also under no_grad."""
    for reshard_after_forward in (True, False):

        class Model(nn.Module):
            def __init__(self) -> None:
                super().__init__()
                self.layer_0 = nn.Linear(5, 5)
                self.layer_no_grad = nn.Linear(5, 5)
                self.layer_with_grad = nn.Linear(5, 5)
                self.layer_no_grad.requires_grad_(False)

            def forward(self, x: torch.Tensor) -> torch.Tensor:
                x = self.layer_0(x)
                for _ in range(3):
                    x = self.layer_no_grad(F.relu(self.layer_with_grad(x)))
                    with torch.no_grad():
                        x += F.relu(self.layer_with_grad(x))
                return x

        torch.manual_seed(42)
        model = Model()
        ref_model = ddp_reference(model)
        ref_optim = torch.optim.Adam(ref_model.parameters(), lr=1e-2)
        for module in model.modules():
            if isinstance(module, nn.Linear):
                fully_shard(module, reshard_after_forward=reshard_after_forward)
        fully_shard(model, reshard_after_forward=reshard_after_forward)
        optim = torch.optim.Adam(model.parameters(), lr=1e-2)
        inputs = [torch.randn((8, 5)) for _ in range(10)]
        train_against(ref_model, ref_optim, model, optim, inputs.__getitem__,
                      f"reshard_after_forward={reshard_after_forward}")


