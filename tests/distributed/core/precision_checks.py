"""Mixed precision: bf16 compute with fp32 main weights (one spawned group per world size)."""

from __future__ import annotations

import copy

import torch
import torch.distributed as dist
from torch.distributed.fsdp import CPUOffloadPolicy

from megatron_fsdp import MixedPrecisionPolicy, comm_stats, fully_shard, microbatch
from megatron_fsdp.core.lookup import units_of
from megatron_fsdp.core.quantized_gather import dequantize, error_bound, quantization_scale, quantize
from tests.distributed.core.accumulation_checks import groups_of
from tests.distributed.core.engine_checks import expect_error, shard_net, world
from tests.distributed.harness import check
from tests.models import Block, Net, global_batch, local_batch, loss_fn

SUITE = "precision"
BF16 = MixedPrecisionPolicy(param_dtype=torch.bfloat16)


def rank_grads(master: torch.nn.Module, step: int, rank: int, n: int) -> list[torch.Tensor | None]:
    """What one rank computes: bf16 forward/backward, gradients widened to fp32."""
    compute = copy.deepcopy(master).to(torch.bfloat16)
    loss_fn(compute, local_batch(step, rank, n)).backward()
    return [None if p.grad is None else p.grad.float() for p in compute.parameters()]


@check(SUITE, world_sizes=(2,))
def bf16_main_weights_bitwise_vs_fp32_master_reference() -> None:
    rank, n = world()
    for strategy in ("optim_grads_params", "optim_grads", "optim", "no_shard"):
        torch.manual_seed(0)
        base = Net()
        ours = shard_net(copy.deepcopy(base), strategy, mp_policy=BF16)
        master = copy.deepcopy(base)
        opt, opt_ref = (torch.optim.AdamW(m.parameters(), lr=1e-2) for m in (ours, master))
        for step in range(3):
            loss_fn(ours, local_batch(step, rank, n)).backward()
            opt.step()
            opt.zero_grad()
            per_rank = [rank_grads(master, step, r, n) for r in range(n)]
            for i, p in enumerate(master.parameters()):
                if per_rank[0][i] is not None:
                    p.grad = sum(g[i] / n for g in per_rank)
            opt_ref.step()
            opt_ref.zero_grad()
            for (name, p), q in zip(ours.named_parameters(), master.parameters()):
                assert p.dtype == torch.float32, name
                assert torch.equal(p.full_tensor(), q.detach()), f"{strategy} step {step} {name}"


@check(SUITE)
def bf16_tracks_fp32_and_halves_gather_bytes() -> None:
    rank, n = world()
    torch.manual_seed(0)
    base = Net()
    single = copy.deepcopy(base)
    runs = {}
    for policy in (None, BF16):
        model = shard_net(copy.deepcopy(base), "optim_grads_params", mp_policy=policy)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        losses, gathered = [], 0
        for step in range(20):
            comm_stats.reset()
            loss = loss_fn(model, local_batch(step, rank, n))
            loss.backward()
            gathered = comm_stats.bytes["all_gather"]
            opt.step()
            opt.zero_grad()
            losses.append(loss.float())
        runs[policy] = (model, torch.stack(losses), gathered)
    opt = torch.optim.AdamW(single.parameters(), lr=1e-2)
    reference = []
    for step in range(20):
        reference.append(loss_fn(single, local_batch(step, rank, n)).detach())
        loss_fn(single, global_batch(step, n)).backward()
        opt.step()
        opt.zero_grad()
    (_, fp32_losses, fp32_bytes), (bf16, bf16_losses, bf16_bytes) = runs[None], runs[BF16]
    torch.testing.assert_close(fp32_losses, torch.stack(reference), rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(bf16_losses, torch.stack(reference), rtol=2e-2, atol=2e-2)
    for (name, p), q in zip(bf16.named_parameters(), single.parameters()):
        torch.testing.assert_close(p.full_tensor(), q.detach(), rtol=0, atol=3e-2, msg=name)
    # The gathers move compute-dtype elements: half the bytes per element in bf16. The flat
    # buffers' element counts differ a little, since offsets are 16-byte aligned in each
    # buffer's own dtype (sharding/layout.py), so compare each run with its own layouts:
    # a ZeRO-3 step gathers every non-root unit twice (forward, backward), the root once.
    for (model, _, gathered_bytes), itemsize in ((runs[None], 4), (runs[BF16], 2)):
        expected = sum((1 if unit.is_root else 2) * group.layout.total_numel * itemsize
                       for unit in units_of(model) for group in unit.groups if group.gathers)
        assert gathered_bytes == expected, (itemsize, gathered_bytes, expected)
    if rank == 0:
        err = ((bf16_losses - torch.stack(reference)).abs() / torch.stack(reference).abs()).max().item()
        print(f"bf16 vs fp32 single-process, 20 steps, n={n}: max relative loss error {err:.2e}; "
              f"all-gather bytes/step {fp32_bytes} -> {bf16_bytes}")


@check(SUITE, world_sizes=(2,))
def bf16_gradient_communication() -> None:
    rank, n = world()
    torch.manual_seed(0)
    base = Net()
    grads, nbytes = {}, {}
    for comm in (torch.float32, torch.bfloat16):
        model = shard_net(copy.deepcopy(base), "optim_grads_params",
                          mp_policy=MixedPrecisionPolicy(param_dtype=torch.bfloat16, grad_comm_dtype=comm))
        comm_stats.reset()
        loss_fn(model, local_batch(0, rank, n)).backward()
        nbytes[comm] = comm_stats.bytes["reduce_scatter"]
        grads[comm] = {k: p.grad.full_tensor() for k, p in model.named_parameters() if p.grad is not None}
        assert all(g.dtype == torch.float32 for g in grads[comm].values())
    assert nbytes[torch.bfloat16] * 2 == nbytes[torch.float32], nbytes
    for name, g in grads[torch.float32].items():
        torch.testing.assert_close(grads[torch.bfloat16][name], g, rtol=2e-2, atol=1e-3, msg=name)


@check(SUITE, world_sizes=(2,))
def compute_weights_refreshed_once_per_step_in_microbatch() -> None:
    rank, n = world()
    k = 3
    for use_context, expected in ((True, 1), (False, k)):
        model = shard_net(Net(), "optim_grads_params", mp_policy=BF16)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        for step in range(2):
            before = [g.refreshes for g in groups_of(model)]
            for i, batch in enumerate(global_batch(step, n, per_rank=2 * k).chunk(n)[rank].chunk(k)):
                if use_context:
                    with microbatch(model, is_first=(i == 0), is_last=(i == k - 1)):
                        (loss_fn(model, batch) / k).backward()
                else:
                    (loss_fn(model, batch) / k).backward()
            opt.step()
            opt.zero_grad()
            # the probe unit runs under no_grad only: no backward marks it stale
            probe = {id(g) for g in model.probe.fsdp_unit.groups}
            counts = [g.refreshes - b for g, b in zip(groups_of(model), before) if id(g) not in probe]
            if step > 0:  # step 0 starts from freshly copied weights
                assert counts and set(counts) == {expected}, (use_context, counts)


@check(SUITE, world_sizes=(2,))
def policy_validation() -> None:
    expect_error(ValueError, "param_dtype=torch.int32", MixedPrecisionPolicy, param_dtype=torch.int32)
    expect_error(ValueError, "less precise", MixedPrecisionPolicy, param_dtype=torch.float32,
                 main_params_dtype=torch.bfloat16)
    expect_error(TypeError, "MixedPrecisionPolicy", fully_shard, Block(), mp_policy="bf16")
    dtypes = MixedPrecisionPolicy(param_dtype=torch.bfloat16, grad_comm_dtype=torch.bfloat16).dtypes_for(torch.float32)
    assert dtypes == (torch.bfloat16, torch.float32, torch.float32, torch.bfloat16)


F8 = MixedPrecisionPolicy(gather_dtype=torch.float8_e4m3fn)
BF16_F8 = MixedPrecisionPolicy(param_dtype=torch.bfloat16, gather_dtype=torch.float8_e4m3fn)


def record_forward_weights(model: torch.nn.Module) -> list[tuple[torch.nn.Module, str, torch.Tensor]]:
    """Every parameter's value as its module computes with it, at each forward of the module."""
    seen: list[tuple[torch.nn.Module, str, torch.Tensor]] = []

    def record(module: torch.nn.Module, _args: tuple) -> None:
        for name, p in module._parameters.items():
            if p is not None:
                seen.append((module, name, p.detach().clone()))

    for module in model.modules():
        if any(p is not None for p in module._parameters.values()):
            module.register_forward_pre_hook(record)  # after fully_shard's: the gathered weights
    return seen


@check(SUITE)
def float8_gather_dtype_error_and_bytes() -> None:
    """gather_dtype=float8_e4m3fn: the weights a module computes with are exactly the per-tensor
    quantize/dequantize of the fp32 main weights (scale agreed over the whole parameter, zero-row
    pieces included), within the stated float8 bound; the all-gather moves a quarter of fp32's bytes
    and half of bf16's, plus 4 bytes per parameter per gather for the scales."""
    rank, n = world()
    torch.manual_seed(0)
    base = Net()
    for plain, quantized, itemsize in ((None, F8, 4), (BF16, BF16_F8, 2)):
        runs = {}
        for policy in (plain, quantized):
            model = shard_net(copy.deepcopy(base), "optim_grads_params", mp_policy=policy)
            main = {(id(m), k): p for m in model.modules() for k, p in m._parameters.items() if p is not None}
            seen = record_forward_weights(model)
            opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
            losses, nbytes, calls = [], {}, {}
            for step in range(3):
                comm_stats.reset()
                seen.clear()
                loss = loss_fn(model, local_batch(step, rank, n))
                loss.backward()
                nbytes, calls = nbytes or dict(comm_stats.bytes), calls or dict(comm_stats.calls)
                if policy is quantized:  # before the step changes the main weights
                    for module, name, value in seen:
                        full = main[(id(module), name)].full_tensor()
                        scale = quantization_scale(full.abs().max(), torch.float8_e4m3fn)
                        expected = dequantize(quantize(full, scale, torch.float8_e4m3fn), scale, value.dtype)
                        assert torch.equal(value, expected), f"step {step} {name}"
                        bound = error_bound(full, scale, torch.float8_e4m3fn)
                        assert ((value.float() - full).abs() <= bound).all(), f"step {step} {name}"
                opt.step()
                opt.zero_grad()
                losses.append(loss.detach().float())
            assert all(p.dtype == torch.float32 for p in model.parameters())  # fp32 main weights
            runs[policy] = (model, torch.stack(losses), nbytes, calls)
        (model, q_losses, q_bytes, q_calls), (_, p_losses, p_bytes, _) = runs[quantized], runs[plain]
        assert q_bytes["all_gather"] * itemsize == p_bytes["all_gather"], (q_bytes, p_bytes)
        # One scale all-reduce (4 bytes per parameter of the group) per all-gather: at most 4 bytes per
        # parameter per gather of the unit's largest group.
        assert q_calls["all_gather_scale"] == q_calls["all_gather"], q_calls
        most = max(len(g.params) for unit in units_of(model) for g in unit.groups)
        assert 0 < q_bytes["all_gather_scale"] <= 4 * most * q_calls["all_gather"], q_bytes
        assert torch.isfinite(q_losses).all()
        if rank == 0:
            rel = ((q_losses - p_losses).abs() / p_losses.abs()).tolist()
            label = "bf16" if plain else "fp32"
            print(f"gather_dtype=float8_e4m3fn vs {label} gathers, n={n}: all-gather bytes/step "
                  f"{p_bytes['all_gather']} -> "
                  f"{q_bytes['all_gather']} (+{q_bytes['all_gather_scale']} scale); relative loss difference "
                  f"per step {[f'{r:.1e}' for r in rel]}")


@check(SUITE, world_sizes=(2,))
def float8_gather_dtype_refusals() -> None:
    expect_error(ValueError, ("gather_dtype", "float8"), MixedPrecisionPolicy, gather_dtype=torch.bfloat16)
    expect_error(NotImplementedError, ("gather_dtype", "CPU offload"), fully_shard, Net().blocks[0],
                 mp_policy=F8, offload_policy=CPUOffloadPolicy())
    dist.barrier()
