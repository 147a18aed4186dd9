"""Global gradient norm, clipping and the NaN/Inf check over sharded gradients.

A sharded parameter's ``.grad`` is a DTensor: its local piece is summed over
the mesh dimensions it is sharded on (``RaggedShard``/``Shard`` placements)
and counted once over the dimensions it is replicated on (``Replicate``: the
``dp_outer`` replicas of HSDP, the replicated no-shard groups). So the total
is the norm of the unsharded model's gradients, whatever the strategy, and
every rank gets the same value. ``torch.nn.utils.clip_grad_norm_`` on the
sharded parameters works too (DTensor does the same bookkeeping); this one
also accepts plain tensors beside DTensors and a model, and issues one small
collective per group of like-sharded gradients.
"""

from __future__ import annotations

import math
from collections.abc import Iterable

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.placement_types import _StridedShard

from megatron_fsdp.comm.collectives import all_gather, all_reduce
from megatron_fsdp.core.module import FSDPModule

ParamsOrModel = nn.Module | torch.Tensor | Iterable[torch.Tensor]


def sharded_parameters(model: nn.Module) -> list[nn.Parameter]:
    """The parameters an optimizer steps: the sharded ones of every unit, then any not managed by one.

    Unlike ``model.parameters()`` it never returns the gathered (unsharded)
    parameters that modules hold between forward and the end of backward.
    """
    model = getattr(model, "module", model) if not isinstance(model, FSDPModule) else model
    params: dict[int, nn.Parameter] = {}
    gathered: set[int] = set()
    for module in model.modules():
        if isinstance(module, FSDPModule):
            for group in module.fsdp_unit.groups:
                params.update((id(p), p) for p in group.sharded_params)
                gathered.update(id(p) for p in group.unsharded_params)
    for param in model.parameters():
        if id(param) not in gathered:
            params.setdefault(id(param), param)
    return list(params.values())


def _params(parameters: ParamsOrModel) -> list[torch.Tensor]:
    if isinstance(parameters, nn.Module):
        return sharded_parameters(parameters)
    if isinstance(parameters, torch.Tensor):
        return [parameters]
    return list(parameters)


def _sharded_groups(grad: torch.Tensor) -> tuple[dist.ProcessGroup, ...]:
    """The process groups a gradient's local piece must be summed over (its sharded mesh dims)."""
    if not isinstance(grad, DTensor):
        return ()
    groups = []
    for dim, placement in enumerate(grad.placements):
        if placement.is_partial():
            raise ValueError("gradient norm of a Partial DTensor gradient: reduce the gradient first")
        # FSDP2's 2-D _StridedShard is a partition too; in torch 2.13 it is no Shard (is_shard() is False).
        sharded = placement.is_shard() or isinstance(placement, _StridedShard)
        if not sharded and not placement.is_replicate():
            raise ValueError(f"gradient norm of a DTensor gradient placed {placement!r} on mesh dim {dim}: "
                             "only Shard, _StridedShard and Replicate placements are summed correctly")
        if sharded and grad.device_mesh.size(dim) > 1:
            groups.append(grad.device_mesh.get_group(dim))
    return tuple(groups)


def _local(grad: torch.Tensor) -> torch.Tensor:
    return grad.to_local() if isinstance(grad, DTensor) else grad


def get_grad_norm(
    parameters: ParamsOrModel, norm_type: float = 2.0, *, model_parallel_group: dist.ProcessGroup | None = None
) -> torch.Tensor:
    """The norm of all gradients of ``parameters`` as if unsharded (a float32 scalar, equal on every rank).

    ``model_parallel_group``: with tensor/pipeline/expert parallelism each rank
    of that group holds different parameters; their contributions are summed
    over it too. As in Megatron, pass each parameter once: leave out
    duplicates (e.g. a tensor-parallel-replicated LayerNorm on every TP rank but
    the first).
    """
    norm_type = float(norm_type)
    if norm_type <= 0 and not math.isinf(norm_type):
        raise ValueError(f"norm_type={norm_type} is not valid: use a positive number or inf")
    params = list(_params(parameters))
    grads = [p.grad for p in params if p.grad is not None]
    device = _norm_device(grads, params)
    # One partial result per set of process groups: gradients sharded alike are summed together.
    partials: dict[tuple[int, ...], tuple[tuple[dist.ProcessGroup, ...], list[torch.Tensor]]] = {}
    for grad in grads:
        groups = _sharded_groups(grad)
        local = _local(grad)
        if math.isinf(norm_type):
            value = local.abs().max().float() if local.numel() else torch.zeros((), device=local.device)
        else:
            value = torch.linalg.vector_norm(local, norm_type, dtype=torch.float32) ** norm_type
        partials.setdefault(tuple(id(g) for g in groups), (groups, []))[1].append(value.to(device))
    total = torch.zeros((), dtype=torch.float32, device=device)
    for groups, values in partials.values():
        stacked = torch.stack(values)
        value = (stacked.max() if math.isinf(norm_type) else stacked.sum()).reshape(1)
        for group in groups:
            value = _reduce(value, group, maximum=math.isinf(norm_type))
        total = torch.maximum(total, value[0]) if math.isinf(norm_type) else total + value[0]
    if model_parallel_group is not None and dist.get_world_size(model_parallel_group) > 1:
        total = _reduce(total.reshape(1), model_parallel_group, maximum=math.isinf(norm_type))[0]
    return total if math.isinf(norm_type) else total ** (1.0 / norm_type)


def _norm_device(grads: list[torch.Tensor], params: list[torch.Tensor]) -> torch.device:
    """Where the partial norms are reduced: a device the process groups can communicate from.

    NCCL reduces CUDA tensors only, so under it a rank with no gradients, or with gradients
    offloaded to the host, still reduces on its GPU: the first gradient's or parameter's CUDA
    device, else the current one. Other backends reduce where the gradients are (CPU without any).
    """
    if dist.is_initialized() and "nccl" in str(dist.get_backend()) and torch.cuda.is_available():
        for tensor in (*grads, *params):
            local = _local(tensor)
            if local.is_cuda:
                return local.device
        return torch.device("cuda", torch.cuda.current_device())
    return _local(grads[0]).device if grads else torch.device("cpu")


def _reduce(value: torch.Tensor, group: dist.ProcessGroup, *, maximum: bool) -> torch.Tensor:
    if not maximum:
        all_reduce(value, group).wait()
        return value
    gathered = torch.empty(dist.get_world_size(group), dtype=value.dtype, device=value.device)
    all_gather(gathered, value, group).wait()
    return gathered.max().reshape(1)


def clip_grad_norm_(
    parameters: ParamsOrModel,
    max_norm: float,
    norm_type: float = 2.0,
    error_if_nonfinite: bool = False,
    *,
    model_parallel_group: dist.ProcessGroup | None = None,
    parameters_for_norm: ParamsOrModel | None = None,
) -> torch.Tensor:
    """Scale gradients so their global norm is at most ``max_norm``; return the norm before clipping.

    The same formula as ``torch.nn.utils.clip_grad_norm_`` (coefficient
    ``max_norm / (norm + 1e-6)`` clamped to 1), over the unsharded norm.
    ``parameters`` may be a model (``MegatronFSDP`` or a ``fully_shard``-ed
    module: its sharded parameters are used) or an iterable of parameters.
    With model parallelism pass ``model_parallel_group`` and, if some
    parameters are duplicated across it, ``parameters_for_norm`` without the
    duplicates (see ``get_grad_norm``); every parameter is still clipped.
    """
    params = _params(parameters)
    for_norm = params if parameters_for_norm is None else _params(parameters_for_norm)
    total = get_grad_norm(for_norm, norm_type, model_parallel_group=model_parallel_group)
    if error_if_nonfinite and not torch.isfinite(total):
        raise RuntimeError(
            f"the total norm of order {norm_type} of the gradients is non-finite ({total.item()}), so it cannot be "
            "clipped; pass error_if_nonfinite=False to clip anyway"
        )
    coef = (float(max_norm) / (total + 1e-6)).clamp(max=1.0)
    with torch.no_grad():
        for param in params:
            if param.grad is not None:
                local = _local(param.grad)
                local.mul_(coef.to(device=local.device, dtype=local.dtype))
    return total


def check_grads_finite(named_params: list[tuple[str, torch.Tensor]]) -> None:
    """Raise on every rank, naming them, if any parameter's gradient holds NaN or Inf on any rank.

    Each rank checks its own pieces; one all-reduce of a per-parameter count
    (over every mesh dimension the gradients live on) tells all ranks which
    parameters are bad, so the error is raised symmetrically (no hang).
    """
    grads = [(name, p.grad) for name, p in named_params]
    device = next((_local(g).device for _, g in grads if g is not None), torch.device("cpu"))
    # Flags stay on the device until after the all-reduce: one host sync per check, not one per parameter.
    zero = torch.zeros((), device=device)
    flags = [zero if g is None else (~torch.isfinite(_local(g))).any().to(device) for _, g in grads]
    bad = torch.stack(flags).float() if flags else zero.reshape(0)
    groups: dict[int, dist.ProcessGroup] = {}
    for _, grad in grads:
        if isinstance(grad, DTensor):
            for dim in range(grad.device_mesh.ndim):
                group = grad.device_mesh.get_group(dim)
                groups.setdefault(id(group), group)
    if not groups and dist.is_initialized():
        groups[0] = dist.group.WORLD
    if bad.numel():
        for group in groups.values():
            all_reduce(bad, group).wait()
    names = [name for (name, _), count in zip(grads, bad.tolist()) if count > 0]
    if names:
        raise RuntimeError(
            f"non-finite gradients (NaN or Inf) after reduction in {len(names)} parameter(s): {', '.join(names)}"
        )
