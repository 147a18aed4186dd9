"""Checks of distributed checkpointing (issue 5), run inside one spawned gloo group (see harness).

Resharding N -> M inside one group: the saving (or loading) side runs on a
sub-mesh of the first ranks, with DCP's process group set to that sub-mesh's
group; ranks outside it wait. The global batch has the same rows at every data-
parallel size, so training must match single-process training over the same steps.
"""

from __future__ import annotations

import functools
import os
import warnings
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.tensor import DTensor
from torch.nn.parallel import DistributedDataParallel as DDP

from megatron_fsdp import MixedPrecisionPolicy, RaggedShard, fully_shard
from megatron_fsdp.checkpoint import (
    TRACKER_FILE,
    CheckpointCorruptError,
    CheckpointIncompleteError,
    CheckpointMismatchError,
    async_save_checkpoint,
    iteration_dir,
    load_checkpoint,
    load_state,
    save_checkpoint,
    save_state,
)
from megatron_fsdp.checkpoint.export import (
    export_full_state_dict,
    import_full_state_dict,
    read_full_tensor,
    read_full_tensors,
)
from tests.distributed.core.engine_checks import expect_error, world
from tests.distributed.harness import check, device_type, shared_tmpdir
from tests.models import Net, global_batch, loss_fn

SUITE = "checkpoint"
GLOBAL_ROWS = 4  # rows per global batch: divisible by every data-parallel size used
SAVE_STEPS, RESUME_STEPS = 2, 2
RESULTS: list[str] = []


# -- helpers --------------------------------------------------------------------


def batch_for(step: int, dp_rank: int, dp_size: int) -> torch.Tensor:
    return global_batch(step, 1, per_rank=GLOBAL_ROWS).chunk(dp_size)[dp_rank]


@dataclass
class Setup:
    """Where and how a model is sharded: a mesh over some ranks, a strategy, a policy."""

    name: str
    mesh: DeviceMesh | None  # None: all ranks, PyTorch FSDP2 ("fsdp2") or DDP ("ddp")
    strategy: str = "optim_grads_params"
    policy: MixedPrecisionPolicy | None = None
    kind: str = "ours"  # "ours", "fsdp2", "ddp"

    @property
    def ranks(self) -> list[int]:
        return self.mesh.mesh.flatten().tolist() if self.mesh is not None else list(range(dist.get_world_size()))

    @property
    def member(self) -> bool:
        return dist.get_rank() in self.ranks

    @property
    def group(self) -> dist.ProcessGroup | None:
        if self.mesh is None or self.mesh.ndim > 1 or len(self.ranks) == dist.get_world_size():
            return None
        return self.mesh.get_group()

    @property
    def dp(self) -> tuple[int, int]:
        index = self.ranks.index(dist.get_rank())
        return index, len(self.ranks)

    def build(self, seed: int) -> nn.Module:
        torch.manual_seed(seed)
        model = Net()
        if self.kind == "ddp":
            return DDP(model, find_unused_parameters=True)
        if self.kind == "fsdp2":
            from torch.distributed.fsdp import fully_shard as torch_fully_shard

            # A mesh of its own (named): on a mesh equal to ours, DTensor's sharding-propagation
            # cache can hand FSDP2's Shard(0) optimizer state our RaggedShard layout (docs/api.md).
            mesh = init_device_mesh(device_type(), (dist.get_world_size(),), mesh_dim_names=("torch_fsdp2",))
            for block in model.blocks:
                torch_fully_shard(block, mesh=mesh)
            return torch_fully_shard(model, mesh=mesh)
        kwargs = dict(mesh=self.mesh, sharding_strategy=self.strategy, mp_policy=self.policy)
        for block in model.blocks:
            fully_shard(block, **kwargs)
        fully_shard(model.probe, **kwargs)
        return fully_shard(model, **kwargs)


@functools.cache
def sub_mesh(size: int) -> DeviceMesh:
    """A 1-D mesh over ranks 0..size-1 (every rank must call: it creates process groups).

    Cached: a rank of the 2-rank group crashed (SIGSEGV / lost peer) in the case right
    after one that used a freshly made 1-rank sub-group, at random; keeping each group
    alive for the whole suite avoids destroying gloo groups mid-run.
    """
    if size == dist.get_world_size():
        return init_device_mesh(device_type(), (size,))
    return DeviceMesh(device_type(), torch.arange(size))


def adamw(model: nn.Module, lr: float = 1e-2) -> torch.optim.AdamW:
    return torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.1)


def train(model: nn.Module, opt: torch.optim.Optimizer, steps: range, dp: tuple[int, int]) -> None:
    for step in steps:
        loss_fn(model, batch_for(step, *dp)).backward()
        opt.step()
        opt.zero_grad()


def reference(steps: int) -> tuple[nn.Module, torch.optim.Optimizer]:
    """Single-process training over the global batches."""
    torch.manual_seed(0)
    model = Net()
    opt = adamw(model)
    train(model, opt, range(steps), (0, 1))
    return model, opt


def full(t: torch.Tensor) -> torch.Tensor:
    return t.full_tensor() if isinstance(t, DTensor) else t


def inner(model: nn.Module) -> nn.Module:
    return model.module if isinstance(model, DDP) else model


def max_rel_error(model: nn.Module, ref: nn.Module) -> float:
    """Worst per-tensor relative L2 error of the parameters (collective over the model's ranks)."""
    worst = 0.0
    expected = dict(ref.named_parameters())
    for name, p in inner(model).named_parameters():
        got = full(p).detach().float()
        want = expected[name].detach()
        worst = max(worst, ((got - want).norm() / want.norm().clamp_min(1e-12)).item())
    return worst


def assert_state_equals_checkpoint(model: nn.Module, opt: torch.optim.Optimizer, path: str, what: str) -> None:
    """Loaded parameters and AdamW moments equal the checkpoint's full tensors, bit for bit."""
    fqns = {id(p): n for n, p in inner(model).named_parameters()}
    keys = [f"model.{name}" for name in fqns.values()]
    keys += [f"optim.state.{fqns[id(p)]}.{k}" for p in opt.state for k in ("exp_avg", "exp_avg_sq")]
    saved = read_full_tensors(path, keys)  # one read of the checkpoint, not one per tensor
    for name, p in inner(model).named_parameters():
        want = saved[f"model.{name}"]
        assert torch.equal(full(p).detach().to(want.dtype), want), f"{what}: parameter {name}"
    seen = 0
    for p, state in opt.state.items():
        for key in ("exp_avg", "exp_avg_sq"):
            flat = f"optim.state.{fqns[id(p)]}.{key}"
            assert torch.equal(full(state[key]), saved[flat]), f"{what}: {flat}"
        seen += 1
    assert seen > 0, f"{what}: no optimizer state was loaded"


def run_reshard(save: Setup, load: Setup, tolerance: float = 1e-5, compare_exact: bool = True) -> float:
    """Train SAVE_STEPS under ``save``, checkpoint, resume under ``load`` for RESUME_STEPS; check vs single."""
    ref, ref_opt = reference(SAVE_STEPS + RESUME_STEPS)
    err = 0.0
    with shared_tmpdir("ckpt_") as root:
        path = os.path.join(root, "ckpt")
        if save.member:
            model = save.build(seed=0)
            opt = adamw(model)
            train(model, opt, range(SAVE_STEPS), save.dp)
            save_state(path, model, opt, process_group=save.group)
        dist.barrier()
        if load.member:
            model = load.build(seed=7)  # different weights: the load must replace them
            opt = adamw(model, lr=0.5)  # a different lr: the checkpoint's must come back
            result = load_state(path, model, opt, process_group=load.group)
            assert not (result.missing_keys or result.unexpected_keys or result.mismatched_keys), result
            assert all(g["lr"] == 1e-2 for g in opt.param_groups), opt.param_groups
            if compare_exact:
                assert_state_equals_checkpoint(model, opt, path, f"{save.name} -> {load.name}")
            steps = {float(s["step"]) for s in opt.state.values()}
            assert steps == {float(SAVE_STEPS)}, steps
            train(model, opt, range(SAVE_STEPS, SAVE_STEPS + RESUME_STEPS), load.dp)
            err = max_rel_error(model, ref)
        errs = [None] * dist.get_world_size()
        dist.all_gather_object(errs, err)
        err = max(e for e in errs)
    assert err <= tolerance, f"{save.name} -> {load.name}: max relative error {err:.2e} > {tolerance:.0e}"
    if dist.get_rank() == 0:
        line = f"reshard {save.name} -> {load.name}: max rel error vs single-process {err:.2e}"
        RESULTS.append(line)
        print(line, flush=True)
    return err


# -- 1. state-dict helpers and DCP metadata -------------------------------------
@check(SUITE)
def state_dict_helpers_full_and_sharded() -> None:
    rank, n = world()
    ref, ref_opt = reference(2)
    model = Setup("zero3", init_device_mesh(device_type(), (n,))).build(seed=0)
    opt = adamw(model)
    train(model, opt, range(2), (rank, n))
    sharded = get_optimizer_state_dict(model, opt)
    for name, p in model.named_parameters():
        if name in sharded["state"]:
            state = sharded["state"][name]
            for key in ("exp_avg", "exp_avg_sq"):
                assert isinstance(state[key], DTensor), (name, key)
                assert state[key].placements == p.placements, (name, key, state[key].placements, p.placements)
                assert type(state[key].placements[0]) is type(p.placements[0]), (name, key)
    full_osd = get_optimizer_state_dict(model, opt, options=StateDictOptions(full_state_dict=True))
    ref_state = {n_: ref_opt.state[p] for n_, p in ref.named_parameters() if p in ref_opt.state}
    assert set(full_osd["state"]) == set(ref_state), (sorted(full_osd["state"]), sorted(ref_state))
    for name, state in ref_state.items():
        for key in ("exp_avg", "exp_avg_sq", "step"):
            torch.testing.assert_close(full_osd["state"][name][key], state[key], rtol=1e-5, atol=1e-7,
                                       msg=f"{name}.{key}")
    # full -> a fresh sharded model + optimizer through the standard setters
    fresh = Setup("zero3", init_device_mesh(device_type(), (n,))).build(seed=3)
    fresh_opt = adamw(fresh, lr=0.3)
    full_msd = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True))
    set_model_state_dict(fresh, full_msd, options=StateDictOptions(full_state_dict=True))
    set_optimizer_state_dict(fresh, fresh_opt, full_osd, options=StateDictOptions(full_state_dict=True,
                                                                                   strict=False))
    for (name, p), q in zip(model.named_parameters(), fresh.parameters()):
        assert torch.equal(p.full_tensor(), q.full_tensor()), name
    for p, q in zip(model.parameters(), fresh.parameters()):
        if p in opt.state:
            assert torch.equal(opt.state[p]["exp_avg"].full_tensor(), fresh_opt.state[q]["exp_avg"].full_tensor())
    assert fresh_opt.param_groups[0]["lr"] == 1e-2


@check(SUITE)
def dcp_save_writes_each_ranks_rows_at_their_global_offsets() -> None:
    rank, n = world()
    model = Setup("zero3", init_device_mesh(device_type(), (n,))).build(seed=0)
    opt = adamw(model)
    train(model, opt, range(1), (rank, n))
    with shared_tmpdir("ckpt_") as root:
        # the standard PyTorch recipe, on our model
        dcp.save({"model": get_model_state_dict(model), "optim": get_optimizer_state_dict(model, opt)},
                 checkpoint_id=root)
        md = FileSystemReader(root).read_metadata()
        fqns = {id(p): name for name, p in model.named_parameters()}
        for name, p in model.named_parameters():
            placement = p.placements[0]
            assert isinstance(placement, RaggedShard), (name, placement)
            expected = sorted((placement.offset(r), size) for r, size in enumerate(placement.local_sizes) if size)
            keys = [f"model.{name}"] + [f"optim.state.{name}.{k}" for k in ("exp_avg", "exp_avg_sq")
                                        if p in opt.state]
            for key in keys:
                entry = md.state_dict_metadata[key]
                assert tuple(entry.size) == tuple(p.shape), key
                chunks = sorted((c.offsets[0], c.sizes[0]) for c in entry.chunks if c.sizes[0])
                assert chunks == expected, f"{key}: chunks {chunks}, layout {expected}"
                assert all(tuple(c.sizes[1:]) == tuple(p.shape[1:]) and not any(c.offsets[1:])
                           for c in entry.chunks), key
        # each rank's file holds exactly that rank's rows of every sharded tensor (no full tensor moved)
        pieces = {f"model.{name}": p.placements[0] for name, p in model.named_parameters()}
        written = 0
        for index, info in md.storage_data.items():
            placement = pieces.get(index.fqn)
            if placement is None:
                continue
            writer = int(os.path.basename(info.relative_path).split("_")[2])
            chunk = next(c for c in md.state_dict_metadata[index.fqn].chunks if c.offsets == index.offset)
            if chunk.sizes[0] == 0:
                continue  # an empty shard (its offset is a DTensor convention, not a row)
            assert (index.offset[0], chunk.sizes[0]) == (placement.offset(writer), placement.local_sizes[writer]), (
                f"{index.fqn}: rank {writer} wrote rows {index.offset[0]}+{chunk.sizes[0]}, "
                f"owns {placement.offset(writer)}+{placement.local_sizes[writer]}")
            written += 1
        assert written >= len(fqns), (written, len(fqns))
        # read back with the standard recipe into a fresh model
        fresh = Setup("zero3", init_device_mesh(device_type(), (n,))).build(seed=5)
        state = {"model": get_model_state_dict(fresh)}
        dcp.load(state, checkpoint_id=root)
        set_model_state_dict(fresh, state["model"])
        for (name, p), q in zip(model.named_parameters(), fresh.parameters()):
            assert torch.equal(p.full_tensor(), q.full_tensor()), name


# -- 2. resharding ----------------------------------------------------------------
# saved on world_size // a ranks, loaded on world_size // b ranks
RESHARD_RANKS = {"same": (1, 1), "fewer": (1, 2), "more": (2, 1)}


@check(SUITE, params={"ranks": list(RESHARD_RANKS)})
def reshard_zero3(ranks: str) -> None:
    """ZeRO-3 saved on n (or n/2) ranks loads bit for bit on the same, fewer or more ranks and trains on."""
    n = dist.get_world_size()
    save_on, load_on = (n // d for d in RESHARD_RANKS[ranks])
    save = Setup(f"zero3@{save_on}", sub_mesh(save_on))
    run_reshard(save, save if ranks == "same" else Setup(f"zero3@{load_on}", sub_mesh(load_on)))


@check(SUITE)
def reshard_zero3_to_zero1_and_zero1_to_zero2() -> None:
    n = dist.get_world_size()
    mesh = sub_mesh(n)
    run_reshard(Setup(f"zero3@{n}", mesh), Setup(f"zero1@{n}", mesh, "optim"))
    run_reshard(Setup(f"zero1@{n}", mesh, "optim"), Setup(f"zero2@{n // 2}", sub_mesh(n // 2), "optim_grads"))


@check(SUITE)
def reshard_no_shard_to_zero3() -> None:
    n = dist.get_world_size()
    run_reshard(Setup(f"no_shard@{n}", sub_mesh(n), "no_shard"), Setup(f"zero3@{n}", sub_mesh(n)))


@check(SUITE, world_sizes=(4,))
def reshard_hsdp_to_1d_and_back() -> None:
    hsdp = init_device_mesh(device_type(), (2, 2), mesh_dim_names=("dp_outer", "dp_shard"))
    run_reshard(Setup("hsdp2x2-zero3", hsdp), Setup("zero3@4", sub_mesh(4)))
    run_reshard(Setup("zero2@2", sub_mesh(2), "optim_grads"), Setup("hsdp2x2-zero3", hsdp))


@check(SUITE)
def reshard_fp32_to_bf16_compute_with_fp32_main() -> None:
    n = dist.get_world_size()
    bf16 = MixedPrecisionPolicy(param_dtype=torch.bfloat16)
    # Exact: fp32 main weights and moments equal the checkpoint; the continued
    # training computes in bf16, so it only tracks fp32 training loosely.
    run_reshard(Setup(f"fp32-zero3@{n}", sub_mesh(n)), Setup(f"bf16-zero3@{n // 2}", sub_mesh(n // 2), policy=bf16),
                tolerance=3e-2)
    run_reshard(Setup(f"bf16-zero3@{n // 2}", sub_mesh(n // 2), policy=bf16), Setup(f"fp32-zero1@{n}", sub_mesh(n),
                "optim"), tolerance=1e-1)


# -- 3. FQN-keyed optimizer state, regrouping ---------------------------------------
def _groups(model: nn.Module, lrs: tuple[float, float], reverse: bool) -> list[dict]:
    decay = [p for n, p in model.named_parameters() if p.dim() > 1]
    no_decay = [p for n, p in model.named_parameters() if p.dim() <= 1]
    if reverse:
        decay, no_decay = decay[::-1], no_decay[::-1]
    return [{"params": no_decay, "lr": lrs[1], "weight_decay": 0.0}, {"params": decay, "lr": lrs[0]}]


@check(SUITE)
def optimizer_state_survives_new_order_and_grouping() -> None:
    rank, n = world()
    setup = Setup("zero3", sub_mesh(n))
    model = setup.build(seed=0)
    opt = adamw(model)
    train(model, opt, range(2), (rank, n))
    with shared_tmpdir("ckpt_") as root:
        save_state(root + "/one_group", model, opt)
        # one group -> two groups, parameters listed in reverse: state by FQN, lr from the saved group
        fresh = setup.build(seed=3)
        regrouped = torch.optim.AdamW(_groups(fresh, (0.7, 0.8), reverse=True))
        load_state(root + "/one_group", fresh, regrouped)
        assert [g["lr"] for g in regrouped.param_groups] == [1e-2, 1e-2], regrouped.param_groups
        assert [g["weight_decay"] for g in regrouped.param_groups] == [0.1, 0.1]
        assert_state_equals_checkpoint(fresh, regrouped, root + "/one_group", "one group -> two groups")
        # two groups with their own hyper-parameters -> the same groups in the other order
        two = torch.optim.AdamW(_groups(model, (3e-3, 4e-3), reverse=False))
        two.load_state_dict(_copy_state(opt, two))
        save_state(root + "/two_groups", model, two)
        fresh = setup.build(seed=4)
        swapped = torch.optim.AdamW(_groups(fresh, (0.5, 0.5), reverse=True)[::-1])
        load_state(root + "/two_groups", fresh, swapped)
        assert [(g["lr"], g["weight_decay"]) for g in swapped.param_groups] == [(3e-3, 0.01), (4e-3, 0.0)], [
            (g["lr"], g["weight_decay"]) for g in swapped.param_groups]
        assert_state_equals_checkpoint(fresh, swapped, root + "/two_groups", "two groups swapped")


def _copy_state(src: torch.optim.Optimizer, dst: torch.optim.Optimizer) -> dict:
    """``src``'s per-parameter state in ``dst``'s index space (same parameters, other grouping)."""
    index = {id(p): i for i, p in enumerate(p for g in dst.param_groups for p in g["params"])}
    state = {index[id(p)]: s for p, s in src.state.items()}
    return {"state": state, "param_groups": dst.state_dict()["param_groups"]}


# -- 4. safety: atomic directories, strict and partial loads ---------------------------
class ExtraParamNet(Net):
    def __init__(self) -> None:
        super().__init__()
        self.extra = nn.Parameter(torch.ones(3, 2))


class WiderTinyNet(Net):
    def __init__(self) -> None:
        super().__init__()
        self.tiny = nn.Parameter(torch.zeros(2, self.tiny.shape[1]))


def _shard(model: Net, n: int) -> Net:
    for block in model.blocks:
        fully_shard(block)
    return fully_shard(model)


@check(SUITE)
def strict_load_names_the_tensor_and_partial_load_reports() -> None:
    rank, n = world()
    model = _shard(Net(), n)
    opt = adamw(model)
    train(model, opt, range(1), (rank, n))
    with shared_tmpdir("ckpt_") as root:
        save_state(root, model, opt)
        cases = [
            (ExtraParamNet, "model.extra", "missing_keys"),
            (lambda: Net(layers=2), "model.blocks.2.up.weight", "unexpected_keys"),
            (WiderTinyNet, "model.tiny (checkpoint (1, 13), model (2, 13))", "mismatched_keys"),
        ]
        # the message names the first five keys of each kind (sorted) and counts the rest
        messages = {"unexpected_keys": "24 unexpected (in the checkpoint, not in the model/optimizer): "
                                       "model.blocks.2.down.bias, model.blocks.2.down.weight, "
                                       "model.blocks.2.norm.bias, model.blocks.2.norm.weight, "
                                       "model.blocks.2.up.bias, ... (19 more)"}
        for make, name, field_name in cases:
            torch.manual_seed(9)
            other = _shard(make(), n)
            other_opt = adamw(other)
            expect_error(CheckpointMismatchError, messages.get(field_name, name), load_state, root, other, other_opt)
            result = load_state(root, other, other_opt, strict=False)
            assert any(k.startswith(name) for k in getattr(result, field_name)), (field_name, result)
            # what matched was loaded
            for key in ("embed.weight", "blocks.0.up.weight"):
                assert torch.equal(dict(other.named_parameters())[key].full_tensor(),
                                   dict(model.named_parameters())[key].full_tensor()), key
        # unexpected optimizer state of a parameter the model lacks is reported too
        small = _shard(Net(layers=2), n)
        result = load_state(root, small, adamw(small), strict=False)
        assert any(k.startswith("optim.state.blocks.2.") for k in result.unexpected_keys), result
        expect_error(FileNotFoundError, "no .metadata", load_state, root + "/nowhere", model)


@check(SUITE)
def save_is_atomic() -> None:
    rank, n = world()
    model = _shard(Net(), n)
    opt = adamw(model)
    with shared_tmpdir("ckpt_") as root:
        target = os.path.join(root, "ckpt")
        seen = {}

        def inspect(tmp: str) -> None:
            # all data is on disk, yet nothing is at the final path
            seen["metadata"] = os.path.exists(os.path.join(tmp, ".metadata"))
            seen["final"] = os.path.exists(target)

        save_state(target, model, opt, before_commit=inspect)
        assert seen == {"metadata": True, "final": False}, seen
        assert os.path.isfile(os.path.join(target, ".metadata"))

        def crash(tmp: str) -> None:
            if dist.get_rank() == n - 1:
                raise OSError("disk full (simulated)")

        other = os.path.join(root, "crashed")
        expect_error(Exception, "", save_state, other, model, opt, before_commit=crash)
        dist.barrier()
        leftovers = [name for name in os.listdir(root) if name != "ckpt"]
        # Every rank lists before rank 0 makes the next save's hidden directory: without
        # this barrier a slow rank saw it, failed alone and left the others hanging.
        dist.barrier()
        assert not os.path.exists(other) and leftovers == [], leftovers
        # a crash while replacing an existing checkpoint keeps the old one intact
        expect_error(Exception, "", save_state, target, model, opt, before_commit=crash)
        assert os.path.isfile(os.path.join(target, ".metadata"))


# -- 5. the Megatron layout -----------------------------------------------------------
@check(SUITE)
def megatron_layout_save_resume_rng_and_extra() -> None:
    rank, n = world()
    setup = Setup("zero3", sub_mesh(n))
    model = setup.build(seed=0)
    opt = adamw(model)
    scheduler = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    train(model, opt, range(SAVE_STEPS), (rank, n))
    scheduler.step()
    with shared_tmpdir("ckpt_") as root:
        expect_error(FileNotFoundError, TRACKER_FILE, load_checkpoint, root, model)
        extra = {"scheduler": scheduler.state_dict(), "consumed_samples": 64, "args": {"lr": 1e-2}}
        torch.manual_seed(100 + rank)  # per-rank RNG streams
        path = save_checkpoint(root, 10, model, opt, extra)
        after_save = torch.rand(3)
        assert path == os.path.abspath(iteration_dir(root, 10)) and path.endswith("iter_0000010"), path
        with open(os.path.join(root, TRACKER_FILE)) as f:
            assert f.read().strip() == "10"
        save_checkpoint(root, 12, model, opt, extra)
        with open(os.path.join(root, TRACKER_FILE)) as f:
            assert f.read().strip() == "12"
        assert sorted(x for x in os.listdir(root)) == ["iter_0000010", "iter_0000012", TRACKER_FILE]
        expect_error(FileNotFoundError, "iter_0000011", load_checkpoint, root, model, iteration=11)

        fresh = setup.build(seed=5)
        fresh_opt = adamw(fresh, lr=0.3)
        torch.manual_seed(999)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            loaded = load_checkpoint(root, fresh, fresh_opt, iteration=10)
        assert loaded.iteration == 10 and loaded.rng_restored
        assert not [w for w in caught if "RNG" in str(w.message)], [str(w.message) for w in caught]
        assert torch.equal(torch.rand(3), after_save), "RNG state not restored"
        assert loaded.extra["consumed_samples"] == 64 and loaded.extra["args"] == {"lr": 1e-2}
        fresh_scheduler = torch.optim.lr_scheduler.StepLR(fresh_opt, step_size=1, gamma=0.5)
        fresh_scheduler.load_state_dict(loaded.extra["scheduler"])
        assert fresh_scheduler.get_last_lr() == scheduler.get_last_lr()
        assert fresh_opt.param_groups[0]["lr"] == opt.param_groups[0]["lr"] == 5e-3
        assert_state_equals_checkpoint(fresh, fresh_opt, path, "megatron layout")
        latest = load_checkpoint(root, setup.build(seed=6), load_optimizer=False, load_rng=False)
        assert latest.iteration == 12 and not latest.rng_restored


@functools.cache
def checkpoint_io_group() -> dist.ProcessGroup:
    """A gloo group of all ranks for background saves alone (every rank must call: it creates a group)."""
    return dist.new_group(backend="gloo")


@check(SUITE, params={"kind": ["ours", "fsdp2"]})
def async_save_writes_the_state_of_its_call(kind: str) -> None:
    """``async_save_checkpoint`` copies the state when called: the model, moments and RNG changed right after it
    returns (before its thread can have written anything) are not in the checkpoint, which loads to the same
    tensors as a synchronous save of that state; the tracker names it once ``wait()`` returns; a write that fails
    raises from ``wait()`` on every rank."""
    rank, n = world()
    setup = Setup(kind, sub_mesh(n) if kind == "ours" else None, kind=kind)
    model = setup.build(seed=0)
    opt = adamw(model)
    train(model, opt, range(SAVE_STEPS), setup.dp)
    with shared_tmpdir("ckpt_") as root:
        sync_root, async_root = os.path.join(root, "sync"), os.path.join(root, "async")
        torch.manual_seed(100 + rank)
        save_checkpoint(sync_root, 10, model, opt, {"k": [1]})
        torch.manual_seed(100 + rank)
        pending = async_save_checkpoint(async_root, 10, model, opt, {"k": [1]}, io_group=checkpoint_io_group())
        after_save = torch.rand(3)
        with torch.no_grad():  # in place, at once: the parameters' and moments' own storage
            for p in model.parameters():
                p.add_(1.0)
            for state in opt.state.values():
                state["exp_avg"].add_(1.0)
        train(model, opt, range(SAVE_STEPS, SAVE_STEPS + 2), setup.dp)
        path = pending.wait()
        assert pending.done() and path == os.path.abspath(iteration_dir(async_root, 10)), path
        with open(os.path.join(async_root, TRACKER_FILE)) as f:
            assert f.read().strip() == "10"
        loaded = {}
        for where in (sync_root, async_root):
            fresh = setup.build(seed=5)
            fresh_opt = adamw(fresh, lr=0.3)
            result = load_checkpoint(where, fresh, fresh_opt)
            assert result.rng_restored and result.extra == {"k": [1]}, result.extra
            assert torch.equal(torch.rand(3), after_save), f"{where}: the RNG state of the call"
            assert_state_equals_checkpoint(fresh, fresh_opt, result.path, f"{kind} {where}")
            loaded[where] = [full(p).detach().clone() for p in fresh.parameters()]
            loaded[where] += [full(s[k]).clone() for s in fresh_opt.state.values() for k in ("exp_avg", "exp_avg_sq")]
        for got, want in zip(loaded[async_root], loaded[sync_root], strict=True):
            assert torch.equal(got, want), f"{kind}: the async checkpoint differs from the synchronous one"
        blocker = os.path.join(root, "a_file")  # a save directory that is a file: the background write fails
        if rank == 0:
            open(blocker, "w").close()
        dist.barrier()
        failing = async_save_checkpoint(blocker, 11, model, opt, io_group=checkpoint_io_group())
        expect_error(OSError, "", failing.wait)


@check(SUITE)
def megatron_layout_other_world_size_skips_rng() -> None:
    n = dist.get_world_size()
    half = Setup("zero3-half", sub_mesh(n // 2))
    full_ = Setup("zero3-all", sub_mesh(n))
    with shared_tmpdir("ckpt_") as root:
        model = full_.build(seed=0)
        opt = adamw(model)
        train(model, opt, range(1), full_.dp)
        save_checkpoint(root, 1, model, opt, {"k": 1})
        if half.member:
            fresh = half.build(seed=2)
            fresh_opt = adamw(fresh)
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                loaded = load_checkpoint(root, fresh, fresh_opt, process_group=half.group)
            assert not loaded.rng_restored and loaded.extra == {"k": 1}
            wording = f"was saved by {n} ranks and this run has {n // 2}: per-rank RNG states are not restored"
            assert any(wording in str(w.message) for w in caught), [str(w.message) for w in caught]
            assert_state_equals_checkpoint(fresh, fresh_opt, loaded.path, "megatron layout at half the ranks")


@check(SUITE)
def damaged_incomplete_or_backward_checkpoints_fail_on_every_rank() -> None:
    """Each rank checks a share of the files; whichever rank finds the damage, every rank raises, naming the file."""
    rank, n = world()
    setup = Setup("zero3", sub_mesh(n))
    model = setup.build(seed=0)
    opt = adamw(model)
    train(model, opt, range(1), (rank, n))
    with shared_tmpdir("ckpt_") as root:
        save_checkpoint(root, 1, model, opt, {"k": 1})
        path = iteration_dir(root, 1)
        for victim in ("__0_0.distcp", f"__{n - 1}_0.distcp", "rng/rank_00001.pt"):
            target = os.path.join(path, victim)
            original = open(target, "rb").read()
            if rank == 0:
                with open(target, "r+b") as f:
                    f.seek(len(original) // 2)
                    f.write(bytes(255 - b for b in original[len(original) // 2:len(original) // 2 + 256]))
            dist.barrier()
            fresh = setup.build(seed=1)
            expect_error(CheckpointCorruptError, f"{victim} does not match its SHA-256", load_checkpoint, root, fresh,
                         adamw(fresh))
            dist.barrier()
            if rank == 0:
                with open(target, "wb") as f:
                    f.write(original)
            dist.barrier()
        if rank == 0:
            os.rename(os.path.join(path, "extra.pt"), os.path.join(root, "extra.pt.away"))
        dist.barrier()
        fresh = setup.build(seed=1)
        expect_error(CheckpointIncompleteError, "extra.pt is missing", load_checkpoint, root, fresh, adamw(fresh))
        dist.barrier()
        if rank == 0:
            os.rename(os.path.join(root, "extra.pt.away"), os.path.join(path, "extra.pt"))
        dist.barrier()
        assert load_checkpoint(root, fresh, adamw(fresh)).extra == {"k": 1}
        save_checkpoint(root, 3, model, opt)
        expect_error(ValueError, "refusing to save iteration 2", save_checkpoint, root, 2, model, opt)
        with open(os.path.join(root, TRACKER_FILE)) as f:
            assert f.read().strip() == "3"


@check(SUITE)
def ddp_baseline_checkpoint_loads_into_fsdp_and_back() -> None:
    n = dist.get_world_size()
    run_reshard(Setup("ddp", None, kind="ddp"), Setup(f"zero3@{n}", sub_mesh(n)))
    run_reshard(Setup(f"zero2@{n}", sub_mesh(n), "optim_grads"), Setup("ddp", None, kind="ddp"))
    with shared_tmpdir("ckpt_") as root:  # keys carry no "module." prefix
        ddp = Setup("ddp", None, kind="ddp").build(seed=0)
        save_checkpoint(root, 1, ddp, adamw(ddp))
        keys = FileSystemReader(iteration_dir(root, 1)).read_metadata().state_dict_metadata
        assert "model.embed.weight" in keys and not any(k.startswith("model.module.") for k in keys)


# -- 6. interop with PyTorch FSDP2, full-state-dict export and import -------------------
@check(SUITE)
def fsdp2_checkpoints_load_into_ours_and_back() -> None:
    n = dist.get_world_size()
    fsdp2 = Setup("torch-fsdp2", None, kind="fsdp2")
    run_reshard(fsdp2, Setup(f"zero3@{n // 2}", sub_mesh(n // 2)))
    run_reshard(Setup(f"zero1@{n}", sub_mesh(n), "optim"), fsdp2)
    # a checkpoint written with the plain PyTorch recipe (no megatron_fsdp code) loads too
    with shared_tmpdir("ckpt_") as root:
        model = fsdp2.build(seed=0)
        opt = adamw(model)
        train(model, opt, range(SAVE_STEPS), (dist.get_rank(), n))
        dcp.save({"model": get_model_state_dict(model), "optim": get_optimizer_state_dict(model, opt)},
                 checkpoint_id=root)
        ours = Setup("zero3", sub_mesh(n)).build(seed=4)
        ours_opt = adamw(ours, lr=0.2)
        load_state(root, ours, ours_opt)
        assert_state_equals_checkpoint(ours, ours_opt, root, "plain FSDP2 recipe -> ours")


@check(SUITE)
def export_and_import_full_state_dict() -> None:
    rank, n = world()
    ref, _ = reference(1)
    model = Setup("zero3", sub_mesh(n)).build(seed=0)
    opt = adamw(model)
    train(model, opt, range(1), (rank, n))
    expected = {k: v.detach() for k, v in ref.state_dict().items()}
    with shared_tmpdir("ckpt_") as root:
        save_checkpoint(root, 1, model, opt)
        for ext in ("safetensors", "pt"):
            live = export_full_state_dict(model, os.path.join(root, f"live.{ext}"))
            offline = os.path.join(root, f"offline.{ext}")
            if rank == 0:  # from the checkpoint directory, in one process
                export_full_state_dict(iteration_dir(root, 1), offline)
            dist.barrier()
            for path in (live, offline):
                fresh = Setup("zero3", sub_mesh(n)).build(seed=8)
                report = import_full_state_dict(path, fresh)
                assert not report, report.describe()
                for name, p in fresh.named_parameters():
                    torch.testing.assert_close(p.full_tensor(), expected[name], rtol=1e-5, atol=1e-6, msg=name)
                with torch.no_grad():  # the re-gathered weights are the imported ones
                    torch.testing.assert_close(fresh(batch_for(0, 0, 1)), ref(batch_for(0, 0, 1)), rtol=1e-5,
                                               atol=1e-5)
        if rank == 0:
            from megatron_fsdp.checkpoint.safetensors_stream import read_header

            header, _ = read_header(os.path.join(root, "live.safetensors"))
            assert set(header) == set(expected), sorted(header)
            pt = torch.load(os.path.join(root, "offline.pt"), weights_only=True)
            assert all(torch.equal(pt[k], read_full_tensor(iteration_dir(root, 1), f"model.{k}")) for k in pt)
        dist.barrier()
        # strictness applies to imports too
        other = _shard(ExtraParamNet(), n)
        expect_error(CheckpointMismatchError, "extra", import_full_state_dict, os.path.join(root, "live.pt"), other)
        assert import_full_state_dict(os.path.join(root, "live.pt"), other, strict=False).missing_keys == ["extra"]
