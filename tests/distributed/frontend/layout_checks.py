"""The front-end's parallel layout is derived from megatron-core's ``parallel_state`` (parallel_state.py).

``build_layout`` initializes megatron-core's groups and builds the meshes the engine needs FROM
them: after it, the process groups created are exactly the ones megatron-core created
(``create_group`` calls), every group this rank holds (``pg_map``) is one of megatron-core's,
each mesh dimension's group is megatron-core's group object, and the ranks are laid out as the
front-end had them (TP fastest, then CP, then DP; expert TP fastest, then EP). At 8 ranks:
TP2 x CP2 x DP2, TP2 x DP4 with two distributed-optimizer instances (HSDP), TP2 x CP2 x DP2 with
two instances (dp_shard 1: megatron-core has a group of this rank alone), EP2 at TP1
and EP2 x expert TP2 at TP2; one ``pretrain`` at 4 ranks (TP2 x DP2, megatron_fsdp) creates no
group beyond megatron-core's but the engine's own per-purpose copies of the data-parallel group
(core/schedule.py's "control" and "reduce" communicators) through the wrapping and a training step.
"""

from __future__ import annotations

import contextlib
import io
from collections.abc import Iterator

import torch
import torch.distributed as dist

from tests.distributed.harness import check, device

SUITE = "layout"

BASE = ["--mock-data", "--vocab-size", "64", "--num-layers", "1", "--hidden-size", "16", "--num-attention-heads", "4",
        "--seq-length", "16", "--micro-batch-size", "1", "--lr", "1e-3", "--train-iters", "1"]
LAYOUTS = {
    "tp2_cp2_dp2": ["--tensor-model-parallel-size", "2", "--context-parallel-size", "2"],
    "tp2_dp4_hsdp": ["--tensor-model-parallel-size", "2", "--num-distributed-optimizer-instances", "2",
                     "--use-megatron-fsdp", "--data-parallel-sharding-strategy", "optim_grads_params"],
    "tp2_cp2_dp2_hsdp": ["--tensor-model-parallel-size", "2", "--context-parallel-size", "2",
                         "--num-distributed-optimizer-instances", "2", "--use-megatron-fsdp",
                         "--data-parallel-sharding-strategy", "optim_grads_params"],
    "ep2": ["--use-megatron-fsdp", "--num-experts", "4", "--expert-model-parallel-size", "2",
            "--disable-bias-linear", "--swiglu"],
    "tp2_ep2_etp2": ["--use-megatron-fsdp", "--tensor-model-parallel-size", "2", "--sequence-parallel",
                     "--num-experts", "4", "--expert-model-parallel-size", "2", "--disable-bias-linear", "--swiglu"],
}


def _ranks(group) -> list[int]:
    return dist.get_process_group_ranks(group)


@contextlib.contextmanager
def _counting_mcore_groups() -> Iterator[list[int]]:
    """The number of ``create_group`` calls megatron-core's ``parallel_state`` makes inside the block (one entry)."""
    from megatron.core import parallel_state

    real, calls = parallel_state.create_group, [0]

    def create_group(*args, **kwargs):
        calls[0] += 1
        return real(*args, **kwargs)

    parallel_state.create_group = create_group
    try:
        yield calls
    finally:
        parallel_state.create_group = real


def _all_mcore_groups() -> set[int]:
    """ids of megatron-core's groups of this rank, gloo copies included."""
    from megatron.core import parallel_state

    found = set()
    for value in vars(parallel_state).values():
        for group in value if isinstance(value, (list, tuple)) else (value,):
            if isinstance(group, dist.ProcessGroup):
                found.add(id(group))
    return found


def _pg_map() -> dict:
    return dict(dist.distributed_c10d._world.pg_map)


def _expected(world: int, tp: int, cp: int, instances: int) -> dict[str, list[int]]:
    """This rank's groups by the front-end's arithmetic: TP fastest, then CP, then DP (dp_outer slowest)."""
    rank, dp = dist.get_rank(), world // (tp * cp)
    t, c, d = rank % tp, rank // tp % cp, rank // (tp * cp)
    shard = dp // instances
    o, s = d // shard, d % shard
    at = lambda o_, s_, c_, t_: ((o_ * shard + s_) * cp + c_) * tp + t_  # noqa: E731
    out = {"tp": [at(o, s, c, x) for x in range(tp)], "cp": [at(o, s, x, t) for x in range(cp)],
           "dp_shard": [at(o, x, c, t) for x in range(shard)],
           "dp_shard_cp": sorted(at(o, x, y, t) for x in range(shard) for y in range(cp))}
    if instances > 1:
        out["dp_outer"] = [at(x, s, c, t) for x in range(instances)]
    return out


def _build(argv: list[str]):
    from megatron.training.arguments import parse_args, validate_args
    from megatron.training.mcore_model import destroy_mcore_parallel
    from megatron.training.parallel_state import build_layout

    args = validate_args(parse_args([*BASE, *argv]), dist.get_world_size())
    destroy_mcore_parallel()
    before, count = _pg_map(), dist.distributed_c10d._world.group_count
    with _counting_mcore_groups() as calls:
        layout = build_layout(args, device())
    made = dist.distributed_c10d._world.group_count - count
    new = [pg for pg in _pg_map() if pg not in before]
    return args, layout, calls[0], made, new


@check(SUITE, world_sizes=(8,), params={"layout": list(LAYOUTS)})
def layout_is_built_from_megatron_cores_groups(layout: str) -> None:
    """No process group beyond megatron-core's; each mesh dimension's group is megatron-core's; the ranks are the
    front-end's layout."""
    from megatron.core import parallel_state as mpu

    args, got, mcore_calls, made, new = _build(LAYOUTS[layout])
    assert made == mcore_calls, (layout, made, mcore_calls)
    mcore = _all_mcore_groups()
    foreign = [pg for pg in new if id(pg) not in mcore]
    assert not foreign, (layout, [_ranks(pg) for pg in foreign])
    if dist.get_rank() == 0:
        print(f"layout {layout}: {made} groups created ({mcore_calls} by megatron-core), {len(new)} held by rank 0",
              flush=True)
    world, tp, cp = dist.get_world_size(), args.tensor_model_parallel_size, args.context_parallel_size
    instances = args.num_distributed_optimizer_instances
    expected = _expected(world, tp, cp, instances)
    mesh = got.mesh
    for name in mesh.mesh_dim_names:
        assert _ranks(mesh.get_group(name)) == expected[name], (name, _ranks(mesh.get_group(name)), expected[name])
    assert mesh.get_group("tp") is mpu.get_tensor_model_parallel_group() and got.tp.group is mesh.get_group("tp")
    shard = "dp_shard_cp" if cp > 1 else "dp_shard"  # FSDP's shard dimension: DP x CP under CP, one dimension
    assert mesh.mesh_dim_names == (("dp_outer",) if instances > 1 else ()) + (shard, "tp"), mesh.mesh_dim_names
    assert mesh.get_group(shard) is mpu.get_data_parallel_group(with_context_parallel=True, partial_data_parallel=True)
    if cp > 1:
        assert got.cp.group is mpu.get_context_parallel_group() and _ranks(got.cp.group) == expected["cp"]
    assert got.grad_group is mpu.get_data_parallel_group(with_context_parallel=True)
    assert got.dp_group is mpu.get_data_parallel_group()
    assert got.dp_rank == dist.get_rank() // (tp * cp) and got.dp_size == world // (tp * cp)
    if instances > 1:
        assert mesh.get_group("dp_outer") is mpu.get_inter_distributed_optimizer_instance_group()
    ep = getattr(args, "expert_model_parallel_size", 1)
    if ep > 1:
        etp = args.expert_tensor_parallel_size or tp
        rank = dist.get_rank()
        e_mesh = got.expt_mesh
        assert _ranks(e_mesh.get_group("ep")) == [rank // (ep * etp) * ep * etp + x * etp + rank % etp
                                                  for x in range(ep)]
        assert e_mesh.get_group("ep") is mpu.get_expert_model_parallel_group() is got.ep.group
        assert e_mesh.get_group("dp_shard") is mpu.get_expert_data_parallel_group()
        if etp > 1:
            assert e_mesh.get_group("tp") is mpu.get_expert_tensor_parallel_group() is got.etp.group
            assert got.expert_model_group is mpu.get_expert_tensor_and_model_parallel_group()


@check(SUITE, world_sizes=(4,))
def pretrain_creates_no_group_beyond_megatron_cores() -> None:
    """pretrain() at TP2 x DP2 with megatron_fsdp (megatron-core's GPTModel): through the set-up, the model's
    wrapping and one training step, the process groups created are megatron-core's ``create_group`` calls and the
    engine's per-purpose copies of the data-parallel group (its schedule's communicators), nothing else."""
    from megatron.training import training
    from megatron.training.mcore_model import destroy_mcore_parallel
    from megatron_fsdp.core.schedule import _GROUP_COPIES
    from pretrain_gpt import forward_step, model_provider

    destroy_mcore_parallel()
    before, count = _pg_map(), dist.distributed_c10d._world.group_count
    with _counting_mcore_groups() as calls, contextlib.redirect_stdout(io.StringIO()):
        result = training.pretrain(model_provider, forward_step,
                                   [*BASE, "--global-batch-size", "2", "--tensor-model-parallel-size", "2",
                                    "--use-megatron-fsdp", "--data-parallel-sharding-strategy", "optim_grads_params"])
    assert sorted(result.losses) == [1], result.losses
    made = dist.distributed_c10d._world.group_count - count
    mcore = _all_mcore_groups()
    new = [pg for pg in _pg_map() if pg not in before]
    # beyond megatron-core's: only the engine's own per-purpose copies of the data-parallel group (the schedule's
    # "control" and "reduce" communicators, core/schedule.py::group_copy), made by their members
    copies = {id(pg) for pg in _GROUP_COPIES.values()}
    foreign = [pg for pg in new if id(pg) not in mcore]
    assert all(id(pg) in copies for pg in foreign), [_ranks(pg) for pg in foreign if id(pg) not in copies]
    if dist.get_rank() == 0:
        print(f"pretrain TP2 x DP2: {made} groups created, {calls[0]} by megatron-core; rank 0 holds {len(new)}, "
              f"{len(foreign)} of them the engine's group copies {[_ranks(pg) for pg in foreign]}", flush=True)
    assert torch.isfinite(torch.tensor(result.losses[1]))
