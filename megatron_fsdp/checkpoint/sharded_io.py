"""Sharded save and load of a model (+ optimizer) with torch.distributed.checkpoint.

``save_state`` writes into a hidden scratch directory next to the target and
renames it into place only after every rank's data, DCP's ``.metadata`` and the
SHA-256 ``manifest.json`` of every file are on disk, so a crash mid-save leaves
no directory that looks like a checkpoint (``dirs``). ``load_state``
checks every file against the manifest (``integrity``) and the
checkpoint's metadata against the model first, so a damaged file, a missing
key, an unexpected key or a shape mismatch fails naming the file or tensor (on
every rank alike) before anything is read, or, with ``strict=False``, mismatched
keys are skipped and reported.

Both are collective over ``process_group`` (default: the default group); with
torch.distributed not initialised they run in a single process.
"""

from __future__ import annotations

import os
import uuid
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint import DefaultLoadPlanner, FileSystemReader, FileSystemWriter
from torch.distributed.checkpoint.metadata import Metadata

from megatron_fsdp.checkpoint.dirs import ScratchDir, clean_stale, fsync_dir, resolve_committed
from megatron_fsdp.checkpoint.integrity import (
    MANIFEST_FILE,
    METADATA_FILE,
    CheckpointCorruptError,
    check_storage_files,
    describe_problems,
    hash_files,
    list_files,
    manifest_text,
    read_manifest,
    read_part,
    share,
    verify_files,
)
from megatron_fsdp.checkpoint.model_parallel import NO_MODEL_PARALLEL, ModelParallel
from megatron_fsdp.checkpoint.state_dicts import (
    KeyReport,
    apply_model_state,
    apply_optimizer_state,
    logger,
    model_entries,
    model_names,
    optimizer_entries,
    plan_model_load,
    plan_optimizer_load,
    reshard_all,
    settle,
)
from megatron_fsdp.comm.objects import all_gather_objects, broadcast_object


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
    return broadcast_object(value, process_group)


def any_rank(flag: bool, process_group: dist.ProcessGroup | None) -> bool:
    """True on every rank if ``flag`` is true on any rank of the group (also a barrier)."""
    if not _distributed():
        return flag
    return any(all_gather_objects(bool(flag), process_group))


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


# -- atomic directories and integrity --------------------------------------
def agree(fn: Callable[[], Any], process_group: dist.ProcessGroup | None) -> Any:
    """Run ``fn`` on every rank; if it raised on any rank, raise on every rank (its own error first).

    For steps that read files on each rank: a failure on one rank alone would
    leave the others waiting in the next collective.
    """
    result, error = None, None
    try:
        result = fn()
    except Exception as exc:  # re-raised below, on every rank
        error = exc
    if not _distributed():
        if error is not None:
            raise error
        return result
    errors = all_gather_objects(None if error is None else (type(error).__name__, str(error)), process_group)
    if error is not None:
        raise error
    for rank, failure in enumerate(errors):
        if failure is not None:
            raise RuntimeError(f"rank {rank} of the group failed: {failure[0]}: {failure[1]}")
    return result


def write_file_atomically(path: str, data: bytes) -> None:
    tmp = f"{path}.tmp-{uuid.uuid4().hex[:12]}"
    with open(tmp, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    fsync_dir(os.path.dirname(os.path.abspath(path)))


def is_checkpoint_dir(path: str) -> bool:
    return os.path.isfile(os.path.join(path, METADATA_FILE))


def read_metadata(path: str) -> Metadata:
    """DCP metadata of ``path``; a missing, empty or garbled ``.metadata`` raises an error naming it."""
    if not is_checkpoint_dir(path):
        raise FileNotFoundError(
            f"{path!r} is not a torch.distributed.checkpoint directory (no {METADATA_FILE} file in it); "
            "pass the directory save_state wrote (for the Megatron layout, <save_dir>/iter_XXXXXXX)"
        )
    metadata = read_part(os.path.join(path, METADATA_FILE), "the DCP metadata (the index of every saved tensor)",
                         lambda _: FileSystemReader(path).read_metadata())
    if not isinstance(metadata, Metadata):
        raise CheckpointCorruptError(
            f"{os.path.join(path, METADATA_FILE)} holds a {type(metadata).__name__}, not DCP metadata; the file was "
            "replaced. Restore the checkpoint from a copy, or load an earlier iteration"
        )
    return metadata


def write_manifest(directory: str, process_group: dist.ProcessGroup | None) -> None:
    """Hash (and fsync) every file of ``directory``, the work shared by the group's ranks; rank 0 writes the manifest.

    Collective. Called after every rank finished writing its files.
    """
    rank, world = group_rank(process_group), group_size(process_group)
    files = broadcast_from_first(list_files(directory) if rank == 0 else None, process_group)
    entries = agree(lambda: hash_files(directory, share(files, world, rank), fsync=True), process_group)
    if _distributed():
        gathered = all_gather_objects(entries, process_group)
        entries = {k: v for part in gathered for k, v in part.items()}

    def write() -> None:
        with open(os.path.join(directory, MANIFEST_FILE), "wb") as f:
            f.write(manifest_text(entries))
            f.flush()
            os.fsync(f.fileno())
        for root, _, _ in os.walk(directory):
            fsync_dir(root)

    run_on_first(write, process_group)


_unverified_warned: set[str] = set()


def verify_checkpoint(path: str, process_group: dist.ProcessGroup | None = None, *, collective: bool = True) -> bool:
    """Check every file of ``path`` against its manifest (the work shared by the group's ranks); False if none.

    Raises ``CheckpointIncompleteError`` / ``CheckpointCorruptError`` naming each bad
    file, on every rank. A directory without a manifest (written by an older
    version, or by plain ``dcp.save``) is loaded with a warning (once per path).
    ``collective=False``: this process alone checks every file.
    """
    group = process_group if collective else None
    distributed = collective and _distributed()
    rank, world = (group_rank(group), group_size(group)) if distributed else (0, 1)
    expected = run_on_first(lambda: read_manifest(path), group) if distributed else read_manifest(path)
    if expected is None:
        if path not in _unverified_warned:
            _unverified_warned.add(path)
            warnings.warn(f"checkpoint {path} has no {MANIFEST_FILE} (written by an older version or by plain "
                          "dcp.save): its files cannot be checked for damage", stacklevel=3)
        return False
    problems = verify_files(path, expected, share({k: v["size"] for k, v in expected.items()}, world, rank))
    if distributed:
        gathered = all_gather_objects(problems, group)
        problems = [p for part in gathered for p in part]
    if problems:
        raise describe_problems(path, sorted(problems, key=lambda p: p[1]))
    return True


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


def state_entries(
    model: nn.Module, optimizer: torch.optim.Optimizer | None, model_parallel: ModelParallel | None = None
) -> dict[str, Any]:
    """The flat dict ``save_state`` writes (see ``state_dicts``; ``model_parallel`` in ``model_parallel``)."""
    layout = model_parallel or NO_MODEL_PARALLEL
    reshard_all(model)
    entries = model_entries(model, layout)
    if optimizer is not None:
        entries.update(optimizer_entries(model, optimizer, layout))
    return entries


def save_state(
    path: str,
    model: nn.Module,
    optimizer: torch.optim.Optimizer | None = None,
    *,
    process_group: dist.ProcessGroup | None = None,
    before_commit: Callable[[str], None] | None = None,
    model_parallel: ModelParallel | None = None,
) -> str:
    """Write ``model`` (and ``optimizer``) as a sharded DCP checkpoint at ``path``, atomically.

    Every rank of ``process_group`` writes only its own shards into a hidden
    scratch directory beside ``path``. ``before_commit``, if given, is called on
    every rank with that directory after the DCP write, to add files of its own.
    Then every file is hashed into ``manifest.json`` and the directory is renamed
    to ``path`` (an existing ``path`` is swapped out, never left missing where the
    system can exchange directories). Scratch directories of earlier saves into
    the same parent whose process died are removed first. Returns ``path`` (absolute).

    ``model_parallel``: with tensor or expert parallelism, this rank's place in it;
    entries are then the unsplit model's (``model_parallel`` module), loadable at any
    other tensor-/expert-parallel size.
    """
    return write_state(path, state_entries(model, optimizer, model_parallel), process_group=process_group,
                       before_commit=before_commit)


def write_state(
    path: str,
    entries: dict[str, Any],
    *,
    process_group: dist.ProcessGroup | None = None,
    before_commit: Callable[[str], None] | None = None,
) -> str:
    """``save_state``'s write of ``entries`` (``state_entries``, or a staged copy of them), atomically at ``path``.

    Collective over ``process_group``. Returns ``path`` (absolute).
    """
    path = os.path.abspath(path)
    scratch: ScratchDir | None = None  # the group's first rank only

    def create() -> str:
        nonlocal scratch
        try:
            removed = clean_stale(os.path.dirname(path))
        except OSError as exc:  # never fail a save for want of clean-up
            logger.warning("could not remove the scratch of interrupted saves beside %s: %s", path, exc)
        else:
            if removed:
                logger.warning("removed the scratch of interrupted saves: %s", ", ".join(removed))
        scratch = ScratchDir(path)
        return scratch.path

    tmp = run_on_first(create, process_group)
    committed = False
    try:
        error: Exception | None = None
        try:
            write_dcp(entries, tmp, process_group)
            if before_commit is not None:
                before_commit(tmp)
        except Exception as exc:  # agreed on below, so no rank waits for a failed one
            error = exc
        if any_rank(error is not None, process_group):
            if error is not None:
                raise error
            raise RuntimeError(f"saving {path!r} failed on another rank; nothing was committed")
        write_manifest(tmp, process_group)
        run_on_first(lambda: scratch.commit(), process_group)
        committed = True
    finally:
        # An uncommitted scratch directory is never taken for a checkpoint; removing it only saves space.
        if scratch is not None:
            scratch.close(remove=not committed)
    return path


def load_state(
    path: str,
    model: nn.Module,
    optimizer: torch.optim.Optimizer | None = None,
    *,
    strict: bool = True,
    process_group: dist.ProcessGroup | None = None,
    verify: bool = True,
    model_parallel: ModelParallel | None = None,
) -> LoadResult:
    """Load a checkpoint written by ``save_state`` (or by DCP from PyTorch FSDP2/DDP state dicts).

    Works at any world size and sharding strategy: each rank reads exactly the
    rows its own parameters and optimizer state hold. First every file is checked
    against the checkpoint's ``manifest.json`` (``verify=False`` skips this, for
    callers that just did it); a missing, truncated or damaged file raises
    ``CheckpointIncompleteError`` / ``CheckpointCorruptError`` naming it. With
    ``strict`` (default) any missing, unexpected or differently-shaped key raises
    ``CheckpointMismatchError`` naming it; with ``strict=False`` those keys are
    skipped, logged and returned. ``model_parallel`` as in ``save_state`` (for this run's layout,
    whatever the saving run's).
    """
    layout = model_parallel or NO_MODEL_PARALLEL
    path = resolve_committed(path)
    metadata = agree(lambda: read_metadata(path), process_group)
    verified = verify_checkpoint(path, process_group) if verify else True
    agree(lambda: check_storage_files(path, metadata), process_group)
    reshard_all(model)
    model_targets, report = plan_model_load(model_entries(model, layout), metadata)
    optim_plan = None
    if optimizer is not None:
        optim_plan = plan_optimizer_load(model, optimizer, metadata, layout)
        _merge(report, optim_plan.report)
    if layout != NO_MODEL_PARALLEL:
        report = _across_ranks(report, process_group)
    settle(report, strict, repr(path))
    entries = dict(model_targets)
    if optim_plan is not None and optim_plan.group_keys:
        entries.update(optim_plan.entries)
    try:
        read_dcp(entries, path, process_group)
    except Exception as exc:
        if verified:
            raise  # the files are those that were saved: not a damaged checkpoint
        raise CheckpointCorruptError(
            f"reading the tensors of checkpoint {path} failed ({type(exc).__name__}: {exc}). It has no "
            f"{MANIFEST_FILE} to check its files against; a file modified after the save is the likely cause. "
            "Restore it from a copy, or load an earlier iteration"
        ) from exc
    names = None if layout == NO_MODEL_PARALLEL else model_names(model, layout)
    apply_model_state(model, {k: entries[k] for k in model_targets}, names)
    if optim_plan is not None and optim_plan.group_keys:
        apply_optimizer_state(model, optimizer, optim_plan, entries, layout)
    return LoadResult(report.missing_keys, report.unexpected_keys, report.mismatched_keys)


def _across_ranks(report: KeyReport, process_group: dist.ProcessGroup | None) -> KeyReport:
    """The group's report: a key is unexpected only if no rank wants it; missing or mismatched if so on any.

    With model parallelism ranks hold different parameters (expert-parallel ranks
    other experts): each rank reads only its own, and every rank must raise alike.
    """
    if not _distributed():
        return report
    reports = all_gather_objects(report, process_group)
    unexpected = set.intersection(*(set(r.unexpected_keys) for r in reports))

    def union(lists: list[list[str]]) -> list[str]:
        return list(dict.fromkeys(k for keys in lists for k in keys))

    return KeyReport(union([r.missing_keys for r in reports]),
                     [k for k in report.unexpected_keys if k in unexpected],
                     union([r.mismatched_keys for r in reports]))


def _merge(into: KeyReport, other: KeyReport) -> None:
    into.missing_keys += other.missing_keys
    into.unexpected_keys += other.unexpected_keys
    into.mismatched_keys += other.mismatched_keys
