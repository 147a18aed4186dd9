"""checkpoint: sharded save and load, full-state-dict export, and the checkpoint command line.

Owns distributed checkpoints in the Megatron directory layout (``iterations``:
``save_checkpoint``/``load_checkpoint``, ``async_save_checkpoint`` in the background),
sharded DCP I/O of a model and optimizer (``sharded_io``: ``save_state``/``load_state``), the state dicts it writes
(``state_dicts``; tensor-parallel slices and expert renaming in ``model_parallel``),
atomic directories and integrity manifests (``dirs``,
``integrity``), full state dicts exported one tensor at a time (``export``,
``safetensors_stream``) and ``python -m megatron_fsdp.checkpoint`` (``cli``).
May import ``comm``, ``memory``, ``sharding`` and ``core``; not ``optim`` or ``api``.
The names below are re-exported for ``from megatron_fsdp.checkpoint import ...``.
"""

from megatron_fsdp.checkpoint.export import export_full_state_dict, import_full_state_dict
from megatron_fsdp.checkpoint.integrity import CheckpointCorruptError, CheckpointIncompleteError
from megatron_fsdp.checkpoint.iterations import (
    TRACKER_FILE,
    AsyncSave,
    LoadedCheckpoint,
    async_save_checkpoint,
    iteration_dir,
    load_checkpoint,
    read_latest_iteration,
    save_checkpoint,
)
from megatron_fsdp.checkpoint.model_parallel import ModelParallel
from megatron_fsdp.checkpoint.sharded_io import load_state, save_state
from megatron_fsdp.checkpoint.state_dicts import CheckpointMismatchError

__all__ = [
    "TRACKER_FILE",
    "AsyncSave",
    "CheckpointCorruptError",
    "CheckpointIncompleteError",
    "CheckpointMismatchError",
    "LoadedCheckpoint",
    "ModelParallel",
    "async_save_checkpoint",
    "export_full_state_dict",
    "import_full_state_dict",
    "iteration_dir",
    "load_checkpoint",
    "load_state",
    "read_latest_iteration",
    "save_checkpoint",
    "save_state",
]
