"""A unit laid out in several flat buffers (``layout.partition_for_padding``): trains like DDP, checkpoints across.

``Linear(3000, 64) -> Linear(64, 3000)`` as one unit: rows of 3000 and 64
elements. At 4 ranks one buffer pads each shard to a multiple of 3000 (24% of
the unit), so the unit is split into two buffers with 8 elements of padding; at 2
ranks one buffer pads 8 elements and is kept. docs/scale.md.
"""

from __future__ import annotations

import copy
import os

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from megatron_fsdp import fully_shard
from megatron_fsdp.checkpoint import load_state, save_state
from megatron_fsdp.core.lookup import units_of
from tests.distributed.core.engine_checks import assert_close_params, world
from tests.distributed.harness import check, shared_tmpdir

SUITE = "layout_split"
STEPS = 4


def make_model() -> nn.Sequential:
    return nn.Sequential(nn.Linear(3000, 64), nn.ReLU(), nn.Linear(64, 3000))


def batch(step: int, rank: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(1000 * step + rank)
    return torch.randn(2, 3000, generator=g)


def loss_of(model: nn.Module, x: torch.Tensor) -> torch.Tensor:
    return (model(x) - x).pow(2).mean()


def assert_same_values(a: nn.Module, b: nn.Module, what: str, atol: float = 0.0) -> None:
    """Both sharded: compare full tensors, bitwise when ``atol`` is 0."""
    other = dict(b.named_parameters())
    for name, p in a.named_parameters():
        x, y = p.full_tensor(), other[name].full_tensor()
        if atol == 0.0:
            assert torch.equal(x, y), f"{what} {name}: max diff {(x - y).abs().max().item()}"
        else:
            torch.testing.assert_close(x, y, rtol=0, atol=atol, msg=f"{what} {name}")


def expected_buffers(n: int) -> int:
    return 2 if n == 4 else 1


@check(SUITE)
def split_unit_trains_like_ddp() -> None:
    rank, n = world()
    for strategy in ("optim_grads_params", "optim_grads", "optim"):
        torch.manual_seed(0)
        base = make_model()
        ddp = DDP(copy.deepcopy(base))
        ours = fully_shard(copy.deepcopy(base), sharding_strategy=strategy)
        (unit,) = units_of(ours)
        assert len(unit.groups) == expected_buffers(n), f"{strategy}: {len(unit.groups)} buffers at {n} ranks"
        padding = sum(g.layout.padding_numel for g in unit.groups)
        assert padding == 8, f"{strategy}: padding {padding}"
        # SGD: linear in the gradients, so float rounding in the sums stays at rounding size
        # (Adam's first step divides by |g| and turns 1e-9 differences of near-zero gradients into 1e-3).
        opt_ours = torch.optim.SGD(ours.parameters(), lr=0.1, momentum=0.9)
        opt_ddp = torch.optim.SGD(ddp.parameters(), lr=0.1, momentum=0.9)
        for step in range(STEPS):
            x = batch(step, rank)
            loss_of(ours, x).backward()
            opt_ours.step()
            opt_ours.zero_grad()
            loss_of(ddp, x).backward()
            opt_ddp.step()
            opt_ddp.zero_grad()
            # Same gloo sums on both sides but over differently cut buffers: equal to float rounding.
            assert_close_params(ours, ddp.module, exact=False, rtol=0, atol=1e-6, what=f"{strategy} step {step}")


@check(SUITE)
def checkpoint_between_split_and_single_buffer_layouts() -> None:
    """Save the split unit, load it into per-Linear units and back: same values."""
    rank, n = world()
    torch.manual_seed(0)
    split = fully_shard(make_model())
    opt = torch.optim.AdamW(split.parameters(), lr=1e-3)
    loss_of(split, batch(0, rank)).backward()
    opt.step()
    opt.zero_grad()
    assert len(units_of(split)[0].groups) == expected_buffers(n)

    per_layer = make_model()
    fully_shard(per_layer[0], sharding_strategy="optim_grads")
    fully_shard(per_layer[2], sharding_strategy="optim_grads")
    fully_shard(per_layer, sharding_strategy="optim_grads")
    # Other units, other buffers: each Linear in its own unit (Linear(3000, 64) itself split in two at 2 ranks,
    # where one buffer would pad 5,936 elements against FSDP2's 0).
    assert len(units_of(per_layer)) == 3
    opt_per_layer = torch.optim.AdamW(per_layer.parameters(), lr=1e-3)
    with shared_tmpdir("split_ckpt_") as root:
        first, second = os.path.join(root, "split"), os.path.join(root, "per_layer")
        save_state(first, split, opt)
        load_state(first, per_layer, opt_per_layer)
        assert_same_values(per_layer, split, "split -> per-layer")
        # One more identical step on both: the optimizer state came across too.
        for model, optimizer in ((split, opt), (per_layer, opt_per_layer)):
            loss_of(model, batch(1, rank)).backward()
            optimizer.step()
            optimizer.zero_grad()
        assert_same_values(per_layer, split, "after a step", atol=1e-6)
        save_state(second, per_layer, opt_per_layer)
        torch.manual_seed(1)
        back = fully_shard(make_model())
        opt_back = torch.optim.AdamW(back.parameters(), lr=1e-3)
        load_state(second, back, opt_back)
        assert_same_values(back, per_layer, "per-layer -> split")
    dist.barrier()
