"""CPU offload (FSDP2's ``offload_policy=``): main weights, gradients and optimizer state on the host.

``fully_shard(module, offload_policy=CPUOffloadPolicy())`` keeps a group's sharded main
weights (``ParamGroup.shard``) and the ``.grad`` of its sharded parameters in host
memory, so the optimizer steps there. The device holds only what a unit computes with:
before each all-gather the shard is uploaded (``upload``), and each reduced gradient
shard is downloaded (``download``) before it is installed. The copies are always real
copies into separate tensors, also where the "device" is the CPU itself (gloo tests),
so the host path is the same code on every machine.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

from megatron_fsdp.core.fsdp2_classes import is_fsdp2_instance, loaded_class

if TYPE_CHECKING:
    from torch.distributed.fsdp import CPUOffloadPolicy

HOST = torch.device("cpu")


def resolve_offload_policy(value: Any, *, where: str = "fully_shard") -> CPUOffloadPolicy | None:
    """``CPUOffloadPolicy`` when offloading, None for ``None`` or a plain ``OffloadPolicy()`` (no offload)."""
    if value is None:
        return None
    if is_fsdp2_instance(value, "CPUOffloadPolicy"):
        if not isinstance(value.pin_memory, bool):
            raise TypeError(
                f"{where}: CPUOffloadPolicy(pin_memory=...) must be True or False, got {value.pin_memory!r}"
            )
        return value
    if type(value) is loaded_class("OffloadPolicy"):
        return None
    raise TypeError(
        f"{where}: offload_policy must be torch.distributed.fsdp.OffloadPolicy() (no offload), "
        f"CPUOffloadPolicy(pin_memory=...) or None, got {value!r} ({type(value).__name__})"
    )


def pins(policy: CPUOffloadPolicy | None) -> bool:
    """Host tensors are page-locked: asked for, and possible (pinning needs CUDA)."""
    return policy is not None and policy.pin_memory and torch.cuda.is_available()


def host_empty(numel: int, dtype: torch.dtype, policy: CPUOffloadPolicy | None) -> torch.Tensor:
    """An uninitialised flat host tensor, pinned when ``policy`` asks and CUDA can pin."""
    return torch.empty(numel, dtype=dtype, device=HOST, pin_memory=pins(policy))


def upload(host: torch.Tensor, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A new device tensor holding ``host`` cast to ``dtype`` (a copy even when ``device`` is the CPU).

    Asynchronous from pinned memory on CUDA: it is queued on the current stream, which
    the collective that reads it follows.
    """
    out = torch.empty(host.numel(), dtype=dtype, device=device)
    out.copy_(host, non_blocking=host.is_pinned())
    return out


def download(device_tensor: torch.Tensor, dtype: torch.dtype, policy: CPUOffloadPolicy) -> torch.Tensor:
    """A new host tensor holding ``device_tensor`` cast to ``dtype``.

    Synchronous, so the optimizer may read it at once.
    """
    out = host_empty(device_tensor.numel(), dtype, policy)
    out.copy_(device_tensor)
    return out
