"""FSDP2's ``offload_policy=`` and ``reshard_after_forward=N`` on ``megatron_fsdp.fully_shard``.

CPU offload is checked against the same model without offload (bitwise: the copies
are exact, the arithmetic is the same) and for where tensors live. On a CPU-only
machine the "device" is the CPU: the host copies still run (``ParamGroup.uploads`` /
``downloads`` count them). ``reshard_after_forward=N`` is checked against
``reshard_after_forward=True`` (bitwise: the sub-group gather moves the same values),
including a unit that runs on some ranks only, and for the sub-group and bytes of its
backward gathers.
"""

from __future__ import annotations

import copy
import json
import os
import traceback

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import CPUOffloadPolicy, OffloadPolicy
from torch.distributed.tensor import DTensor

from megatron_fsdp import MixedPrecisionPolicy, fully_shard
from megatron_fsdp.core.lookup import units_of
from tests.distributed.core.engine_checks import expect_error
from tests.distributed.harness import check
from tests.models import ResidualMLP as Block

SUITE = "fsdp2_offload"
STEPS = 3


class Net(nn.Module):
    """Three blocks; ``skip`` names a block this rank leaves out (data-dependent execution)."""

    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(7, 12)
        self.blocks = nn.ModuleList(Block() for _ in range(3))
        self.out = nn.Linear(12, 5)
        self.skip: int | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.inp(x)
        for i, block in enumerate(self.blocks):
            if i != self.skip:
                h = block(h)
        return self.out(h)


def shard(base: Net, **kwargs) -> Net:
    model = copy.deepcopy(base)
    for block in model.blocks:
        fully_shard(block, **kwargs)
    fully_shard(model, **kwargs)
    return model


def batch(step: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(1000 * step + dist.get_rank())
    return torch.randn(4, 7, generator=g)


def train_step(model: Net, opt: torch.optim.Optimizer, step: int) -> torch.Tensor:
    opt.zero_grad()
    loss = model(batch(step)).square().mean()
    loss.backward()
    opt.step()
    return loss.detach()


def assert_same_training(a: Net, b: Net, what: str, check_after_step=None) -> None:
    """Train ``a`` and ``b`` (AdamW) side by side; losses, weights and gradients must be bitwise equal."""
    opts = [torch.optim.AdamW(m.parameters(), lr=1e-2) for m in (a, b)]
    for step in range(STEPS):
        la, lb = (train_step(m, o, step) for m, o in zip((a, b), opts))
        assert torch.equal(la, lb), f"{what} step {step}: loss {la.item()} != {lb.item()}"
        if check_after_step is not None:
            check_after_step(step)
    for (name, p), q in zip(a.named_parameters(), b.parameters()):
        assert torch.equal(p.to_local(), q.to_local()), f"{what}: weight {name} differs"
        assert torch.equal(p.grad.to_local(), q.grad.to_local()), f"{what}: gradient of {name} differs"


# -- CPU offload ---------------------------------------------------------------
def check_offloaded(model: Net, opt: torch.optim.Optimizer, pin: bool) -> None:
    """Main shards, gradients and optimizer state on the host; the copies ran."""
    pinned = pin and torch.cuda.is_available()  # pinning needs CUDA; on CPU-only machines it is skipped
    for unit in units_of(model):
        for group in unit.groups:
            assert group.offload is not None
            assert group.shard.device.type == "cpu" and group.shard.is_pinned() == pinned
            if group.gathers:
                assert group.compute_shard is None, "a gathering group keeps no device copy of its shard"
                assert group.uploads > 0, "every all-gather sends an upload of the host shard"
            else:
                assert group.compute_shard.untyped_storage().data_ptr() != group.shard.untyped_storage().data_ptr()
            assert group.downloads > 0, "reduced gradients are copied to the host"
    for p in model.parameters():
        assert p.to_local().device.type == "cpu"
        assert p.grad.to_local().device.type == "cpu" and p.grad.to_local().is_pinned() == pinned
        for value in opt.state[p].values():
            if isinstance(value, torch.Tensor) and value.dim():
                assert value.device.type == "cpu", "the optimizer state lives with the main weights, on the host"


@check(SUITE)
def cpu_offload_trains_bitwise_like_no_offload() -> None:
    """Each strategy, with and without a compute dtype: CPUOffloadPolicy() trains exactly like no offload."""
    for strategy in ("optim_grads_params", "optim_grads", "optim", "no_shard"):
        for mp in (None, MixedPrecisionPolicy(param_dtype=torch.bfloat16)):
            what = f"{strategy}, mp={mp is not None}"
            torch.manual_seed(0)
            base = Net()
            plain = shard(base, sharding_strategy=strategy, mp_policy=mp)
            offloaded = shard(base, sharding_strategy=strategy, mp_policy=mp,
                              offload_policy=CPUOffloadPolicy(pin_memory=True))
            assert_same_training(offloaded, plain, what)
            opt = torch.optim.AdamW(offloaded.parameters(), lr=1e-2)
            train_step(offloaded, opt, STEPS)
            check_offloaded(offloaded, opt, pin=True)


@check(SUITE, world_sizes=(2,))
def cpu_offload_counts_one_upload_per_gather() -> None:
    """ZeRO-3: one host->device copy per all-gather of a group, one device->host copy per reduction."""
    torch.manual_seed(0)
    model = shard(Net(), offload_policy=CPUOffloadPolicy(pin_memory=False))
    opt = torch.optim.SGD(model.parameters(), lr=1e-2)
    train_step(model, opt, 0)
    for unit in units_of(model):
        gathers = 1 if unit.is_root else 2  # the root is not resharded after forward
        for group in unit.groups:
            assert (group.uploads, group.downloads) == (gathers, 1), (group.uploads, group.downloads)
            assert not group.shard.is_pinned()


@check(SUITE, world_sizes=(2,))
def offload_policy_arguments() -> None:
    """OffloadPolicy() is no offload; anything else is refused naming offload_policy."""
    torch.manual_seed(0)
    model = shard(Net(), offload_policy=OffloadPolicy())
    for unit in units_of(model):
        for group in unit.groups:
            assert group.offload is None and group.compute_shard is group.shard
    for bad in ("cpu", True, CPUOffloadPolicy(pin_memory="yes")):
        try:
            fully_shard(Block(), offload_policy=bad)
        except TypeError as exc:
            assert "offload_policy" in str(exc) or "pin_memory" in str(exc), exc
        else:
            raise AssertionError(f"offload_policy={bad!r} must raise")
    try:
        fully_shard(Net(), torch.optim.SGD(Net().parameters(), lr=1.0), offload_policy=CPUOffloadPolicy())
    except TypeError as exc:
        assert "offload_policy=" in str(exc) and "per-module" in str(exc), exc
    else:
        raise AssertionError("the whole-model form must refuse offload_policy")


# -- reshard_after_forward=N ------------------------------------------------------
def _post_forward_groups(model: Net) -> list:
    return [g for block in model.blocks for g in block.fsdp_unit.groups if g.gathers]


@check(SUITE, world_sizes=(4,))
def reshard_after_forward_int_trains_like_true_and_gathers_in_sub_groups() -> None:
    """N=2 of 4: bitwise like True; the post-forward shard is 1/2 of the weights, freed after backward;
    backward gathers run on groups of 2 consecutive ranks and move the same bytes."""
    rank = dist.get_rank()
    torch.manual_seed(0)
    base = Net()
    hpz, full = shard(base, reshard_after_forward=2), shard(base, reshard_after_forward=True)
    for group in _post_forward_groups(hpz):
        mine = tuple(range(rank // 2 * 2, rank // 2 * 2 + 2))
        assert group.post_forward.ranks == mine, group.post_forward.ranks
        assert tuple(dist.get_process_group_ranks(group.post_forward.group)) == mine
        assert group.post_forward.position == rank % 2

    def after(step: int) -> None:
        for group in _post_forward_groups(hpz):
            assert group.post_forward_piece is None, "the post-forward shard is freed after backward"

    assert_same_training(hpz, full, "reshard_after_forward=2 vs True", after)

    # One more step, looking inside: pieces after forward, gathers of backward on the sub-groups.
    hpz.fsdp_comm_stats.reset()
    full.fsdp_comm_stats.reset()
    loss_h, loss_f = (m(batch(9)).square().mean() for m in (hpz, full))
    for group in _post_forward_groups(hpz):
        assert group.post_forward_piece.numel() == group.layout.total_numel // 2
        assert not group.unsharded.allocated, "the full weights are freed after forward"
    assert all(g.post_forward_piece is None for g in hpz.fsdp_unit.groups), "the root is never resharded"
    pieces = hpz.fsdp_comm_stats.bytes.get("all_gather_post_forward", 0)
    assert pieces == 0, "the forward gathers over the whole shard group"
    loss_h.backward()
    loss_f.backward()
    expected = sum(g.layout.total_numel * g.unsharded.data.element_size() for g in _post_forward_groups(hpz))
    stats_h, stats_f = hpz.fsdp_comm_stats, full.fsdp_comm_stats
    assert stats_h.bytes["all_gather_post_forward"] == expected, (dict(stats_h.bytes), expected)
    assert stats_h.calls["all_gather_post_forward"] == len(_post_forward_groups(hpz)), dict(stats_h.calls)
    assert stats_h.bytes["all_gather"] + expected == stats_f.bytes["all_gather"], (dict(stats_h.bytes),
                                                                                   dict(stats_f.bytes))
    for group in _post_forward_groups(hpz):
        assert group.post_forward_piece is None


@check(SUITE, world_sizes=(4,))
def reshard_after_forward_int_with_a_unit_skipped_on_some_ranks() -> None:
    """Data-dependent execution: ranks 1 and 2 skip a block; N=2 still trains bitwise like True.

    The ranks that skip it take part in its gathers (forward over the shard group,
    backward over their sub-group from the piece stored by that participation).
    """
    rank = dist.get_rank()
    torch.manual_seed(0)
    base = Net()
    hpz, full = shard(base, reshard_after_forward=2), shard(base, reshard_after_forward=True)
    for model in (hpz, full):
        model.skip = 1 if rank in (1, 2) else None
    assert_same_training(hpz, full, "a skipped unit, reshard_after_forward=2 vs True")
    assert hpz.fsdp_comm_stats.calls["all_gather_post_forward"] > 0


@check(SUITE, world_sizes=(2, 4))
def reshard_after_forward_int_edges() -> None:
    """N=1 keeps a full copy (like False), N=world is True, with offload too; other ints are refused by name."""
    world = dist.get_world_size()
    torch.manual_seed(0)
    base = Net()
    one, keep = shard(base, reshard_after_forward=1), shard(base, reshard_after_forward=False)
    assert all(not b.fsdp_unit.reshard_after_forward for b in one.blocks)
    assert_same_training(one, keep, "reshard_after_forward=1 vs False")
    assert "all_gather_post_forward" not in one.fsdp_comm_stats.calls
    assert one.fsdp_comm_stats.bytes == keep.fsdp_comm_stats.bytes
    whole, true = shard(base, reshard_after_forward=world), shard(base, reshard_after_forward=True)
    assert_same_training(whole, true, "reshard_after_forward=world vs True")
    if world == 4:
        both = shard(base, reshard_after_forward=2, offload_policy=CPUOffloadPolicy())
        assert_same_training(both, shard(base), "reshard_after_forward=2 with CPU offload vs True")
    for bad, error in ((3, ValueError), (0, ValueError), (2.0, TypeError)):
        try:
            fully_shard(Block(), reshard_after_forward=bad)
        except error as exc:
            assert "reshard_after_forward" in str(exc), exc
        else:
            raise AssertionError(f"reshard_after_forward={bad!r} must raise {error.__name__}")
    expect_error(NotImplementedError, "fully_shard(module, reshard_after_forward=N)", one.set_reshard_after_forward, 2)


# -- CUDA (run by test_fsdp2_offload.py only where a GPU is present) -------------------
def cuda_offload_worker(rank: int, port: int, out_dir: str) -> None:
    """One NCCL rank on a GPU: offloaded main weights, gradients and optimizer state are pinned host
    tensors, the module computes on the GPU, and training matches no offload (the optimizer runs on
    the CPU there, on the GPU without offload: rtol 1e-6)."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.cuda.set_device(0)
    dist.init_process_group("nccl", rank=rank, world_size=1)
    result: dict[str, str | None] = {"error": None}
    try:
        torch.manual_seed(0)
        base = Net().cuda()
        plain = shard(base)
        offloaded = shard(base, offload_policy=CPUOffloadPolicy(pin_memory=True))
        opts = [torch.optim.SGD(m.parameters(), lr=1e-2) for m in (offloaded, plain)]
        for step in range(STEPS):
            losses = []
            for model, opt in zip((offloaded, plain), opts):
                opt.zero_grad()
                loss = model(batch(step).cuda()).square().mean()
                loss.backward()
                opt.step()
                losses.append(loss.detach())
            torch.testing.assert_close(losses[0], losses[1], rtol=1e-6, atol=1e-7)
        for unit in units_of(offloaded):
            for group in unit.groups:
                assert group.shard.device.type == "cpu" and group.shard.is_pinned()
                assert group.compute_shard is None or group.compute_shard.device.type == "cuda"
                assert group.uploads > 0 and group.downloads > 0
        for p, q in zip(offloaded.parameters(), plain.parameters()):
            assert p.to_local().device.type == "cpu" and p.grad.to_local().is_pinned()
            torch.testing.assert_close(p.to_local(), q.to_local().cpu(), rtol=1e-6, atol=1e-7)
    except Exception:  # reported to the test, which fails with it
        result["error"] = traceback.format_exc()
    finally:
        with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
            json.dump(result, f)
        dist.destroy_process_group()


@check(SUITE, world_sizes=(2,))
def cpu_offload_with_clipping_and_state_dict() -> None:
    """clip_grad_norm_ and a state_dict round trip on offloaded (host) shards: as without offload."""
    torch.manual_seed(0)
    base = Net()
    models = [shard(base, offload_policy=CPUOffloadPolicy()), shard(base)]
    opts = [torch.optim.AdamW(m.parameters(), lr=1e-2) for m in models]
    for step in range(STEPS):
        norms = []
        for model, opt in zip(models, opts):
            opt.zero_grad()
            model(batch(step)).square().mean().backward()
            norms.append(torch.nn.utils.clip_grad_norm_(model.parameters(), 0.05))
            opt.step()
        norms = [n.full_tensor() if isinstance(n, DTensor) else n for n in norms]
        assert torch.equal(norms[0], norms[1]), norms
    state = models[0].state_dict()
    torch.manual_seed(1)
    fresh = shard(Net(), offload_policy=CPUOffloadPolicy())
    fresh.load_state_dict(state)
    for (name, p), q in zip(fresh.named_parameters(), models[1].parameters()):
        assert p.to_local().device.type == "cpu"
        assert torch.equal(p.to_local(), q.to_local()), name
    x = batch(STEPS)
    assert torch.equal(fresh(x), models[1](x))
