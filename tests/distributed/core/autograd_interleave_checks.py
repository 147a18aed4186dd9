"""Autograd interleavings users write: several forwards before one backward, backwards in turn.

Each rank feeds the same batches, so every strategy's gradients must equal those of a
plain replica that runs the same autograd calls (bitwise order aside: tolerance 1e-6).
``Net`` has a frozen norm in one block: a unit's weights must stay gathered until every
forward pass's backward has left the unit (``FSDPUnit.open_instance``), since no gradient
hook tracks what the frozen weight's consumers still read. Not covered (a known limit,
docs/fsdp2.md): CPU offload, whose device copy is refreshed in place at the second forward.
"""

from __future__ import annotations

import copy

import torch
from torch.distributed.fsdp import CPUOffloadPolicy
from torch.distributed.tensor import DTensor

from megatron_fsdp import fully_shard
from tests.distributed.core.engine_checks import expect_error
from tests.distributed.harness import check
from tests.models import Net, local_batch, loss_fn

SUITE = "autograd_interleave"
STRATEGIES = ("optim_grads_params", "optim_grads", "optim", "no_shard")
RESHARD = (True, False, 2)


def shard(model: Net, strategy: str, reshard, offload: bool) -> Net:
    kwargs = {"sharding_strategy": strategy, "reshard_after_forward": reshard}
    if offload:
        kwargs["offload_policy"] = CPUOffloadPolicy(pin_memory=False)
    for block in model.blocks:
        fully_shard(block, **kwargs)
    fully_shard(model.probe, **kwargs)
    fully_shard(model, **kwargs)
    return model


def full_grads(model: Net) -> dict[str, torch.Tensor]:
    return {n: (p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad)
            for n, p in model.named_parameters() if p.grad is not None}


def compare(run, offload: bool) -> None:
    """``run(model, batches)`` on every strategy and resharding, against a plain replica."""
    batches = [local_batch(i, 0, 1) for i in range(3)]  # the same on every rank
    for strategy in STRATEGIES:
        for reshard in RESHARD:
            torch.manual_seed(0)
            base = Net()
            plain, ours = copy.deepcopy(base), shard(copy.deepcopy(base), strategy, reshard, offload)
            for model in (plain, ours):
                run(model, batches)
            want, got = full_grads(plain), full_grads(ours)
            assert want.keys() == got.keys(), (strategy, reshard)
            for name in want:
                torch.testing.assert_close(got[name].cpu(), want[name], rtol=1e-6, atol=1e-6,
                                           msg=f"{strategy} reshard={reshard}: {name}")


def two_forwards_one_backward(model: Net, batches) -> None:
    (loss_fn(model, batches[0]) + loss_fn(model, batches[1])).backward()


def three_forwards_one_backward(model: Net, batches) -> None:
    sum(loss_fn(model, b) for b in batches).backward()


def two_forwards_two_backwards(model: Net, batches) -> None:
    first, second = loss_fn(model, batches[0]), loss_fn(model, batches[1])
    first.backward()
    second.backward()


@check(SUITE, params={"offload": (False,)})
def sum_of_two_forwards_backward_once(offload: bool) -> None:
    compare(two_forwards_one_backward, offload)


@check(SUITE, params={"offload": (False,)})
def sum_of_three_forwards_backward_once(offload: bool) -> None:
    compare(three_forwards_one_backward, offload)


@check(SUITE, params={"offload": (False,)})
def two_forwards_then_their_backwards_in_turn(offload: bool) -> None:
    compare(two_forwards_two_backwards, offload)


@check(SUITE)
def double_backward_is_refused_where_weights_are_gathered() -> None:
    """A gradient penalty (``create_graph=True``): no_shard gives the replica's gradients; a strategy whose
    weights are gathered and released at the end of the backward refuses it, naming the cause and the fix."""
    def penalised(model: torch.nn.Module) -> None:
        x = torch.randn(3, 4, generator=torch.Generator().manual_seed(1)).requires_grad_()
        loss = model(x).sum()
        (grad,) = torch.autograd.grad(loss, x, create_graph=True)
        (loss + grad.square().sum()).backward()

    for strategy in STRATEGIES:
        torch.manual_seed(0)
        plain = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1))
        ours = copy.deepcopy(plain)
        for layer in (ours[0], ours[2]):
            fully_shard(layer, sharding_strategy=strategy)
        fully_shard(ours, sharding_strategy=strategy)
        if strategy != "no_shard":
            expect_error(RuntimeError, ("create_graph=True", "sharding_strategy='no_shard'"), penalised, ours)
            continue
        penalised(plain)
        penalised(ours)
        for (name, p), q in zip(ours.named_parameters(), plain.parameters()):
            got = p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad
            torch.testing.assert_close(got, q.grad, rtol=1e-6, atol=1e-6, msg=name)
