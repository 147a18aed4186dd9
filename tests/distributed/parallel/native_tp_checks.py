"""Torch-native DTensor TP (``parallelize_module``) composed with our per-module ``fully_shard``, torchtitan style.

Mesh ``(dp, tp) = (world / 2, 2)``: at 4 ranks TP2 x DP2, at 2 ranks TP2 x DP1. Each check builds
the same small transformer-ish model three ways from one seed: ours (parallelize each block, then
``fully_shard(block, mesh=mesh["dp"])`` and the root), torch's FSDP2 on the same setup, and a plain
single-process replica that trains on the whole global batch.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import fully_shard as torch_fully_shard
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, SequenceParallel, parallelize_module

from megatron_fsdp import clip_grad_norm_, fully_shard
from tests.distributed.core.engine_checks import expect_error
from tests.distributed.harness import check, device_type, shared_tmpdir

SUITE = "native_tp"
VOCAB, DIM, HIDDEN, TP = 16, 12, 30, 2
RTOL = 1e-5  # the brief's parity tolerance (relative), against the replica and against FSDP2


class TPBlock(nn.Module):
    """Pre-norm residual MLP: in-projection ColwiseParallel, out-projection RowwiseParallel."""

    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(DIM)
        self.up = nn.Linear(DIM, HIDDEN)
        self.down = nn.Linear(HIDDEN, DIM)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(torch.tanh(self.up(self.norm(x))))


class TPNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, DIM)
        self.blocks = nn.ModuleList([TPBlock() for _ in range(2)])
        self.head = nn.Linear(DIM, VOCAB, bias=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens)
        for block in self.blocks:
            x = block(x)
        return self.head(x)


def block_plan(sp: bool) -> dict:
    if not sp:
        return {"up": ColwiseParallel(), "down": RowwiseParallel()}
    return {
        "norm": SequenceParallel(),
        "up": ColwiseParallel(input_layouts=Shard(1)),
        "down": RowwiseParallel(output_layouts=Shard(1)),
    }


def root_plan(sp: bool) -> dict:
    return {
        "embed": RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1) if sp else Replicate()),
        "head": ColwiseParallel(input_layouts=Shard(1) if sp else Replicate(), output_layouts=Replicate()),
    }


def make_mesh() -> DeviceMesh:
    return init_device_mesh(device_type(), (dist.get_world_size() // TP, TP), mesh_dim_names=("dp", "tp"))


def replica() -> TPNet:
    torch.manual_seed(0)
    return TPNet()


def build(mesh: DeviceMesh, sp: bool, engine=fully_shard) -> TPNet:
    """torchtitan's order: parallelize each block, then shard each block over dp, then the root."""
    model = replica()
    for block in model.blocks:
        parallelize_module(block, mesh["tp"], block_plan(sp))
    parallelize_module(model, mesh["tp"], root_plan(sp))
    for block in model.blocks:
        engine(block, mesh=mesh["dp"])
    engine(model, mesh=mesh["dp"])
    return model


def batch(step: int) -> torch.Tensor:
    """The global batch (4 sequences per dp rank; length 8 so SP splits it over TP)."""
    g = torch.Generator().manual_seed(100 + step)
    return torch.randint(0, VOCAB, (4 * dist.get_world_size() // TP, 9), generator=g)


def loss_of(model: nn.Module, tokens: torch.Tensor) -> torch.Tensor:
    logits = model(tokens[:, :-1])
    return nn.functional.cross_entropy(logits.reshape(-1, VOCAB), tokens[:, 1:].reshape(-1))


def local_tokens(mesh: DeviceMesh, step: int) -> torch.Tensor:
    return batch(step).chunk(mesh["dp"].size())[mesh["dp"].get_local_rank()]


def dp_mean(mesh: DeviceMesh, loss: torch.Tensor) -> float:
    loss = loss.detach().clone()
    dist.all_reduce(loss, group=mesh["dp"].get_group())
    return loss.item() / mesh["dp"].size()


def make_optimizer(model: nn.Module, kind: str) -> torch.optim.Optimizer:
    return torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1,
                             foreach=kind == "foreach", fused=kind == "fused" or None)


def torch_clip(params, max_norm: float) -> torch.Tensor:
    return torch.nn.utils.clip_grad_norm_(params, max_norm, foreach=True)


def train_step(model, optimizer, tokens, mesh=None, clip: float | None = None, clip_fn=torch_clip):
    """One step (clipped to ``clip`` by ``clip_fn`` if given): the data-parallel mean loss and the norm."""
    loss = loss_of(model, tokens)
    loss.backward()
    norm = None
    if clip is not None:
        norm = clip_fn(model.parameters(), clip)
        norm = (norm.full_tensor() if isinstance(norm, DTensor) else norm).item()
    optimizer.step()
    optimizer.zero_grad()
    return (loss.item() if mesh is None else dp_mean(mesh, loss)), norm


def assert_close(what: str, ours: float, theirs: float) -> None:
    assert abs(ours - theirs) <= RTOL * abs(theirs), f"{what}: {ours!r} vs {theirs!r} (relative {RTOL})"


def assert_same_weights(model: nn.Module, reference: nn.Module, what: str) -> None:
    expected = dict(reference.named_parameters())
    for name, param in model.named_parameters():
        full = param.full_tensor()
        assert torch.allclose(full, expected[name], rtol=RTOL, atol=1e-6), f"{what}: {name} differs"


@check(SUITE, params={"sp": [False, True], "optimizer": ["foreach", "fused"]})
def parity_with_replica_and_fsdp2(sp: bool, optimizer: str) -> None:
    """12 AdamW steps with clipping: losses and norms match the replica and torch's FSDP2 2-D within 1e-5."""
    mesh = make_mesh()
    ours, theirs, reference = build(mesh, sp), build(mesh, sp, torch_fully_shard), replica()
    optimizers = [make_optimizer(m, optimizer) for m in (ours, theirs, reference)]
    # Without SP the norms are not TP-parallelized and live on the dp mesh beside the 2-D ones; torch's
    # clip_grad_norm_ cannot stack norms of two meshes (FSDP2 alike): megatron_fsdp's takes both, for
    # our (tp, dp) placements and FSDP2's (dp, tp) _StridedShard ones.
    clip_fns = (torch_clip, torch_clip) if sp else (clip_grad_norm_, clip_grad_norm_)
    clip = 0.05
    for step in range(12):
        tokens = local_tokens(mesh, step)
        loss, norm = train_step(ours, optimizers[0], tokens, mesh, clip, clip_fns[0])
        fsdp2_loss, fsdp2_norm = train_step(theirs, optimizers[1], tokens, mesh, clip, clip_fns[1])
        ref_loss, ref_norm = train_step(reference, optimizers[2], batch(step), None, clip)
        assert_close(f"step {step} loss vs replica", loss, ref_loss)
        assert_close(f"step {step} loss vs FSDP2", loss, fsdp2_loss)
        assert ref_norm > clip, "the clip must bite for this check to test it"
        assert_close(f"step {step} grad norm vs replica", norm, ref_norm)
        assert_close(f"step {step} grad norm vs FSDP2", norm, fsdp2_norm)
    assert_same_weights(ours, reference, "after training")


@check(SUITE)
def placements_full_tensor_offsets_and_redistribute() -> None:
    """The 2-D placements: full_tensor, DCP's chunk offsets and redistribution give the replica's values."""
    mesh = make_mesh()
    model, reference = build(mesh, sp=True), replica()
    expected = dict(reference.named_parameters())
    for name, param in model.named_parameters():
        full = expected[name]
        assert isinstance(param, DTensor) and param.device_mesh.mesh_dim_names == ("tp", "dp"), name
        assert param.shape == full.shape, name
        assert torch.equal(param.full_tensor(), full), f"full_tensor() of {name}"
        shape, offset = compute_local_shape_and_global_offset(param.shape, param.device_mesh, param.placements)
        assert tuple(param.to_local().shape) == tuple(shape), f"{name}: local shape vs DCP's chunk"
        piece = full
        for dim, (size, start) in enumerate(zip(shape, offset)):
            piece = piece.narrow(dim, start, size)
        assert torch.equal(param.to_local(), piece), f"{name}: local piece vs DCP's chunk offset {offset}"
        tp_only = param.redistribute(param.device_mesh, [param.placements[0], Replicate()])
        tp_local = DTensor.from_local(full, mesh["tp"], [Replicate()]).redistribute(
            mesh["tp"], [param.placements[0]]).to_local()
        assert torch.equal(tp_only.to_local(), tp_local), f"{name}: redistribute to (TP placement, Replicate)"


@check(SUITE)
def model_state_dicts_full_and_sharded() -> None:
    """get/set_model_state_dict, full and sharded, round-trip into another model and train on alike."""
    mesh = make_mesh()
    model, reference = build(mesh, sp=True), replica()
    full = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True))
    for key, value in reference.state_dict().items():
        assert torch.equal(full[key], value), f"full state dict: {key}"
    with torch.no_grad():  # new values everywhere, loaded as a full state dict into the sharded model
        for param in reference.parameters():
            param.mul_(1.5).add_(0.01)
    set_model_state_dict(model, reference.state_dict(), options=StateDictOptions(full_state_dict=True))
    assert_same_weights(model, reference, "after set_model_state_dict(full)")
    other = build(mesh, sp=True)
    set_model_state_dict(other, get_model_state_dict(model))
    assert_same_weights(other, reference, "after set_model_state_dict(sharded)")
    optimizers = [make_optimizer(m, "foreach") for m in (other, reference)]
    for step in range(3):
        loss, _ = train_step(other, optimizers[0], local_tokens(mesh, step), mesh)
        ref_loss, _ = train_step(reference, optimizers[1], batch(step))
        assert_close(f"step {step} loss after loading", loss, ref_loss)


@check(SUITE)
def dcp_save_load_model_and_optimizer() -> None:
    """DCP save after 3 steps, load into a fresh model and optimizer: the next 3 steps are bitwise the same."""
    mesh = make_mesh()
    model = build(mesh, sp=True)
    optimizer = make_optimizer(model, "foreach")
    for step in range(3):
        train_step(model, optimizer, local_tokens(mesh, step), mesh)
    with shared_tmpdir("native_tp_dcp_") as path:
        dcp.save({"model": get_model_state_dict(model), "optim": get_optimizer_state_dict(model, optimizer)},
                 checkpoint_id=path)
        restored = build(mesh, sp=True)
        with torch.no_grad():
            for param in restored.parameters():
                param.zero_()
        restored_optimizer = make_optimizer(restored, "foreach")
        state = {"model": get_model_state_dict(restored),
                 "optim": get_optimizer_state_dict(restored, restored_optimizer)}
        dcp.load(state, checkpoint_id=path)
        set_model_state_dict(restored, state["model"])
        set_optimizer_state_dict(restored, restored_optimizer, state["optim"])
    for step in range(3, 6):
        tokens = local_tokens(mesh, step)
        expected, _ = train_step(model, optimizer, tokens, mesh)
        got, _ = train_step(restored, restored_optimizer, tokens, mesh)
        assert got == expected, f"step {step} after DCP load: {got!r} vs {expected!r}"
    for (name, a), b in zip(model.named_parameters(), restored.parameters()):
        assert torch.equal(a.to_local(), b.to_local()), f"{name} after DCP load and 3 steps"


@check(SUITE)
def errors_name_the_fix() -> None:
    """A 2-D mesh handed to fully_shard, and TP applied to a sharded module, raise and say what to do."""
    mesh = make_mesh()
    model = replica()
    parallelize_module(model.blocks[0], mesh["tp"], block_plan(False))
    expect_error(ValueError, ("mesh['dp']", "up.weight"), fully_shard, model.blocks[0], mesh=mesh)
    # parallelize_module after fully_shard on sharded weights: torch's distribute_tensor refuses our DTensors
    # ("Cannot distribute a DTensor with device mesh (dp) ..."), before anything changes.
    model = replica()
    fully_shard(model.blocks[0], mesh=mesh["dp"])
    fully_shard(model, mesh=mesh["dp"])
    before = model(batch(0)[:, :-1]).detach()
    expect_error(ValueError, "Cannot distribute a DTensor", parallelize_module, model.blocks[0], mesh["tp"],
                 block_plan(False))
    assert torch.equal(model(batch(0)[:, :-1]).detach(), before), "the refused parallelize_module changed the model"
    # On weights the module holds gathered (ZeRO-1 keeps them installed after a forward), the replaced
    # parameters are found at the next forward, and the error says to parallelize first.
    model = replica()
    fully_shard(model.blocks[0], mesh=mesh["dp"], sharding_strategy="optim")
    fully_shard(model, mesh=mesh["dp"], sharding_strategy="optim")
    model(batch(0)[:, :-1])
    parallelize_module(model.blocks[0], mesh["tp"], block_plan(False))
    expect_error(RuntimeError, ("parallelize_module", "fully_shard"), model, batch(0)[:, :-1])


@check(SUITE)
def meta_device_init_gives_the_eager_weights() -> None:
    """Built on meta, parallelized and sharded, initialised at the first forward: the eager model's weights,
    even when every rank's random stream differs (the full values come from rank 0, TP slices are cut after)."""
    mesh = make_mesh()
    with torch.device("meta"):
        model = TPNet()
    for block in model.blocks:
        parallelize_module(block, mesh["tp"], block_plan(True))
    parallelize_module(model, mesh["tp"], root_plan(True))
    for block in model.blocks:
        fully_shard(block, mesh=mesh["dp"])
    fully_shard(model, mesh=mesh["dp"])
    if dist.get_rank() == 0:
        torch.manual_seed(0)  # rank 0 draws what the eager replica drew; the others draw something else
    else:
        torch.manual_seed(1000 + dist.get_rank())
    tokens = local_tokens(mesh, 0)
    loss = loss_of(model, tokens)
    assert_same_weights(model, replica(), "after meta-device init")
    reference = replica()
    expected = loss_of(reference, batch(0)).item()
    assert_close("first loss after meta-device init", dp_mean(mesh, loss), expected)


@check(SUITE)
def unsupported_layouts_are_refused() -> None:
    """HSDP beside TP and TP shards of unequal size raise, naming the parameter, before the module changes."""
    world = dist.get_world_size()
    mesh = init_device_mesh(device_type(), (1, world // TP, TP), mesh_dim_names=("dp_outer", "dp_shard", "tp"))
    model = replica()
    parallelize_module(model.blocks[0], mesh["tp"], block_plan(False))
    expect_error(NotImplementedError, ("HSDP", "up.weight"), fully_shard, model.blocks[0], mesh=mesh,
                 dp_shard_dim="dp_shard", dp_outer_dim="dp_outer")
    uneven = nn.Sequential(nn.Linear(DIM, HIDDEN + 1))
    parallelize_module(uneven, make_mesh()["tp"], {"0": ColwiseParallel()})
    expect_error(NotImplementedError, ("0.weight", "evenly"), fully_shard, uneven, mesh=make_mesh()["dp"])


@check(SUITE)
def dcp_checkpoint_loads_across_tp_and_dp_layouts() -> None:
    """A DCP checkpoint of the 2-D model loads into the same model sharded over all ranks without TP,
    and back: DCP's chunk offsets of the (tp, dp) placements are right, optimizer state included."""
    mesh = make_mesh()
    flat = init_device_mesh(device_type(), (dist.get_world_size(),), mesh_dim_names=("dp",))

    def plain_sharded() -> TPNet:
        model = replica()
        for block in model.blocks:
            fully_shard(block, mesh=flat)
        fully_shard(model, mesh=flat)
        return model

    two_d = build(mesh, sp=True)
    optimizer = make_optimizer(two_d, "foreach")
    for step in range(2):
        train_step(two_d, optimizer, local_tokens(mesh, step), mesh)
    with shared_tmpdir("native_tp_reshard_") as path:
        dcp.save({"model": get_model_state_dict(two_d), "optim": get_optimizer_state_dict(two_d, optimizer)},
                 checkpoint_id=f"{path}/2d")
        one_d = plain_sharded()
        one_d_optimizer = make_optimizer(one_d, "foreach")
        train_step(one_d, one_d_optimizer, local_tokens(mesh, 9), mesh)  # creates optimizer state to load into
        state = {"model": get_model_state_dict(one_d), "optim": get_optimizer_state_dict(one_d, one_d_optimizer)}
        dcp.load(state, checkpoint_id=f"{path}/2d")
        set_model_state_dict(one_d, state["model"])
        set_optimizer_state_dict(one_d, one_d_optimizer, state["optim"])
        assert_same_weights(one_d, _plain_copy(two_d), "2-D checkpoint loaded without TP")
        full_state = get_optimizer_state_dict(two_d, optimizer, options=StateDictOptions(full_state_dict=True))
        loaded_state = get_optimizer_state_dict(one_d, one_d_optimizer, options=StateDictOptions(full_state_dict=True))
        for name, values in full_state["state"].items():
            for key, value in values.items():
                assert torch.equal(loaded_state["state"][name][key], value), f"optimizer {key} of {name}"
        dcp.save({"model": get_model_state_dict(one_d)}, checkpoint_id=f"{path}/1d")
        back = build(mesh, sp=True)
        state = {"model": get_model_state_dict(back)}
        dcp.load(state, checkpoint_id=f"{path}/1d")
        set_model_state_dict(back, state["model"])
        assert_same_weights(back, _plain_copy(one_d), "checkpoint without TP loaded into the 2-D model")


def _plain_copy(model: nn.Module) -> TPNet:
    """An unsharded TPNet holding ``model``'s current weights."""
    plain = TPNet()
    plain.load_state_dict({name: param.full_tensor() for name, param in model.named_parameters()})
    return plain
