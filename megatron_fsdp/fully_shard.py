"""``fully_shard``: the public entry point, per-module or whole-model by its arguments.

It sits above both forms so that neither imports the other: the per-module
engine (``core.shard_module``) knows nothing of the whole-model API
(``api.fully_shard_model``), which is built on the engine.
"""

from __future__ import annotations

import difflib
import functools
import inspect
from typing import Any

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import OffloadPolicy

from megatron_fsdp.api.fully_shard_model import FULLY_SHARD_MODEL_OPTIONS, fully_shard_whole_model
from megatron_fsdp.core.mixed_precision import MixedPrecisionPolicy
from megatron_fsdp.core.options import EngineOptions
from megatron_fsdp.core.shard_module import shard_module
from megatron_fsdp.sharding.strategy import ShardingPlan


@functools.cache
def _whole_model_keywords() -> frozenset[str]:
    """Keywords that select the whole-model form: ``fully_shard_model``'s own options."""
    per_module = set(inspect.signature(fully_shard).parameters)
    return frozenset(name for name in FULLY_SHARD_MODEL_OPTIONS if name not in per_module)


def _check_per_module_keywords(optimizer: Any, options: dict[str, Any]) -> None:
    """Without an optimizer, only whole-model keywords may select the whole-model form."""
    if optimizer is not None:
        return  # the whole-model form: it names the options it does not know
    whole_model = _whole_model_keywords()
    unknown = [name for name in options if name not in whole_model]
    if not unknown:
        return
    per_module = [n for n, p in inspect.signature(fully_shard).parameters.items()
                  if p.kind is p.KEYWORD_ONLY]
    parts = []
    for name in unknown:
        close = difflib.get_close_matches(name, per_module + sorted(whole_model), n=1)
        parts.append(repr(name) + (f" (did you mean {close[0]!r}?)" if close else ""))
    raise TypeError(
        f"fully_shard(module, ...) got unknown keyword argument(s) {', '.join(parts)}; the per-module form takes "
        f"{', '.join(per_module)}; an optimizer as second argument or a fully_shard_model option "
        f"({', '.join(sorted(whole_model))}) selects the whole-model form"
    )


def fully_shard(
    module: nn.Module,
    optimizer: torch.optim.Optimizer | None = None,
    *,
    mesh: DeviceMesh | None = None,
    sharding_strategy: str | int | ShardingPlan = "optim_grads_params",
    reshard_after_forward: bool | int = True,
    gradient_scaling: str | float = "mean",
    outer_sharding_strategy: str = "no_shard",
    dp_shard_dim: str | None = None,
    dp_outer_dim: str | None = None,
    mp_policy: MixedPrecisionPolicy | None = None,
    options: EngineOptions | None = None,
    offload_policy: OffloadPolicy | None = None,
    **whole_model_options: Any,
) -> nn.Module | tuple[nn.Module, torch.optim.Optimizer | None]:
    """Shard ``module``'s parameters over ``mesh`` and make it an ``FSDPModule``.

    Two forms, told apart by the arguments (docs/whole_model_api.md):

    - per-module (this docstring): ``fully_shard(block, mesh=...)`` bottom-up,
      then the root; returns ``module``;
    - whole-model (Megatron-FSDP's one-liner): an optimizer as second argument
      or any ``fully_shard_model`` option (``fsdp_unit_modules=``,
      ``device_mesh=``, ``zero_dp_strategy=`` ...) makes it
      ``model, optimizer = fully_shard(model, optimizer, **options)``: see
      ``megatron_fsdp.api.fully_shard_model.fully_shard_whole_model``.

    Args:
        module: the module to shard; its class becomes ``FSDP<Class>``.
        mesh: a 1-D ``DeviceMesh`` (default: every rank; CUDA under NCCL, else CPU),
            a 2-D ``(dp_outer, dp_shard)`` mesh for HSDP, or any named mesh with
            ``dp_shard_dim``/``dp_outer_dim`` naming its data-parallel dimensions.
        sharding_strategy: ``"no_shard"``, ``"optim"`` (ZeRO-1), ``"optim_grads"``
            (ZeRO-2) or ``"optim_grads_params"`` (ZeRO-3), or a ZeRO stage 0-3.
        reshard_after_forward: ZeRO-3 only: free the gathered weights after
            forward and gather again for backward (the root unit never does).
            True, False, or an int N dividing the ``dp_shard`` size (FSDP2's
            form): keep 1/N of the weights after forward and all-gather within
            groups of N consecutive ranks in backward (N == size: True; 1: False).
        gradient_scaling: ``"mean"`` (average over data-parallel ranks, like DDP),
            ``"sum"`` (per-token losses normalised by the training loop), or a
            positive number every rank's gradient is multiplied by before summing.
        outer_sharding_strategy: HSDP only: ``"no_shard"`` replicates across the
            outer dimension (gradients all-reduced over it after the inner
            reduce-scatter); ``"optim"`` also splits main weights, gradients and
            optimizer state across it (model weights stay sharded within
            ``dp_shard``; needs ``optim_grads`` or ``optim_grads_params``).
        dp_shard_dim, dp_outer_dim: names of the mesh dimensions that shard and
            replicate, for meshes with more (e.g. ``tp``) dimensions.
        mp_policy: a ``MixedPrecisionPolicy`` (compute, main-weight, gradient and
            communication dtypes); default: every parameter keeps its dtype.
        options: ``EngineOptions`` (buffer pool, gloo fast paths, CUDA side streams,
            reductions in flight, prefetch depth); default ``EngineOptions()``. The
            units already under ``module`` take these (every unit runs with its
            root's); one given different options in a root field raises ValueError.
        offload_policy: torch's ``CPUOffloadPolicy(pin_memory=...)``: sharded main
            weights, their gradients and the optimizer step on the host, each
            unit's shard copied to the device per all-gather; ``OffloadPolicy()``
            or None: no offload (docs/api.md).

    Every data-parallel rank must pass the same module: one all-reduce of a
    fingerprint of its parameters checks it (``validation``). A module whose
    parameters are all replicated (0-dim or ``fsdp_no_shard``) becomes a unit
    with the ``no_shard`` plan, so its gradients are all-reduced.

    Returns:
        ``module`` itself, whose ``parameters()`` are now sharded DTensors.
    """
    if optimizer is not None or whole_model_options:
        _check_per_module_keywords(optimizer, whole_model_options)
        per_module = dict(mesh=mesh, sharding_strategy=sharding_strategy, reshard_after_forward=reshard_after_forward,
                          gradient_scaling=gradient_scaling, outer_sharding_strategy=outer_sharding_strategy,
                          mp_policy=mp_policy, options=options, offload_policy=offload_policy)
        return fully_shard_whole_model(module, optimizer, per_module, dp_shard_dim=dp_shard_dim,
                                       dp_outer_dim=dp_outer_dim, **whole_model_options)
    return shard_module(module, mesh=mesh, sharding_strategy=sharding_strategy,
                        reshard_after_forward=reshard_after_forward, gradient_scaling=gradient_scaling,
                        outer_sharding_strategy=outer_sharding_strategy, dp_shard_dim=dp_shard_dim,
                        dp_outer_dim=dp_outer_dim, mp_policy=mp_policy, options=options,
                        offload_policy=offload_policy)
