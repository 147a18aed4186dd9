"""``megatron_fsdp.experimental.Placements``: validation, error types, and the mapping to engine strategies.

One process: the meshes come from torch's fake process group (no collectives run).
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh

from megatron_fsdp.experimental import MixedPrecisionPolicy
from megatron_fsdp.experimental.placements import (
    PRESETS,
    EngineMapping,
    Partial,
    Placements,
    Replicate,
    Shard,
    hfsdp,
    hsdp,
    map_placements,
    no_shard,
    zero1,
    zero2,
    zero3,
)

R, P, S = Replicate(), Partial("avg"), Shard(0)


@pytest.fixture(scope="module")
def meshes() -> Iterator[dict[str, object]]:
    from torch.testing._internal.distributed.fake_pg import FakeStore

    if dist.is_initialized():
        pytest.skip("a process group is already initialised in this process")
    dist.init_process_group("fake", rank=1, world_size=4, store=FakeStore())
    try:
        yield {
            "1d": init_device_mesh("cpu", (4,)),
            "2d": init_device_mesh("cpu", (2, 2), mesh_dim_names=("outer", "inner")),
            "3d": init_device_mesh("cpu", (1, 2, 2), mesh_dim_names=("a", "b", "c")),
        }
    finally:
        dist.destroy_process_group()


def test_lengths_must_match_the_axes() -> None:
    with pytest.raises(ValueError, match="Expected 1 gradient placements, got 2"):
        Placements([0], [S], [S, S], [S])
    with pytest.raises(ValueError, match="Expected 2 parameter placements, got 1"):
        Placements([0, 1], [S], [S, S], [S, S])


@pytest.mark.parametrize(("preset", "expected"), [
    ("no_shard", EngineMapping("no_shard", "no_shard")),
    ("zero1", EngineMapping("optim", "no_shard")),
    ("zero2", EngineMapping("optim_grads", "no_shard")),
    ("zero3", EngineMapping("optim_grads_params", "no_shard")),
])
def test_one_axis_presets_map_to_the_four_strategies(meshes, preset: str, expected: EngineMapping) -> None:
    assert map_placements(PRESETS[preset](), meshes["1d"]) == expected


def test_two_axis_presets_map_to_hsdp_outer_strategies(meshes) -> None:
    assert map_placements(hsdp(), meshes["2d"]) == EngineMapping("optim_grads_params", "no_shard")
    assert map_placements(hfsdp(), meshes["2d"]) == EngineMapping("optim_grads_params", "optim")
    # named axes, as Megatron-LM's tests write them
    assert map_placements(hsdp("outer", "inner"), meshes["2d"]) == EngineMapping("optim_grads_params", "no_shard")
    # beyond the presets: an inner ZeRO-2 under either outer form, an inner ZeRO-1 or DDP with replicas outside
    assert map_placements(Placements([0, 1], [R, R], [P, S], [R, S]), meshes["2d"]) == EngineMapping(
        "optim_grads", "no_shard")
    assert map_placements(Placements([0, 1], [R, R], [P, S], [S, S]), meshes["2d"]) == EngineMapping(
        "optim_grads", "optim")
    assert map_placements(Placements([0, 1], [R, R], [P, P], [R, S]), meshes["2d"]) == EngineMapping(
        "optim", "no_shard")
    assert map_placements(Placements([0, 1], [R, R], [P, P], [R, R]), meshes["2d"]) == EngineMapping(
        "no_shard", "no_shard")


def test_axes_rules(meshes) -> None:
    mesh = meshes["2d"]
    with pytest.raises(ValueError, match="must be distinct"):
        map_placements(Placements([0, 0], [R, S], [P, S], [R, S]), mesh)
    with pytest.raises(ValueError, match="mesh-axis order"):
        map_placements(Placements(["inner", "outer"], [R, S], [P, S], [R, S]), mesh)
    with pytest.raises(ValueError, match="not present in mesh dim names"):
        map_placements(Placements(["dp", "inner"], [R, S], [P, S], [R, S]), mesh)
    with pytest.raises(ValueError, match="out of bounds"):
        map_placements(Placements([5], [S], [S], [S]), meshes["1d"])
    with pytest.raises(NotImplementedError, match="match every mesh axis"):
        map_placements(zero3(1), mesh)  # a sub-set of the axes
    with pytest.raises(NotImplementedError, match="3-axis"):
        map_placements(Placements([0, 1, 2], [R, R, S], [P, P, S], [R, R, S]), meshes["3d"])
    assert map_placements(zero3(-1), meshes["1d"]) == EngineMapping("optim_grads_params", "no_shard")


def test_placement_kinds(meshes) -> None:
    mesh = meshes["1d"]
    with pytest.raises(NotImplementedError, match="only dim-0 Shard"):
        map_placements(Placements([0], [Shard(1)], [S], [S]), mesh)
    with pytest.raises(NotImplementedError, match=r"Partial\('avg'\)"):
        map_placements(Placements([0], [R], [Partial("sum")], [R]), mesh)
    with pytest.raises(TypeError, match="Unsupported optimizer placement"):
        map_placements(Placements([0], [R], [P], ["shard"]), mesh)
    with pytest.raises(TypeError, match="Placements"):
        map_placements("zero3", mesh)


def test_shards_are_the_innermost_axes(meshes) -> None:
    with pytest.raises(ValueError, match="suffix of the parameter placement list"):
        map_placements(Placements([0, 1], [S, R], [P, S], [R, S]), meshes["2d"])


@pytest.mark.parametrize("placements", [
    Placements([0], [S], [P], [S]),  # sharded weights with all-reduced gradients
    Placements([0], [R], [S], [R]),  # sharded gradients, replicated optimizer
    Placements([0], [S], [S], [R]),
])
def test_unsupported_combinations_name_the_presets(meshes, placements: Placements) -> None:
    with pytest.raises(NotImplementedError, match="zero3 \\(S, S, S\\).*hfsdp"):
        map_placements(placements, meshes["1d"])


def test_outer_optimizer_shard_needs_sharded_inner_gradients(meshes) -> None:
    with pytest.raises(NotImplementedError, match="needs the inner gradient"):
        map_placements(Placements([0, 1], [R, R], [P, P], [S, S]), meshes["2d"])
    with pytest.raises(NotImplementedError, match="not supported"):  # an outer sharded weight
        map_placements(Placements([0, 1], [S, S], [S, S], [S, S]), meshes["2d"])


def test_presets_are_all_listed() -> None:
    assert set(PRESETS) == {"no_shard", "zero1", "zero2", "zero3", "hsdp", "hfsdp"}
    assert (no_shard().optimizer, zero1().optimizer, zero2().gradient) == ([R], [S], [S])


def test_mixed_precision_policy_defaults_follow_the_parameter_dtype() -> None:
    policy = MixedPrecisionPolicy()
    assert policy.main_params_dtype == torch.float32 and policy.main_grads_dtype is None
    engine = policy.engine_policy(torch.bfloat16)
    assert engine.dtypes_for(torch.bfloat16)[1:3] == (torch.float32, torch.bfloat16)  # main weights, grads
    engine = MixedPrecisionPolicy(main_params_dtype=None).engine_policy(torch.bfloat16)
    assert engine.dtypes_for(torch.bfloat16)[1:3] == (torch.bfloat16, torch.bfloat16)
    with pytest.raises(NotImplementedError, match="Unsupported dtype"):
        MixedPrecisionPolicy(main_params_dtype=torch.float64)
