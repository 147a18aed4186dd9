"""Meta-device materialisation: build big models without ever holding them whole.

A model built under ``torch.device("meta")`` can be passed to ``fully_shard``
directly: its shards are allocated (uninitialised) on the mesh device. Then
``materialize_meta`` (run automatically before the root's first forward)
initialises it one module at a time:

1. modules are visited in pre-order, the order ordinary eager construction
   runs their ``reset_parameters()``, so the random stream is consumed exactly
   as eager initialisation would: with the same seed, meta-init gives
   bitwise the same weights as eager init (on the same device);
2. the module's own parameters get temporary full tensors on the device and
   are initialised by ``init_fn(module)`` or ``module.reset_parameters()`` (an
   instance attribute of that name counts: a caller can give a module whose
   class has none its own initialiser);
3. each full tensor is broadcast from data-parallel rank 0 (and, for a
   torch-native tensor-parallel parameter, then from TP rank 0), so every
   rank's shard is a slice of one and the same initialisation whatever the
   ranks' random states (TP-replicated norms stay identical across TP);
4. this rank's rows are copied into its shard and the full tensors dropped.

The temporaries start as NaN, and an element the initialiser left unwritten stops
materialisation with an error naming the parameter (never a silent NaN or stale value).

Peak memory is the sharded model plus one module's full parameters. A tied
parameter keeps the value its first owner gave it (eager tying happens after
both modules were initialised), while the second owner's initialisation
still consumes the random stream as in eager mode.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from megatron_fsdp.comm.collectives import all_reduce_max, broadcast
from megatron_fsdp.core.lookup import units_of
from megatron_fsdp.core.param_group import ParamGroup


def _pending_groups(root: nn.Module) -> list[ParamGroup]:
    groups = []
    for unit in units_of(root):
        groups.extend(g for g in unit.groups if g.needs_init)
    return groups


def _take_users_writes(groups: list[ParamGroup]) -> None:
    """Parameters the user wrote in place while they waited (``p.copy_``, ``nn.init``, ``dcp.load`` into
    ``model.state_dict()``; ``ParamGroup.written_pending``) count as initialised, on every rank alike.

    One all-reduce (maximum) of the flags over the first group's data-parallel groups (every rank of
    them holds the same groups): a parameter some rank holds no rows of is decided with the others,
    so that all ranks take part in the same broadcasts below.
    """
    slots = [(g, i) for g in groups for i in sorted(g.pending_init)]
    written = {(id(g), i) for g in groups for i in g.written_pending()}
    flags = torch.tensor([float((id(g), i) in written) for g, i in slots], device=groups[0].device)
    all_reduce_max(flags, groups[0].process_group, comm=groups[0].comm)
    if groups[0].dp.has_outer:
        all_reduce_max(flags, groups[0].dp.outer_group, comm=groups[0].comm)
    for (group, index), flag in zip(slots, flags.tolist()):
        if flag:
            group.pending_init.discard(index)


META_BUFFERS = "_megatron_fsdp_meta_buffers"  # module attribute: buffer names awaiting init


def _broadcast_from_dp_rank0(tensor: torch.Tensor, group: ParamGroup) -> None:
    """Make every data-parallel rank hold rank 0's values: inside dp_shard, then across dp_outer."""
    broadcast(tensor, 0, group.process_group, comm=group.comm).wait()
    if group.dp.has_outer:
        broadcast(tensor, 0, group.dp.outer_group, comm=group.comm).wait()


def _init_meta_buffers(module: nn.Module, init_fn, anchor: ParamGroup) -> None:
    """Initialise (if not done with its parameters) and broadcast a module's meta-built buffers."""
    names = module.__dict__.pop(META_BUFFERS, None)
    if names is None:
        return
    if init_fn is not None:
        init_fn(module)
    elif hasattr(module, "reset_parameters"):
        module.reset_parameters()
    else:
        raise ValueError(
            f"meta-device buffers {names} of {type(module).__name__} have no initialiser (no "
            "reset_parameters()); pass init_fn to megatron_fsdp.materialize_meta"
        )
    for name in names:
        _broadcast_from_dp_rank0(module._buffers[name], anchor)


def materialize_meta(root: nn.Module, init_fn: Callable[[nn.Module], None] | None = None) -> None:
    """Initialise every meta-device parameter sharded under ``root`` that has no values yet (see module
    docstring). Parameters that received values (``load_state_dict``, ``to_empty``) keep them."""
    groups = _pending_groups(root)
    if not groups and not any(META_BUFFERS in m.__dict__ for m in root.modules()):
        return
    if groups:
        _take_users_writes(groups)
    # Any group of the model knows the data-parallel groups buffers are broadcast over.
    anchor = next(g for unit in units_of(root) for g in unit.groups)
    owner: dict[tuple[int, str], tuple[ParamGroup, int]] = {}
    for unit in units_of(root):
        for group in unit.groups:
            for index, ref in enumerate(group.refs):
                for module, name in ref.uses:
                    owner[(id(module), name)] = (group, index)
    done: set[tuple[int, int]] = set()  # (group, index) of tied parameters already initialised
    uninitialised = {(id(g), i): g.refs[i].fqn for g in groups for i in g.pending_init}
    for module in root.modules():
        own = [(name, *owner[(id(module), name)]) for name in module._parameters if (id(module), name) in owner]
        if not own:
            with torch.no_grad():
                _init_meta_buffers(module, init_fn, anchor)
            continue
        if init_fn is None and not hasattr(module, "reset_parameters"):
            names = [group.refs[i].fqn for _, group, i in own if (id(group), i) in uninitialised]
            if not names:
                continue
            raise ValueError(
                f"meta-device parameters {names} belong to {type(module).__name__}, which has no "
                "reset_parameters(); pass init_fn to megatron_fsdp.materialize_meta to initialise them"
            )
        _materialize_module(module, own, init_fn, done, uninitialised)
        for name in module.__dict__.pop(META_BUFFERS, []):  # initialised with the parameters
            _broadcast_from_dp_rank0(module._buffers[name], own[0][1])
        for _, group, index in own:
            uninitialised.pop((id(group), index), None)
    if uninitialised:
        raise ValueError(f"meta-device parameters {sorted(uninitialised.values())} were never initialised")
    for group in groups:
        group.pending_init.clear()
        group.mark_compute_stale()


def _check_written(module: nn.Module, fqn: str, full: torch.Tensor) -> None:
    """Raise where ``module``'s initialiser left elements of the temporary ``full`` (of parameter ``fqn``) unwritten
    (still the NaN they were filled with): an initialiser that skips a parameter, writes only part of it, or
    rebinds ``param.data`` instead of writing into it would otherwise train on NaN. Every rank runs the same
    initialiser, so all raise alike."""
    if not full.is_floating_point():
        return
    unwritten = int(torch.isnan(full).sum())
    if unwritten:
        raise ValueError(
            f"meta-device parameter '{fqn}': the initialiser of {type(module).__name__} (its reset_parameters(), "
            f"or init_fn) left {unwritten} of its {full.numel()} elements unwritten (NaN); it must write every "
            "element of each parameter in place"
        )


def _materialize_module(module, own, init_fn, done, uninitialised) -> None:
    """Initialise ``module``'s parameters on temporary full tensors; keep those still ``uninitialised``.

    Every parameter of the module gets a temporary (its initialiser consumes the random stream as in
    eager mode), so one that already holds loaded values is never written by the initialiser."""
    saved = module._parameters.copy()
    fulls = []
    for name, group, index in own:
        full = torch.empty(group.params[index].global_shape, dtype=group.dtype, device=group.device)
        if full.is_floating_point():
            full.fill_(float("nan"))  # what the initialiser leaves unwritten stays NaN: caught below
        module._parameters[name] = nn.Parameter(full, requires_grad=group.refs[index].param.requires_grad)
        fulls.append(full)
    try:
        with torch.no_grad():
            if init_fn is not None:
                init_fn(module)
            else:  # the instance's own where it has one, else its class's
                module.reset_parameters()
            for (_, group, index), full in zip(own, fulls):
                key = (id(group), index)
                if key in done or key not in uninitialised:
                    continue  # tied: the first owner's value stands, as in eager tying
                _check_written(module, group.refs[index].fqn, full)
                _broadcast_from_dp_rank0(full, group)
                spec = group.refs[index].tp
                if spec is not None:  # the global value: the same on every TP rank, which keeps its slice
                    broadcast(full, 0, spec.mesh.get_group(0), comm=group.comm).wait()
                group.params[index].fill(full)
                if len(group.refs[index].uses) > 1:
                    done.add(key)
    finally:
        module._parameters.update(saved)
