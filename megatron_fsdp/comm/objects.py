"""Python objects exchanged between ranks through lent tensors (``comm/lending.py``).

``torch.distributed.all_gather_object`` and ``broadcast_object_list`` hand gloo tensors that
only they reference and drop them as soon as the wait returns, which is the exit race
``lending.py`` describes (a gloo worker thread releasing the last reference during the
interpreter's finalization aborts the process). These do the same exchange (pickle, sizes,
padded bytes) with every tensor lent, so the library's own object rounds (start-up
validation, the sharded checkpoint's agreement rounds, the mesh checks) are safe at exit like
its other collectives. They are not counted in ``comm_stats``: control traffic, not training's.
"""

from __future__ import annotations

import pickle
from typing import Any

import torch
import torch.distributed as dist

from megatron_fsdp.comm.collectives import _all_gather_flat
from megatron_fsdp.comm.lending import wait_lent


def _device(group: dist.ProcessGroup | None) -> torch.device:
    # NCCL moves only CUDA tensors; every other backend (gloo, or "cpu:gloo,cuda:nccl") takes CPU ones.
    if str(dist.get_backend(group)) == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _to_bytes(obj: Any, device: torch.device) -> torch.Tensor:
    return torch.frombuffer(bytearray(pickle.dumps(obj)), dtype=torch.uint8).to(device)


def _from_bytes(payload: torch.Tensor) -> Any:
    return pickle.loads(payload.cpu().numpy().tobytes())


def all_gather_objects(obj: Any, group: dist.ProcessGroup | None = None) -> list[Any]:
    """Every rank's ``obj`` (picklable), in group-rank order: ``dist.all_gather_object`` on lent tensors."""
    device = _device(group)
    world = dist.get_world_size(group)
    payload = _to_bytes(obj, device)
    sizes = torch.zeros(world, dtype=torch.int64, device=device)
    mine = torch.tensor([payload.numel()], dtype=torch.int64, device=device)
    wait_lent(_all_gather_flat, sizes, mine, group=group)
    counts = sizes.tolist()
    biggest = max(counts)
    padded = torch.zeros(biggest, dtype=torch.uint8, device=device)
    padded[: payload.numel()] = payload
    gathered = torch.empty(world * biggest, dtype=torch.uint8, device=device)
    wait_lent(_all_gather_flat, gathered, padded, group=group)
    return [_from_bytes(gathered[r * biggest : r * biggest + n]) for r, n in enumerate(counts)]


def broadcast_object(obj: Any, group: dist.ProcessGroup | None = None, src: int = 0) -> Any:
    """Group rank ``src``'s ``obj`` on every rank (what the others pass is ignored): ``broadcast_object_list`` lent."""
    group = group if group is not None else dist.group.WORLD
    device = _device(group)
    source = dist.get_global_rank(group, src)
    is_source = dist.get_rank(group) == src
    payload = _to_bytes(obj, device) if is_source else None
    size = torch.tensor([payload.numel() if payload is not None else 0], dtype=torch.int64, device=device)
    wait_lent(dist.broadcast, size, src=source, group=group)
    if payload is None:
        payload = torch.empty(int(size.item()), dtype=torch.uint8, device=device)
    wait_lent(dist.broadcast, payload, src=source, group=group)
    return _from_bytes(payload)
