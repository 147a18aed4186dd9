"""The gradient copy-in at one gloo rank: stashed gradients land in a reused, dirty buffer exactly.

A group's gradients stay autograd's tensors until its reduction copies them into a flat
buffer that is not zero-filled first (often the previous unit's spare, full of its
gradients): everything they do not cover (alignment padding, a parameter without a
gradient) must be zeroed there, or another unit's gradients leak in (docs/design.md,
"Gradients"). Multi-rank behaviour is covered by the distributed suites.
"""

from __future__ import annotations

import copy

import torch
from torch import nn

from megatron_fsdp import fully_shard


class PartlyUsed(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        # Odd sizes (alignment padding between slots); unused ones before and after the used one.
        self.before, self.used, self.after = nn.Linear(7, 2), nn.Linear(3, 5), nn.Linear(1, 3)
        self.everything = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.used(x)  # ``before`` and ``after`` get no gradient, unless ``everything``
        if self.everything:
            y = y + self.before(x.new_ones(x.shape[0], 7)).sum() + self.after(x.new_ones(x.shape[0], 1)).sum()
        return y


def test_a_dirty_spare_buffer_leaks_nothing_into_the_gradients(gloo_rank) -> None:
    torch.manual_seed(0)
    model = PartlyUsed()
    reference = copy.deepcopy(model)
    fully_shard(model)
    group = model.fsdp_unit.groups[0]
    assert group.layout.total_numel > sum(p.numel() for p in reference.parameters()), "the layout pads"
    group.spares.give_back(torch.full((group.layout.total_numel,), float("nan")))
    x = torch.randn(4, 3)
    model(x).square().sum().backward()
    reference(x).square().sum().backward()
    assert group.spares.reused == 1, "the reduction took the spare buffer"
    for name, param in model.named_parameters():
        want = dict(reference.named_parameters())[name].grad
        if want is None:  # no gradient on any rank: .grad stays None, as in one process (design.md)
            assert param.grad is None, f"{name}: {param.grad}"
            continue
        got = param.grad.full_tensor()
        assert torch.equal(got, want), f"{name}: {got} vs {want}"
    assert group.grad_buffer is None and group.contribution is None and not group._stash


def test_micro_batches_without_sync_add_up_in_the_stash(gloo_rank) -> None:
    torch.manual_seed(0)
    model = nn.Linear(5, 3)
    reference = copy.deepcopy(model)
    fully_shard(model)
    batches = [torch.randn(2, 5) for _ in range(3)]
    for i, x in enumerate(batches):
        model.set_requires_gradient_sync(i == len(batches) - 1)
        model(x).sum().backward()
        reference(x).sum().backward()
        if i < len(batches) - 1:
            assert model.weight.grad is None, "no reduction without sync"
    for name, param in model.named_parameters():
        assert torch.equal(param.grad.full_tensor(), dict(reference.named_parameters())[name].grad), name


def test_gaps_are_zeroed_where_an_unused_parameter_keeps_its_gradient(gloo_rank) -> None:
    """Without zero_grad, a parameter unused in the next backward keeps last backward's .grad: the reduction
    adds its slot into it, so a slot left dirty (another unit's gradients, NaN here) would show there."""
    torch.manual_seed(0)
    model = PartlyUsed()
    reference = copy.deepcopy(model)
    fully_shard(model)
    group = model.fsdp_unit.groups[0]
    x = torch.randn(4, 3)
    for m in (model, reference):
        m.everything = True
        m(x).square().sum().backward()  # every parameter gets a gradient
        m.everything = False
    group.spares.give_back(torch.full((group.layout.total_numel,), float("nan")))
    for m in (model, reference):
        m(x).square().sum().backward()  # only ``used``: its gradient adds up, the others keep theirs
    assert group.spares.reused == 1, "the reduction took the spare buffer"
    for name, param in model.named_parameters():
        got = param.grad.full_tensor()
        want = dict(reference.named_parameters())[name].grad
        assert torch.equal(got, want), f"{name}: {got} vs {want}"
