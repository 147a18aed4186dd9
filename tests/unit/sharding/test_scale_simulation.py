"""One rank of a 256-rank job under torch's fake process group: per-rank figures equal the analytic ones.

The fake group makes every collective return at once, so the engine's
rank-count-dependent code (layout, RaggedShard sizes, buffers, control rounds)
runs for real in one process. ``benchmarks/simulate_scale.py`` does the same at
model scale; this is its fast CI check (docs/scale.md).
"""

from __future__ import annotations

import contextlib
import math

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.testing._internal.distributed.fake_pg import FakeStore

from megatron_fsdp import MixedPrecisionPolicy, fully_shard
from megatron_fsdp.core.lookup import units_of
from megatron_fsdp.plan import MLPConfig, Precision, UnitShape, plan_rank

WORLD = 256
HIDDEN = 256  # a (256, 256) weight: exactly one row per rank, no padding


@contextlib.contextmanager
def fake_world(world: int, rank: int):
    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world)
    try:
        yield
    finally:
        dist.destroy_process_group()  # the schedule's group copies die with it and are made again next time


def build(layers: int, bias: bool) -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(*(nn.Linear(HIDDEN, HIDDEN, bias=bias) for _ in range(layers)))


def shard_all(model: nn.Sequential, **kwargs) -> None:
    for layer in model:
        fully_shard(layer, **kwargs)
    fully_shard(model, **kwargs)


def local_numel(model: nn.Module) -> int:
    return sum(p.to_local().numel() for p in model.parameters())


def shard_numel(model: nn.Module) -> int:
    return sum(g.shard.numel() for u in units_of(model) for g in u.groups)


@pytest.mark.parametrize("strategy", ["optim_grads_params", "optim_grads", "optim"])
def test_unpadded_model_holds_exactly_its_zero_share(strategy):
    layers, rank = 3, 37
    params = layers * HIDDEN * HIDDEN
    with fake_world(WORLD, rank):
        model = build(layers, bias=False)
        shard_all(model, sharding_strategy=strategy)
        assert shard_numel(model) == local_numel(model) == params // WORLD
        stats = model.fsdp_comm_stats
        stats.reset()
        model(torch.ones(2, HIDDEN)).sum().backward()
        gathers = 2 if strategy == "optim_grads_params" else 1  # ZeRO-3 gathers again for backward
        assert stats.bytes["all_gather"] == gathers * params * 4
        reduce_kind = "all_reduce" if strategy == "optim" else "reduce_scatter"
        assert stats.bytes[reduce_kind] == params * 4
        grads = [p.grad for p in model.parameters()]
        # ZeRO-2/3: a shard of gradients; ZeRO-1: the full reduced buffer stays alive, each .grad a slice of it.
        assert sum(g.to_local().numel() for g in grads) == params // WORLD
        optimizer = torch.optim.Adam(model.parameters(), lr=0.1)
        optimizer.step()
        state = sum(t.to_local().numel() for s in optimizer.state.values() for k, t in s.items() if k != "step")
        assert state == 2 * params // WORLD


@pytest.mark.parametrize("rank", [0, 255])
def test_padded_model_matches_the_plan_exactly(rank):
    # Linear(256, 256) with bias over 256 ranks: in one buffer, whole 256-element rows per shard would make
    # each shard 512 elements (a 99% overhead, where FSDP2 pads nothing), so the unit is split in two
    # (layout.partition_for_padding): the weight one row per rank, the bias 4 elements (16 bytes, the
    # alignment) on each of the first 64 ranks.
    layers = 2
    config = MLPConfig("ci", hidden=HIDDEN, layers=layers)
    plan = plan_rank(config.units(), WORLD, "optim_grads_params", rank=rank)
    (unit,) = plan.units
    with fake_world(WORLD, rank):
        model = build(layers, bias=True)
        shard_all(model)
        assert shard_numel(model) == plan.shard_numel == layers * unit.shard_numel
        assert local_numel(model) == plan.local_param_numel
        stats = model.fsdp_comm_stats
        stats.reset()
        model(torch.ones(2, HIDDEN)).sum().backward()
        assert {k: v for k, v in stats.bytes.items() if k != "control"} == plan.step_bytes()
    assert len(unit.layouts) == 2
    assert plan.local_param_numel == layers * (HIDDEN + 1)
    assert unit.total_numel == WORLD * (HIDDEN + 1) and unit.padding_numel == 0


@pytest.mark.parametrize("outer_optim", [False, True])
def test_hsdp_8_x_32(outer_optim):
    layers, outer, rank = 2, 8, 77
    params = layers * HIDDEN * HIDDEN
    pieces = WORLD if outer_optim else WORLD // outer
    units = [UnitShape("linear", (("weight", (HIDDEN, HIDDEN)),), layers)]
    plan = plan_rank(units, WORLD, "optim_grads_params", outer=outer, outer_optim=outer_optim, rank=rank % pieces)
    with fake_world(WORLD, rank):
        mesh = init_device_mesh("cpu", (outer, WORLD // outer), mesh_dim_names=("dp_outer", "dp_shard"))
        model = build(layers, bias=False)
        shard_all(
            model,
            mesh=mesh,
            dp_shard_dim="dp_shard",
            dp_outer_dim="dp_outer",
            outer_sharding_strategy="optim" if outer_optim else "no_shard",
        )
        assert shard_numel(model) == plan.shard_numel == params // pieces
        assert local_numel(model) == params // pieces
        stats = model.fsdp_comm_stats
        stats.reset()
        model(torch.ones(2, HIDDEN)).sum().backward()
        assert {k: v for k, v in stats.bytes.items() if k != "control"} == plan.step_bytes()
    assert math.isclose(plan.main_params, plan.zero_main_params())


def test_bf16_compute_matches_the_plan():
    # MixedPrecisionPolicy(param_dtype=bf16): bf16 compute shards and gathers, fp32 main weights and gradients.
    layers, rank = 2, 5
    params = layers * HIDDEN * HIDDEN
    units = [UnitShape("linear", (("weight", (HIDDEN, HIDDEN)),), layers)]
    plan = plan_rank(units, WORLD, "optim_grads_params", precision=Precision.named("bf16"), rank=rank)
    with fake_world(WORLD, rank):
        model = build(layers, bias=False)
        shard_all(model, mp_policy=MixedPrecisionPolicy(param_dtype=torch.bfloat16))
        groups = [g for u in units_of(model) for g in u.groups]
        assert sum(g.shard.numel() * g.shard.element_size() for g in groups) == plan.main_params
        copies = [g.compute_shard for g in groups if g.compute_shard is not g.shard]
        extra = sum(c.numel() * c.element_size() for c in copies)
        assert extra == plan.compute_shards == params // WORLD * 2
        stats = model.fsdp_comm_stats
        stats.reset()
        model(torch.ones(2, HIDDEN)).sum().backward()
        assert {k: v for k, v in stats.bytes.items() if k != "control"} == plan.step_bytes()
        assert stats.bytes["all_gather"] == 2 * params * 2 and stats.bytes["reduce_scatter"] == params * 4


def test_split_unit_holds_exactly_its_zero_share():
    # Linear(512, 512) with bias at 256 ranks: one buffer would pad each shard to 3 rows of 512
    # (50%); weight and bias in two buffers hold 2 rows and 2 elements per rank, exactly the share
    # (a bias buffer's parts under 16 bytes are not rounded up to it: layout.build_flat_layout).
    hidden, layers, rank = 512, 2, 200
    params = layers * (hidden * hidden + hidden)
    with fake_world(WORLD, rank):
        torch.manual_seed(0)
        model = nn.Sequential(*(nn.Linear(hidden, hidden) for _ in range(layers)))
        shard_all(model)
        assert sorted(len(u.groups) for u in units_of(model)) == [0, 2, 2]  # the root owns no parameter
        padded = params // WORLD
        assert shard_numel(model) == local_numel(model) == padded
        stats = model.fsdp_comm_stats
        stats.reset()
        model(torch.ones(2, hidden)).sum().backward()
        assert stats.bytes["all_gather"] == 2 * padded * WORLD * 4
        assert stats.bytes["reduce_scatter"] == padded * WORLD * 4
