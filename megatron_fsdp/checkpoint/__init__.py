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

import importlib

# Loaded on first access (PEP 562), so that ``import megatron_fsdp`` (which imports this
# package's parent only) and ``import megatron_fsdp.checkpoint`` do not load
# torch.distributed.checkpoint until a checkpoint name is used.
_LAZY = {
    "TRACKER_FILE": "iterations",
    "AsyncSave": "iterations",
    "CheckpointCorruptError": "integrity",
    "CheckpointIncompleteError": "integrity",
    "CheckpointMismatchError": "state_dicts",
    "LoadedCheckpoint": "iterations",
    "ModelParallel": "model_parallel",
    "async_save_checkpoint": "iterations",
    "export_full_state_dict": "export",
    "import_full_state_dict": "export",
    "iteration_dir": "iterations",
    "load_checkpoint": "iterations",
    "load_state": "sharded_io",
    "read_latest_iteration": "iterations",
    "save_checkpoint": "iterations",
    "save_state": "sharded_io",
}

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


def __getattr__(name: str) -> object:
    """Import a re-exported name's submodule on first access (``_LAZY``)."""
    if name not in _LAZY:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f"{__name__}.{_LAZY[name]}"), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_LAZY))
