"""Flat, FQN-keyed state dicts for torch.distributed.checkpoint (DCP), and their validation.

A checkpoint holds one flat dict (DCP metadata keys)::

    model.<fqn>                        parameters and persistent buffers (sharded DTensors stay sharded)
    optim.state.<fqn>.<name>           per-parameter optimizer state (exp_avg, exp_avg_sq, step, ...)
    optim.param_groups.<i>.<hyper>     hyper-parameters of group i (lr, betas, weight_decay, ...)
    optim.param_groups.<i>.params      the FQNs of group i's parameters

This is exactly the layout that ``dcp.save({"model": get_model_state_dict(m),
"optim": get_optimizer_state_dict(m, opt)})`` writes, so checkpoints are
interchangeable with PyTorch FSDP2 / DDP users' checkpoints. Saved under the
top-level name ``optimizer`` instead (``optimizer.state.<fqn>.<name>``,
``optimizer.param_groups.<i>.<hyper>``: Megatron-LM's ``megatron_fsdp.experimental``
and many FSDP2 scripts, ``optimizer_entries(..., prefix="optimizer.")``), the
optimizer state loads the same way. Optimizer state is
keyed by parameter FQN, never by index, so a checkpoint survives a change of
parameter order or grouping (``apply_optimizer_state`` maps groups by FQN).

Every value is this rank's view: a sharded parameter (ours ``RaggedShard``,
FSDP2's ``Shard(0)``) contributes only its local rows, with global offsets from
its placement, so saving moves no full tensor through any rank.
"""

from __future__ import annotations

import logging
import warnings
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from torch.distributed.checkpoint.metadata import BytesStorageMetadata, Metadata, TensorStorageMetadata
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict, set_model_state_dict
from torch.distributed.tensor import DTensor

from megatron_fsdp.checkpoint.model_parallel import (
    NO_MODEL_PARALLEL,
    ModelParallel,
    checkpoint_value,
    full_shape,
    source_of,
)
from megatron_fsdp.core.module import FSDPModule

logger = logging.getLogger("megatron_fsdp.checkpoint")

MODEL_PREFIX = "model."
OPTIM_STATE_PREFIX = "optim.state."
OPTIM_GROUPS_PREFIX = "optim.param_groups."
# The top-level names an optimizer state dict is saved under: ours, and ``optimizer`` (module docstring).
OPTIMIZER_PREFIXES = ("optim.", "optimizer.")
DESCRIBE_LIMIT = 5  # keys named per kind in an error message


class CheckpointMismatchError(RuntimeError):
    """The checkpoint and the model/optimizer disagree (missing or unexpected keys, shapes).

    Raised by a strict load with ``report`` (the ``KeyReport``) and ``where`` (which part
    of the checkpoint) set, so that callers without a ``strict=`` option can say what to do.
    """

    report: KeyReport | None = None
    where: str = ""


@dataclass
class KeyReport:
    """Keys a load could not match; empty lists after a full (strict) load."""

    missing_keys: list[str] = field(default_factory=list)  # wanted by the model, absent from the checkpoint
    unexpected_keys: list[str] = field(default_factory=list)  # in the checkpoint, unknown to the model
    mismatched_keys: list[str] = field(default_factory=list)  # present in both with different shapes

    def __bool__(self) -> bool:
        return bool(self.missing_keys or self.unexpected_keys or self.mismatched_keys)

    def describe(self, limit: int = DESCRIBE_LIMIT) -> str:
        """Each kind with its count and its first ``limit`` keys (the lists themselves keep every key)."""
        parts = []
        for title, keys in (
            ("missing from the checkpoint", self.missing_keys),
            ("unexpected (in the checkpoint, not in the model/optimizer)", self.unexpected_keys),
            ("shape mismatch", self.mismatched_keys),
        ):
            if keys:
                more = f", ... ({len(keys) - limit} more)" if len(keys) > limit else ""
                parts.append(f"{len(keys)} {title}: {', '.join(keys[:limit])}{more}")
        return "; ".join(parts)


# -- module helpers ---------------------------------------------------------
def unwrap(model: nn.Module) -> nn.Module:
    """The user's module inside DDP / DataParallel / torch.compile wrappers (their FQNs)."""
    while True:
        if isinstance(model, (nn.parallel.DistributedDataParallel, nn.DataParallel)):
            model = model.module
        elif hasattr(model, "_orig_mod") and isinstance(model._orig_mod, nn.Module):
            model = model._orig_mod
        else:
            return model


def reshard_all(model: nn.Module) -> None:
    """Make every FSDP unit (ours or PyTorch FSDP2) hold its sharded parameters.

    After a forward without backward a unit may still hold its gathered weights;
    the state dict and the optimizer must see the sharded ones.
    """
    torch_fsdp_module = _torch_fsdp_module_class()
    for module in unwrap(model).modules():
        if isinstance(module, FSDPModule) or (torch_fsdp_module is not None and isinstance(module, torch_fsdp_module)):
            module.reshard()


def _torch_fsdp_module_class() -> type | None:
    try:
        from torch.distributed.fsdp import FSDPModule as TorchFSDPModule
    except ImportError:  # pragma: no cover - torch builds without FSDP2
        return None
    return TorchFSDPModule


def parameter_fqns(model: nn.Module, layout: ModelParallel = NO_MODEL_PARALLEL) -> dict[int, str]:
    """``id(param) -> name`` in the checkpoint: the FQN (the first name of a tied parameter, as PyTorch's
    helpers use), renamed by ``layout``."""
    return {id(p): layout.name(name) for name, p in unwrap(model).named_parameters()}


# -- building the flat dicts ------------------------------------------------
def model_entries(model: nn.Module, layout: ModelParallel = NO_MODEL_PARALLEL) -> dict[str, Any]:
    """``model.<name>`` -> this rank's (sharded) value, via PyTorch's DCP state-dict helper.

    With model parallelism (``layout``) names are the checkpoint's and TP-sharded
    parameters are full-shape ``ChunkedTensor`` values (``model_parallel``).
    """
    state = get_model_state_dict(model, options=StateDictOptions(full_state_dict=False))
    if layout == NO_MODEL_PARALLEL:
        return {MODEL_PREFIX + k: v for k, v in state.items()}
    params = dict(unwrap(model).named_parameters(remove_duplicate=False))
    out = {}
    for fqn, value in state.items():
        name = layout.name(fqn)
        param = params.get(fqn)
        out[MODEL_PREFIX + name] = value if param is None else checkpoint_value(value, param, layout, name)
    return out


def model_names(model: nn.Module, layout: ModelParallel = NO_MODEL_PARALLEL) -> dict[str, str]:
    """``model.<name>`` in the checkpoint -> the state-dict FQN it loads into."""
    state = get_model_state_dict(model, options=StateDictOptions(full_state_dict=False))
    return {MODEL_PREFIX + layout.name(fqn): fqn for fqn in state}


def optimizer_entries(
    model: nn.Module, optimizer: torch.optim.Optimizer, layout: ModelParallel = NO_MODEL_PARALLEL,
    prefix: str = "optim.",
) -> dict[str, Any]:
    """``optim.*`` entries of ``optimizer``, keyed by parameter name (see module docstring).

    ``prefix``: one of ``OPTIMIZER_PREFIXES``; ``"optimizer."`` writes Megatron-LM v2's / torch
    ``get_optimizer_state_dict`` under ``"optimizer"`` layout.
    """
    if prefix not in OPTIMIZER_PREFIXES:
        raise ValueError(f"optimizer_entries: prefix must be one of {OPTIMIZER_PREFIXES}, got {prefix!r}")
    groups_prefix, state_prefix = f"{prefix}param_groups.", f"{prefix}state."
    fqns = parameter_fqns(model, layout)
    out: dict[str, Any] = {}
    for index, group in enumerate(optimizer.param_groups):
        names = []
        for param in group["params"]:
            if id(param) not in fqns:
                raise ValueError(
                    f"optimizer param_groups[{index}] holds a parameter of shape {tuple(param.shape)} that is not "
                    "a parameter of the model; checkpoints key optimizer state by the model's parameter names"
                )
            names.append(fqns[id(param)])
        for key, value in group.items():
            if key != "params":
                out[f"{groups_prefix}{index}.{key}"] = value
        out[f"{groups_prefix}{index}.params"] = names
    for param, state in optimizer.state.items():
        name = fqns.get(id(param))
        if name is None:
            continue  # state of a parameter no longer in any group
        for key, value in state.items():
            out[f"{state_prefix}{name}.{key}"] = checkpoint_value(value, param, layout, name)
    return out


# -- loading ----------------------------------------------------------------
def _shape_of(md: Any) -> tuple[int, ...] | None:
    return tuple(md.size) if isinstance(md, TensorStorageMetadata) else None


def plan_model_load(model_state: dict[str, Any], metadata: Metadata) -> tuple[dict[str, Any], KeyReport]:
    """The ``model.*`` entries that can be read from ``metadata`` and what cannot."""
    saved = {k: v for k, v in metadata.state_dict_metadata.items() if k.startswith(MODEL_PREFIX)}
    report = KeyReport()
    loadable: dict[str, Any] = {}
    for key, value in model_state.items():
        md = saved.get(key)
        if md is None:
            report.missing_keys.append(key)
        elif isinstance(value, torch.Tensor) and _shape_of(md) != tuple(value.shape):
            report.mismatched_keys.append(
                f"{key} (checkpoint {_shape_of(md) or 'non-tensor'}, model {tuple(value.shape)})"
            )
        else:
            loadable[key] = value
    report.unexpected_keys += sorted(set(saved) - set(model_state))
    return loadable, report


def _state_target(param: torch.Tensor, md: Any, layout: ModelParallel = NO_MODEL_PARALLEL, name: str = "") -> Any:
    """An empty value in ``param``'s layout that DCP can read a saved state entry into."""
    if isinstance(md, BytesStorageMetadata):
        return None  # replaced by the unpickled object
    dtype = md.properties.dtype
    if tuple(md.size) == full_shape(param, layout, name):
        # Same shape as the parameter: read only this rank's rows, in its layout.
        return checkpoint_value(torch.zeros_like(param.detach(), dtype=dtype), param, layout, name)
    local = param.to_local() if isinstance(param, DTensor) else param
    device = torch.device("cpu") if len(md.size) == 0 else local.device  # AdamW keeps `step` on CPU
    return torch.zeros(tuple(md.size), dtype=dtype, device=device)


@dataclass
class OptimizerLoadPlan:
    """What to read for the optimizer, and how to map it back (see ``apply_optimizer_state``)."""

    entries: dict[str, Any]
    state_keys: dict[str, tuple[str, str]]  # flat key -> (fqn, state name)
    group_keys: dict[str, tuple[int, str]]  # flat key -> (saved group index, hyper-parameter)
    report: KeyReport


def plan_optimizer_load(
    model: nn.Module, optimizer: torch.optim.Optimizer, metadata: Metadata,
    layout: ModelParallel = NO_MODEL_PARALLEL,
) -> OptimizerLoadPlan:
    """Targets for every ``optim.*`` (or ``optimizer.*``) entry of the checkpoint that belongs to
    ``optimizer``'s parameters."""
    fqns = parameter_fqns(model, layout)
    params = {fqns[id(p)]: p for group in optimizer.param_groups for p in group["params"] if id(p) in fqns}
    plan = OptimizerLoadPlan({}, {}, {}, KeyReport())
    by_length = sorted(params, key=len, reverse=True)  # longest FQN first: 'a.b' before 'a'
    for key, md in metadata.state_dict_metadata.items():
        prefix = next((p for p in OPTIMIZER_PREFIXES if key.startswith(p)), "")
        if key.startswith(f"{prefix}param_groups.") and prefix:
            index, _, hyper = key[len(prefix) + len("param_groups."):].partition(".")
            if not index.isdigit() or not hyper:
                plan.report.unexpected_keys.append(key)
                continue
            plan.group_keys[key] = (int(index), hyper)
            plan.entries[key] = None if isinstance(md, BytesStorageMetadata) else _state_target(torch.empty(()), md)
        elif key.startswith(f"{prefix}state.") and prefix:
            rest = key[len(prefix) + len("state."):]
            name = next((f for f in by_length if rest.startswith(f + ".")), None)
            if name is None:
                plan.report.unexpected_keys.append(key)
                continue
            param = params[name]
            shape = full_shape(param, layout, name)
            if isinstance(md, TensorStorageMetadata) and len(md.size) > 0 and tuple(md.size) != shape:
                if len(md.size) == param.dim():  # a moment of a parameter whose shape changed
                    plan.report.mismatched_keys.append(f"{key} (checkpoint {tuple(md.size)}, parameter {shape})")
                    continue
            plan.state_keys[key] = (name, rest[len(name) + 1:])
            plan.entries[key] = _state_target(param, md, layout, name)
    if not plan.group_keys:
        plan.report.missing_keys.append("optim.param_groups (the checkpoint holds no optimizer state)")
    return plan


def apply_optimizer_state(
    model: nn.Module, optimizer: torch.optim.Optimizer, plan: OptimizerLoadPlan, loaded: dict[str, Any],
    layout: ModelParallel = NO_MODEL_PARALLEL,
) -> None:
    """Load the read entries into ``optimizer``, matching parameters and groups by FQN.

    A parameter with no saved state gets none (as in the run that saved it: e.g. it
    never received a gradient). Each current group takes the hyper-parameters of the
    saved group that held its first parameter; a group of only new parameters keeps
    its own.
    """
    saved_groups: dict[int, dict[str, Any]] = {}
    for key, (index, hyper) in plan.group_keys.items():
        saved_groups.setdefault(index, {})[hyper] = loaded[key]
    group_of_fqn = {name: i for i, g in saved_groups.items() for name in g.get("params", [])}
    state_by_fqn: dict[str, dict[str, Any]] = {}
    for key, (name, state_name) in plan.state_keys.items():
        state_by_fqn.setdefault(name, {})[state_name] = source_of(loaded[key])

    fqns = parameter_fqns(model, layout)
    ids: dict[int, int] = {}
    state: dict[int, dict[str, Any]] = {}
    groups = []
    for position, group in enumerate(optimizer.param_groups):
        names = [fqns[id(p)] for p in group["params"]]
        for p, name in zip(group["params"], names):
            if id(p) not in ids:
                ids[id(p)] = len(ids)
                if name in state_by_fqn:
                    state[ids[id(p)]] = state_by_fqn[name]
        new_group = {k: v for k, v in group.items() if k != "params"}
        sources = [group_of_fqn[n] for n in names if n in group_of_fqn]
        if sources:
            source = saved_groups[sources[0]]
            conflicting = {i for i in sources if _hypers(saved_groups[i]) != _hypers(source)}
            if conflicting:
                warnings.warn(
                    f"optimizer param_groups[{position}] holds parameters of saved groups with different "
                    f"hyper-parameters {sorted(set(sources))}; taking those of saved group {sources[0]}",
                    stacklevel=3,
                )
            new_group.update({k: v for k, v in source.items() if k in new_group})
        new_group["params"] = [ids[id(p)] for p in group["params"]]
        groups.append(new_group)
    optimizer.load_state_dict({"state": state, "param_groups": groups})


def _hypers(group: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in group.items() if k != "params"}


def apply_model_state(model: nn.Module, loaded: dict[str, Any], names: dict[str, str] | None = None) -> None:
    """Install read ``model.*`` entries through ``load_state_dict`` (ours re-marks gathered weights stale).

    ``names``: checkpoint key -> state-dict FQN (``model_names``) when the two differ.
    """
    if names is None:
        state = {k[len(MODEL_PREFIX):]: v for k, v in loaded.items()}
    else:
        state = {names[k]: source_of(v) for k, v in loaded.items()}
    set_model_state_dict(model, state, options=StateDictOptions(strict=False))


def settle(report: KeyReport, strict: bool, where: str) -> None:
    """Raise on a mismatch when ``strict``; else log what is skipped."""
    if not report:
        return
    if strict:
        error = CheckpointMismatchError(
            f"checkpoint {where} does not match: {report.describe()}. Pass strict=False to load the rest "
            "(the skipped keys are returned and logged)"
        )
        error.report, error.where = report, where  # a front-end words its own advice (no strict= there)
        raise error
    logger.warning("partial load of checkpoint %s: skipped %s", where, report.describe())
