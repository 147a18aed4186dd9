"""``shard_module``: the per-module ``fully_shard``, FSDP2-shaped (the one engine).

Apply it bottom-up: to each block, then to the root. A unit owns the
parameters of its module's subtree that no already-sharded descendant owns.
"""

from __future__ import annotations

import dataclasses
import weakref
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from megatron_fsdp.core import step_guard
from megatron_fsdp.core.fsdp_param import ParamRef, gather_extension
from megatron_fsdp.core.grad_scaling import resolve_grad_scaling
from megatron_fsdp.core.lookup import units_of
from megatron_fsdp.core.meta_init import META_BUFFERS
from megatron_fsdp.core.mixed_precision import MixedPrecisionPolicy, resolve_mp_policy
from megatron_fsdp.core.module import FSDPModule, make_fsdp_module
from megatron_fsdp.core.offload import resolve_offload_policy
from megatron_fsdp.core.options import EngineOptions, resolve_options
from megatron_fsdp.core.param_group import ParamGroup, flat_alignment
from megatron_fsdp.core.post_forward_shard import check_post_forward_size, post_forward_mesh
from megatron_fsdp.core.unit import FSDPUnit
from megatron_fsdp.core.validation import (
    check_ignored_params,
    check_optional_name,
    check_same_across_ranks,
    check_shard_placement,
    param_signature,
    resolve_dp_mesh_dims,
    resolve_reshard_after_forward,
)
from megatron_fsdp.sharding.layout import partition_for_padding
from megatron_fsdp.sharding.mesh import OUTER_STRATEGIES, DataParallelMesh, resolve_mesh, resolve_outer_strategy
from megatron_fsdp.sharding.no_shard import is_marked_no_shard
from megatron_fsdp.sharding.strategy import STRATEGIES, ShardingPlan, resolve_strategy
from megatron_fsdp.sharding.tensor_parallel import check_dp_mesh_for_tp, tensor_parallel_spec

if TYPE_CHECKING:
    from torch.distributed.fsdp import OffloadPolicy


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


def mesh_device(mesh: DeviceMesh, device: torch.device | str | None = None) -> torch.device:
    """Where a unit's shards, gathered weights and gradient buffers live.

    ``device`` (the whole-model API's ``device=``) when given, index included (``"cuda:1"``); it must
    be of the mesh's device type. Otherwise, or without an index, the current device of the mesh's
    type, as FSDP2 does (``torch.cuda.set_device`` picks it).
    """
    if device is not None:
        device = torch.device(device)
        if device.type != mesh.device_type:
            raise ValueError(f"device={str(device)!r} does not match the mesh's device type {mesh.device_type!r}; "
                             "shards live on the mesh's device")
        if device.index is not None or device.type != "cuda":
            return device
    if mesh.device_type == "cuda":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device(mesh.device_type)


def _collect_params(modules: list[nn.Module], ignored: set[int], prefixes: list[str]) -> list[ParamRef]:
    """Parameters of the modules' subtrees not owned by a sharded descendant nor ignored, in order.

    ``prefixes`` name each module in messages (``""`` for a single module).
    """
    refs: dict[int, ParamRef] = {}
    seen_modules: set[int] = set()
    stack: list[tuple[str, nn.Module]] = list(reversed(list(zip(prefixes, modules))))
    while stack:
        prefix, mod = stack.pop()
        if id(mod) in seen_modules:
            continue
        seen_modules.add(id(mod))
        for name, param in mod._parameters.items():
            if param is None or id(param) in ignored:
                continue
            fqn = f"{prefix}{name}"
            if getattr(param, "_megatron_fsdp_sharded", False) or getattr(param, "_megatron_fsdp_managed", False):
                raise ValueError(
                    f"parameter '{fqn}' is already sharded by another fully_shard unit (it is "
                    "shared with a module outside that unit); apply fully_shard to a common "
                    "ancestor of every module that uses it instead, or to all of them as one unit "
                    "with the list form fully_shard([module_a, module_b])"
                )
            ref = refs.setdefault(id(param), ParamRef(param, tp=tensor_parallel_spec(fqn, param)))
            ref.uses.append((mod, name))
            ref.fqns.append(fqn)
            # 0-dim parameters have no rows to shard: they stay replicated.
            ref.replicated |= is_marked_no_shard(mod, param) or param.dim() == 0
        children = [(f"{prefix}{n}.", c) for n, c in mod._modules.items() if c is not None]
        for child_prefix, child in reversed(children):
            if not isinstance(child, FSDPModule):
                stack.append((child_prefix, child))
    return list(refs.values())


def _validate_params(name: str, refs: list[ParamRef]) -> None:
    devices = {ref.param.device for ref in refs}
    if len(devices) > 1:
        detail = ", ".join(f"'{r.fqn}' on {r.param.device}" for r in refs)
        raise ValueError(
            f"fully_shard({name}): parameters are on mixed devices ({detail}); move the module to one device first"
        )


def _root_modules(module: nn.Module | list[nn.Module] | tuple[nn.Module, ...]) -> list[nn.Module]:
    """The module, or the modules of a list that no other listed module contains (FSDP2's root modules)."""
    if isinstance(module, nn.Module):
        modules = [module]
    elif isinstance(module, (list, tuple)):
        if not module:
            raise ValueError("fully_shard got an empty list of modules; pass at least one nn.Module")
        for i, mod in enumerate(module):
            if not isinstance(mod, nn.Module):
                raise TypeError(f"fully_shard: modules[{i}] is a {type(mod).__name__}, not an nn.Module")
        modules = list({id(m): m for m in module}.values())
        contained = {id(sub) for m in modules for sub in m.modules() if sub is not m}
        modules = [m for m in modules if id(m) not in contained]
    else:
        raise TypeError(
            f"fully_shard expects an nn.Module or a list of nn.Module (one unit), got {type(module).__name__}"
        )
    for mod in modules:
        if isinstance(mod, FSDPModule):
            raise ValueError(
                f"fully_shard was already applied to this {type(mod).__name__}; apply it once per module"
            )
        if isinstance(mod, (nn.ModuleList, nn.ModuleDict)) and type(mod).forward is nn.Module.forward:
            raise ValueError(
                f"fully_shard does not take a {type(mod).__name__} (a container without forward, whose hooks "
                "never run): shard its members, or pass them as a list to make them one unit"
            )
    return modules


def shard_module(
    module: nn.Module | list[nn.Module],
    *,
    mesh: DeviceMesh | None = None,
    sharding_strategy: str | int | ShardingPlan = "optim_grads_params",
    reshard_after_forward: bool | int | None = True,
    gradient_scaling: str | float = "mean",
    outer_sharding_strategy: str = "no_shard",
    dp_shard_dim: str | None = None,
    dp_outer_dim: str | None = None,
    mp_policy: Any = None,
    options: EngineOptions | None = None,
    offload_policy: OffloadPolicy | None = None,
    ignored_params: set[nn.Parameter] | None = None,
    shard_placement_fn: Callable[[nn.Parameter], Any] | None = None,
    dp_mesh_dims: Any = None,
    device: torch.device | str | None = None,
) -> nn.Module | list[nn.Module]:
    """The per-module ``fully_shard``: shard ``module``'s parameters and make it an ``FSDPModule``.

    ``megatron_fsdp.fully_shard`` documents the arguments; it calls this unless its
    arguments select the whole-model form. ``module`` may be a list of modules whose
    parameters form one unit (FSDP2's ``fully_shard([a, b])``): each becomes an
    ``FSDPModule`` of that one unit. Returns ``module`` (the list, for a list).
    ``device``: where the unit lives (``mesh_device``); the whole-model API passes its ``device=``.
    """
    _require_distributed()
    modules = _root_modules(module)
    label = type(modules[0]).__name__ if len(modules) == 1 else f"[{', '.join(type(m).__name__ for m in modules)}]"
    resolved = resolve_options(options)
    for mod in modules:
        for child in units_of(mod):  # before anything changes: the units under it take its options
            child.check_enclosing_options(resolved, f"fully_shard({label}, options=...)")
    plan = resolve_strategy(sharding_strategy)
    reshard_after_forward = resolve_reshard_after_forward(reshard_after_forward, allow_int=True)
    offload = resolve_offload_policy(offload_policy)
    scaling = resolve_grad_scaling(gradient_scaling)
    mp_policy = resolve_mp_policy(mp_policy)
    ignored = check_ignored_params(ignored_params)
    dp_shard_dim, dp_outer_dim = resolve_dp_mesh_dims(dp_mesh_dims, dp_shard_dim, dp_outer_dim)
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
    prefixes = [""] if len(modules) == 1 else [f"modules[{i}]." for i in range(len(modules))]
    refs = _collect_params(modules, ignored, prefixes)
    _validate_params(label, refs)
    for ref in refs:
        if ref.tp is not None:
            check_dp_mesh_for_tp(ref.fqn, ref.tp, dp_mesh)
    check_shard_placement(shard_placement_fn, [(ref.fqn, ref.param) for ref in refs if not ref.replicated])
    device = mesh_device(dp_mesh.mesh, device)
    groups = [dp_mesh.shard_group] + ([dp_mesh.outer_group] if dp_mesh.has_outer else [])
    signatures = [param_signature(ref.fqn, ref.param, ref.replicated) for ref in refs]
    check_same_across_ranks(label, signatures, groups, device)
    if refs and all(ref.replicated for ref in refs):
        # Only replicated (0-dim or fsdp_no_shard) parameters: still a unit, so their
        # gradients are all-reduced like DDP's; nothing to gather or shard.
        plan = STRATEGIES["no_shard"]

    unit = FSDPUnit(modules[0], plan, reshard_after_forward, scaling, mp_policy, options, others=modules[1:])
    # Parameters whose class defines FSDP2's all-gather hooks (torchao's float8 weights) get a group
    # each: their gather moves the hooks' payload (core/gather_extension.py), and a hook works on
    # this rank's rows (torchao: their amax), which a buffer shared with others could leave empty.
    by_kind: dict[tuple[torch.dtype, bool, bool, type | None], list[ParamRef]] = {}
    for ref in refs:
        kind = (ref.param.dtype, ref.param.requires_grad, ref.replicated, gather_extension(ref.param))
        by_kind.setdefault(kind, []).append(ref)
    unit.groups = [
        ParamGroup(
            part, dp_mesh, STRATEGIES["no_shard"] if replicated else plan, device, unit.on_grads_ready, mp_policy,
            comm=unit.comm, pool=unit.pool, spares=unit.spares, offload=offload,
            post_forward=None if replicated else post_forward,
        )
        for (_, _, replicated, extension), group in by_kind.items()
        for part in ([group] if replicated else [[ref] for ref in group] if extension is not None
                     else _split_for_padding(group, plan, dp_mesh, mp_policy))
    ]
    for group in unit.groups:  # lets optimizer wrappers and grad-norm code find the engine from a parameter
        for param in group.sharded_params:
            param._megatron_fsdp_unit = weakref.ref(unit)
    for mod in modules:
        for child in units_of(mod):  # the units already under it run with its options (core/options.py)
            if child is not unit:
                child.adopt(unit)
        _move_buffers(mod, device)
        mod.register_state_dict_pre_hook(unit.release_before_state_dict)
        mod.register_load_state_dict_pre_hook(unit.prepare_state_dict_for_load)
    step_guard.watch(unit)
    for mod in modules:
        make_fsdp_module(mod, unit)
    return module


def _split_for_padding(
    refs: list[ParamRef], plan: ShardingPlan, dp: DataParallelMesh, policy: MixedPrecisionPolicy | None
) -> list[list[ParamRef]]:
    """One kind's parameters split into flat buffers where that saves padding (``layout.partition_for_padding``)."""
    world = (dp.shard_size * (dp.outer_size if dp.outer_optim else 1)) if plan.optim else 1
    align = flat_alignment(refs[0].param.dtype, policy)
    parts = partition_for_padding([r.local_shape for r in refs], world, align)
    return [[refs[i] for i in part] for part in parts]


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
