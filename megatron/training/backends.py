"""Data-parallel backends: DDP (the baseline), megatron_fsdp and PyTorch FSDP2 behind one interface.

The training loop asks a backend for what differs between the two (how micro-batches
accumulate, autocast, how summed per-token losses are scaled, the gradient buffers,
the optimizer wrapper) and never branches on the wrapper's type.
"""

from __future__ import annotations

import abc
import argparse
import contextlib
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor
from torch.nn.parallel import DistributedDataParallel as DDP

from megatron_fsdp.core.microbatch import microbatch
from megatron_fsdp.core.module import FSDPModule
from megatron_fsdp.mcore import FullyShardedDataParallel
from megatron_fsdp.optim.grad_norm import clip_grad_norm_, get_grad_norm
from megatron_fsdp.optim.optimizer import fully_shard_optimizer
from megatron_fsdp.parallel import TensorParallel, allreduce_sequence_parallel_grads, params_for_grad_norm

from .initialize import print_rank_0
from .model_setup import ddp_config_from_args
from .parallel_state import GroupOfRanks, ParallelLayout
from .torch_fsdp2 import wrap_with_torch_fsdp2


class DataParallelBackend(abc.ABC):
    """A wrapped model and the operations the loop needs on it."""

    def __init__(self, model: nn.Module, device: torch.device, layout: ParallelLayout) -> None:
        self.model = model  # what forward_step calls
        self.device = device
        self.layout = layout  # the data-parallel group the loop sums losses over, the TP group

    @property
    def module(self) -> nn.Module:
        """The user's module under the wrapper (what checkpoints save, with its own parameter names)."""
        return unwrap_model(self.model)

    @abc.abstractmethod
    def accumulation(self, is_first: bool, is_last: bool) -> AbstractContextManager:
        """The context of one micro-batch's forward and backward: reduce only on the last."""

    def autocast(self) -> AbstractContextManager:
        """The forward's autocast (none unless the backend computes in a lower precision that way)."""
        return contextlib.nullcontext()

    def summed_loss_factor(self) -> float:
        """What a summed (per-token) loss is multiplied by before backward, for gradients to be sums over ranks."""
        return 1.0

    def clip_grad_norm(self, max_norm: float) -> float:
        """Clip the gradients to ``max_norm`` (inf: no clipping) by their global norm; return the norm.

        Each parameter counts once: data-parallel shards and replicas by the gradients'
        placements, tensor-parallel slices summed over TP, TP-replicated ones taken once.
        Under sequence parallelism the TP-replicated gradients are first summed over TP.
        """
        params = [p for p in self.model.parameters() if p.grad is not None]
        tp = self.layout.tp
        allreduce_sequence_parallel_grads(params, tp)
        if self.layout.expt_mesh is not None:  # expert shards are distinct across EP x expert TP too
            return clip_grad_norm_with_experts(params, max_norm, self.layout.expert_norm_group, tp,
                                               self.layout.expert_tp)
        norm = clip_grad_norm_(params, max_norm, model_parallel_group=tp.group if tp.size > 1 else None,
                               parameters_for_norm=params_for_grad_norm(params, tp))
        return float(norm)

    def params_norm(self) -> float:
        """Megatron's ``params norm``: the L2 norm of all parameters, each counted once (as the grad norm)."""
        return self._global_norm([_AsGrad(p, p.detach()) for p in self.model.parameters()], 2.0)

    def num_zeros_in_grad(self) -> int:
        """Megatron's ``num zeros``: zero entries of the reduced gradients, each parameter counted once."""
        holders = [_AsGrad(p, _zero_entries(p.grad)) for p in self.model.parameters() if p.grad is not None]
        return int(round(self._global_norm(holders, 1.0)))

    def _global_norm(self, holders: list[_AsGrad], norm_type: float) -> float:
        """The norm of the holders' ``grad`` over every shard and model-parallel slice, each once."""
        tp = self.layout.tp
        if self.layout.expt_mesh is not None:
            expert = [h for h in holders if not getattr(h, "allreduce", True)]
            dense = [h for h in holders if getattr(h, "allreduce", True)]
            parts = (get_grad_norm(params_for_grad_norm(dense, tp), norm_type,
                                   model_parallel_group=tp.group if tp.size > 1 else None),
                     get_grad_norm(params_for_grad_norm(expert, self.layout.expert_tp), norm_type,
                                   model_parallel_group=self.layout.expert_norm_group))
            return float(sum(p ** norm_type for p in parts) ** (1.0 / norm_type))
        return float(get_grad_norm(params_for_grad_norm(holders, tp), norm_type,
                                   model_parallel_group=tp.group if tp.size > 1 else None))

    @abc.abstractmethod
    def zero_grad(self) -> None:
        """Clear what the backend keeps of the last step's gradients (before the optimizer's zero_grad)."""

    @abc.abstractmethod
    def finish_grad_sync(self) -> None:
        """Wait for every gradient reduction of this step (after the last backward)."""

    @abc.abstractmethod
    def scale_gradients(self, factor: float) -> None:
        """Multiply every reduced gradient by ``factor``."""

    def wrap_optimizer(self, optimizer: torch.optim.Optimizer) -> torch.optim.Optimizer:
        """The optimizer the loop steps (the backend may drive its sharded state)."""
        return optimizer


class DDPBackend(DataParallelBackend):
    """``torch.nn.parallel.DistributedDataParallel``: fp32 weights, bf16 compute under autocast."""

    def __init__(self, model: nn.Module, device: torch.device, layout: ParallelLayout, bf16: bool) -> None:
        super().__init__(model, device, layout)
        self.bf16 = bf16

    def accumulation(self, is_first: bool, is_last: bool) -> AbstractContextManager:
        return contextlib.nullcontext() if is_last else self.model.no_sync()

    def autocast(self) -> AbstractContextManager:
        if self.bf16:
            return torch.autocast(self.device.type, dtype=torch.bfloat16)
        return contextlib.nullcontext()

    def summed_loss_factor(self) -> float:
        return float(self.layout.grad_group_size)  # DDP averages over the ranks it reduces over: undo it

    def zero_grad(self) -> None:
        pass  # DDP keeps no gradient state outside .grad (the optimizer's zero_grad clears it)

    def finish_grad_sync(self) -> None:
        pass  # DDP's last backward returns after its all-reduces have finished

    def scale_gradients(self, factor: float) -> None:
        for param in self.model.parameters():
            if param.grad is not None:
                param.grad.mul_(factor)


class FSDPBackend(DataParallelBackend):
    """megatron_fsdp through megatron-core's adapter: bf16 model weights, fp32 main weights."""

    def accumulation(self, is_first: bool, is_last: bool) -> AbstractContextManager:
        return microbatch(self.model, is_first=is_first, is_last=is_last)

    def zero_grad(self) -> None:
        self.model.zero_grad_buffer()

    def finish_grad_sync(self) -> None:
        self.model.finish_grad_sync()

    def scale_gradients(self, factor: float) -> None:
        self.model.scale_gradients(factor)

    def wrap_optimizer(self, optimizer: torch.optim.Optimizer) -> torch.optim.Optimizer:
        return fully_shard_optimizer(optimizer)


class TorchFSDP2Backend(DataParallelBackend):
    """A model wrapped by ``fully_shard``: DTensor (``Shard(0)``) parameters and gradients over the DP group."""

    def accumulation(self, is_first: bool, is_last: bool) -> AbstractContextManager:
        return _gradient_sync(self.model, is_last)

    def summed_loss_factor(self) -> float:
        return float(self.layout.grad_group_size)  # FSDP2 averages over the ranks it reduces over: undo it

    def zero_grad(self) -> None:
        pass  # FSDP2 keeps gradients only in .grad (the optimizer's zero_grad clears them)

    def finish_grad_sync(self) -> None:
        pass  # FSDP2's root post-backward callback waits for its reduce-scatters

    def scale_gradients(self, factor: float) -> None:
        for param in self.model.parameters():
            if param.grad is not None:
                param.grad.mul_(factor)  # a DTensor: each rank scales its shard


@contextlib.contextmanager
def _gradient_sync(model: nn.Module, sync: bool) -> Iterator[None]:
    """Reduce-scatter in this micro-batch's backward only if ``sync`` (the last micro-batch)."""
    model.set_requires_gradient_sync(sync)
    try:
        yield
    finally:
        model.set_requires_gradient_sync(True)


def clip_grad_norm_with_experts(params: list[torch.Tensor], max_norm: float,
                                expert_group: GroupOfRanks | dist.ProcessGroup | None,
                                tp: TensorParallel | None = None, expert_tp: TensorParallel | None = None) -> float:
    """Clip by the global norm where expert parameters (``allreduce = False``) differ across EP ranks.

    Dense shards are summed over their data-parallel mesh, and under tensor parallelism
    over TP (TP-split slices on every TP rank, TP-replicated parameters from TP rank 0);
    expert shards over their expert data-parallel mesh and then over ``expert_group``
    (the EP group, or EP x expert TP: Megatron's expert tensor-and-model-parallel
    group), expert-TP-replicated ones from expert-TP rank 0 only (``expert_tp``), so
    each parameter counts once.
    """
    if isinstance(expert_group, GroupOfRanks):
        expert_group = expert_group.group
    expert = {id(p) for p in params if not getattr(p, "allreduce", True)}
    dense = [p for p in params if id(p) not in expert]
    if tp is not None and tp.size > 1:
        dense_sq = get_grad_norm(params_for_grad_norm(dense, tp), model_parallel_group=tp.group) ** 2
    else:
        dense_sq = get_grad_norm(dense) ** 2
    experts = [p for p in params if id(p) in expert]
    if expert_tp is not None:
        experts = params_for_grad_norm(experts, expert_tp)
    expert_sq = get_grad_norm(experts, model_parallel_group=expert_group) ** 2
    norm = (dense_sq + expert_sq).sqrt()
    coef = (float(max_norm) / (norm + 1e-6)).clamp(max=1.0)  # torch's clip_grad_norm_ formula
    with torch.no_grad():
        for param in params:
            local = param.grad.to_local() if isinstance(param.grad, DTensor) else param.grad
            local.mul_(coef.to(dtype=local.dtype, device=local.device))
    return float(norm)


class _AsGrad:
    """A parameter's attributes (TP, expert, placement) with another tensor as its ``grad``: to reduce a norm
    of parameters, or of a function of gradients, exactly as the gradient norm is reduced."""

    def __init__(self, param: torch.Tensor, grad: torch.Tensor) -> None:
        self._param, self.grad = param, grad

    def __getattr__(self, name: str) -> object:
        return getattr(self._param, name)


def _zero_entries(grad: torch.Tensor) -> torch.Tensor:
    """1.0 where ``grad`` is zero, laid out as ``grad``. A DTensor's is computed on its local piece: two DTensor
    ops per parameter and step (sharding propagation each) cost more than the training step of a small model."""
    if not isinstance(grad, DTensor):
        return (grad == 0).float()
    return DTensor.from_local((grad.to_local() == 0).float(), grad.device_mesh, grad.placements, run_check=False,
                              shape=grad.shape, stride=grad.stride())


def unwrap_model(model: nn.Module) -> nn.Module:
    """The user's module under DDP / FullyShardedDataParallel / MegatronFSDP wrappers."""
    while hasattr(model, "module") and isinstance(model.module, nn.Module) and not isinstance(model, FSDPModule):
        model = model.module
    return model


def build_backend(
    args: argparse.Namespace, model_provider: Callable[..., nn.Module], device: torch.device, layout: ParallelLayout
) -> DataParallelBackend:
    """Build with ``model_provider`` (on the meta device if asked), then wrap in our FSDP, FSDP2 or DDP over
    ``layout``."""
    meta = args.use_megatron_fsdp and args.init_model_with_meta_device
    with torch.device("meta") if meta else contextlib.nullcontext():
        model = model_provider(pre_process=True, post_process=True)
    n_params = sum(p.numel() for p in model.parameters())
    # Megatron's line: this (TP rank 0) slice; the start-up summary gives the whole model's count.
    print_rank_0(f" > number of parameters on (tensor, pipeline) model parallel rank (0, 0): {n_params}")
    if args.use_torch_fsdp2:
        # fp32 sharded (main) parameters, as Megatron's optimizer keeps fp32 main copies of its bf16 model: with
        # --bf16 megatron-core builds its weights in bf16, and FSDP2's policy computes in bf16 again
        model.to(device=device, dtype=torch.float32)
        wrapped = wrap_with_torch_fsdp2(model, device, layout, bf16=args.bf16,
                                        grad_reduce_in_bf16=args.grad_reduce_in_bf16,
                                        untied=args.untie_embeddings_and_output_weights,
                                        reshard_after_forward=args.torch_fsdp2_reshard_after_forward)
        return TorchFSDP2Backend(wrapped, device, layout)
    if not args.use_megatron_fsdp:
        # fp32 weights, bf16 compute under autocast: with --bf16 megatron-core builds its weights in bf16, whose
        # matmuls against autocast's fp32 gradients fail in its backward (tensor_parallel/layers.py)
        model.to(device=device, dtype=torch.float32)
        wrapped = DDP(model, device_ids=[device.index] if device.type == "cuda" else None,
                      process_group=layout.grad_group)
        return DDPBackend(wrapped, device, layout, bf16=args.bf16)
    if args.bf16:
        model.to(torch.bfloat16)  # compute weights; fp32 main weights kept by preserve_fp32_weights
    if not meta:
        model.to(device)
    # Units: the adapter's default, megatron-core's TransformerLayer.
    # With expert parallelism, expert modules are units of their own over the expert mesh's dp_shard.
    wrapped = FullyShardedDataParallel(args, ddp_config_from_args(args), model, device_mesh=layout.mesh,
                                       expt_device_mesh=layout.expt_mesh)
    return FSDPBackend(wrapped, device, layout)
