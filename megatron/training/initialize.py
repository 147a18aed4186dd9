"""Process-group, device and random-seed set-up for the front-end (torchrun environment)."""

from __future__ import annotations

import argparse
import datetime
import os
import random

import torch
import torch.distributed as dist

from megatron_fsdp.comm.objects import all_gather_objects

from .errors import UsageRuntimeError


def initialize_distributed(args: argparse.Namespace) -> torch.device:
    """Join the torchrun process group (NCCL on CUDA, gloo on CPU unless told) and pick the device.

    A process group that is already initialised (tests running several jobs in
    one group of processes) is used as it is.
    """
    backend = args.distributed_backend
    if backend == "auto":
        backend = "nccl" if torch.cuda.is_available() else "gloo"
    if backend == "nccl" and not torch.cuda.is_available():
        raise UsageRuntimeError("--distributed-backend nccl needs CUDA, and no CUDA device is available")
    if not dist.is_initialized():
        # A rank that stops calling collectives (an exception on it alone, a skipped forward) leaves the
        # others waiting this long before the group reports it.
        timeout = datetime.timedelta(minutes=getattr(args, "distributed_timeout_minutes", 10))
        if "RANK" not in os.environ:
            # A plain `python pretrain_gpt.py`: one process, as torchrun would set it up, but with an
            # in-memory store: no port to bind, so two such runs side by side never clash.
            os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0")
            dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1, timeout=timeout)
        else:
            dist.init_process_group(backend, timeout=timeout)
    else:
        backend = str(dist.get_backend())
    args.distributed_backend = backend
    if "nccl" in backend:
        local_rank = int(os.environ.get("LOCAL_RANK", dist.get_rank() % torch.cuda.device_count()))
        torch.cuda.set_device(local_rank)
        return torch.device("cuda", local_rank)
    return torch.device("cpu")


def check_save_dir(path: str) -> None:
    """Fail at start, on every rank, if ``--save`` cannot hold checkpoints (not only at the first save).

    Each rank creates the directory and writes and removes a probe file, since every rank writes
    its own shards (and ranks on other nodes may see another file system); the first rank's
    error is raised on all ranks, so none is left waiting in a collective.
    """
    error = None
    try:
        if os.path.exists(path) and not os.path.isdir(path):
            raise NotADirectoryError(f"{path} exists and is not a directory")
        os.makedirs(path, exist_ok=True)
        probe = os.path.join(path, f".write_probe_rank{dist.get_rank() if dist.is_initialized() else 0}")
        with open(probe, "w") as f:
            f.write("probe")
        os.remove(probe)
    except OSError as exc:
        error = f"{type(exc).__name__}: {exc}"
    errors = [error]
    if dist.is_initialized() and dist.get_world_size() > 1:
        errors = all_gather_objects(error)
    for rank, message in enumerate(errors):
        if message is not None:
            raise UsageRuntimeError(
                f"--save {path} cannot hold checkpoints (rank {rank}: {message}); give a directory this job "
                "can create and write to"
            )


def set_random_seed(seed: int) -> None:
    """Same seed on every rank: identical initial weights, as Megatron without TP/PP."""
    random.seed(seed)
    torch.manual_seed(seed)
    try:
        import numpy as np

        np.random.seed(seed)
    except ImportError:
        pass
    if torch.cuda.is_available():
        torch.cuda.manual_seed_all(seed)


def print_rank_0(message: str) -> None:
    if not dist.is_initialized() or dist.get_rank() == 0:
        print(message, flush=True)
