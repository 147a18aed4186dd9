"""``fully_shard``: the per-module API, FSDP2-shaped (the one engine).

Apply it bottom-up: to each block, then to the root. A unit owns the
parameters of its module's subtree that no already-sharded descendant owns.
"""

from __future__ import annotations

import dataclasses
import difflib
import functools
import inspect
import weakref
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from . import step_guard
from .grad_scaling import resolve_grad_scaling
from .init import META_BUFFERS
from .mesh import OUTER_STRATEGIES, resolve_mesh, resolve_outer_strategy
from .mixed_precision import MixedPrecisionPolicy
from .module import FSDPModule, make_fsdp_module
from .no_shard import is_marked_no_shard
from .param_group import ParamGroup, ParamRef
from .strategy import STRATEGIES, ShardingPlan, resolve_strategy
from .unit import FSDPUnit
from .validation import check_optional_name, check_reshard_after_forward, check_same_across_ranks, param_signature


def default_mesh() -> DeviceMesh:
    """A 1-D mesh over all ranks: CUDA when the default backend is NCCL, else CPU."""
    _require_distributed()
    backend = dist.get_backend()
    device_type = "cuda" if "nccl" in str(backend) and torch.cuda.is_available() else "cpu"
    return init_device_mesh(device_type, (dist.get_world_size(),))


def _require_distributed() -> None:
    if not dist.is_available() or not dist.is_initialized():
        raise RuntimeError(
            "fully_shard needs torch.distributed: call torch.distributed.init_process_group() "
            "first (e.g. run under torchrun), even for a single process"
        )


def mesh_device(mesh: DeviceMesh) -> torch.device:
    if mesh.device_type == "cuda":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device(mesh.device_type)


def _collect_params(module: nn.Module) -> list[ParamRef]:
    """Parameters of ``module``'s subtree not owned by a sharded descendant, in order."""
    refs: dict[int, ParamRef] = {}
    seen_modules: set[int] = set()
    stack: list[tuple[str, nn.Module]] = [("", module)]
    while stack:
        prefix, mod = stack.pop()
        if id(mod) in seen_modules:
            continue
        seen_modules.add(id(mod))
        for name, param in mod._parameters.items():
            if param is None:
                continue
            fqn = f"{prefix}{name}"
            if getattr(param, "_megatron_fsdp_sharded", False) or getattr(param, "_megatron_fsdp_managed", False):
                raise ValueError(
                    f"parameter '{fqn}' is already sharded by another fully_shard unit (it is "
                    "shared with a module outside that unit); apply fully_shard to a common "
                    "ancestor of every module that uses it instead"
                )
            ref = refs.setdefault(id(param), ParamRef(param))
            ref.uses.append((mod, name))
            ref.fqns.append(fqn)
            # 0-dim parameters have no rows to shard: they stay replicated.
            ref.replicated |= is_marked_no_shard(mod, param) or param.dim() == 0
        children = [(f"{prefix}{n}.", c) for n, c in mod._modules.items() if c is not None]
        for child_prefix, child in reversed(children):
            if not isinstance(child, FSDPModule):
                stack.append((child_prefix, child))
    return list(refs.values())


@functools.cache
def _whole_model_keywords() -> frozenset[str]:
    """Keywords that select the whole-model form: ``fully_shard_model``'s own options."""
    from .fully_shard_model import FULLY_SHARD_MODEL_OPTIONS

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


def _validate_params(module: nn.Module, refs: list[ParamRef]) -> None:
    name = type(module).__name__
    devices = {ref.param.device for ref in refs}
    if len(devices) > 1:
        detail = ", ".join(f"'{r.fqn}' on {r.param.device}" for r in refs)
        raise ValueError(
            f"fully_shard({name}): parameters are on mixed devices ({detail}); move the module to one device first"
        )


def fully_shard(
    module: nn.Module,
    optimizer: torch.optim.Optimizer | None = None,
    *,
    mesh: DeviceMesh | None = None,
    sharding_strategy: str | int | ShardingPlan = "optim_grads_params",
    reshard_after_forward: bool = True,
    gradient_scaling: str | float = "mean",
    outer_sharding_strategy: str = "no_shard",
    dp_shard_dim: str | None = None,
    dp_outer_dim: str | None = None,
    mp_policy: MixedPrecisionPolicy | None = None,
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
      ``megatron_fsdp.fully_shard_model.fully_shard_whole_model``.

    Args:
        module: the module to shard; its class becomes ``FSDP<Class>``.
        mesh: a 1-D ``DeviceMesh`` (default: every rank; CUDA under NCCL, else CPU),
            a 2-D ``(dp_outer, dp_shard)`` mesh for HSDP, or any named mesh with
            ``dp_shard_dim``/``dp_outer_dim`` naming its data-parallel dimensions.
        sharding_strategy: ``"no_shard"``, ``"optim"`` (ZeRO-1), ``"optim_grads"``
            (ZeRO-2) or ``"optim_grads_params"`` (ZeRO-3), or a ZeRO stage 0-3.
        reshard_after_forward: ZeRO-3 only: free the gathered weights after
            forward and gather again for backward (the root unit never does).
            True or False; an int (FSDP2's smaller-group reshard) raises
            NotImplementedError, anything else TypeError.
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

    Every data-parallel rank must pass the same module: one all-reduce of a
    fingerprint of its parameters checks it (``validation``). A module whose
    parameters are all replicated (0-dim or ``fsdp_no_shard``) becomes a unit
    with the ``no_shard`` plan, so its gradients are all-reduced.

    Returns:
        ``module`` itself, whose ``parameters()`` are now sharded DTensors.
    """
    if optimizer is not None or whole_model_options:
        _check_per_module_keywords(optimizer, whole_model_options)
        from .fully_shard_model import fully_shard_whole_model

        per_module = dict(mesh=mesh, sharding_strategy=sharding_strategy, reshard_after_forward=reshard_after_forward,
                          gradient_scaling=gradient_scaling, outer_sharding_strategy=outer_sharding_strategy,
                          mp_policy=mp_policy)
        return fully_shard_whole_model(module, optimizer, per_module, dp_shard_dim=dp_shard_dim,
                                       dp_outer_dim=dp_outer_dim, **whole_model_options)
    _require_distributed()
    if not isinstance(module, nn.Module):
        raise TypeError(f"fully_shard expects an nn.Module, got {type(module).__name__}")
    if isinstance(module, FSDPModule):
        raise ValueError(f"fully_shard was already applied to this {type(module).__name__}; apply it once per module")
    plan = resolve_strategy(sharding_strategy)
    reshard_after_forward = check_reshard_after_forward(reshard_after_forward)
    scaling = resolve_grad_scaling(gradient_scaling)
    if mp_policy is not None and not isinstance(mp_policy, MixedPrecisionPolicy):
        raise TypeError(f"mp_policy must be a megatron_fsdp.MixedPrecisionPolicy, got {type(mp_policy).__name__}")
    if not isinstance(outer_sharding_strategy, str):
        raise TypeError(
            f"outer_sharding_strategy must be one of {OUTER_STRATEGIES} (a str), got {outer_sharding_strategy!r}"
        )
    check_optional_name("dp_shard_dim", dp_shard_dim)
    check_optional_name("dp_outer_dim", dp_outer_dim)
    mesh = default_mesh() if mesh is None else mesh
    dp_mesh = resolve_mesh(mesh, dp_shard_dim, dp_outer_dim)
    if resolve_outer_strategy(outer_sharding_strategy, dp_mesh) == "optim":
        if not plan.grads:
            raise ValueError(
                f"outer_sharding_strategy='optim' needs sharding_strategy 'optim_grads' or 'optim_grads_params' "
                f"(gradients sharded within dp_shard), got sharding_strategy={plan.name!r}; or use "
                "outer_sharding_strategy='no_shard'"
            )
        dp_mesh = dataclasses.replace(dp_mesh, outer_optim=True)
    refs = _collect_params(module)
    _validate_params(module, refs)
    device = mesh_device(dp_mesh.mesh)
    groups = [dp_mesh.shard_group] + ([dp_mesh.outer_group] if dp_mesh.has_outer else [])
    signatures = [param_signature(ref.fqn, ref.param, ref.replicated) for ref in refs]
    check_same_across_ranks(type(module).__name__, signatures, groups, device)
    if refs and all(ref.replicated for ref in refs):
        # Only replicated (0-dim or fsdp_no_shard) parameters: still a unit, so their
        # gradients are all-reduced like DDP's; nothing to gather or shard.
        plan = STRATEGIES["no_shard"]

    unit = FSDPUnit(module, plan, reshard_after_forward, scaling, mp_policy)
    by_kind: dict[tuple[torch.dtype, bool, bool], list[ParamRef]] = {}
    for ref in refs:
        by_kind.setdefault((ref.param.dtype, ref.param.requires_grad, ref.replicated), []).append(ref)
    unit.groups = [
        ParamGroup(
            group, dp_mesh, STRATEGIES["no_shard"] if replicated else plan, device, unit.on_grads_ready, mp_policy
        )
        for (_, _, replicated), group in by_kind.items()
    ]
    for group in unit.groups:  # lets optimizer wrappers and grad-norm code find the engine from a parameter
        for param in group.sharded_params:
            param._megatron_fsdp_unit = weakref.ref(unit)
    _move_buffers(module, device)
    step_guard.watch(unit)
    module.register_state_dict_pre_hook(unit.release_before_state_dict)
    module.register_load_state_dict_pre_hook(unit.prepare_state_dict_for_load)
    return make_fsdp_module(module, unit)


def _move_buffers(module: nn.Module, device: torch.device) -> None:
    for mod in module.modules():
        for name, buf in mod._buffers.items():
            if buf is None or buf.device == device:
                continue
            if buf.is_meta:
                # Storage now, values from materialize_meta (the module's reset_parameters).
                mod._buffers[name] = torch.empty_like(buf, device=device)
                mod.__dict__.setdefault(META_BUFFERS, []).append(name)
            else:
                mod._buffers[name] = buf.to(device)
