"""PyTorch FSDP2's public classes, looked up without importing ``torch.distributed.fsdp`` at ``import megatron_fsdp``.

Importing ``torch.distributed.fsdp`` loads FSDP1 and ``torch.distributed._shard`` too
(86 modules, about 3.5 MB resident, more than this library's own modules). The library
needs torch's classes only to accept FSDP2's objects (policies, ``DataParallelMeshDims``)
and to make sharded modules FSDP2 ``FSDPModule`` instances, so it looks them up here:
``loaded_class`` where an object of the class may be in hand (it can only exist once torch's
package is imported, so nothing is imported to check), ``fsdp2_class`` where the class itself
is needed (``fully_shard``'s first call imports the package then).
"""

from __future__ import annotations

import importlib
import sys

FSDP2_PACKAGE = "torch.distributed.fsdp"


def fsdp2_class(name: str) -> type | None:
    """``torch.distributed.fsdp.<name>``, importing the package; None where this torch lacks the class."""
    return getattr(importlib.import_module(FSDP2_PACKAGE), name, None)


def loaded_class(name: str) -> type | None:
    """``torch.distributed.fsdp.<name>`` if the package is imported already, else None.

    For ``isinstance`` checks of a value the caller passed: an instance of torch's class
    exists only once its package was imported, so None means "not one of torch's".
    """
    module = sys.modules.get(FSDP2_PACKAGE)
    return getattr(module, name, None) if module is not None else None


def is_fsdp2_instance(value: object, name: str) -> bool:
    """``isinstance(value, torch.distributed.fsdp.<name>)`` without importing torch's package."""
    cls = loaded_class(name)
    return cls is not None and isinstance(value, cls)
