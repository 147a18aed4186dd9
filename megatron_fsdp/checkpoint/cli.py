"""Command line for checkpoint directories (no process group, no GPU needed).

    python -m megatron_fsdp.checkpoint info   --checkpoint CKPT/iter_0000010
    python -m megatron_fsdp.checkpoint export --checkpoint CKPT/iter_0000010 --output model.safetensors

``export`` writes the full model state dict; ``.safetensors`` streams one tensor
at a time, ``.pt`` holds the whole model in memory (torch.save needs the dict).
``--checkpoint`` may also be a Megatron save directory: its latest iteration is used.
"""

from __future__ import annotations

import argparse
import os
import sys

from torch.distributed.checkpoint.metadata import TensorStorageMetadata

from megatron_fsdp.checkpoint.export import export_full_state_dict
from megatron_fsdp.checkpoint.iterations import TRACKER_FILE, iteration_dir, read_latest_iteration
from megatron_fsdp.checkpoint.sharded_io import is_checkpoint_dir, read_metadata


def resolve_checkpoint(path: str) -> str:
    """A DCP directory: ``path`` itself, or the latest iteration of a Megatron save directory."""
    if not is_checkpoint_dir(path) and os.path.isfile(os.path.join(path, TRACKER_FILE)):
        return iteration_dir(path, read_latest_iteration(path))
    return path


def _info(path: str) -> None:
    metadata = read_metadata(path)
    total = 0
    for key, md in sorted(metadata.state_dict_metadata.items()):
        if isinstance(md, TensorStorageMetadata):
            numel = 1
            for s in md.size:
                numel *= s
            total += numel * md.properties.dtype.itemsize
            print(f"{key}\t{str(md.properties.dtype).replace('torch.', '')}\t{tuple(md.size)}\t{len(md.chunks)} chunks")
        else:
            print(f"{key}\t(object)")
    print(f"# {len(metadata.state_dict_metadata)} entries, {total / 2**20:.2f} MiB of tensors")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m megatron_fsdp.checkpoint", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    commands = parser.add_subparsers(dest="command", required=True)
    info = commands.add_parser("info", help="list the entries of a checkpoint")
    info.add_argument("--checkpoint", required=True, help="checkpoint directory (or Megatron save directory)")
    export = commands.add_parser("export", help="write the full model state dict (.safetensors or .pt)")
    export.add_argument("--checkpoint", required=True, help="checkpoint directory (or Megatron save directory)")
    export.add_argument("--output", required=True, help="output file: *.safetensors (streamed) or *.pt")
    args = parser.parse_args(argv)
    try:
        path = resolve_checkpoint(args.checkpoint)
        if args.command == "info":
            _info(path)
        else:
            written = export_full_state_dict(path, args.output)
            print(f"wrote {written}")
    except (FileNotFoundError, ValueError, TypeError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    return 0

