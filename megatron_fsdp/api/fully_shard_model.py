"""``fully_shard_model``: Megatron-FSDP's whole-model entry point, on top of ``fully_shard``.

``fully_shard_model(model, fsdp_unit_modules=[Block, "pkg.mod.Block"], ...)``
applies ``fully_shard`` bottom-up to every instance of the unit classes, then
to the root, and wraps the root in a ``MegatronFSDP``. Every option of the
reference README is accepted: most map onto ``fully_shard`` arguments or a
``MixedPrecisionPolicy``; options that need NVIDIA-only machinery this engine
does not have are rejected with the reason when turned on. docs/options.md
lists each option and what it does here.

``fully_shard_whole_model`` is the one-line ``fully_shard(model, optimizer, ...)``
form: it also re-points an existing optimizer at the sharded parameters.
"""

from __future__ import annotations

import dataclasses
import difflib
import importlib
import inspect
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor

from megatron_fsdp.api.megatron_fsdp import MegatronFSDP
from megatron_fsdp.core.lookup import units_of
from megatron_fsdp.core.meta_init import materialize_meta
from megatron_fsdp.core.mixed_precision import MixedPrecisionPolicy
from megatron_fsdp.core.module import FSDPModule
from megatron_fsdp.core.options import EngineOptions, resolve_options
from megatron_fsdp.core.shard_module import default_mesh, shard_module
from megatron_fsdp.optim.optimizer import fully_shard_optimizer
from megatron_fsdp.sharding.mesh import _is_flattened, _names, resolve_mesh
from megatron_fsdp.sharding.strategy import OUTER_STRATEGY_NAMES, OUTER_ZERO_STAGES, ShardingPlan, resolve_strategy

_OUTER_STRATEGIES = {**OUTER_ZERO_STAGES, **{name: name for name in OUTER_STRATEGY_NAMES}}

# Options rejected when turned on: why, and what to do instead.
_REJECTED: dict[str, str] = {
    "nccl_ub": (
        "NCCL user-buffer registration is not implemented: it needs CUDA, NCCL >= 2.19 and persistent, registered "
        "communication buffers, while this engine allocates its all-gather/reduce-scatter buffers per use (freed "
        "between uses). Leave nccl_ub=False; collectives use NCCL's default (copy-engine/SM) algorithms"
    ),
    "fsdp_manual_registration": (
        "manual NCCL buffer registration only applies with nccl_ub=True, which is not implemented (see nccl_ub)"
    ),
    "disable_symmetric_registration": (
        "symmetric (NCCL window) registration only applies with nccl_ub=True, which is not implemented, so there "
        "is no registration to disable (see nccl_ub)"
    ),
    "fsdp_double_buffer": (
        "persistent double buffers exist to give NCCL user-buffer registration (nccl_ub) fixed addresses; this "
        "engine allocates gather buffers per use and bounds memory with the prefetch depth instead "
        "(MegatronFSDP.module.set_prefetch_depth)"
    ),
    "keep_fp8_transpose_cache": (
        "FP8 (TransformerEngine) parameters are not supported by this engine yet, and the transpose cache only "
        "exists for them"
    ),
    "disable_bucketing": (
        "gradients are reduced one flat buffer per fully_shard unit (and dtype) as soon as the unit's backward is "
        "done; a single bucket for the whole model is not implemented. For coarser reductions list fewer "
        "fsdp_unit_modules"
    ),
}


@dataclass(frozen=True)
class MegatronPrecisionPolicy(MixedPrecisionPolicy):
    """Megatron-FSDP's precision options as a policy.

    Compute weights keep each parameter's dtype (build the model in bf16 for
    bf16 compute); main weights are fp32 with ``preserve_fp32_weights``, else
    the parameter's dtype; gradients accumulate in the main dtype and are
    reduced in fp32 with ``grad_reduce_in_fp32``, else in the parameter's dtype.
    """

    grad_reduce_in_fp32: bool = False

    def dtypes_for(self, original: torch.dtype) -> tuple[torch.dtype, torch.dtype, torch.dtype, torch.dtype]:
        compute, main, grads, _ = super().dtypes_for(original)
        if not original.is_floating_point:
            return compute, main, grads, original
        return compute, main, grads, torch.float32 if self.grad_reduce_in_fp32 else original


def precision_policy(*, preserve_fp32_weights: bool, grad_reduce_in_fp32: bool) -> MegatronPrecisionPolicy:
    """The policy for Megatron's ``preserve_fp32_weights`` / ``grad_reduce_in_fp32`` (see the class)."""
    return MegatronPrecisionPolicy(
        param_dtype=None,
        main_params_dtype=torch.float32 if preserve_fp32_weights else None,
        main_grads_dtype=None,
        grad_reduce_in_fp32=grad_reduce_in_fp32,
    )


def resolve_unit_modules(fsdp_unit_modules: Sequence[type | str] | None) -> tuple[type, ...]:
    """Classes from classes or ``"import.path.Class"`` strings; errors name the entry at fault."""
    if fsdp_unit_modules is None:
        return ()
    if isinstance(fsdp_unit_modules, (str, type)):
        fsdp_unit_modules = [fsdp_unit_modules]
    classes = []
    for entry in fsdp_unit_modules:
        cls = _import_class(entry) if isinstance(entry, str) else entry
        if not (isinstance(cls, type) and issubclass(cls, nn.Module)):
            raise TypeError(
                f"fsdp_unit_modules entry {entry!r} is not an nn.Module subclass; give module classes or their "
                "import paths ('package.module.ClassName')"
            )
        classes.append(cls)
    return tuple(classes)


def _import_class(path: str) -> Any:
    module_name, _, attr = path.rpartition(".")
    if not module_name or not attr:
        raise ValueError(
            f"fsdp_unit_modules entry {path!r} is not an import path; write it as 'package.module.ClassName'"
        )
    try:
        module = importlib.import_module(module_name)
    except ImportError as e:
        raise ValueError(f"fsdp_unit_modules entry {path!r}: cannot import module {module_name!r} ({e})") from e
    try:
        return getattr(module, attr)
    except AttributeError:
        raise ValueError(
            f"fsdp_unit_modules entry {path!r}: module {module_name!r} has no attribute {attr!r}"
        ) from None


def _check_flag(name: str, value: Any) -> bool:
    if not isinstance(value, bool):
        raise TypeError(f"fully_shard_model option {name} must be True or False, got {value!r}")
    return value


def _modules_to_shard(root: nn.Module, classes: tuple[type, ...], fine_grained: bool) -> list[nn.Module]:
    """Unit-class instances (and, fine-grained, every parameter-owning module inside one), children first."""
    chosen: set[int] = set()
    for module in root.modules():
        if module is not root and classes and isinstance(module, classes):
            chosen.add(id(module))
            if fine_grained:
                chosen.update(
                    id(m) for m in module.modules()
                    if m is not module and any(p is not None for p in m._parameters.values())
                )
    # Reversed pre-order visits every descendant before its ancestors (fully_shard is bottom-up).
    return [m for m in reversed(list(root.modules())) if id(m) in chosen]


def fully_shard_model(
    module: nn.Module,
    *,
    fsdp_unit_modules: Sequence[type | str] | None = None,
    device_mesh: DeviceMesh | None = None,
    dp_shard_dim: str | None = None,
    dp_outer_dim: str | None = None,
    tp_dim: str | None = None,
    hybrid_fsdp_group: torch.distributed.ProcessGroup | None = None,
    expt_device_mesh: DeviceMesh | None = None,
    zero_dp_strategy: str | int = 3,
    outer_dp_sharding_strategy: str | int = 0,
    device: torch.device | str | None = None,
    init_model_with_meta_device: bool = False,
    grad_reduce_in_fp32: bool = False,
    preserve_fp32_weights: bool = True,
    overlap_grad_reduce: bool = True,
    overlap_param_gather: bool = True,
    sync_model_each_microbatch: bool = True,
    preproc_state_dict_for_dcp_ckpt: bool = True,
    check_for_nan_in_grad: bool = False,
    average_in_collective: bool = False,
    calculate_per_token_loss: bool = False,
    enable_fine_grained_param_gather: bool = False,
    keep_fp8_transpose_cache: bool = False,
    nccl_ub: bool = False,
    fsdp_manual_registration: bool = False,
    disable_symmetric_registration: bool = False,
    fsdp_double_buffer: bool = False,
    disable_bucketing: bool = False,
    mp_policy: MixedPrecisionPolicy | None = None,
    options: EngineOptions | None = None,
    **unknown: Any,
) -> MegatronFSDP:
    """Fully shard ``module`` (Megatron-FSDP's API) and return it wrapped in a ``MegatronFSDP``.

    Each option and its status here is in docs/options.md. The main ones:

    Args:
        module: the root module; its sub-modules of the ``fsdp_unit_modules``
            classes become units (all-gathered and freed one at a time), the
            rest of the parameters belong to the root unit.
        fsdp_unit_modules: classes or ``"import.path.Class"`` strings.
        device_mesh, dp_shard_dim, dp_outer_dim: the mesh (default: all ranks)
            and the names of its sharding and (HSDP) replicating dimensions.
        expt_device_mesh: expert parallelism: the expert modules (``expert_modules``:
            the outermost modules whose parameters all carry ``allreduce = False``)
            become units of their own, sharded over this mesh's ``dp_shard_cp`` or
            ``dp_shard`` dimension (a 1-D mesh: all of it), their gradients averaged
            over the dense data-parallel size (docs/moe.md). Its ``ep`` and ``tp``
            (expert tensor parallelism: slices marked ``tensor_model_parallel``)
            dimensions are the model's own.
        zero_dp_strategy: 0-3 or ``"no_shard"``/``"optim"``/``"optim_grads"``/``"optim_grads_params"``.
        outer_dp_sharding_strategy: HSDP across ``dp_outer``: 0/``"no_shard"``.
        grad_reduce_in_fp32, preserve_fp32_weights: the precision (see
            ``MegatronPrecisionPolicy``); ``mp_policy`` (an extension) overrides both.
        options: ``EngineOptions`` for every unit (an extension; default
            ``EngineOptions()``); ``overlap_grad_reduce=False`` sets its
            ``max_reduces_in_flight`` to 0, ``overlap_param_gather=False`` its
            ``prefetch_depth`` to 0.
        sync_model_each_microbatch, check_for_nan_in_grad: see ``MegatronFSDP``.
        calculate_per_token_loss: sum gradients over ranks (the loop normalises by
            the token count) instead of averaging them.

    Returns:
        A ``MegatronFSDP`` whose ``.module`` is ``module`` (now sharded).
    """
    if unknown:
        raise TypeError(_unknown_options_message("fully_shard_model", unknown, FULLY_SHARD_MODEL_OPTIONS))
    if not isinstance(module, nn.Module):
        raise TypeError(f"fully_shard_model expects an nn.Module, got {type(module).__name__}")
    if isinstance(module, (FSDPModule, MegatronFSDP)):
        raise ValueError(
            f"{type(module).__name__} is already sharded; apply fully_shard_model once, to the unsharded model"
        )
    flags = {name: value for name, value in locals().items() if name in _FLAG_OPTIONS}
    for name, value in flags.items():
        _check_flag(name, value)
    if keep_fp8_transpose_cache and zero_dp_strategy not in (3, "optim_grads_params"):
        # Megatron-FSDP keeps FP8 parameters under ZeRO-3 only: an invalid combination, whatever is supported
        raise ValueError(
            f"fully_shard_model(keep_fp8_transpose_cache=True): FP8 parameters are ZeRO-3 only (Megatron-FSDP), so "
            f"their transpose cache needs zero_dp_strategy=3 ('optim_grads_params'), got {zero_dp_strategy!r}"
        )
    for name, value in flags.items():
        if value and name in _REJECTED:
            raise NotImplementedError(f"fully_shard_model({name}=True): {_REJECTED[name]}")
    if expt_device_mesh is not None and not isinstance(expt_device_mesh, DeviceMesh):
        raise TypeError(f"expt_device_mesh must be a DeviceMesh (or None), got {type(expt_device_mesh).__name__}")
    if average_in_collective and calculate_per_token_loss:
        raise ValueError(
            "average_in_collective=True and calculate_per_token_loss=True contradict each other (average vs sum)"
        )
    classes = resolve_unit_modules(fsdp_unit_modules)
    mesh = default_mesh() if device_mesh is None else device_mesh
    dp_mesh = resolve_mesh(mesh, dp_shard_dim, dp_outer_dim)
    _check_tp_and_groups(module, mesh, dp_mesh, tp_dim, hybrid_fsdp_group, dp_outer_dim, device)
    if outer_dp_sharding_strategy not in _OUTER_STRATEGIES:
        raise ValueError(
            f"outer_dp_sharding_strategy={outer_dp_sharding_strategy!r} is not valid: use 0/'no_shard' "
            "(replicate across dp_outer) or 1/'optim'"
        )
    plan: ShardingPlan = resolve_strategy(zero_dp_strategy, argument="zero_dp_strategy")
    if mp_policy is None:
        mp_policy = precision_policy(
            preserve_fp32_weights=preserve_fp32_weights, grad_reduce_in_fp32=grad_reduce_in_fp32
        )
    options = resolve_options(options)
    if not overlap_grad_reduce:
        options = dataclasses.replace(options, max_reduces_in_flight=0)  # every reduction synchronous
    if not overlap_param_gather:
        options = dataclasses.replace(options, prefetch_depth=0)
    shard_kwargs = dict(
        options=options,
        mesh=mesh, sharding_strategy=plan, dp_shard_dim=dp_shard_dim, dp_outer_dim=dp_outer_dim,
        gradient_scaling="sum" if calculate_per_token_loss else "mean",
        outer_sharding_strategy=_OUTER_STRATEGIES[outer_dp_sharding_strategy], mp_policy=mp_policy,
        device=device,  # its index too ("cuda:1"), not only the current device
    )
    if expt_device_mesh is not None:  # expert units first: they sit inside the dense units
        expert_kwargs = _expert_shard_kwargs(expt_device_mesh, dp_mesh.size, shard_kwargs)
        experts = expert_modules(module)
        if not experts:
            raise ValueError(
                "fully_shard_model(expt_device_mesh=...): no module's parameters are all expert parameters (marked "
                "with Megatron's attribute param.allreduce = False); mark the experts' parameters, or pass "
                "expt_device_mesh=None"
            )
        for sub in experts:
            shard_module(sub, **expert_kwargs)
    for sub in _modules_to_shard(module, classes, enable_fine_grained_param_gather):
        if not isinstance(sub, FSDPModule):
            shard_module(sub, **shard_kwargs)
    root = shard_module(module, **shard_kwargs)
    if not isinstance(root, FSDPModule):
        raise ValueError(
            f"fully_shard_model({type(module).__name__}): every parameter outside the unit modules is marked "
            "fsdp_no_shard, so the root has no unit; leave at least one root parameter sharded"
        )
    if any(g.needs_init for u in units_of(root) for g in u.groups):
        materialize_meta(root)  # now, so a checkpoint loaded before the first forward is not overwritten
    return MegatronFSDP(root, sync_model_each_microbatch=sync_model_each_microbatch,
                        check_for_nan_in_grad=check_for_nan_in_grad)


def expert_modules(root: nn.Module) -> list[nn.Module]:
    """The outermost modules (not containers) all of whose parameters are expert parameters.

    Expert parameters carry Megatron's ``allreduce = False``. Containers without a
    forward (``ModuleList``, ``ModuleDict``) are looked into, never chosen.
    """
    chosen: list[nn.Module] = []

    def visit(module: nn.Module) -> None:
        params = list(module.parameters())
        container = isinstance(module, (nn.ModuleList, nn.ModuleDict))
        if params and not container and all(not getattr(p, "allreduce", True) for p in params):
            chosen.append(module)
            return
        for child in module.children():
            visit(child)

    for child in root.children():
        visit(child)
    return chosen


def _expert_shard_kwargs(expt_device_mesh: DeviceMesh, dense_dp_size: int, dense: dict[str, Any]) -> dict[str, Any]:
    """``shard_module`` arguments of expert units: the expert data-parallel dimension of ``expt_device_mesh``.

    Expert gradients are averaged over the dense data-parallel size, as Megatron's
    (each expert already summed its EP group's tokens in backward); sums stay sums.
    Other dimensions (``ep``; ``tp``: expert tensor parallelism, Megatron-style, each
    rank holding its expert-TP slice as a plain tensor) are not sharded over.
    """
    names = _names(expt_device_mesh)
    dims = [d for d in ("dp_shard_cp", "dp_shard") if d in names or _is_flattened(expt_device_mesh, d)]
    if expt_device_mesh.ndim > 1 and not dims:
        raise ValueError(
            f"expt_device_mesh has dimensions {names}: name its expert data-parallel dimension 'dp_shard_cp' (as "
            "Megatron-FSDP's) or 'dp_shard', or pass a 1-D mesh of the expert data-parallel ranks"
        )
    kwargs = dict(dense, mesh=expt_device_mesh, dp_shard_dim=dims[0] if dims else None, dp_outer_dim=None,
                  outer_sharding_strategy="no_shard")
    if dense["gradient_scaling"] == "mean":
        kwargs["gradient_scaling"] = 1.0 / dense_dp_size
    return kwargs


_FLAG_OPTIONS = {
    "init_model_with_meta_device", "grad_reduce_in_fp32", "preserve_fp32_weights", "overlap_grad_reduce",
    "overlap_param_gather", "sync_model_each_microbatch", "preproc_state_dict_for_dcp_ckpt", "check_for_nan_in_grad",
    "average_in_collective", "calculate_per_token_loss", "enable_fine_grained_param_gather",
    "keep_fp8_transpose_cache", "nccl_ub", "fsdp_manual_registration", "disable_symmetric_registration",
    "fsdp_double_buffer", "disable_bucketing",
}
FULLY_SHARD_MODEL_OPTIONS: tuple[str, ...] = tuple(
    name for name, p in inspect.signature(fully_shard_model).parameters.items() if p.kind is p.KEYWORD_ONLY
)


def _check_tp_and_groups(
    module: nn.Module,
    mesh: DeviceMesh,
    dp_mesh: Any,
    tp_dim: str | None,
    hybrid_fsdp_group: Any,
    dp_outer_dim: str | None,
    device: torch.device | str | None,
) -> None:
    if tp_dim is not None and tp_dim not in _names(mesh) and not _is_flattened(mesh, tp_dim):
        raise ValueError(f"tp_dim={tp_dim!r} is not a dimension of device_mesh; its dimensions are {_names(mesh)}")
    dtensors = [name for name, p in module.named_parameters() if isinstance(p, DTensor)]
    if dtensors:
        raise NotImplementedError(
            f"parameters {dtensors[:3]} are DTensors (torch-native tensor parallelism): the whole-model form "
            "does not take them. Use the per-module form: fully_shard(block, mesh=mesh['dp']) on each "
            "parallelized block, then on the root (docs/parallelism.md); or Megatron-style TP (each rank's "
            "local slice as a plain tensor), where every TP rank shards its slice over the data-parallel dimensions"
        )
    if hybrid_fsdp_group is not None:
        if dp_outer_dim is None and not dp_mesh.has_outer:
            raise ValueError("hybrid_fsdp_group is only for HSDP: pass dp_outer_dim too, or hybrid_fsdp_group=None")
        size = torch.distributed.get_world_size(hybrid_fsdp_group)
        if size != dp_mesh.size:
            raise ValueError(
                f"hybrid_fsdp_group has {size} ranks but the (dp_outer, dp_shard) mesh has {dp_mesh.size}; it must "
                "be the flattened group of dp_outer x dp_shard (device_mesh[('dp_outer', 'dp_shard')]._flatten())"
            )
    if device is not None and torch.device(device).type != mesh.device_type:
        raise ValueError(
            f"device={device!r} does not match device_mesh's device type {mesh.device_type!r}; shards live on the "
            "mesh's device"
        )


def _unknown_options_message(where: str, unknown: dict[str, Any], valid: Sequence[str]) -> str:
    parts = []
    for name in unknown:
        close = difflib.get_close_matches(name, valid, n=1)
        parts.append(f"{name!r}" + (f" (did you mean {close[0]!r}?)" if close else ""))
    return f"{where} got unknown option(s) {', '.join(parts)}; valid options: {', '.join(valid)}"


_PER_MODULE_DEFAULTS = dict(
    mesh=None, sharding_strategy="optim_grads_params", reshard_after_forward=True, gradient_scaling="mean",
    outer_sharding_strategy="no_shard", mp_policy=None, offload_policy=None,
)
_PER_MODULE_ONLY = {
    "mesh": "device_mesh", "sharding_strategy": "zero_dp_strategy",
    "outer_sharding_strategy": "outer_dp_sharding_strategy", "gradient_scaling": "calculate_per_token_loss",
}


def fully_shard_whole_model(
    module: nn.Module,
    optimizer: torch.optim.Optimizer | None,
    per_module: dict[str, Any],
    **options: Any,
) -> tuple[MegatronFSDP, torch.optim.Optimizer | None]:
    """``model, optimizer = fully_shard(model, optimizer, **fully_shard_model options)``.

    Shards ``module`` with ``fully_shard_model`` and re-points ``optimizer``'s
    parameter groups (keeping each group's hyperparameters) from the original
    parameters to the sharded ones, then applies ``fully_shard_optimizer``.
    ``optimizer`` may be None (returned as None). The optimizer must not have
    stepped yet: its state would be for the unsharded parameters.
    """
    if per_module.get("options") is not None:
        options = {**options, "options": per_module["options"]}  # fully_shard_model takes it too
    for name, value in per_module.items():
        if name == "options":
            continue
        if value is not _PER_MODULE_DEFAULTS[name] and value != _PER_MODULE_DEFAULTS[name]:
            hint = f" (use {_PER_MODULE_ONLY[name]}=...)" if name in _PER_MODULE_ONLY else ""
            raise TypeError(
                f"fully_shard(model, optimizer, ...) is the whole-model form, which takes fully_shard_model's "
                f"options; {name}= belongs to the per-module form{hint}"
            )
    unknown = {k: v for k, v in options.items() if k not in FULLY_SHARD_MODEL_OPTIONS}
    if unknown:
        valid = sorted(set(FULLY_SHARD_MODEL_OPTIONS) | set(_PER_MODULE_DEFAULTS) | {"dp_shard_dim", "dp_outer_dim"})
        raise TypeError(_unknown_options_message("fully_shard", unknown, valid))
    if optimizer is not None and not isinstance(optimizer, torch.optim.Optimizer):
        raise TypeError(
            f"fully_shard's second argument must be a torch.optim.Optimizer (whole-model form), got "
            f"{type(optimizer).__name__}; for the per-module form pass only keyword arguments"
        )
    names: list[list[str]] = []
    if optimizer is not None:
        if optimizer.state:
            raise ValueError(
                "fully_shard(model, optimizer): the optimizer has already stepped (it holds state for the unsharded "
                "parameters); create it anew, or shard before the first step"
            )
        fqn_of = {id(p): name for name, p in module.named_parameters()}
        for index, group in enumerate(optimizer.param_groups):
            missing = [tuple(p.shape) for p in group["params"] if id(p) not in fqn_of]
            if missing:
                raise ValueError(
                    f"fully_shard(model, optimizer): optimizer.param_groups[{index}] holds parameters that are not "
                    f"in the model (shapes {missing[:3]})"
                )
            names.append([fqn_of[id(p)] for p in group["params"]])
    model = fully_shard_model(module, **options)
    if optimizer is None:
        return model, None
    sharded = dict(model.module.named_parameters())
    for group, fqns in zip(optimizer.param_groups, names):
        group["params"] = [sharded[name] for name in fqns]
    fully_shard_optimizer(
        optimizer,
        preproc_state_dict_for_dcp_ckpt=options.get("preproc_state_dict_for_dcp_ckpt", True),
        check_for_nan_in_grad=options.get("check_for_nan_in_grad", False),
    )
    return model, optimizer
