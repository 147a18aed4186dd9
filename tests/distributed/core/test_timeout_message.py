"""A rank that skips a forward: the others' wait times out with a message naming the collective and the cause.

Run in its own process group with a 5-second timeout (the shared harness uses 120 s).
"""

from __future__ import annotations

import datetime
import os
import tempfile
import time

import torch.multiprocessing as mp

from tests.distributed.harness import free_port


def _worker(rank: int, port: int, out: str) -> None:
    import torch
    import torch.distributed as dist
    from torch import nn

    from megatron_fsdp import fully_shard

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2, timeout=datetime.timedelta(seconds=5))
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4))
    fully_shard(model[1])
    fully_shard(model)
    model(torch.randn(2, 4)).sum().backward()  # both ranks: a full step
    message = "no error"
    if rank == 0:  # rank 1 skips this forward
        try:
            model(torch.randn(2, 4))
        except RuntimeError as exc:
            message = str(exc)
    else:
        time.sleep(8)  # alive but elsewhere: rank 0's wait times out (5 s) rather than losing its peer
    with open(os.path.join(out, f"rank{rank}.txt"), "w") as f:
        f.write(message)
    os._exit(0)  # the group is broken after a timeout


def test_a_skipped_forward_names_the_collective_that_timed_out() -> None:
    with tempfile.TemporaryDirectory() as out:
        mp.start_processes(_worker, args=(free_port(), out), nprocs=2, start_method="spawn", join=True)
        with open(os.path.join(out, "rank0.txt")) as f:
            message = f.read()
    assert "the all-gather of '' (Sequential)'s weights failed in the forward" in message, message
    assert "every rank must run the sharded model's forward and backward the same number of times" in message
