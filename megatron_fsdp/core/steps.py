"""Per-step operations on a model's units, shared by the ``MegatronFSDP`` wrapper and the optimizer wrapper.

Start and finish gradient reduction, install new main weights, scale or discard
gradients, wait for communication, and name sharded parameters: each is a few
calls on the ``FSDPUnit``s it is given (``units_of`` a model, or
``units_of_params`` of the parameters an optimizer steps).
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from megatron_fsdp.core.state import RootState
from megatron_fsdp.core.unit import FSDPUnit, TrainingState


def units_of_params(params: Iterable[torch.Tensor]) -> list[FSDPUnit]:
    """The units that own ``params`` (sharded parameters), each once, in first-seen order."""
    units: dict[int, FSDPUnit] = {}
    for param in params:
        ref = getattr(param, "_megatron_fsdp_unit", None)
        unit = ref() if ref is not None else None
        if unit is not None:
            units.setdefault(id(unit), unit)
    return list(units.values())


def start_grad_sync(units: list[FSDPUnit]) -> None:
    """Start reducing gradients accumulated but not reduced yet (e.g. under ``no_sync``).

    Ranks may hold unreduced gradients for different units (units that ran on some
    ranks only): under a root the set is agreed across ranks first (core/schedule.py).
    """
    by_root: dict[int, tuple[RootState, list[FSDPUnit]]] = {}
    for unit in units:
        if unit.root_state is not None:
            by_root.setdefault(id(unit.root_state), (unit.root_state, []))[1].append(unit)
            continue
        for group in unit.groups:  # never ran a forward: nothing to agree on
            if group.grads_pending:
                group.reduce_grads(True, unit.grad_scaling).finish()
    for root, root_units in by_root.values():
        root.schedule.reduce_pending(root_units)


def finish_grad_sync(units: list[FSDPUnit]) -> None:
    """Reduce what is pending, wait for every reduction, and mark the weights stale.

    After it, every sharded parameter's ``.grad`` holds the reduced gradient and
    the next forward re-gathers weights from the (about to be updated) main shards.
    """
    start_grad_sync(units)
    roots = {id(u.root_state): u.root_state for u in units if u.root_state is not None}
    for root in roots.values():
        root.drain()
    install_weights(units, eager=False)


def install_weights(units: list[FSDPUnit], *, eager: bool = True) -> None:
    """The main weights changed: release gathered weights; ``eager`` also refreshes compute copies now.

    Without ``eager`` the low-precision compute copy is refreshed by the next
    all-gather; with it the cast happens here, right after the optimizer step.
    """
    for unit in units:
        if unit.state is not TrainingState.IDLE:
            raise RuntimeError(
                f"cannot install weights of {type(unit.module).__name__} during its {unit.state.value}; "
                "call it between training steps"
            )
        unit.mark_weights_stale()
        if eager:
            for group in unit.groups:
                if not group.needs_init:
                    group.refresh_compute()


def discard_grad_buffers(units: list[FSDPUnit], *, reduced: bool = True) -> None:
    """Drop unreduced gradient buffers and (``reduced``) the sharded ``.grad``s."""
    for unit in units:
        for group in unit.groups:
            if reduced:
                for param in group.sharded_params:
                    param.grad = None
            group.discard_unreduced_grads()  # after: it drops main_grad where .grad is gone


def scale_grads(units: list[FSDPUnit], factor: float) -> None:
    """Multiply every gradient, reduced (``.grad``) or still accumulating (``main_grad``), by ``factor``."""
    with torch.no_grad():
        for unit in units:
            for group in unit.groups:
                group.scale_unreduced(factor)
                for param in group.sharded_params:
                    if param.grad is not None:
                        grad = param.grad
                        (grad.to_local() if isinstance(grad, DTensor) else grad).mul_(factor)


def stop_communication(units: list[FSDPUnit]) -> None:
    """Wait for every collective in flight (reductions, prefetched all-gathers)."""
    roots = {id(u.root_state): u.root_state for u in units if u.root_state is not None}
    for root in roots.values():
        root.drain()
    for unit in units:
        if unit.state is TrainingState.IDLE:
            unit.reshard()  # waits for (and frees) a prefetch nobody consumed


def named_sharded_parameters(units: list[FSDPUnit], root: nn.Module | None = None) -> list[tuple[str, nn.Parameter]]:
    """(FQN relative to the root model, sharded parameter) for every parameter of ``units``.

    The root is ``root`` if given, else found from the units' runtime state
    (which exists once a forward ran).
    """
    roots = {id(u.root_state): u.root_state.root.module for u in units if u.root_state is not None}
    if root is not None:
        roots = {id(root): root}
    prefixes: dict[int, str] = {}
    for root in roots.values():
        for name, module in root.named_modules(remove_duplicate=False):
            prefixes.setdefault(id(module), f"{name}." if name else "")
    out = []
    for unit in units:
        prefix = prefixes.get(id(unit.module), f"{type(unit.module).__name__}.")
        for group in unit.groups:
            for ref, param in zip(group.refs, group.sharded_params):
                out.append((prefix + ref.fqn, param))
    return out
