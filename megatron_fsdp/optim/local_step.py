"""Step an optimizer on the local shards of its DTensor parameters.

A torch optimizer stepping DTensor parameters sends every elementwise op through
DTensor's Python dispatch (sharding propagation, then the local op). For the
single-tensor loops torch uses on CPU that is a dozen dispatches per parameter per
step; on a 6-layer GPT it was ~100 ms of a ~1.3 s CPU step. The optimizer's math
is elementwise on identically sharded tensors, so running it on the local tensors
gives bit-for-bit the same numbers without the dispatch.

``on_local_shards(optimizer)`` swaps, for the duration of a ``step``, each DTensor
parameter in ``param_groups`` for a plain alias of its local shard (same storage)
carrying the local gradient, and re-keys its state to local aliases of the state's
DTensors. Afterwards everything is put back: parameters, and state keyed by the
original parameters holding DTensors (the objects that were there, updated in
place; a state tensor the optimizer replaced or created is wrapped with the
parameter's layout). Checkpoints, ``state_dict`` and LR schedulers see no change.

The first step of a parameter (no state yet) runs the plain DTensor step, so its
state is created exactly as torch creates it. Nor is the local step used while any step
hook other than megatron_fsdp's own is registered (on the optimizer or globally): hooks
run inside the window and must see the DTensors they see under FSDP2
(``observed_by_hooks``). Optimizers without such hooks keep the speed-up.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch
import torch.optim.optimizer as optim_hooks
from torch.distributed.tensor import DTensor

from megatron_fsdp.core.step_guard import OWN_HOOK
from megatron_fsdp.sharding.ragged_dtensor import as_ragged


def _local_alias(tensor: DTensor) -> torch.Tensor:
    return tensor._local_tensor.detach()  # shares storage and version counter


def _restore(value: Any, param: DTensor, aliased: dict[int, tuple[torch.Tensor, DTensor]]) -> Any:
    """What the state keeps for ``value`` after a local step: a DTensor where it had one."""
    if id(value) in aliased:  # updated in place: the original DTensor holds the result
        return aliased[id(value)][1]
    if isinstance(value, torch.Tensor) and not isinstance(value, DTensor) and value.dim() > 0 and (
        value.shape == param._local_tensor.shape
    ):  # replaced or created by the optimizer: give it the parameter's layout
        return as_ragged(DTensor.from_local(value, param.device_mesh, param.placements, run_check=False,
                                            shape=param.shape, stride=param.stride()))
    return value


def observed_by_hooks(optimizer: torch.optim.Optimizer) -> bool:
    """Whether a user's step hook would run inside the local window and see local aliases.

    torch runs the global step pre-hooks, then the optimizer's own, the step, the
    optimizer's own post-hooks, then the global ones: any of them but ours would see plain
    local shards where FSDP2 shows DTensors (a ``clip_grad_norm_`` in a pre-hook would take
    each rank's own norm, an EMA in a post-hook would mix shapes).
    """
    if optimizer._optimizer_step_pre_hooks or optimizer._optimizer_step_post_hooks:
        return True
    hooks = (*optim_hooks._global_optimizer_pre_hooks.values(), *optim_hooks._global_optimizer_post_hooks.values())
    return any(not getattr(hook, OWN_HOOK, False) for hook in hooks)


def steppable_locally(optimizer: torch.optim.Optimizer) -> bool:
    """Every DTensor parameter with a gradient already has optimizer state (not its first step),
    and no step hook but ours can observe the parameters during the step."""
    return not observed_by_hooks(optimizer) and all(
        p in optimizer.state and len(optimizer.state[p]) > 0
        for group in optimizer.param_groups
        for p in group["params"]
        if isinstance(p, DTensor) and p.grad is not None
    )


@contextlib.contextmanager
def on_local_shards(optimizer: torch.optim.Optimizer) -> Iterator[None]:
    """Inside, ``optimizer`` refers to local aliases of its DTensor parameters and state."""
    swapped: list[tuple[dict, int, DTensor, torch.Tensor, dict[str, Any]]] = []
    # id(local alias) -> (the alias, kept alive so its id stays unique; the state DTensor it aliases)
    aliased: dict[int, tuple[torch.Tensor, DTensor]] = {}
    try:
        for group in optimizer.param_groups:
            params = group["params"]
            for i, p in enumerate(params):
                if not isinstance(p, DTensor) or p.dim() == 0:
                    continue
                local = _local_alias(p)
                if p.grad is not None:
                    local.grad = p.grad._local_tensor if isinstance(p.grad, DTensor) else p.grad
                original = optimizer.state.pop(p, {})
                state = {}
                for key, value in original.items():
                    if isinstance(value, DTensor):
                        value = _local_alias(value)
                        aliased[id(value)] = (value, original[key])
                    state[key] = value
                if state:
                    optimizer.state[local] = state
                params[i] = local
                swapped.append((group, i, p, local, original))
        yield
    finally:
        for group, i, p, local, original in swapped:
            group["params"][i] = p
            state = optimizer.state.pop(local, None)
            if state is not None:
                optimizer.state[p] = {key: _restore(value, p, aliased) for key, value in state.items()}
            elif original:
                optimizer.state[p] = original
            local.grad = None
