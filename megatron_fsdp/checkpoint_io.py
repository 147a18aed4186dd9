"""Sharded save and load of a model (+ optimizer) with torch.distributed.checkpoint.

``save_state`` writes into a hidden temporary directory next to the target and
renames it into place only after every rank's data and DCP's ``.metadata`` are
on disk, so a crash mid-save leaves no directory that looks like a checkpoint.
``load_state`` checks the checkpoint's metadata against the model first, so a
missing key, an unexpected key or a shape mismatch fails with the tensor's name
(on every rank alike) before anything is read, or, with ``strict=False``, is
skipped and reported.

Both are collective over ``process_group`` (default: the default group); with
torch.distributed not initialised they run in a single process.
"""

from __future__ import annotations

import os
import shutil
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint import DefaultLoadPlanner, FileSystemReader, FileSystemWriter
from torch.distributed.checkpoint.metadata import Metadata

from .checkpoint_state import (
    KeyReport,
    apply_model_state,
    apply_optimizer_state,
    model_entries,
    optimizer_entries,
    plan_model_load,
    plan_optimizer_load,
    reshard_all,
    settle,
)

METADATA_FILE = ".metadata"
TMP_MARKER = ".tmp-"


@dataclass
class LoadResult:
    """What ``load_state`` skipped (only with ``strict=False``; empty otherwise)."""

    missing_keys: list[str] = field(default_factory=list)
    unexpected_keys: list[str] = field(default_factory=list)
    mismatched_keys: list[str] = field(default_factory=list)


# -- process-group helpers --------------------------------------------------
def _distributed() -> bool:
    return dist.is_available() and dist.is_initialized()


def group_rank(process_group: dist.ProcessGroup | None) -> int:
    return dist.get_rank(process_group) if _distributed() else 0


def group_size(process_group: dist.ProcessGroup | None) -> int:
    return dist.get_world_size(process_group) if _distributed() else 1


def broadcast_from_first(value: Any, process_group: dist.ProcessGroup | None) -> Any:
    """``value`` as computed on the group's first rank, on every rank."""
    if not _distributed():
        return value
    holder = [value]
    dist.broadcast_object_list(holder, group_src=0, group=process_group)
    return holder[0]


def any_rank(flag: bool, process_group: dist.ProcessGroup | None) -> bool:
    """True on every rank if ``flag`` is true on any rank of the group (also a barrier)."""
    if not _distributed():
        return flag
    flags: list[Any] = [None] * group_size(process_group)
    dist.all_gather_object(flags, bool(flag), group=process_group)
    return any(flags)


def run_on_first(fn: Callable[[], Any], process_group: dist.ProcessGroup | None) -> Any:
    """Run ``fn`` on the group's first rank; re-raise its error on every rank (no hang)."""
    result, error = None, None
    if group_rank(process_group) == 0:
        try:
            result = fn()
        except Exception as exc:  # re-raised on all ranks below
            error = exc
    error = broadcast_from_first(error, process_group)
    if error is not None:
        raise error
    return broadcast_from_first(result, process_group)


# -- atomic directories -----------------------------------------------------
def make_temporary_dir(final_dir: str, process_group: dist.ProcessGroup | None) -> str:
    """A fresh hidden directory beside ``final_dir`` (same filesystem, so the rename is atomic)."""
    parent, name = os.path.split(os.path.abspath(final_dir))

    def create() -> str:
        os.makedirs(parent, exist_ok=True)
        path = os.path.join(parent, f".{name}{TMP_MARKER}{uuid.uuid4().hex[:12]}")
        os.makedirs(path)
        return path

    return run_on_first(create, process_group)


def commit_dir(tmp_dir: str, final_dir: str) -> None:
    """Rename a complete ``tmp_dir`` to ``final_dir`` (replacing an older one), then fsync the parent."""
    final_dir = os.path.abspath(final_dir)
    old = None
    if os.path.exists(final_dir):
        old = f"{final_dir}{TMP_MARKER}old-{uuid.uuid4().hex[:12]}"
        os.rename(final_dir, old)
    os.rename(tmp_dir, final_dir)
    _fsync_dir(os.path.dirname(final_dir))
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)


def write_file_atomically(path: str, data: bytes) -> None:
    tmp = f"{path}{TMP_MARKER}{uuid.uuid4().hex[:12]}"
    with open(tmp, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    _fsync_dir(os.path.dirname(os.path.abspath(path)))


def _fsync_dir(path: str) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:  # e.g. platforms without directory handles
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def is_checkpoint_dir(path: str) -> bool:
    return os.path.isfile(os.path.join(path, METADATA_FILE))


def read_metadata(path: str) -> Metadata:
    if not is_checkpoint_dir(path):
        raise FileNotFoundError(
            f"{path!r} is not a torch.distributed.checkpoint directory (no {METADATA_FILE} file in it); "
            "pass the directory save_state wrote (for the Megatron layout, <save_dir>/iter_XXXXXXX)"
        )
    return FileSystemReader(path).read_metadata()


# -- save / load ------------------------------------------------------------
def write_dcp(
    entries: dict[str, Any], directory: str, process_group: dist.ProcessGroup | None
) -> None:
    """DCP-save a flat dict into ``directory`` (collective)."""
    dcp.save(entries, storage_writer=FileSystemWriter(directory), process_group=process_group,
             no_dist=not _distributed())


def read_dcp(entries: dict[str, Any], directory: str, process_group: dist.ProcessGroup | None) -> None:
    """DCP-load into the values of ``entries`` in place (keys already checked against the metadata)."""
    if not entries:
        return
    dcp.load(entries, storage_reader=FileSystemReader(directory), process_group=process_group,
             planner=DefaultLoadPlanner(allow_partial_load=True), no_dist=not _distributed())


def state_entries(model: nn.Module, optimizer: torch.optim.Optimizer | None) -> dict[str, Any]:
    """The flat dict ``save_state`` writes (see ``checkpoint_state``)."""
    reshard_all(model)
    entries = model_entries(model)
    if optimizer is not None:
        entries.update(optimizer_entries(model, optimizer))
    return entries


def save_state(
    path: str,
    model: nn.Module,
    optimizer: torch.optim.Optimizer | None = None,
    *,
    process_group: dist.ProcessGroup | None = None,
    before_commit: Callable[[str], None] | None = None,
) -> str:
    """Write ``model`` (and ``optimizer``) as a sharded DCP checkpoint at ``path``, atomically.

    Every rank of ``process_group`` writes only its own shards. ``before_commit``,
    if given, is called on every rank with the temporary directory after the DCP
    write, to add files of its own before the directory is renamed into place.
    Returns ``path`` (absolute).
    """
    path = os.path.abspath(path)
    entries = state_entries(model, optimizer)
    tmp = make_temporary_dir(path, process_group)
    error: BaseException | None = None
    try:
        write_dcp(entries, tmp, process_group)
        if before_commit is not None:
            before_commit(tmp)
    except Exception as exc:  # agreed on below, so no rank waits for a failed one
        error = exc
    if any_rank(error is not None, process_group):
        # The hidden directory is never renamed, so never taken for a checkpoint;
        # removing it only saves space.
        if group_rank(process_group) == 0:
            shutil.rmtree(tmp, ignore_errors=True)
        if error is not None:
            raise error
        raise RuntimeError(f"saving {path!r} failed on another rank; nothing was committed")
    run_on_first(lambda: commit_dir(tmp, path), process_group)
    return path


def load_state(
    path: str,
    model: nn.Module,
    optimizer: torch.optim.Optimizer | None = None,
    *,
    strict: bool = True,
    process_group: dist.ProcessGroup | None = None,
) -> LoadResult:
    """Load a checkpoint written by ``save_state`` (or by DCP from PyTorch FSDP2/DDP state dicts).

    Works at any world size and sharding strategy: each rank reads exactly the
    rows its own parameters and optimizer state hold. With ``strict`` (default)
    any missing, unexpected or differently-shaped key raises
    ``CheckpointMismatchError`` naming it; with ``strict=False`` those keys are
    skipped, logged and returned.
    """
    metadata = read_metadata(path)
    reshard_all(model)
    model_targets, report = plan_model_load(model_entries(model), metadata)
    optim_plan = None
    if optimizer is not None:
        optim_plan = plan_optimizer_load(model, optimizer, metadata)
        _merge(report, optim_plan.report)
    settle(report, strict, repr(path))
    entries = dict(model_targets)
    if optim_plan is not None and optim_plan.group_keys:
        entries.update(optim_plan.entries)
    read_dcp(entries, path, process_group)
    apply_model_state(model, {k: entries[k] for k in model_targets})
    if optim_plan is not None and optim_plan.group_keys:
        apply_optimizer_state(model, optimizer, optim_plan, entries)
    return LoadResult(report.missing_keys, report.unexpected_keys, report.mismatched_keys)


def _merge(into: KeyReport, other: KeyReport) -> None:
    into.missing_keys += other.missing_keys
    into.unexpected_keys += other.unexpected_keys
    into.mismatched_keys += other.mismatched_keys
