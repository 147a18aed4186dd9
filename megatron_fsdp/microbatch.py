"""``microbatch(module, is_first=..., is_last=...)``: per-step work once per step (seed 001).

Outside the context the engine is correctness-first: weights are refreshed
before a forward that follows a backward, and gradients are reduced in every
backward. Inside it, with gradient accumulation over micro-batches:

- weights replicated between steps (``no_shard``/``optim``/``optim_grads``)
  are refreshed (gathered from the updated main shards) only on the first
  micro-batch and kept until the last one's backward;
- gradients are reduced where the strategy needs it: every micro-batch for
  sharded gradients (``optim_grads``, ``optim_grads_params``: they accumulate
  in the small sharded ``.grad``), only on the last micro-batch for full-size
  gradients (``no_shard``, ``optim``: they accumulate locally in ``main_grad``).

Prior flags are restored on exit, so contexts nest and a later step outside
them behaves as before. Works when only children, not the root, are wrapped.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass

from torch import nn


@dataclass(frozen=True)
class MicrobatchFlags:
    is_first: bool
    is_last: bool


@contextlib.contextmanager
def microbatch(module: nn.Module, *, is_first: bool, is_last: bool = False) -> Iterator[None]:
    """Run one micro-batch's forward and backward of ``module`` inside this context."""
    from .module import FSDPModule

    units = [m.fsdp_unit for m in module.modules() if isinstance(m, FSDPModule)]
    if not units:
        raise ValueError(
            f"microbatch({type(module).__name__}): the module contains no fully_shard-ed module; "
            "apply fully_shard first"
        )
    flags = MicrobatchFlags(bool(is_first), bool(is_last))
    previous = [(unit, unit.microbatch) for unit in units]
    for unit in units:
        unit.enter_microbatch(flags)
    try:
        yield
    finally:
        for unit, flags_before in previous:
            unit.microbatch = flags_before
