"""What ``pretrain`` prints around training: the set-up at start and what the run did at the end.

The start-up summary says what the flags became (world size and the DP/TP/CP/EP split,
the mesh, the data-parallel backend and strategy, the batch arithmetic, the whole
model's parameter count and a memory estimate from ``megatron_fsdp.plan``), so a
wrong layout shows before the first iteration. The end-of-run summary says how many
iterations and tokens were trained, how long it took, the last loss and where the
checkpoint went.
"""

from __future__ import annotations

import argparse
import os

from torch import nn
from torch.distributed.fsdp import FSDPModule as TorchFSDPModule

from megatron_fsdp.checkpoint import iteration_dir
from megatron_fsdp.core.module import FSDPModule
from megatron_fsdp.plan import Precision, RankPlan, UnitShape, plan_rank

from .mcore_model import mcore_fallback_note
from .parallel_state import ParallelLayout

MIB = 1 << 20
_ZERO = {"no_shard": "ZeRO-0", "optim": "ZeRO-1", "optim_grads": "ZeRO-2", "optim_grads_params": "ZeRO-3"}


def _size(nbytes: float) -> str:
    """Bytes in the unit that keeps them readable (a tiny CPU model's figures are KiB, a real one's GiB)."""
    for unit, scale in (("GiB", 1 << 30), ("MiB", MIB)):
        if nbytes >= scale:
            return f"{nbytes / scale:.2f} {unit}"
    return f"{nbytes / 1024:.1f} KiB"


def _ranks(n: int) -> str:
    return f"{n} rank" + ("s" if n != 1 else "")


def whole_model_parameters(module: nn.Module, tp_size: int, ep_size: int, etp_size: int | None = None) -> int:
    """Parameters of the whole model, not of this rank's slice.

    A tensor-parallel parameter (``tensor_model_parallel``) is one of ``tp_size``
    equal slices, an expert one of ``etp_size`` (the expert TP size; default
    ``tp_size``); an expert parameter (``allreduce = False``) one of ``ep_size``
    ranks' experts. Shapes are the unsharded ones (a DTensor's global shape).
    """
    etp_size = tp_size if etp_size is None else etp_size
    total = 0
    for param in module.parameters():
        expert = not getattr(param, "allreduce", True)
        factor = (etp_size if expert else tp_size) if getattr(param, "tensor_model_parallel", False) else 1
        factor *= ep_size if expert else 1
        total += param.numel() * factor
    return total


def _units(module: nn.Module, expert_parallel: bool) -> list[tuple[UnitShape, bool]]:
    """The model's FSDP units as the planner describes them (each parameter in its innermost unit),
    with whether the unit holds experts sharded over the expert mesh (only with expert parallelism)."""
    units = [m for m in module.modules() if isinstance(m, (FSDPModule, TorchFSDPModule))]
    if module not in units:
        units.insert(0, module)
    names = {id(p): n for n, p in module.named_parameters()}
    taken: set[int] = set()
    out = []
    for unit in reversed(units):  # innermost first: modules() lists a parent before its children
        params = [p for p in unit.parameters() if id(p) not in taken]
        taken.update(id(p) for p in params)
        if params:
            shape = UnitShape(type(unit).__name__, tuple((names.get(id(p), "?"), tuple(p.shape)) for p in params),
                              1, is_root=unit is module)
            out.append((shape, expert_parallel and any(not getattr(p, "allreduce", True) for p in params)))
    return list(reversed(out))


def memory_plan(args: argparse.Namespace, module: nn.Module, layout: ParallelLayout) -> list[RankPlan]:
    """``megatron_fsdp.plan``'s layout of this rank's weights, gradients and Adam state (one plan per mesh:
    the dense units over the data-parallel ranks, the expert units over the expert data-parallel ones)."""
    if args.use_torch_fsdp2:  # ZeRO-3: fp32 shards of weights, gradients and Adam state; bf16 only when gathered
        return [plan_rank([u for u, _ in _units(module, False)], layout.grad_group_size, "optim_grads_params",
                          precision=Precision(2 if args.bf16 else 4, 4, 4))]
    if not args.use_megatron_fsdp:  # DDP: full weights, gradients and optimizer state on every rank
        units = [UnitShape("model", tuple((n, tuple(p.shape)) for n, p in module.named_parameters()), 1, True)]
        return [plan_rank(units, layout.grad_group_size, "no_shard")]
    precision = Precision.named("bf16" if args.bf16 else "fp32")
    units = _units(module, layout.expt_mesh is not None)
    dense = [u for u, expert in units if not expert]
    experts = [u for u, expert in units if expert]
    instances = args.num_distributed_optimizer_instances
    plans = [plan_rank(dense, layout.grad_group_size, args.data_parallel_sharding_strategy,
                       outer=instances, outer_optim=args.outer_dp_sharding_strategy == "optim",
                       precision=precision)] if dense else []
    if experts:
        plans.append(plan_rank(experts, args.expert_data_parallel_size, args.data_parallel_sharding_strategy,
                               precision=precision))
    return plans


def _mesh(layout: ParallelLayout) -> str:
    def one(mesh) -> str:
        return "(" + ", ".join(f"{n}={s}" for n, s in zip(mesh.mesh_dim_names, mesh.shape)) + ")"

    if layout.mesh is None:
        return "none"
    return one(layout.mesh) + (f", experts {one(layout.expt_mesh)}" if layout.expt_mesh is not None else "")


def startup_summary(args: argparse.Namespace, layout: ParallelLayout, module: nn.Module, start_iteration: int) -> str:
    """The lines printed before training (rank 0)."""
    tp, cp, ep, etp = layout.tp.size, layout.cp.size, layout.ep.size, layout.expert_tp.size
    instances = args.num_distributed_optimizer_instances
    if args.use_megatron_fsdp:
        backend = (f"megatron_fsdp {args.data_parallel_sharding_strategy} "
                   f"({_ZERO.get(args.data_parallel_sharding_strategy, '?')}) over "
                   f"{_ranks(layout.grad_group_size // instances)}")
        if instances > 1:
            backend += f" x {instances} replicas (HSDP, outer strategy {args.outer_dp_sharding_strategy})"
        if getattr(args, "megatron_fsdp_version", 1) == 2:
            backend += (" (--megatron-fsdp-version 2: Megatron-LM's placements API, megatron_fsdp.experimental, "
                        "runs this same engine)")
    elif args.use_torch_fsdp2:
        backend = f"PyTorch FSDP2 (fully_shard, ZeRO-3) over {_ranks(layout.grad_group_size)}"
    else:
        backend = f"PyTorch DDP (no sharding) over {_ranks(layout.grad_group_size)}"
    plans = memory_plan(args, module, layout)
    # FSDP2 casts to bf16 as it gathers: it keeps no bf16 shards between steps
    fsdp2_casts = sum(p.compute_shards for p in plans) if args.use_torch_fsdp2 else 0
    resident = sum(p.resident for p in plans) - fsdp2_casts
    gathered = sum(p.gathered_weights for p in plans)
    parts = " + ".join(f"{name} {_size(sum(getattr(p, attr) for p in plans))}"
                       for name, attr in (("weights", "main_params"), ("gradients", "grads"),
                                          ("Adam state", "optimizer_state")))
    compute = sum(p.compute_shards for p in plans) - fsdp2_casts
    if compute:
        parts += f" + compute-dtype shards {_size(compute)}"
    start = (f"resuming at iteration {start_iteration}, training to {args.train_iters}" if start_iteration
             else f"training {args.train_iters} iterations")
    rule = "-" * 28
    lines = [
        f"{rule} set-up {rule}",
        f"world size: {args.world_size} = data-parallel {layout.dp_size} x context-parallel {cp} x "
        f"tensor-parallel {tp}" + (f"; expert-parallel {ep}" + (f" x expert tensor-parallel {etp}" if etp != tp else "")
                                    + f" (experts sharded over {_ranks(args.expert_data_parallel_size)})"
                                    if layout.expt_mesh is not None else ""),
        f"mesh: {_mesh(layout)}",
        f"data parallelism: {backend}",
        f"batch: global {args.global_batch_size} = micro-batch {args.micro_batch_size} x data-parallel "
        f"{layout.dp_size} x {args.num_microbatches} micro-batches per step; sequence length {args.seq_length}",
        f"parameters: {whole_model_parameters(module, tp, ep, etp):,} (the whole model"
        + (", over every tensor-/expert-parallel slice)" if tp * ep * etp > 1 else ")")
        + f"; weights {_weights(args)}",
        f"memory estimate per rank (megatron_fsdp.plan; activations not included): {_size(resident)} "
        f"between steps ({parts}); gathered weights in forward/backward {_size(gathered)}",
        f"{start}; checkpoints: " + (f"--save {args.save}" if args.save else "none (no --save)"),
    ]
    note = mcore_fallback_note()
    if note is not None:
        lines.append(note)
    lines.append("-" * (2 * len(rule) + 8))
    return "\n".join(lines)


def _weights(args: argparse.Namespace) -> str:
    if not args.bf16:
        return "fp32"
    return "fp32, computed in bf16 (FSDP2's mixed precision)" if args.use_torch_fsdp2 else "bf16 (fp32 main weights)"


def end_of_run_summary(args: argparse.Namespace, *, start_iteration: int, iteration: int, samples: int,
                       seconds: float, final_loss: float | None, saved: bool) -> str:
    """The lines printed after training (rank 0): what this run did, and where its checkpoint is."""
    trained = iteration - start_iteration
    tokens = samples * args.seq_length
    loss = f"{final_loss:.6E}" if final_loss is not None else "none (no iteration ran)"
    where = (os.path.abspath(iteration_dir(args.save, iteration)) if saved
             else "none (no --save)" if not args.save else "none (nothing trained)")
    plural = "" if trained == 1 else "s"
    return (f"end of training: {trained} iteration{plural} ({start_iteration + 1} to {iteration}) | "
            f"{samples} samples, {tokens} tokens | {seconds:.1f} s | final lm loss: {loss} | checkpoint: {where}")
