"""``save_checkpoint`` / ``load_checkpoint`` of the placements API: one DCP checkpoint of model and optimizer.

Keys are Megatron-LM v2's (``dcp.save({"model": ..., "optimizer": ...})`` over torch's FQN-keyed
state dicts): ``model.<fqn>``, ``optimizer.state.<fqn>.<name>``, ``optimizer.param_groups.<i>.<hyper>``.
The engine's checkpoint code writes and reads them (``megatron_fsdp.checkpoint``: each rank its own
rows, any world size or strategy on load, a manifest of file hashes), so ``load_state``, the
``python -m megatron_fsdp.checkpoint`` tools and FSDP2's ``get_state_dict`` + ``dcp.load`` read these
checkpoints too.
"""

from __future__ import annotations

import os

import torch
from torch import nn

from megatron_fsdp.checkpoint.sharded_io import load_state, write_state
from megatron_fsdp.checkpoint.state_dicts import model_entries, optimizer_entries, reshard_all
from megatron_fsdp.core.lookup import units_of

__all__ = ["load_checkpoint", "save_checkpoint"]


def save_checkpoint(model: nn.Module, optimizer: torch.optim.Optimizer, checkpoint_dir: str | os.PathLike) -> None:
    """Save ``model`` (sharded with ``fully_shard``) and ``optimizer`` as a DCP checkpoint in ``checkpoint_dir``.

    Collective over the default process group; written atomically (an existing directory is replaced).
    """
    reshard_all(model)
    entries = model_entries(model)
    entries.update(optimizer_entries(model, optimizer, prefix="optimizer."))
    write_state(os.fspath(checkpoint_dir), entries)


def load_checkpoint(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    checkpoint_dir: str | os.PathLike,
    *,
    sync_model_weights: bool = True,
) -> None:
    """Load a checkpoint of ``save_checkpoint`` (or of ``megatron_fsdp.save_state``) into ``model`` and ``optimizer``.

    Any world size, placements or strategy at save time; every key must match (a missing or extra one
    raises ``megatron_fsdp.CheckpointMismatchError`` naming it).

    Args:
        model, optimizer: sharded with ``fully_shard`` and ``fully_shard_optimizer``.
        checkpoint_dir: the checkpoint's directory.
        sync_model_weights: make the next forward use the loaded weights (always the case here:
            the engine refreshes its compute weights after a load; ``False`` changes nothing).
    """
    load_state(os.fspath(checkpoint_dir), model, optimizer)
    if sync_model_weights:
        for unit in units_of(model):
            unit.mark_weights_stale()
