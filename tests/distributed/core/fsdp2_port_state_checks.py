"""FSDP2 port, part of the ``fsdp2_port`` suite: state dicts and DCP, meta-device init, mixed precision,
clip_grad_norm_ and GradScaler (test_fully_shard_state_dict.py, _init, _mixed_precision, _clip_grad_norm_,
_grad_scaler).

See ``fsdp2_port_checks`` for how the scenarios are ported.
"""

from __future__ import annotations

import copy
import itertools
import math

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.amp.grad_scaler import GradScaler, OptState
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.debug import CommDebugMode

from megatron_fsdp import MixedPrecisionPolicy, fully_shard
from megatron_fsdp import clip_grad_norm_ as mfsdp_clip_grad_norm_
from tests.distributed.core.fsdp2_port_models import (
    MLP,
    SUITE,
    ModelArgs,
    Transformer,
    assert_equal,
    assert_sharded_parity,
    ddp_reference,
    rank_world,
    shard_blocks_then_root,
    train_against,
)
from tests.distributed.harness import check, device, device_type, shared_tmpdir

# -- test_fully_shard_state_dict.py -------------------------------------------------------


def state_dict_save_load(model: nn.Module, what: str) -> None:
    """_test_state_dict_save_load: the state dict aliases the shards; loading new DTensors writes them back."""
    rank, _ = rank_world()
    for name, param in model.named_parameters():
        assert isinstance(param, DTensor), f"{what}: {name} is not a DTensor"
    old_fill, new_fill = 1, 42 + rank
    with torch.no_grad():
        for param in model.parameters():
            param.fill_(old_fill)
    data_ptrs = {n: p.to_local().data_ptr() for n, p in model.named_parameters()}
    sizes = [p.size() for p in model.parameters()]
    state_dict = model.state_dict()
    for param, size in zip(model.parameters(), sizes):
        assert param.size() == size and isinstance(param, nn.Parameter), what
    assert set(state_dict) == set(data_ptrs), f"{what}: keys {sorted(state_dict)} vs {sorted(data_ptrs)}"
    for name, tensor in state_dict.items():
        assert isinstance(tensor, DTensor), f"{what}: {name}"
        if tensor.to_local().numel():  # our zero-row shards have no storage to compare
            assert tensor.to_local().data_ptr() == data_ptrs[name], f"{what}: {name} does not alias the shard"
    new_state_dict = {n: t.detach().clone().fill_(new_fill) for n, t in state_dict.items()}
    for param in model.parameters():
        assert_equal(param.to_local(), torch.full_like(param.to_local(), old_fill), what)
    model.load_state_dict(new_state_dict)
    for name, param in model.named_parameters():
        local = param.to_local()
        assert_equal(local, torch.full_like(local, new_fill), f"{what}: {name} after load")
        if local.numel():
            assert local.data_ptr() == data_ptrs[name], f"{what}: {name} moved on load"


@check(SUITE)
def dp_state_dict_save_load() -> None:
    """test_dp_state_dict_save_load: mlp_dim 2..5, reshard_after_forward True, and False before/after a forward."""
    for mlp_dim in (2, 3, 4, 5):
        torch.manual_seed(42)
        base = nn.Sequential(MLP(mlp_dim), nn.Sequential(MLP(mlp_dim), nn.Linear(mlp_dim, mlp_dim)), MLP(mlp_dim))
        model1 = copy.deepcopy(base)
        for module in model1:
            fully_shard(module)
        fully_shard(model1)
        state_dict_save_load(model1, f"mlp_dim={mlp_dim} reshard")
        model2 = copy.deepcopy(base)
        for module in model2:
            fully_shard(module, reshard_after_forward=False)
        fully_shard(model2, reshard_after_forward=False)
        state_dict_save_load(model2, f"mlp_dim={mlp_dim} keep")
        ref_sd = model2.state_dict()
        model2(torch.randn((2, mlp_dim)))  # parameters are not resharded after this forward
        sd = model2.state_dict()  # state dict hooks reshard
        assert set(ref_sd) == set(sd)
        for key, value in ref_sd.items():
            assert isinstance(sd[key], DTensor), f"mlp_dim={mlp_dim}: {key} after forward is not a DTensor"
            assert_equal(sd[key].full_tensor(), value.full_tensor(), f"mlp_dim={mlp_dim}: {key} after forward")


@check(SUITE)
def rank0_full_state_dict() -> None:
    """test_rank0_offload_full_state_dict: full_tensor() of each sharded entry equals the unsharded model's."""
    rank, _ = rank_world()
    torch.manual_seed(42)
    ref_model = Transformer(ModelArgs())
    model = copy.deepcopy(ref_model)
    shard_blocks_then_root(model)
    full = {}
    for name, sharded in model.state_dict().items():
        value = sharded.full_tensor()
        if rank == 0:
            full[name] = value.cpu()
    if rank == 0:
        ref_full = ref_model.state_dict()
        assert list(full) == list(ref_full), f"keys {list(full)} vs {list(ref_full)}"
        for name, value in full.items():
            assert_equal(value, ref_full[name], name)


@check(SUITE)
def dcp_save_load_resumes_training() -> None:
    """DCP round trip of model and optimizer state (get_state_dict / dcp.save / dcp.load / set_state_dict).

    torchtitan's checkpointing: save after 2 steps, train on; a fresh sharded model and
    optimizer loaded from the checkpoint then trains to the same losses and weights.
    """
    rank, _ = rank_world()
    args = ModelArgs()

    def build(seed: int) -> tuple[nn.Module, torch.optim.Optimizer]:
        torch.manual_seed(seed)
        model = Transformer(args)
        shard_blocks_then_root(model)
        return model, torch.optim.AdamW(model.parameters(), lr=1e-2)

    torch.manual_seed(42 + rank)
    inputs = [torch.randint(0, args.vocab_size, (2, 16)) for _ in range(4)]

    def step(model: nn.Module, optim: torch.optim.Optimizer, inp: torch.Tensor) -> torch.Tensor:
        loss = model(inp).sum()
        loss.backward()
        optim.step()
        optim.zero_grad()
        return loss.detach()

    model, optim = build(42)
    with shared_tmpdir() as path:
        for inp in inputs[:2]:
            step(model, optim, inp)
        model_sd, optim_sd = get_state_dict(model, optim)
        dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=path)
        losses = [step(model, optim, inp) for inp in inputs[2:]]

        resumed, resumed_optim = build(7)  # other initial weights: the load must replace them
        model_sd, optim_sd = get_state_dict(resumed, resumed_optim)
        state = {"model": model_sd, "optim": optim_sd}
        dcp.load(state, checkpoint_id=path)
        set_state_dict(resumed, resumed_optim, model_state_dict=state["model"], optim_state_dict=state["optim"])
        resumed_losses = [step(resumed, resumed_optim, inp) for inp in inputs[2:]]
    for i, (a, b) in enumerate(zip(resumed_losses, losses)):
        assert_equal(a, b, f"step {i + 2} after resuming: loss")
    for (name, p), q in zip(resumed.named_parameters(), model.parameters()):
        assert_equal(p.full_tensor(), q.full_tensor(), f"after resuming: {name}")


# -- test_fully_shard_init.py (meta device) ----------------------------------------------


@check(SUITE)
def meta_device_1d_init() -> None:
    """test_meta_device_1d_init: build on meta, fully_shard, to_empty, reset_parameters, then train like DDP.

    The original checks that every value (parameters and buffers) moved off the fill
    constant and that an iteration runs; this port also trains 5 steps against DDP started
    from the initialised weights (buffers included).
    """
    rank, _ = rank_world()
    mlp_dim = 8
    torch.manual_seed(42)
    with torch.device("meta"):
        model = nn.Sequential(MLP(mlp_dim, with_buffer=True), MLP(mlp_dim))
    assert all(p.is_meta for p in model.parameters())
    fully_shard(model[0])
    fully_shard(model[1])
    fully_shard(model)
    # FSDP2 leaves the sharded parameters on meta until to_empty; ours allocates the shards
    # (uninitialised) at fully_shard, and to_empty keeps them (docs/fsdp2.md, "Differences").
    assert all(isinstance(p, DTensor) for p in model.parameters())
    model.to_empty(device=device())
    assert all(p.device.type == device_type() and isinstance(p, DTensor) for p in model.parameters())
    optim = torch.optim.Adam(model.parameters(), lr=1e-2)
    const = 1337
    for tensor in itertools.chain(model.parameters(), model.buffers()):
        tensor.detach().fill_(const)
    torch.manual_seed(0)
    for module in model.modules():
        if hasattr(module, "reset_parameters"):
            module.reset_parameters()
    for name, param in model.named_parameters():
        local = param.to_local()
        if local.numel():
            assert not torch.equal(local, torch.full_like(local, const)), f"{name} was not initialised"
    for name, buffer in model.named_buffers():
        assert not torch.equal(buffer, torch.full_like(buffer, const)), f"buffer {name} was not initialised"
    reference = nn.Sequential(MLP(mlp_dim, with_buffer=True), MLP(mlp_dim))
    reference.load_state_dict({k: v.full_tensor() if isinstance(v, DTensor) else v
                               for k, v in model.state_dict().items()})
    ref_model = ddp_reference(reference)
    ref_optim = torch.optim.Adam(ref_model.parameters(), lr=1e-2)
    torch.manual_seed(42 + rank)
    inp = torch.randn((4, mlp_dim))
    train_against(ref_model, ref_optim, model, optim, lambda _, inp=inp: inp, "meta init", iters=5)
    for name, buffer in model.named_buffers():
        assert_equal(buffer, dict(reference.named_buffers())[name], f"buffer {name} after training")


# -- test_fully_shard_mixed_precision.py --------------------------------------------------


@check(SUITE, world_sizes=(2,))  # the original runs at 2 ranks
def mixed_precision_bf16_compute_fp32_reduce() -> None:
    """test_reduce_dtype (param_dtype=bf16, reduce_dtype=fp32), with our policy's names.

    FSDP2's ``MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)``
    is ours with ``grad_comm_dtype=torch.float32`` (fp32 main weights are our default).
    Reference as in the original: a bf16 copy computes, its gradients are cast to fp32,
    all-reduced and averaged, an fp32 copy takes the optimizer step and is cast back.
    FSDP2's bf16-reduce variant (reduce_dtype=None) divides before and after the
    reduction by factors of its own and has no counterpart here; it is not ported.
    """
    rank, world = rank_world()
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, grad_comm_dtype=torch.float32)
    for reshard_after_forward in (True, False):
        what = f"reshard_after_forward={reshard_after_forward}"
        torch.manual_seed(42)
        model = nn.Sequential(*[MLP(16) for _ in range(3)])
        ref_model = copy.deepcopy(model)
        ref_model_bf16 = copy.deepcopy(ref_model).to(torch.bfloat16)
        ref_optim = torch.optim.Adam(ref_model.parameters(), lr=1e-2)
        for mlp in model:
            fully_shard(mlp, reshard_after_forward=reshard_after_forward, mp_policy=policy)
        fully_shard(model, reshard_after_forward=reshard_after_forward, mp_policy=policy)
        optim = torch.optim.Adam(model.parameters(), lr=1e-2)
        torch.manual_seed(42 + rank + 1)
        inp = torch.randn((4, 16))
        for iter_idx in range(10):
            optim.zero_grad(set_to_none=(iter_idx % 2 == 0))
            loss = model(inp).sum()
            loss.backward()
            optim.step()

            ref_optim.zero_grad(set_to_none=(iter_idx % 2 == 0))
            ref_loss = ref_model_bf16(inp.to(torch.bfloat16)).sum()
            ref_loss.backward()
            for param_fp32, param_bf16 in zip(ref_model.parameters(), ref_model_bf16.parameters()):
                grad = param_bf16.grad.to(torch.float32)
                dist.all_reduce(grad)
                param_fp32.grad = grad.div_(world)
                param_bf16.grad = None
            ref_optim.step()
            with torch.no_grad():
                for param_fp32, param_bf16 in zip(ref_model.parameters(), ref_model_bf16.parameters()):
                    param_bf16.copy_(param_fp32)
            assert loss.dtype == torch.bfloat16, f"{what}: output dtype {loss.dtype}"
            assert_equal(loss, ref_loss, f"{what} iter {iter_idx}: loss")
            assert_sharded_parity(ref_model, model, f"{what} iter {iter_idx}")


# -- test_fully_shard_clip_grad_norm_.py ------------------------------------------------


@check(SUITE, world_sizes=(2,))  # the original runs at 2 ranks
def clip_grad_norm_1d() -> None:
    """test_clip_grad_norm_1d: torch.nn.utils.clip_grad_norm_ on the sharded gradients, norms 2, 1, inf, vs DDP.

    One all-reduce for the norm (CommDebugMode), as the original expects. The original
    checks every local gradient's norm exceeds max_norm before clipping; our row-aligned
    shards can leave a rank zero rows of a parameter, so that holds for non-empty ones.
    The inf norm goes through ``megatron_fsdp.clip_grad_norm_``: torch's raises on an
    empty local tensor (docs/fsdp2.md, "Differences").
    """
    rank, _ = rank_world()
    max_norm = 1
    for norm_type in (2, 1, float("inf")):
        torch.manual_seed(42)
        args = ModelArgs()
        model = Transformer(args)
        ref_model = ddp_reference(model)
        ref_optim = torch.optim.Adam(ref_model.parameters(), lr=1e-2)
        shard_blocks_then_root(model)
        optim = torch.optim.Adam(model.parameters(), lr=1e-2)
        torch.manual_seed(42 + rank + 1)
        inp = torch.randint(0, args.vocab_size, (3, 16))
        for iter_idx in range(10):
            what = f"norm_type={norm_type} iter {iter_idx}"
            ref_optim.zero_grad()
            ref_model(inp).sum().backward()
            optim.zero_grad()
            model(inp).sum().backward()
            ref_grads = [p.grad.detach().clone() for p in ref_model.parameters()]
            local_grads = [p.grad.to_local().detach().clone() for p in model.parameters()]
            for ref_grad, param in zip(ref_grads, model.parameters()):
                assert_equal(param.grad.full_tensor(), ref_grad, what)
            norms = [torch.linalg.vector_norm(g, ord=norm_type).item() for g in ref_grads]
            assert all(n > max_norm for n in norms), f"{what}: clipping would be vacuous: {norms}"
            norms = [torch.linalg.vector_norm(g, ord=norm_type).item() for g in local_grads if g.numel()]
            assert all(n > max_norm for n in norms), f"{what}: local norms {norms}"
            ref_total = torch.nn.utils.clip_grad_norm_(ref_model.parameters(), max_norm=max_norm, norm_type=norm_type)
            if math.isinf(norm_type):
                # torch's inf norm raises on an empty local tensor ("no identity"), and our row-aligned
                # shards leave some rank zero rows of small parameters: ours handles them.
                total = mfsdp_clip_grad_norm_(model, max_norm=max_norm, norm_type=norm_type)
                assert_equal(total, ref_total, f"{what}: total norm")
            else:
                with CommDebugMode() as comm_mode:
                    total = torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm=max_norm, norm_type=norm_type,
                                                           foreach=True)
                assert_equal(total.full_tensor(), ref_total, f"{what}: total norm")
                all_reduces = comm_mode.get_comm_counts()[torch.ops.c10d_functional.all_reduce]
                assert all_reduces == len(total.placements), f"{what}: {all_reduces} all-reduces"
            for param, grad in zip(ref_model.parameters(), ref_grads):
                assert torch.linalg.vector_norm(param.grad, ord=norm_type).item() <= max_norm, what
                if torch.count_nonzero(grad):
                    assert not torch.equal(param.grad, grad), what
            for param, grad in zip(model.parameters(), local_grads):
                if not grad.numel():
                    continue  # a rank holding zero rows of this parameter
                assert torch.linalg.vector_norm(param.grad.to_local(), ord=norm_type).item() <= max_norm, what
                if torch.count_nonzero(grad):
                    assert not torch.equal(param.grad.to_local(), grad), what
            for (name, p), q in zip(model.named_parameters(), ref_model.parameters()):
                assert_equal(p.grad.full_tensor(), q.grad, f"{what}: clipped {name}.grad")


# -- test_fully_shard_grad_scaler.py ----------------------------------------------------


@check(SUITE)
def gradient_scaler() -> None:
    """test_gradient_scaler (1-D): torch.amp.GradScaler on sharded gradients; an inf on one rank skips every step."""
    rank, _ = rank_world()
    for has_inf in (True, False):
        torch.manual_seed(0)
        model = nn.Sequential(*[nn.Linear(4, 4, bias=False) for _ in range(2)])
        for layer in model:
            fully_shard(layer)
        fully_shard(model)
        loss = model(torch.randn([4, 4])).sum()
        scaler = GradScaler(device_type(), init_scale=2.0, enabled=True)
        opt = torch.optim.Adam(model.parameters(), lr=1e-2)
        scaler.scale(loss).backward()
        inv_scale = scaler._scale.double().reciprocal().float()
        first = opt.param_groups[0]["params"][0]
        assert first.grad.to_local().numel(), "the first weight needs rows on every rank for this scenario"
        if has_inf and rank == 1:
            first.grad.to_local()[0, 0].fill_(float("inf"))
        initial_grad = first.grad.to_local().clone()
        scaler.unscale_(opt)
        for found_inf in scaler._per_optimizer_states[id(opt)]["found_inf_per_device"].values():
            assert found_inf.item() == float(has_inf), f"has_inf={has_inf}: rank {rank} found_inf={found_inf}"
        assert scaler._per_optimizer_states[id(opt)]["stage"] is OptState.UNSCALED
        assert_equal(first.grad.to_local(), initial_grad * inv_scale, f"has_inf={has_inf}: unscaled")
        initial_scale = scaler.get_scale()
        before = [p.full_tensor().clone() for p in model.parameters()]
        scaler.step(opt)
        after = [p.full_tensor() for p in model.parameters()]
        changed = [not torch.equal(a, b) for a, b in zip(after, before)]
        assert changed == [not has_inf] * len(changed), f"has_inf={has_inf}: parameters changed {changed}"
        scaler.update()
        expected = initial_scale * scaler.get_backoff_factor() if has_inf else initial_scale
        assert scaler.get_scale() == expected, f"has_inf={has_inf}: scale {scaler.get_scale()}, expected {expected}"


