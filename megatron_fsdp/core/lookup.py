"""Find the units under a module: the one lookup the engine, optimizer and wrappers use.

``fully_shard`` stores a module's ``FSDPUnit`` in the module's ``__dict__`` under
``UNIT_ATTR`` (``FSDPModule.fsdp_unit`` reads it back). Looking the attribute up
here, rather than testing ``isinstance(m, FSDPModule)``, keeps this module free of
imports, so any layer of the engine can find units without importing the module
class (which imports the unit).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from torch import nn

if TYPE_CHECKING:
    from megatron_fsdp.core.unit import FSDPUnit

UNIT_ATTR = "_megatron_fsdp_unit"  # module.__dict__ key holding its FSDPUnit


def unit_of(module: nn.Module) -> FSDPUnit | None:
    """The unit ``fully_shard`` made of ``module``, or None if it was not sharded."""
    return module.__dict__.get(UNIT_ATTR)


def units_of(module: nn.Module) -> list[FSDPUnit]:
    """Every unit in ``module``'s subtree (itself included), in ``module.modules()`` order.

    A unit over several modules (``fully_shard([a, b])``) is listed once, at its first module.
    """
    units = {id(unit): unit for m in module.modules() if (unit := m.__dict__.get(UNIT_ATTR)) is not None}
    return list(units.values())
