"""Process-group, device and random-seed set-up for the front-end (torchrun environment)."""

from __future__ import annotations

import argparse
import datetime
import os
import random

import torch
import torch.distributed as dist


def initialize_distributed(args: argparse.Namespace) -> torch.device:
    """Join the torchrun process group (NCCL on CUDA, gloo on CPU unless told) and pick the device.

    A process group that is already initialised (tests running several jobs in
    one group of processes) is used as it is.
    """
    backend = args.distributed_backend
    if backend == "auto":
        backend = "nccl" if torch.cuda.is_available() else "gloo"
    if backend == "nccl" and not torch.cuda.is_available():
        raise RuntimeError("--distributed-backend nccl needs CUDA, and no CUDA device is available")
    if not dist.is_initialized():
        if "RANK" not in os.environ:
            # A plain `python pretrain_gpt.py`: one process, as torchrun would set it up.
            os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1",
                              MASTER_PORT=os.environ.get("MASTER_PORT", "29517"))
        dist.init_process_group(backend, timeout=datetime.timedelta(minutes=10))
    else:
        backend = str(dist.get_backend())
    args.distributed_backend = backend
    if "nccl" in backend:
        local_rank = int(os.environ.get("LOCAL_RANK", dist.get_rank() % torch.cuda.device_count()))
        torch.cuda.set_device(local_rank)
        return torch.device("cuda", local_rank)
    return torch.device("cpu")


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
