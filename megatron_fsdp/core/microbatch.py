"""``microbatch(module, is_first, is_last=None)``: per-step work once per step.

Outside the context the engine is correctness-first: weights are refreshed
before a forward that follows a backward, and gradients are reduced in every
backward. Inside it, with gradient accumulation over micro-batches:

- ``is_first``: weights replicated between steps (``no_shard``/``optim``/
  ``optim_grads``) are refreshed (gathered from the updated main shards) on the
  first micro-batch of a step;
- ``is_last=None`` (the default; the seed's ``microbatch(module, is_first)``):
  whether this is the step's last micro-batch is unknown, so every backward
  reduces its gradients and releases its weights exactly as outside the
  context. Correct whatever follows, including an optimizer step;
- ``is_last=False``: not the last micro-batch. Weights stay gathered until the
  last one's backward, and full-size gradients (``no_shard``, ``optim``)
  accumulate locally in ``main_grad`` instead of being all-reduced; sharded
  gradients (``optim_grads``, ``optim_grads_params``) are still reduce-scattered
  inside ``dp_shard`` every micro-batch, and under HSDP their reduction across
  ``dp_outer`` is deferred: the parts are summed locally and reduced across
  replicas once, in the last micro-batch (docs/design.md, section 8);
- ``is_last=True``: the last micro-batch: everything is reduced, and the
  weights are released for the optimizer step.

Gradients deferred by ``is_last=False`` must be reduced before the optimizer
steps: an optimizer step that holds parameters with deferred gradients raises
(``megatron_fsdp.step_guard``) instead of stepping on missing gradients.

Prior flags are restored on exit, so contexts nest and a later step outside
them behaves as before. Works when only children, not the root, are wrapped.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass

from torch import nn

from megatron_fsdp.core.lookup import units_of


@dataclass(frozen=True)
class MicrobatchFlags:
    """What the engine is told about the current micro-batch.

    ``is_last`` is what the engine acts on (True when the caller did not say:
    reduce and release as outside the context); ``is_last_known`` records
    whether the caller said it.
    """

    is_first: bool
    is_last: bool
    is_last_known: bool = True


def _check_flag(argument: str, value: object) -> None:
    if not isinstance(value, bool):
        raise TypeError(f"microbatch: {argument} must be True or False, got {value!r} ({type(value).__name__})")


@contextlib.contextmanager
def microbatch(module: nn.Module, is_first: bool, is_last: bool | None = None) -> Iterator[None]:
    """Run one micro-batch's forward and backward of ``module`` inside this context.

    Args:
        module: a module that is, or contains, ``fully_shard``-ed modules.
        is_first: the first micro-batch of a step (weights are refreshed from the
            main weights the last optimizer step updated).
        is_last: the last micro-batch of a step (True), not the last (False:
            full-size and HSDP outer reductions are deferred), or None (unknown: reduce
            every backward, as outside the context).
    """
    if not isinstance(module, nn.Module):
        raise TypeError(f"microbatch: module must be an nn.Module, got {type(module).__name__}")
    _check_flag("is_first", is_first)
    if is_last is not None:
        _check_flag("is_last", is_last)
    units = units_of(module)
    if not units:
        raise ValueError(
            f"microbatch({type(module).__name__}): the module contains no fully_shard-ed module; "
            "apply fully_shard first"
        )
    flags = MicrobatchFlags(is_first, True if is_last is None else is_last, is_last_known=is_last is not None)
    previous = [(unit, unit.microbatch) for unit in units]
    for unit in units:
        unit.enter_microbatch(flags)
    try:
        yield
    finally:
        for unit, flags_before in previous:
            unit.microbatch = flags_before
