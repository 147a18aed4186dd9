"""torchao float8 training under fully_shard: FSDP2's all-gather extension (one spawned group per world size).

torchao's ``convert_to_float8_training(..., Float8LinearConfig(enable_fsdp_float8_all_gather=True))``
makes each ``Float8Linear`` weight a ``WeightWithDynamicFloat8CastTensor``, whose
``fsdp_pre_all_gather`` casts this rank's rows to float8 before the all-gather
(core/gather_extension.py). The shim skips this suite when torchao is not installed.
"""

from __future__ import annotations

import copy
import functools
import os

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
from torch.distributed.fsdp import CPUOffloadPolicy
from torch.distributed.tensor import DTensor
from torch.utils._pytree import tree_map_only
from torchao.float8 import Float8LinearConfig, convert_to_float8_training, precompute_float8_dynamic_scale_for_fsdp
from torchao.float8.float8_linear import Float8Linear
from torchao.float8.float8_training_tensor import Float8TrainingTensor
from torchao.float8.fsdp_utils import WeightWithDynamicFloat8CastTensor
from torchao.prototype.mx_formats.mx_tensor import MXTensor

from megatron_fsdp import MixedPrecisionPolicy, comm_stats, fully_shard
from megatron_fsdp.checkpoint.export import read_full_tensors
from megatron_fsdp.core.quantized_gather import BLOCK_SCALE_KIND, SCALE_KIND, dequantize, quantization_scale, quantize
from tests.distributed.core.engine_checks import expect_error, world
from tests.distributed.harness import check, device_type, shared_tmpdir

SUITE = "float8"
STEPS = 4


def blocks(bias: bool = True) -> nn.Sequential:
    """Three blocks of two linears each (two float8 weights per unit, of different shapes)."""
    torch.manual_seed(0)
    return nn.Sequential(*[
        nn.Sequential(nn.Linear(64, 128, bias=bias), nn.ReLU(), nn.Linear(128, 64, bias=bias)) for _ in range(3)
    ])


def float8(model: nn.Module) -> nn.Module:
    return convert_to_float8_training(model, config=Float8LinearConfig(enable_fsdp_float8_all_gather=True))


def shard(model: nn.Sequential, **kwargs) -> nn.Sequential:
    for block in model:
        fully_shard(block, **kwargs)
    fully_shard(model, **kwargs)
    return model


def batch(step: int, rank: int, n: int) -> torch.Tensor:
    return torch.randn(16, 64, generator=torch.Generator().manual_seed(1000 + step * n + rank))


def compute_weight_types(model: nn.Module) -> list[type]:
    """Run on every Float8Linear's forward: the type of the weight it computes with."""
    seen: list[type] = []
    for module in model.modules():
        if isinstance(module, Float8Linear):
            module.register_forward_pre_hook(lambda m, _args: seen.append(type(m.weight)))
    return seen


@check(SUITE, params={"precompute": [False, True]})
def float8_gather_matches_ddp(precompute: bool) -> None:
    """Float8 all-gather under fully_shard == DDP with the same recipe: bitwise at 2 ranks, 1e-6 at 4.

    At 4 ranks the plain (bias) gradients' sum runs in another order than DDP's bucket.
    """
    rank, n = world()
    base = float8(blocks())
    ours = shard(copy.deepcopy(base))
    ddp = nn.parallel.DistributedDataParallel(copy.deepcopy(base))
    seen = compute_weight_types(ours)
    opt, opt_ref = (torch.optim.AdamW(m.parameters(), lr=1e-2, weight_decay=0.1) for m in (ours, ddp))
    weights = [m.weight for m in ours.modules() if isinstance(m, Float8Linear)]
    for step in range(STEPS):
        for model in (ours, ddp):
            model(batch(step, rank, n)).square().mean().backward()
        for o in (opt, opt_ref):
            o.step()
            o.zero_grad()
        if precompute:
            precompute_float8_dynamic_scale_for_fsdp(ours)
            for w in weights:  # set on our sharded parameters, from the whole weight's amax
                scale = w._local_tensor._precomputed_scale
                amax = w.full_tensor().abs().max().to(torch.float64).clamp(min=1e-12)
                assert scale is not None and torch.equal(scale, (torch.finfo(torch.float8_e4m3fn).max / amax).float())
        for (name, p), q in zip(ours.named_parameters(), ddp.module.parameters()):
            if n == 2:
                assert torch.equal(p.full_tensor(), q.detach()), f"step {step} {name}"
            else:
                torch.testing.assert_close(p.full_tensor(), q.detach(), rtol=0, atol=1e-6, msg=f"step {step} {name}")
    assert seen and all(t is Float8TrainingTensor for t in seen), set(seen)  # computed with the gathered float8
    for w in weights:  # the sharded parameter keeps torchao's class (its optimizer path, precompute)
        assert isinstance(w._local_tensor, WeightWithDynamicFloat8CastTensor), type(w._local_tensor)


@check(SUITE)
def float8_gather_moves_a_quarter_of_fp32_bytes() -> None:
    """The weights' all-gather bytes of one step: 0.25x fp32, 0.5x bf16, 1 byte per element per gather."""
    rank, n = world()
    numel = sum(p.numel() for p in blocks(bias=False).parameters())
    gathered = {}
    for name, model, policy in (
        ("fp32", blocks(bias=False), None),
        ("bf16", blocks(bias=False), MixedPrecisionPolicy(param_dtype=torch.bfloat16)),
        ("float8", float8(blocks(bias=False)), None),
    ):
        model = shard(model, mp_policy=policy)
        comm_stats.reset()
        model(batch(0, rank, n)).float().square().mean().backward()
        gathered[name] = comm_stats.bytes["all_gather"]
    assert gathered["float8"] == 2 * numel, (gathered, numel)  # forward and backward gathers, float8
    assert gathered["float8"] * 4 == gathered["fp32"] and gathered["float8"] * 2 == gathered["bf16"], gathered
    if rank == 0:
        print(f"float8 all-gather bytes per step: {gathered} (float8/fp32 = {gathered['float8'] / gathered['fp32']})")


@check(SUITE, world_sizes=(2,))
def float8_gather_refuses_what_it_does_not_support() -> None:
    """CPU offload with a float8 all-gather would gather the wrong bytes: refused, naming it."""
    model = float8(blocks())
    expect_error(NotImplementedError, ("all-gather hooks", "WeightWithDynamicFloat8CastTensor", "CPU offload"),
                 fully_shard, model[0], offload_policy=CPUOffloadPolicy())
    expect_error(ValueError, ("gather_format='mxfp4'", "valid", "'mxfp8'"), MixedPrecisionPolicy,
                 gather_format="mxfp4")
    expect_error(ValueError, ("gather_format='mxfp8'", "gather_dtype"), MixedPrecisionPolicy,
                 gather_format="mxfp8", gather_dtype=torch.float8_e5m2)
    expect_error(NotImplementedError, ("gather_format='mxfp8'", "CPU offload"), fully_shard, blocks()[0],
                 mp_policy=MXFP8, offload_policy=CPUOffloadPolicy())
    dist.barrier()


# -- MXFP8 gathers: MixedPrecisionPolicy(gather_format="mxfp8") -------------------------
MXFP8 = MixedPrecisionPolicy(gather_format="mxfp8")
# The loss against fp32's, relative. First step (the same main weights: the quantization alone):
# 2**-5, a quarter of MXFP8's worst per-weight error (1/8, a block maximum saturated to 448).
# All STEPS: 2**-3, the per-weight worst case, since AdamW's steps carry the difference on.
MX_LOSS_RTOL_FIRST, MX_LOSS_RTOL = 2.0**-5, 2.0**-3


def mx_blocks() -> nn.Sequential:
    """``blocks()`` and a unit whose second weight (64, 40) and first bias (40) have no 32-element blocks."""
    model = blocks()
    torch.manual_seed(1)
    model.append(nn.Sequential(nn.Linear(64, 40), nn.ReLU(), nn.Linear(40, 64)))
    return model


def mx_reference(full: torch.Tensor) -> torch.Tensor:
    """torchao's MXFP8 round trip of a whole weight (block 32 along the last dim, FLOOR scales: OCP's)."""
    return MXTensor.to_mx(full.contiguous(), torch.float8_e4m3fn, block_size=32).dequantize(full.dtype)


def per_tensor_reference(full: torch.Tensor) -> torch.Tensor:
    scale = quantization_scale(full.abs().max(), torch.float8_e4m3fn)
    return dequantize(quantize(full, scale, torch.float8_e4m3fn), scale, full.dtype)



def _main_and_computed_with(model: nn.Module) -> tuple[dict, list]:
    """The sharded main parameters by (module, name), and a list each forward fills with
    (module, name, the weight the module computed with)."""
    main = {(id(m), k): p for m in model.modules() for k, p in m._parameters.items() if p is not None}
    seen: list = []
    for module in model.modules():
        if module._parameters:
            module.register_forward_pre_hook(lambda m, _a: seen.extend(
                (m, k, p.detach().clone()) for k, p in m._parameters.items() if p is not None))
    return main, seen


@check(SUITE)
def mxfp8_gather_matches_torchao_trains_and_moves_a_quarter_plus_scales() -> None:
    """gather_format="mxfp8": every weight a module computes with equals, bitwise, torchao's
    ``MXTensor.to_mx(full, e4m3, 32).dequantize()`` of the fp32 main weight (the 2-D ones whose last dim
    is a multiple of 32; the (64, 40) weight and 40-bias take the per-tensor float8 path, bitwise
    too; a 1-D bias of 64 or 128 is MXFP8 where its shard boundaries fall on blocks); training's loss
    stays within ``MX_LOSS_RTOL_FIRST`` of fp32's at the first step and ``MX_LOSS_RTOL`` after; the
    all-gather moves 1 byte per element plus 1 scale byte per 32 (1/4 + 1/128 of fp32's bytes) with
    no amax all-reduce when every parameter is block-scaled."""
    rank, n = world()
    losses = {}
    for policy in (None, MXFP8):
        model = shard(mx_blocks(), mp_policy=policy)
        main, seen = _main_and_computed_with(model)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
        losses[policy] = []
        for step in range(STEPS):
            seen.clear()
            loss = model(batch(step, rank, n)).square().mean()
            loss.backward()
            if policy is MXFP8:  # before the step changes the main weights
                kinds = set()
                for module, name, value in seen:
                    full = main[(id(module), name)].full_tensor()
                    mx = full.shape[-1] % 32 == 0 and torch.equal(value, mx_reference(full))
                    assert mx or torch.equal(value, per_tensor_reference(full)), f"step {step} {name} {full.shape}"
                    kinds.add((tuple(full.shape), mx))
                assert {((128, 64), True), ((64, 128), True), ((40, 64), True), ((64, 40), False), ((40,), False)
                        } <= kinds, kinds
            opt.step()
            opt.zero_grad()
            losses[policy].append(loss.detach())
    ref, got = torch.stack(losses[None]), torch.stack(losses[MXFP8])
    assert torch.isfinite(got).all() and ((got - ref).abs() <= MX_LOSS_RTOL * ref.abs()).all(), (got, ref)
    assert (got[0] - ref[0]).abs() <= MX_LOSS_RTOL_FIRST * ref[0].abs(), (got, ref)
    numel = sum(p.numel() for p in blocks(bias=False).parameters())  # every weight block-scaled
    gathered = {}
    for name, policy in (("fp32", None), ("mxfp8", MXFP8)):
        model = shard(blocks(bias=False), mp_policy=policy)
        comm_stats.reset()
        model(batch(0, rank, n)).square().mean().backward()
        gathered[name] = dict(comm_stats.bytes)
    mx = gathered["mxfp8"]
    assert mx["all_gather"] == 2 * numel and mx[BLOCK_SCALE_KIND] == 2 * numel // 32, mx  # forward, backward
    assert mx.get(SCALE_KIND, 0) == 0, mx  # block scales are local: no amax all-reduce
    ratio = (mx["all_gather"] + mx[BLOCK_SCALE_KIND]) / gathered["fp32"]["all_gather"]
    assert ratio == 1 / 4 + 1 / 128, ratio
    if rank == 0:
        rel = ((got - ref).abs() / ref.abs()).tolist()
        print(f"mxfp8 gather, n={n}: bytes/step {gathered['fp32']['all_gather']} (fp32) -> {mx['all_gather']} "
              f"+ {mx[BLOCK_SCALE_KIND]} scales = {ratio} of fp32; relative loss difference per step "
              f"{[f'{r:.1e}' for r in rel]}")


# bf16 compute: the loss against the unquantized bf16 run's and the fp32 run's, relative, stated before
# measuring: the same bounds as fp32 compute's above (MXFP8's rounding, up to 2**-4 per weight and 1/8
# at a saturated block maximum, dominates bf16's 2**-9 per operation, which both bf16 runs share).
MXFP8_BF16 = MixedPrecisionPolicy(param_dtype=torch.bfloat16, gather_format="mxfp8")


@check(SUITE)
def mxfp8_gather_with_bf16_compute_matches_torchao() -> None:
    """``MixedPrecisionPolicy(param_dtype=bf16, gather_format="mxfp8")``: every weight a module computes with is
    bf16 and equals, bitwise, torchao's ``MXTensor.to_mx(full, e4m3, 32).dequantize(torch.bfloat16)`` of the fp32
    main weight (the same as dequantizing to fp32 and casting: e4m3 times a power of two is exact in fp32), or
    the per-tensor round trip cast to bf16 for the parameters without whole blocks; training's loss stays within
    ``MX_LOSS_RTOL_FIRST`` / ``MX_LOSS_RTOL`` of the unquantized bf16 run's and of the fp32 run's; the gather
    moves half of bf16's bytes (1 byte per element instead of 2), plus the block scales."""
    rank, n = world()
    losses, gathered = {}, {}
    for name, policy in (("fp32", None), ("bf16", MixedPrecisionPolicy(param_dtype=torch.bfloat16)),
                         ("mxfp8", MXFP8_BF16)):
        model = shard(mx_blocks(), mp_policy=policy)
        main, seen = _main_and_computed_with(model)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
        losses[name] = []
        for step in range(STEPS):
            seen.clear()
            comm_stats.reset()
            loss = model(batch(step, rank, n)).float().square().mean()
            loss.backward()
            if step == 0:
                gathered[name] = dict(comm_stats.bytes)
            if name == "mxfp8":  # before the step changes the main weights
                kinds = set()
                for module, key, value in seen:
                    full = main[(id(module), key)].full_tensor()
                    assert value.dtype == torch.bfloat16, (key, value.dtype)
                    mx = full.shape[-1] % 32 == 0
                    if mx:
                        reference = MXTensor.to_mx(full.contiguous(), torch.float8_e4m3fn, block_size=32)
                        assert torch.equal(reference.dequantize(torch.bfloat16), mx_reference(full).bfloat16())
                        mx = torch.equal(value, reference.dequantize(torch.bfloat16))
                    assert mx or torch.equal(value, per_tensor_reference(full).bfloat16()), f"step {step} {key}"
                    kinds.add((tuple(full.shape), mx))
                assert {((128, 64), True), ((64, 128), True), ((40, 64), True), ((64, 40), False), ((40,), False)
                        } <= kinds, kinds
            opt.step()
            opt.zero_grad()
            losses[name].append(loss.detach())
    got = torch.stack(losses["mxfp8"])
    for ref_name in ("bf16", "fp32"):
        ref = torch.stack(losses[ref_name])
        assert torch.isfinite(got).all() and ((got - ref).abs() <= MX_LOSS_RTOL * ref.abs()).all(), (ref_name, got, ref)
        assert (got[0] - ref[0]).abs() <= MX_LOSS_RTOL_FIRST * ref[0].abs(), (ref_name, got, ref)
    mx, bf16 = gathered["mxfp8"], gathered["bf16"]
    assert 2 * mx["all_gather"] == bf16["all_gather"] and mx[BLOCK_SCALE_KIND] > 0, (mx, bf16)
    if rank == 0:
        rel = {r: [f"{x:.1e}" for x in ((got - torch.stack(losses[r])).abs() / torch.stack(losses[r]).abs()).tolist()]
               for r in ("bf16", "fp32")}
        print(f"mxfp8 gather with bf16 compute, n={n}: bytes/step {bf16['all_gather']} (bf16) -> {mx['all_gather']} "
              f"+ {mx[BLOCK_SCALE_KIND]} scales + {mx.get(SCALE_KIND, 0)} per-tensor amax; relative loss difference "
              f"per step vs bf16 {rel['bf16']}, vs fp32 {rel['fp32']}")


@check(SUITE, world_sizes=(2,))
def float8_zero2_parity_and_full_state_dict_round_trip() -> None:
    """ZeRO-2 (no weight gather: torchao casts in forward) equals DDP bitwise; a full state dict holds the
    fp32 main weights as plain tensors and loads into a fresh float8 model bitwise."""
    rank, n = world()
    base = float8(blocks())
    ddp = nn.parallel.DistributedDataParallel(copy.deepcopy(base))
    for strategy in ("optim_grads", "optim_grads_params"):
        ours = shard(copy.deepcopy(base), sharding_strategy=strategy)
        ddp.module.load_state_dict(base.state_dict())
        opt, opt_ref = (torch.optim.AdamW(m.parameters(), lr=1e-2, weight_decay=0.1) for m in (ours, ddp))
        for step in range(2):
            for model in (ours, ddp):
                model(batch(step, rank, n)).square().mean().backward()
            for o in (opt, opt_ref):
                o.step()
                o.zero_grad()
        for (name, p), q in zip(ours.named_parameters(), ddp.module.parameters()):
            assert torch.equal(p.full_tensor(), q.detach()), f"{strategy} {name}"
        full = get_model_state_dict(ours, options=StateDictOptions(full_state_dict=True))
        assert all(type(v) is torch.Tensor and v.dtype == torch.float32 for v in full.values()), strategy
        fresh = shard(float8(blocks()), sharding_strategy=strategy)
        set_model_state_dict(fresh, full, options=StateDictOptions(full_state_dict=True))
        for (name, p), q in zip(fresh.named_parameters(), ddp.module.parameters()):
            assert torch.equal(p.full_tensor(), q.detach()), f"{strategy} reloaded {name}"
        x = batch(99, rank, n)
        assert torch.equal(fresh(x), ours(x)), strategy


# -- sharded DCP checkpoints of float8 models ---------------------------------------
SAVE_AT = 2  # steps before the checkpoint; STEPS in all


@functools.cache
def sub_mesh(size: int) -> DeviceMesh:
    """A 1-D mesh over ranks 0..size-1 (every rank calls: it creates process groups); kept for the suite."""
    if size == dist.get_world_size():
        return init_device_mesh(device_type(), (size,))
    return DeviceMesh(device_type(), torch.arange(size))


def build(recipe: str, mesh: DeviceMesh) -> tuple[nn.Sequential, torch.optim.Optimizer]:
    """A freshly built float8 model on ``mesh`` and its AdamW: torchao's float8 training
    (``recipe="torchao"``), the native ``gather_dtype`` gather (``recipe="gather_dtype"``) or the MXFP8 gather
    with bf16 compute (``recipe="mxfp8"``, ``mx_blocks()``: block-scaled weights and per-tensor fallbacks)."""
    if recipe == "torchao":
        model = shard(float8(blocks()), mesh=mesh)
    elif recipe == "mxfp8":
        model = shard(mx_blocks(), mesh=mesh, mp_policy=MXFP8_BF16)
    else:
        model = shard(blocks(), mesh=mesh, mp_policy=MixedPrecisionPolicy(gather_dtype=torch.float8_e4m3fn))
    return model, torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)


def train_steps(model: nn.Module, opt: torch.optim.Optimizer, steps: range, mesh: DeviceMesh) -> list[torch.Tensor]:
    """Train ``steps`` on this rank's batches of ``mesh``'s data-parallel world; the losses."""
    rank, n = mesh.get_local_rank(), mesh.size()
    losses = []
    for step in steps:
        loss = model(batch(step, rank, n)).square().mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.detach())
    return losses


def save(path: str, model: nn.Module, opt: torch.optim.Optimizer) -> None:
    """The standard recipe, checking what DCP is handed: DTensors (float8 weights: over torchao's class, as
    under FSDP2) and plain optimizer state."""
    state = {"model": get_model_state_dict(model), "optim": get_optimizer_state_dict(model, opt)}
    assert all(isinstance(v, DTensor) for v in state["model"].values()), state["model"].keys()
    for name, entry in state["optim"]["state"].items():
        for key in ("exp_avg", "exp_avg_sq"):
            assert isinstance(entry[key], DTensor) and type(entry[key]._local_tensor) is torch.Tensor, (name, key)
    dcp.save(state, checkpoint_id=path, process_group=model_group(model))


def load(path: str, model: nn.Module, opt: torch.optim.Optimizer) -> None:
    state = {"model": get_model_state_dict(model), "optim": get_optimizer_state_dict(model, opt)}
    dcp.load(state, checkpoint_id=path, process_group=model_group(model))
    set_model_state_dict(model, state["model"])
    set_optimizer_state_dict(model, opt, state["optim"])


def model_group(model: nn.Module) -> dist.ProcessGroup:
    return next(model.parameters()).device_mesh.get_group()


def full_state(model: nn.Module, opt: torch.optim.Optimizer) -> dict[str, torch.Tensor]:
    """Every parameter and AdamW moment as a whole plain tensor (collective over the model's ranks)."""
    out = {f"model.{k}": v for k, v in get_model_state_dict(model, options=StateDictOptions(full_state_dict=True,
                                                                                              cpu_offload=False)).items()}
    osd = get_optimizer_state_dict(model, opt, options=StateDictOptions(full_state_dict=True, cpu_offload=False))
    for name, entry in osd["state"].items():
        for key in ("exp_avg", "exp_avg_sq", "step"):
            out[f"optim.state.{name}.{key}"] = entry[key]
    return out


@check(SUITE, params={"recipe": ["torchao", "gather_dtype", "mxfp8"]})
def float8_dcp_resume_is_bitwise(recipe: str) -> None:
    """A sharded DCP checkpoint of a float8 model (model and optimizer) loads into a freshly built one
    whose training goes on bitwise as the uninterrupted run's (losses and weights); the checkpoint's
    tensors are the plain fp32 main weights and moments, equal to the full state dict's."""
    rank, n = world()
    mesh = sub_mesh(n)
    model, opt = build(recipe, mesh)
    train_steps(model, opt, range(SAVE_AT), mesh)
    with shared_tmpdir("float8_ckpt_") as root:
        path = os.path.join(root, "ckpt")
        save(path, model, opt)
        saved = full_state(model, opt)
        assert all(type(v) is torch.Tensor and v.dtype == torch.float32 for v in saved.values()), recipe
        if recipe == "torchao":  # the full state dict: DDP's weights with the same recipe (tolerance as above)
            ddp = nn.parallel.DistributedDataParallel(float8(blocks()))
            train_steps(ddp, torch.optim.AdamW(ddp.parameters(), lr=1e-2, weight_decay=0.1), range(SAVE_AT), mesh)
            for name, q in ddp.module.named_parameters():
                if n == 2:
                    assert torch.equal(saved[f"model.{name}"], q.detach()), name
                else:
                    torch.testing.assert_close(saved[f"model.{name}"], q.detach(), rtol=0, atol=1e-6, msg=name)
        on_disk = read_full_tensors(path, [k for k in saved if not k.endswith(".step")])
        for key, value in on_disk.items():  # the fp32 main weights and moments
            assert torch.equal(value, saved[key]), key
        # As under FSDP2: torch.save pickles each float8 weight's rows as torchao's class, which
        # DCP's weights_only reader accepts once torchao.float8 is imported (it allowlists the class).
        pickled = b""
        for file in sorted(os.listdir(path)):
            with open(os.path.join(path, file), "rb") as f:
                pickled += f.read()
        assert (b"WeightWithDynamicFloat8CastTensor" in pickled) == (recipe == "torchao"), recipe
        fresh, fresh_opt = build(recipe, mesh)
        train_steps(fresh, fresh_opt, range(SAVE_AT, SAVE_AT + 1), mesh)  # other weights and moments: replaced
        load(path, fresh, fresh_opt)
    resumed = full_state(fresh, fresh_opt)
    assert resumed.keys() == saved.keys(), sorted(resumed.keys() ^ saved.keys())
    for key, value in saved.items():
        assert torch.equal(resumed[key], value), f"{recipe}: {key} after load"
    expected = train_steps(model, opt, range(SAVE_AT, STEPS), mesh)
    got = train_steps(fresh, fresh_opt, range(SAVE_AT, STEPS), mesh)
    assert all(torch.equal(a, b) for a, b in zip(got, expected)), (recipe, got, expected)
    for (name, p), q in zip(model.named_parameters(), fresh.parameters()):
        assert torch.equal(p.full_tensor(), q.full_tensor()), f"{recipe}: {name} after resumed training"
    if rank == 0:
        print(f"float8 DCP resume ({recipe}, {n} ranks): losses after resume {[f'{x.item():.6g}' for x in got]} "
              "bitwise equal to the uninterrupted run's")


@check(SUITE, world_sizes=(4,), params={"recipe": ["torchao", "gather_dtype", "mxfp8"], "ranks": ["4->2", "2->4"]})
def float8_dcp_reshards_across_world_sizes(recipe: str, ranks: str) -> None:
    """Saved on one number of ranks, loaded on another: the loaded weights and moments equal the saved
    ones bitwise, and training goes on bitwise as a model that got the same state through the full
    state dict (no DCP) on the loading ranks."""
    saving, loading = (int(x) for x in ranks.split("->"))
    rank, _ = world()
    # Every rank makes both meshes, members or not: a mesh's process groups are created by all ranks
    # (torch counts groups per rank), or the next group any later suite of this process creates hangs.
    saving_mesh, loading_mesh = sub_mesh(saving), sub_mesh(loading)
    with shared_tmpdir("float8_reshard_") as root:
        path = os.path.join(root, "ckpt")
        saved = None
        if rank < saving:
            mesh = saving_mesh
            model, opt = build(recipe, mesh)
            train_steps(model, opt, range(SAVE_AT), mesh)
            save(path, model, opt)
            saved = full_state(model, opt)
        dist.barrier()
        if rank < loading:
            mesh = loading_mesh
            fresh, fresh_opt = build(recipe, mesh)
            train_steps(fresh, fresh_opt, range(SAVE_AT, SAVE_AT + 1), mesh)  # other state: replaced
            load(path, fresh, fresh_opt)
            resumed = full_state(fresh, fresh_opt)
            on_disk = read_full_tensors(path, [k for k in resumed if not k.endswith(".step")])
            for key, value in on_disk.items():
                assert torch.equal(resumed[key], value), f"{ranks}: {key} after load"
            if saved is not None:
                assert resumed.keys() == saved.keys() and all(torch.equal(resumed[k], saved[k]) for k in saved)
            # the same state through the full state dict, on the loading ranks
            other, other_opt = build(recipe, mesh)
            options = StateDictOptions(full_state_dict=True)
            set_model_state_dict(other, get_model_state_dict(fresh, options=options), options=options)
            # cloned: the full optimizer state dict hands out fresh_opt's own "step" tensors, which
            # other_opt would then share (and step twice)
            full_osd = tree_map_only(torch.Tensor, torch.clone,
                                     get_optimizer_state_dict(fresh, fresh_opt, options=options))
            set_optimizer_state_dict(other, other_opt, full_osd, options=options)
            theirs = full_state(other, other_opt)
            assert all(torch.equal(resumed[k], theirs[k]) for k in resumed), ranks
            got = train_steps(fresh, fresh_opt, range(SAVE_AT, STEPS), mesh)
            expected = train_steps(other, other_opt, range(SAVE_AT, STEPS), mesh)
            assert all(torch.equal(a, b) for a, b in zip(got, expected)), (recipe, ranks, got, expected)
            for (name, p), q in zip(fresh.named_parameters(), other.parameters()):
                assert torch.equal(p.full_tensor(), q.full_tensor()), f"{recipe} {ranks}: {name}"
