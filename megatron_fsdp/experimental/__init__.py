"""Megatron-LM main's placement-based Megatron-FSDP API ("Megatron-FSDP v2"), over this library's engine.

::

    from megatron_fsdp.experimental import Placements, fully_shard, fully_shard_context, zero3

    with fully_shard_context() as ctx:
        for block in model.layers:
            fully_shard(block, mesh, zero3())
        fully_shard(model, mesh, zero3())
    optimizer = torch.optim.AdamW(model.parameters()); fully_shard_optimizer(optimizer)

docs/api.md ("The placements API") maps its placements to ``sharding_strategy`` and HSDP options
and compares it with the other two entry points. Not imported by ``import megatron_fsdp``; the
checkpoint functions load torch.distributed.checkpoint on first use only (module ``__getattr__``).
"""

from __future__ import annotations

import importlib
from typing import Any

from megatron_fsdp.experimental.mixed_precision import MixedPrecisionPolicy
from megatron_fsdp.experimental.module import (
    FsdpContext,
    FsdpModule,
    fully_shard,
    fully_shard_context,
    microbatch,
)
from megatron_fsdp.experimental.optimizer import fully_shard_optimizer
from megatron_fsdp.experimental.placements import (
    PRESETS,
    Partial,
    Placements,
    Replicate,
    Shard,
    hfsdp,
    hsdp,
    no_shard,
    zero1,
    zero2,
    zero3,
)

__all__ = [
    "PRESETS",
    "FsdpContext",
    "FsdpModule",
    "MixedPrecisionPolicy",
    "Partial",
    "Placements",
    "Replicate",
    "Shard",
    "fully_shard",
    "fully_shard_context",
    "fully_shard_optimizer",
    "hfsdp",
    "hsdp",
    "load_checkpoint",
    "microbatch",
    "no_shard",
    "save_checkpoint",
    "zero1",
    "zero2",
    "zero3",
]

_LAZY = {
    "load_checkpoint": "megatron_fsdp.experimental.checkpoint",
    "save_checkpoint": "megatron_fsdp.experimental.checkpoint",
}


def __getattr__(name: str) -> Any:
    """The checkpoint functions, imported on first use (they load torch.distributed.checkpoint)."""
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    """Every public name, the lazy ones included."""
    return sorted(set(globals()) | set(__all__))
