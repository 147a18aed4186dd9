"""Full (unsharded) state dicts: export from a live model or a checkpoint directory, import into a model.

Formats, chosen by the output's extension:

- ``.safetensors`` streams: the header is written from shapes and dtypes alone,
  then each tensor is gathered (or read), written and dropped, so no process ever
  holds more than one full tensor. Import reads only each tensor's bytes.
- ``.pt`` / ``.pth`` (``torch.save``): the format needs the whole dict at once, so
  the writing rank holds the full model in memory; import maps the file lazily
  (``torch.load(mmap=True)``).
"""

from __future__ import annotations

import os
import re
import uuid
import warnings
from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint import DefaultLoadPlanner, FileSystemReader
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.metadata import TensorStorageMetadata
from torch.distributed.tensor import DTensor

from megatron_fsdp.checkpoint.integrity import MANIFEST_FILE, CheckpointCorruptError, check_storage_files
from megatron_fsdp.checkpoint.safetensors_stream import SafetensorsWriter, TensorSpec, read_header, read_tensor
from megatron_fsdp.checkpoint.sharded_io import any_rank, group_rank, read_metadata, verify_checkpoint
from megatron_fsdp.checkpoint.state_dicts import MODEL_PREFIX, KeyReport, model_entries, reshard_all, settle
from megatron_fsdp.sharding.ragged_shard import full_tensor

# torch.load(weights_only=True)'s refusal of a pickled class it was not told is safe
_UNSUPPORTED_GLOBAL = re.compile(r"Unsupported global: GLOBAL ([\w.]+)")


class CheckpointClassError(RuntimeError):
    """A checkpoint stores tensors of a class this process has not allowlisted for ``weights_only`` loading.

    Not damage: ``torch.save`` pickles a tensor subclass's class with its data (torchao's
    ``WeightWithDynamicFloat8CastTensor`` under float8 training, as with PyTorch FSDP2), and DCP's
    reader accepts it once the class's package, which allowlists it on import, is imported.
    """

SAFETENSORS = (".safetensors",)
TORCH_SAVE = (".pt", ".pth")


def _format(path: str) -> str:
    lower = path.lower()
    if lower.endswith(SAFETENSORS):
        return "safetensors"
    if lower.endswith(TORCH_SAVE):
        return "torch"
    raise ValueError(f"cannot tell the format of {path!r}: use a .safetensors (streamed) or .pt/.pth file name")


# -- sources of full tensors, one at a time ---------------------------------
def _checkpoint_specs(checkpoint_dir: str) -> list[TensorSpec]:
    metadata = read_metadata(checkpoint_dir)
    specs = []
    for key, md in metadata.state_dict_metadata.items():
        if key.startswith(MODEL_PREFIX) and isinstance(md, TensorStorageMetadata):
            specs.append(TensorSpec(key[len(MODEL_PREFIX):], md.properties.dtype, tuple(md.size)))
    if not specs:
        raise ValueError(f"checkpoint {checkpoint_dir!r} holds no model tensors (no 'model.*' keys)")
    return specs


def read_full_tensors(checkpoint_dir: str, keys: list[str]) -> dict[str, torch.Tensor]:
    """Whole tensors of a DCP checkpoint (e.g. ``"model.embed.weight"``), read in this process only.

    Every requested tensor is held at once: export reads one key per call.
    """
    entries = read_metadata(checkpoint_dir).state_dict_metadata
    target = {}
    for key in keys:
        md = entries.get(key)
        if not isinstance(md, TensorStorageMetadata):
            raise KeyError(f"checkpoint {checkpoint_dir!r} has no tensor {key!r}")
        target[key] = torch.empty(tuple(md.size), dtype=md.properties.dtype)
    try:
        with warnings.catch_warnings():  # "assuming the intent is to load in a single process": it is
            warnings.simplefilter("ignore", UserWarning)
            dcp.load(target, storage_reader=FileSystemReader(checkpoint_dir),
                     planner=DefaultLoadPlanner(allow_partial_load=True), no_dist=True)
    except (Exception, CheckpointException) as exc:  # DCP wraps a read's failure in a BaseException
        unknown = _UNSUPPORTED_GLOBAL.search(str(exc))
        if unknown:
            module = unknown.group(1).rpartition(".")[0]
            raise CheckpointClassError(
                f"checkpoint {checkpoint_dir} stores tensors of class {unknown.group(1)}, which this process has "
                f"not allowlisted for loading: import {module} first (torchao's float8 modules allowlist their "
                "classes on import), or name it in torch.serialization.add_safe_globals / safe_globals"
            ) from exc
        raise CheckpointCorruptError(
            f"reading {', '.join(keys)} from checkpoint {checkpoint_dir} failed ({type(exc).__name__}: {exc}); a "
            f"file of it is likely damaged (a checkpoint with a {MANIFEST_FILE} names the file: export checks it "
            "first)"
        ) from exc
    return target


def read_full_tensor(checkpoint_dir: str, key: str) -> torch.Tensor:
    """One whole tensor of a DCP checkpoint, read in this process only."""
    return read_full_tensors(checkpoint_dir, [key])[key]


def _iter_checkpoint(checkpoint_dir: str, specs: list[TensorSpec]) -> Iterator[tuple[str, torch.Tensor]]:
    for spec in specs:
        yield spec.name, read_full_tensor(checkpoint_dir, MODEL_PREFIX + spec.name)


def _model_specs(state: dict[str, Any]) -> list[TensorSpec]:
    specs = []
    for key, value in state.items():
        if isinstance(value, torch.Tensor):
            specs.append(TensorSpec(key[len(MODEL_PREFIX):], value.dtype, tuple(value.shape)))
    return specs


def _iter_model(state: dict[str, Any]) -> Iterator[tuple[str, torch.Tensor]]:
    for key, value in state.items():
        if isinstance(value, torch.Tensor):
            yield key[len(MODEL_PREFIX):], full_tensor(value).detach().cpu()  # collective for DTensors


# -- export -------------------------------------------------------------------
def export_full_state_dict(
    source: nn.Module | str, path: str, *, process_group: dist.ProcessGroup | None = None
) -> str:
    """Write the full model state dict of ``source`` to ``path`` (``.safetensors`` or ``.pt``).

    ``source`` is a live model (then collective over ``process_group``: every rank
    calls it, tensors are all-gathered one at a time and the group's first rank
    writes), or the path of a checkpoint directory (``save_state`` /
    ``save_checkpoint`` output; then it runs in the calling process alone, no
    process group needed, and first checks every file against the checkpoint's
    manifest). Keys are FQNs without wrapper prefixes. The file
    appears atomically (written under a temporary name, then renamed).
    """
    kind = _format(path)
    path = os.path.abspath(path)
    if isinstance(source, nn.Module):
        reshard_all(source)
        state = model_entries(source)
        specs, tensors = _model_specs(state), _iter_model(state)
        writer_here = group_rank(process_group) == 0
    elif isinstance(source, (str, os.PathLike)):
        verify_checkpoint(os.fspath(source), collective=False)  # damaged files are named before any tensor is read
        check_storage_files(os.fspath(source), read_metadata(os.fspath(source)))
        specs = _checkpoint_specs(os.fspath(source))
        tensors = _iter_checkpoint(os.fspath(source), specs)
        writer_here, process_group = True, None
    else:
        raise TypeError(f"source must be an nn.Module or a checkpoint directory path, got {type(source).__name__}")
    tmp = f"{path}.tmp-{uuid.uuid4().hex[:12]}"
    error = _write(kind, tmp, specs, tensors, writer_here)
    collective = isinstance(source, nn.Module)
    if any_rank(error is not None, process_group) if collective else error is not None:
        if os.path.exists(tmp):
            os.remove(tmp)
        raise error or RuntimeError(f"exporting to {path!r} failed on the writing rank")
    if writer_here:
        os.replace(tmp, path)
    if collective:
        any_rank(False, process_group)  # the file exists once any rank returns
    return path


def _write(
    kind: str, tmp: str, specs: list[TensorSpec], tensors: Iterator[tuple[str, torch.Tensor]], writer_here: bool
) -> Exception | None:
    """Consume ``tensors`` (every rank: they may be collective) and write them here; return the error."""
    error: Exception | None = None
    writer: SafetensorsWriter | None = None
    full: dict[str, torch.Tensor] = {}
    try:
        if writer_here and kind == "safetensors":
            writer = SafetensorsWriter(tmp, specs, {"format": "pt"})
    except Exception as exc:
        error = exc
    for name, tensor in tensors:
        if not writer_here or error is not None:
            continue  # keep joining the gathers so that no rank waits for this one
        try:
            if writer is not None:
                writer.write(name, tensor)
            else:
                full[name] = tensor  # torch.save needs the whole dict
        except Exception as exc:
            error = exc
    try:
        if writer is not None:
            writer.close()
        elif writer_here and error is None:
            torch.save(full, tmp)
    except Exception as exc:
        error = error or exc
    return error


# -- import -------------------------------------------------------------------
def _open_full(path: str) -> tuple[dict[str, tuple[torch.dtype | None, tuple[int, ...]]], Any]:
    """Shapes in the file, and a function reading one tensor by name."""
    kind = _format(path)
    if not os.path.isfile(path):
        raise FileNotFoundError(f"no full state dict file at {path!r}")
    if kind == "safetensors":
        header, start = read_header(path)
        shapes = {k: (None, tuple(v["shape"])) for k, v in header.items()}
        return shapes, lambda name: read_tensor(path, header[name], start)
    loaded = torch.load(path, map_location="cpu", mmap=True, weights_only=True)
    if not isinstance(loaded, dict):
        raise TypeError(f"{path!r} holds a {type(loaded).__name__}, not a state dict")
    shapes = {k: (v.dtype, tuple(v.shape)) for k, v in loaded.items() if isinstance(v, torch.Tensor)}
    return shapes, loaded.__getitem__


def import_full_state_dict(path: str, model: nn.Module, *, strict: bool = True) -> KeyReport:
    """Load a full state dict file into ``model`` (sharded or not), one tensor at a time.

    Each rank reads from the file only the tensors it needs, one at a time, and
    keeps its own rows of each (by the parameter's DTensor chunk). No collective
    is issued. ``strict`` works as in ``load_state``; the skipped keys are returned.
    """
    shapes, read = _open_full(path)
    reshard_all(model)
    state = {k[len(MODEL_PREFIX):]: v for k, v in model_entries(model).items()}
    report = KeyReport()
    for key, value in state.items():
        if key not in shapes:
            report.missing_keys.append(key)
        elif isinstance(value, torch.Tensor) and shapes[key][1] != tuple(value.shape):
            report.mismatched_keys.append(f"{key} (file {shapes[key][1]}, model {tuple(value.shape)})")
    report.unexpected_keys += sorted(set(shapes) - set(state))
    settle(report, strict, repr(path))
    skip = set(report.missing_keys) | {m.split(" ")[0] for m in report.mismatched_keys}
    with torch.no_grad():
        for key, value in state.items():
            if key in skip or not isinstance(value, torch.Tensor):
                continue
            full = read(key)
            if isinstance(value, DTensor):
                local = value.to_local()
                for chunk in value.__create_chunk_list__():
                    piece = full
                    for dim, (offset, size) in enumerate(zip(chunk.offsets, chunk.sizes)):
                        piece = piece.narrow(dim, offset, size)
                    local.copy_(piece)
            else:
                value.copy_(full)
    reshard_all(model)  # our units: re-gather (and re-cast compute copies) on the next forward
    return report
