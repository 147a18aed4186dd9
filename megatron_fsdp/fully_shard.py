"""``fully_shard``: the public entry point, per-module or whole-model by its arguments.

It sits above both forms so that neither imports the other: the per-module
engine (``core.shard_module``) knows nothing of the whole-model API
(``api.fully_shard_model``), which is built on the engine.
"""

from __future__ import annotations

import difflib
import functools
import inspect
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from megatron_fsdp.api.fully_shard_model import FULLY_SHARD_MODEL_OPTIONS, fully_shard_whole_model
from megatron_fsdp.core.lookup import UNIT_ATTR
from megatron_fsdp.core.mixed_precision import MixedPrecisionPolicy, resolve_mp_policy
from megatron_fsdp.core.options import EngineOptions
from megatron_fsdp.core.shard_module import shard_module
from megatron_fsdp.optim import plain_local_step
from megatron_fsdp.sharding.strategy import ShardingPlan

if TYPE_CHECKING:  # torch's FSDP2 classes are looked up lazily (core/fsdp2_classes.py)
    from torch.distributed.fsdp import MixedPrecisionPolicy as TorchMixedPrecisionPolicy
    from torch.distributed.fsdp import OffloadPolicy

# Per-module keywords that have no meaning in the whole-model form.
_PER_MODULE_ONLY = ("ignored_params", "shard_placement_fn", "dp_mesh_dims")


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
    module: nn.Module | list[nn.Module],
    optimizer: torch.optim.Optimizer | None = None,
    *,
    mesh: DeviceMesh | None = None,
    sharding_strategy: str | int | ShardingPlan = "optim_grads_params",
    reshard_after_forward: bool | int | None = None,
    gradient_scaling: str | float = "mean",
    outer_sharding_strategy: str = "no_shard",
    dp_shard_dim: str | None = None,
    dp_outer_dim: str | None = None,
    mp_policy: MixedPrecisionPolicy | TorchMixedPrecisionPolicy | None = None,
    options: EngineOptions | None = None,
    offload_policy: OffloadPolicy | None = None,
    ignored_params: set[nn.Parameter] | None = None,
    shard_placement_fn: Callable[[nn.Parameter], Any] | None = None,
    dp_mesh_dims: Any = None,
    **whole_model_options: Any,
) -> nn.Module | list[nn.Module] | tuple[nn.Module, torch.optim.Optimizer | None]:
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
        module: the module to shard; its class becomes ``FSDP<Class>``. A list of
            modules (FSDP2's ``fully_shard([block.attn, block.mlp])``) makes their
            parameters one unit: gathered before whichever runs first in forward,
            resharded after the last; each module's class becomes ``FSDP<Class>``.
        mesh: a 1-D ``DeviceMesh`` (default: every rank; CUDA under NCCL, else CPU),
            a 2-D ``(dp_outer, dp_shard)`` mesh for HSDP, or any named mesh with
            ``dp_shard_dim``/``dp_outer_dim`` naming its data-parallel dimensions.
            A module already parallelized with torch-native TP (``parallelize_module(block,
            mesh["tp"], plan)``) takes the data-parallel sub-mesh, ``mesh["dp"]``; its sharded
            parameters are DTensors over ``(tp, dp)`` (docs/parallelism.md).
        sharding_strategy: ``"no_shard"``, ``"optim"`` (ZeRO-1), ``"optim_grads"``
            (ZeRO-2) or ``"optim_grads_params"`` (ZeRO-3), or a ZeRO stage 0-3.
        reshard_after_forward: ZeRO-3 only: free the gathered weights after
            forward and gather again for backward (the root unit never does).
            True, False, None (FSDP2's default: True for non-root units, False
            for the root, which is what True does here), or an int N dividing the
            ``dp_shard`` size (FSDP2's form): keep 1/N of the weights after forward
            and all-gather within groups of N consecutive ranks in backward (N ==
            size: True; 1: False); anything else TypeError.
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
            communication dtypes, output and input casts), or PyTorch's
            ``torch.distributed.fsdp.MixedPrecisionPolicy`` with FSDP2's meaning
            (``MixedPrecisionPolicy.from_fsdp2``); default: every parameter keeps its dtype.
        options: ``EngineOptions`` (buffer pool, gloo fast paths, CUDA side streams,
            reductions in flight, prefetch depth); default ``EngineOptions()``. The
            units already under ``module`` take these (every unit runs with its
            root's); one given different options in a root field raises ValueError.
        offload_policy: torch's ``CPUOffloadPolicy(pin_memory=...)``: sharded main
            weights, their gradients and the optimizer step on the host, each
            unit's shard copied to the device per all-gather; ``OffloadPolicy()``
            or None: no offload (docs/api.md).
        ignored_params: FSDP2's: parameters this unit leaves alone: not sharded, not
            moved, their gradients not reduced (each rank keeps its own).
        shard_placement_fn: FSDP2's: ``None``, or a function returning ``None`` or
            ``Shard(0)`` for every parameter (our row layout is dim-0 sharding);
            another placement raises NotImplementedError naming the parameter.
        dp_mesh_dims: torch 2.13's ``DataParallelMeshDims(shard=, replicate=)``:
            the same as ``dp_shard_dim=``/``dp_outer_dim=`` (one name each).

    Every data-parallel rank must pass the same module: one all-reduce of a
    fingerprint of its parameters checks it (``validation``). A module whose
    parameters are all replicated (0-dim or ``fsdp_no_shard``) becomes a unit
    with the ``no_shard`` plan, so its gradients are all-reduced.

    Returns:
        ``module`` itself (the list, for a list), whose ``parameters()`` are now
        sharded DTensors, as FSDP2.
    """
    if optimizer is not None or whole_model_options:
        _check_per_module_keywords(optimizer, whole_model_options)
        given = dict(ignored_params=ignored_params, shard_placement_fn=shard_placement_fn, dp_mesh_dims=dp_mesh_dims)
        for name in _PER_MODULE_ONLY:
            if given[name] is not None:
                raise TypeError(
                    f"fully_shard(model, optimizer, ...) is the whole-model form, which takes fully_shard_model's "
                    f"options; {name}= belongs to the per-module form"
                )
        per_module = dict(mesh=mesh, sharding_strategy=sharding_strategy,
                          reshard_after_forward=True if reshard_after_forward is None else reshard_after_forward,
                          gradient_scaling=gradient_scaling, outer_sharding_strategy=outer_sharding_strategy,
                          mp_policy=resolve_mp_policy(mp_policy), options=options, offload_policy=offload_policy)
        return fully_shard_whole_model(module, optimizer, per_module, dp_shard_dim=dp_shard_dim,
                                       dp_outer_dim=dp_outer_dim, **whole_model_options)
    plain_local_step.enable()  # plain torch optimizers over our parameters step on the local shards
    return shard_module(module, mesh=mesh, sharding_strategy=sharding_strategy,
                        reshard_after_forward=reshard_after_forward, gradient_scaling=gradient_scaling,
                        outer_sharding_strategy=outer_sharding_strategy, dp_shard_dim=dp_shard_dim,
                        dp_outer_dim=dp_outer_dim, mp_policy=mp_policy, options=options,
                        offload_policy=offload_policy, ignored_params=ignored_params,
                        shard_placement_fn=shard_placement_fn, dp_mesh_dims=dp_mesh_dims)


def _state(module: nn.Module) -> Any:
    """``fully_shard.state(module)``, as FSDP2's: the module's runtime state (our ``FSDPUnit``), or
    ``None`` where ``fully_shard`` was not applied to it."""
    return module.__dict__.get(UNIT_ATTR)


fully_shard.state = _state  # type: ignore[attr-defined]
