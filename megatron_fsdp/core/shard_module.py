"""``shard_module``: the per-module ``fully_shard``, FSDP2-shaped (the one engine).

Apply it bottom-up: to each block, then to the root. A unit owns the
parameters of its module's subtree that no already-sharded descendant owns.
"""

from __future__ import annotations

import dataclasses
import weakref

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import OffloadPolicy

from megatron_fsdp.core import step_guard
from megatron_fsdp.core.grad_scaling import resolve_grad_scaling
from megatron_fsdp.core.lookup import units_of
from megatron_fsdp.core.meta_init import META_BUFFERS
from megatron_fsdp.core.mixed_precision import MixedPrecisionPolicy
from megatron_fsdp.core.module import FSDPModule, make_fsdp_module
from megatron_fsdp.core.offload import resolve_offload_policy
from megatron_fsdp.core.options import EngineOptions, resolve_options
from megatron_fsdp.core.param_group import ParamGroup, ParamRef
from megatron_fsdp.core.post_forward_shard import check_post_forward_size, post_forward_mesh
from megatron_fsdp.core.unit import FSDPUnit
from megatron_fsdp.core.validation import (
    check_optional_name,
    check_reshard_after_forward,
    check_same_across_ranks,
    param_signature,
)
from megatron_fsdp.sharding.mesh import OUTER_STRATEGIES, resolve_mesh, resolve_outer_strategy
from megatron_fsdp.sharding.no_shard import is_marked_no_shard
from megatron_fsdp.sharding.strategy import STRATEGIES, ShardingPlan, resolve_strategy


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


def _validate_params(module: nn.Module, refs: list[ParamRef]) -> None:
    name = type(module).__name__
    devices = {ref.param.device for ref in refs}
    if len(devices) > 1:
        detail = ", ".join(f"'{r.fqn}' on {r.param.device}" for r in refs)
        raise ValueError(
            f"fully_shard({name}): parameters are on mixed devices ({detail}); move the module to one device first"
        )


def shard_module(
    module: nn.Module,
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
) -> nn.Module:
    """The per-module ``fully_shard``: shard ``module``'s parameters and make it an ``FSDPModule``.

    ``megatron_fsdp.fully_shard`` documents the arguments; it calls this unless its
    arguments select the whole-model form. Returns ``module``.
    """
    _require_distributed()
    if not isinstance(module, nn.Module):
        raise TypeError(f"fully_shard expects an nn.Module, got {type(module).__name__}")
    if isinstance(module, FSDPModule):
        raise ValueError(f"fully_shard was already applied to this {type(module).__name__}; apply it once per module")
    resolved = resolve_options(options)
    for child in units_of(module):  # before anything changes: the units under it take its options
        child.check_enclosing_options(resolved, f"fully_shard({type(module).__name__}, options=...)")
    plan = resolve_strategy(sharding_strategy)
    reshard_after_forward = check_reshard_after_forward(reshard_after_forward, allow_int=True)
    offload = resolve_offload_policy(offload_policy)
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
        if offload is not None:
            raise NotImplementedError(
                "offload_policy=CPUOffloadPolicy() with outer_sharding_strategy='optim' is not supported; "
                "use outer_sharding_strategy='no_shard' or offload_policy=None"
            )
    post_forward = None
    if not isinstance(reshard_after_forward, bool):
        # N == dp_shard size is True; N == 1 keeps a full copy, as False does (core/post_forward_shard.py).
        check_post_forward_size(reshard_after_forward, dp_mesh.shard_size)
        if plan.params and 1 < reshard_after_forward < dp_mesh.shard_size:
            post_forward = post_forward_mesh(dp_mesh.shard_group, reshard_after_forward)
        reshard_after_forward = reshard_after_forward > 1
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

    unit = FSDPUnit(module, plan, reshard_after_forward, scaling, mp_policy, options)
    by_kind: dict[tuple[torch.dtype, bool, bool], list[ParamRef]] = {}
    for ref in refs:
        by_kind.setdefault((ref.param.dtype, ref.param.requires_grad, ref.replicated), []).append(ref)
    unit.groups = [
        ParamGroup(
            group, dp_mesh, STRATEGIES["no_shard"] if replicated else plan, device, unit.on_grads_ready, mp_policy,
            comm=unit.comm, pool=unit.pool, spares=unit.spares, offload=offload,
            post_forward=None if replicated else post_forward,
        )
        for (_, _, replicated), group in by_kind.items()
    ]
    for group in unit.groups:  # lets optimizer wrappers and grad-norm code find the engine from a parameter
        for param in group.sharded_params:
            param._megatron_fsdp_unit = weakref.ref(unit)
    for child in units_of(module):  # the units already under it run with its options (core/options.py)
        child.adopt(unit)
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
