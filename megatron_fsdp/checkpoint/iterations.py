"""Distributed checkpoints (``--ckpt-format fsdp_dtensor``) in the Megatron directory layout.

::

    <save_dir>/latest_checkpointed_iteration.txt   the last complete iteration ("10"), replaced atomically
    <save_dir>/iter_0000010/                       renamed into place only when complete
        .metadata, __*_*.distcp                    DCP: sharded model + FQN-keyed optimizer state
        extra.pt                                   the caller's rank-independent dict (rank 0, torch.save)
        checkpoint.json                            format, iteration, world size, torch version
        rng/rank_00000.pt ...                      per-rank RNG states (python, numpy, torch CPU/CUDA)
        manifest.json                              size and SHA-256 of every file, written last

``save_checkpoint`` / ``load_checkpoint`` are what the Megatron front-end calls;
``save_state`` / ``load_state`` (re-exported from ``sharded_io``) are the same
without the layout, for any directory. Docs: docs/checkpointing.md.
"""

from __future__ import annotations

import atexit
import copy
import json
import os
import random
import sys
import threading
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from megatron_fsdp.checkpoint.dirs import resolve_committed
from megatron_fsdp.checkpoint.integrity import CheckpointCorruptError, CheckpointIncompleteError, read_part
from megatron_fsdp.checkpoint.model_parallel import ModelParallel, staged_copy
from megatron_fsdp.checkpoint.sharded_io import (
    LoadResult,
    agree,
    group_rank,
    group_size,
    is_checkpoint_dir,
    load_state,
    run_on_first,
    save_state,
    state_entries,
    verify_checkpoint,
    write_file_atomically,
    write_state,
)
from megatron_fsdp.checkpoint.state_dicts import CheckpointMismatchError

__all__ = [
    "AsyncSave",
    "CheckpointCorruptError",
    "CheckpointIncompleteError",
    "CheckpointMismatchError",
    "LoadResult",
    "LoadedCheckpoint",
    "TRACKER_FILE",
    "iteration_dir",
    "load_checkpoint",
    "load_state",
    "read_latest_iteration",
    "async_save_checkpoint",
    "save_checkpoint",
    "save_state",
    "state_entries",
]

CHECKPOINT_FORMAT = "fsdp_dtensor"
TRACKER_FILE = "latest_checkpointed_iteration.txt"
EXTRA_FILE = "extra.pt"
INFO_FILE = "checkpoint.json"
RNG_DIR = "rng"


@dataclass
class LoadedCheckpoint:
    """What ``load_checkpoint`` restored."""

    iteration: int
    path: str
    extra: dict[str, Any]
    rng_restored: bool
    missing_keys: list[str] = field(default_factory=list)  # strict=False only
    unexpected_keys: list[str] = field(default_factory=list)
    mismatched_keys: list[str] = field(default_factory=list)


def iteration_dir(save_dir: str, iteration: int) -> str:
    """``save_dir/iter_0000010`` for iteration 10."""
    return os.path.join(save_dir, f"iter_{iteration:07d}")


# -- RNG ----------------------------------------------------------------------
def _rng_state() -> dict[str, Any]:
    state: dict[str, Any] = {"python": random.getstate(), "torch_cpu": torch.get_rng_state()}
    try:
        import numpy
    except ImportError:
        pass
    else:
        state["numpy"] = numpy.random.get_state()
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["torch_cuda"] = torch.cuda.get_rng_state()
    return state


def _set_rng_state(state: dict[str, Any]) -> None:
    random.setstate(state["python"])
    torch.set_rng_state(state["torch_cpu"])
    if "numpy" in state:
        try:
            import numpy
        except ImportError:
            pass
        else:
            numpy.random.set_state(state["numpy"])
    if "torch_cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["torch_cuda"])


def _rng_file(directory: str, rank: int) -> str:
    return os.path.join(directory, RNG_DIR, f"rank_{rank:05d}.pt")


# -- save -----------------------------------------------------------------------
def save_checkpoint(
    save_dir: str,
    iteration: int,
    model: nn.Module,
    optimizer: torch.optim.Optimizer | None = None,
    extra: dict | None = None,
    *,
    process_group: dist.ProcessGroup | None = None,
    model_parallel: ModelParallel | None = None,
) -> str:
    """Write ``save_dir/iter_{iteration:07d}/`` atomically, then point the tracker file at it.

    Collective: every rank of ``process_group`` (default: all ranks) calls it.
    ``model`` may be sharded with ``fully_shard`` (per module or at the root), a
    plain module, or wrapped in ``DistributedDataParallel``; keys are FQNs without
    wrapper prefixes in every case. ``extra`` is a picklable dict of
    rank-independent things (scheduler state, consumed samples, args), written
    once by rank 0. Each rank's RNG states are saved too. Returns the directory.

    Refuses (``ValueError``, before writing anything) an ``iteration`` below the
    one the tracker names: the tracker would move back and later checkpoints
    would silently stop being the ones resumed. Saving the tracker's own
    iteration again replaces that checkpoint safely.
    """
    save = _PreparedSave.of(save_dir, iteration, extra, process_group)
    return save.write(state_entries(model, optimizer, model_parallel), process_group)


@dataclass
class _PreparedSave:
    """What a save writes besides the model and optimizer, taken when it is called (RNG states, ``extra``)."""

    save_dir: str
    iteration: int
    extra: dict
    rng: dict[str, Any]

    @classmethod
    def of(cls, save_dir: str, iteration: int, extra: dict | None,
           process_group: dist.ProcessGroup | None) -> _PreparedSave:
        if isinstance(iteration, bool) or not isinstance(iteration, int) or iteration < 0:
            raise ValueError(f"iteration must be a non-negative int, got {iteration!r}")
        if extra is not None and not isinstance(extra, dict):
            raise TypeError(f"extra must be a dict (or None), got {type(extra).__name__}")
        run_on_first(lambda: check_tracker_not_ahead(save_dir, iteration), process_group)
        return cls(save_dir, iteration, dict(extra or {}), _rng_state())

    def write(self, entries: dict[str, Any], process_group: dist.ProcessGroup | None) -> str:
        """Write the iteration's directory and then the tracker (collective over ``process_group``)."""
        rank, world = group_rank(process_group), group_size(process_group)

        def add_files(tmp: str) -> None:
            os.makedirs(os.path.join(tmp, RNG_DIR), exist_ok=True)
            torch.save(self.rng, _rng_file(tmp, rank))
            if rank == 0:
                torch.save(self.extra, os.path.join(tmp, EXTRA_FILE))
                info = {"format": CHECKPOINT_FORMAT, "iteration": self.iteration, "world_size": world,
                        "torch_version": torch.__version__}
                with open(os.path.join(tmp, INFO_FILE), "w") as f:
                    json.dump(info, f, indent=1)

        path = write_state(iteration_dir(self.save_dir, self.iteration), entries, process_group=process_group,
                           before_commit=add_files)
        tracker = os.path.join(os.path.abspath(self.save_dir), TRACKER_FILE)
        run_on_first(lambda: write_file_atomically(tracker, f"{self.iteration}\n".encode()), process_group)
        return path


class AsyncSave:
    """A checkpoint being written by a background thread (``async_save_checkpoint``).

    ``done()`` says whether the write has finished (committed or failed); ``wait()``
    blocks until it has and returns the directory, or raises the write's error. The
    tracker names the iteration only once its directory is committed. The thread is not a
    daemon: a process that ends without ``wait()`` still finishes the write before it exits
    (Python joins such threads first), rather than losing the save or, with the thread inside
    a gloo collective while the interpreter finalizes, aborting (comm/lending.py). A save
    nobody waited for that failed (e.g. ``destroy_process_group()`` came before the write
    finished: its collectives need the group) is reported on stderr at exit, naming the fix.
    """

    def __init__(self, save: _PreparedSave, entries: dict[str, Any], io_group: dist.ProcessGroup | None) -> None:
        self.iteration = save.iteration
        self._path: str | None = None
        self._error: BaseException | None = None

        def run() -> None:
            try:
                self._path = save.write(entries, io_group)
            except BaseException as exc:  # handed to wait(), on the training thread
                self._error = exc

        self._save_dir = save.save_dir
        self._thread = threading.Thread(target=run, name=f"checkpoint-iter-{save.iteration}", daemon=False)
        self._thread.start()
        _not_waited.append(self)

    def done(self) -> bool:
        return not self._thread.is_alive()

    def wait(self) -> str:
        self._thread.join()
        if self in _not_waited:
            _not_waited.remove(self)
        if self._error is not None:
            raise self._error
        assert self._path is not None
        return self._path


_not_waited: list[AsyncSave] = []


def _report_failed_saves_not_waited_for() -> None:
    # Runs after Python joined the writer threads (they are not daemons).
    for pending in list(_not_waited):
        pending._thread.join()
        if pending._error is not None:
            print(f"megatron_fsdp: the background checkpoint save of iteration {pending.iteration} into "
                  f"{pending._save_dir} FAILED and nothing called its wait(): {pending._error!r}. Call "
                  "AsyncSave.wait() before torch.distributed.destroy_process_group() and before the process "
                  "ends.", file=sys.stderr, flush=True)


atexit.register(_report_failed_saves_not_waited_for)


def async_save_checkpoint(
    save_dir: str,
    iteration: int,
    model: nn.Module,
    optimizer: torch.optim.Optimizer | None = None,
    extra: dict | None = None,
    *,
    io_group: dist.ProcessGroup | None,
    process_group: dist.ProcessGroup | None = None,
    model_parallel: ModelParallel | None = None,
) -> AsyncSave:
    """``save_checkpoint`` written in the background: returns once this rank's state is copied to host memory.

    Collective over ``process_group`` for the copy (the tracker check, the model's
    reshard); the write itself (DCP files, manifest, commit, tracker) runs on a thread
    whose collectives use ``io_group``: a group of the same ranks that nothing else
    uses while the save runs (gloo; collectives of two threads on one group would
    interleave). Training may change the model and optimizer as soon as this returns.
    Call ``wait()`` on the result before the next save into ``save_dir`` and before
    the process ends.
    """
    save = _PreparedSave.of(save_dir, iteration, extra, process_group)
    save.extra = copy.deepcopy(save.extra)
    entries = {k: staged_copy(v) for k, v in state_entries(model, optimizer, model_parallel).items()}
    return AsyncSave(save, entries, io_group)


def check_tracker_not_ahead(save_dir: str, iteration: int) -> None:
    """Raise ``ValueError`` if ``save_dir``'s tracker names an iteration after ``iteration``."""
    if not os.path.isfile(os.path.join(save_dir, TRACKER_FILE)):
        return
    latest = read_latest_iteration(save_dir)
    if latest > iteration:
        raise ValueError(
            f"refusing to save iteration {iteration} into {save_dir}: its {TRACKER_FILE} names iteration {latest}, "
            f"and this save would move it back (a resume would start from {iteration} and skip the later "
            f"checkpoints). Save into another directory, or remove {TRACKER_FILE} and the iter_* directories after "
            f"{iteration} there if they are to be discarded"
        )


# -- load -----------------------------------------------------------------------
def read_latest_iteration(load_dir: str) -> int:
    """The iteration named by ``load_dir/latest_checkpointed_iteration.txt``."""
    tracker = os.path.join(load_dir, TRACKER_FILE)
    if not os.path.isfile(tracker):
        raise FileNotFoundError(
            f"no checkpoint in {load_dir!r}: expected {TRACKER_FILE} (written by save_checkpoint) naming the "
            "latest iteration, with an iter_XXXXXXX directory beside it; or pass iteration=..."
        )
    text = read_part(tracker, "the latest iteration's number", lambda p: open(p, "rb").read().decode()).strip()
    if not text.isdigit():
        raise CheckpointCorruptError(f"{tracker} should hold an iteration number, but holds {text[:40]!r}")
    return int(text)


def _read_info(path: str) -> dict[str, Any]:
    def parse(file: str) -> dict[str, Any]:
        with open(file, "rb") as f:
            info = json.loads(f.read().decode())
        if not isinstance(info, dict) or not isinstance(info.get("world_size"), int):
            raise ValueError("expected a JSON object with an integer 'world_size'")
        return info

    return read_part(os.path.join(path, INFO_FILE), "the format, iteration and world size of the save", parse)


def _read_extra(path: str) -> dict[str, Any]:
    def parse(file: str) -> dict[str, Any]:
        # On the host: without map_location, CUDA tensors saved by rank r would land on the saving
        # device (cuda:0 for rank 0's file) on every loading rank.
        extra = torch.load(file, map_location="cpu", weights_only=False)
        if not isinstance(extra, dict):
            raise TypeError(f"expected a dict, found a {type(extra).__name__}")
        return extra

    return read_part(os.path.join(path, EXTRA_FILE), "the caller's extra state (e.g. scheduler, data position)",
                     parse)


def load_checkpoint(
    load_dir: str,
    model: nn.Module,
    optimizer: torch.optim.Optimizer | None = None,
    *,
    iteration: int | None = None,
    load_optimizer: bool = True,
    load_rng: bool = True,
    strict: bool = True,
    process_group: dist.ProcessGroup | None = None,
    check_extra: Callable[[dict[str, Any]], None] | None = None,
    model_parallel: ModelParallel | None = None,
) -> LoadedCheckpoint:
    """Restore what ``save_checkpoint`` wrote, at any world size and sharding strategy.

    ``iteration=None`` loads the one named by the tracker file. Before anything is
    read, every file is checked against the checkpoint's manifest, and a missing
    part (``extra.pt``, ``checkpoint.json``, a shard, an RNG file) raises
    ``CheckpointIncompleteError`` naming it; a damaged or unreadable one
    ``CheckpointCorruptError``. ``check_extra(extra)``, if given, runs next, before
    any tensor is read (e.g. to refuse a checkpoint of another model
    configuration). RNG states are restored only when the rank count equals the
    saving run's (each rank gets its own); otherwise a warning says so and they
    are left alone. With ``strict=False`` missing, unexpected or mis-shaped keys
    are skipped and listed in the result instead of raising
    ``CheckpointMismatchError``.
    """
    rank, world = group_rank(process_group), group_size(process_group)

    def locate() -> tuple[int, str]:
        number = read_latest_iteration(load_dir) if iteration is None else iteration
        path = resolve_committed(iteration_dir(load_dir, number))
        if not is_checkpoint_dir(path):
            raise FileNotFoundError(
                f"no checkpoint for iteration {number} in {load_dir!r}: expected the directory {path!r} holding "
                "a complete save_checkpoint output (with its .metadata file)"
            )
        return number, path

    number, path = run_on_first(locate, process_group)
    verify_checkpoint(path, process_group)
    info, extra = agree(lambda: (_read_info(path), _read_extra(path)), process_group)
    if check_extra is not None:
        check_extra(extra)
    saved_world = info["world_size"]
    restore_rng = load_rng and saved_world == world
    rng = agree(lambda: _read_rng(path, rank) if restore_rng else None, process_group)
    result: LoadResult = load_state(
        path, model, optimizer if load_optimizer else None, strict=strict, process_group=process_group,
        verify=False, model_parallel=model_parallel,
    )
    if restore_rng:
        _set_rng_state(rng)
    elif load_rng:
        warnings.warn(
            f"checkpoint {path} was saved by {saved_world} ranks and this run has {world}: per-rank RNG states are "
            "not restored (no rank of this run corresponds to one of the saving run), so random draws such as "
            "dropout masks differ from those of an uninterrupted run",
            stacklevel=2,
        )
    return LoadedCheckpoint(number, path, extra, restore_rng, result.missing_keys, result.unexpected_keys,
                            result.mismatched_keys)


def _read_rng(path: str, rank: int) -> dict[str, Any]:
    def parse(file: str) -> dict[str, Any]:
        state = torch.load(file, map_location="cpu", weights_only=False)  # RNG states are host tensors
        if not isinstance(state, dict) or "python" not in state or "torch_cpu" not in state:
            raise ValueError("expected a dict with 'python' and 'torch_cpu' RNG states")
        return state

    return read_part(_rng_file(path, rank), f"rank {rank}'s RNG states", parse)
