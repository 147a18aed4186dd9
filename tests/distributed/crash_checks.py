"""Checks that exercise the harness itself: a rank killed by a signal gets the suite re-run once."""

from __future__ import annotations

import os

import torch.distributed as dist

from tests.distributed.harness import check

SUITE = "crash"
MARKER_ENV = "MFSDP_CRASH_MARKER"  # a path: rank 0 aborts while it does not exist, and creates it
ALWAYS_ENV = "MFSDP_CRASH_ALWAYS"  # set: rank 0 aborts on every run


@check(SUITE, world_sizes=(2,))
def rank0_aborts_on_the_first_run_only() -> None:
    marker = os.environ[MARKER_ENV]
    if dist.get_rank() == 0 and (not os.path.exists(marker) or os.environ.get(ALWAYS_ENV)):
        open(marker, "w").close()
        os.abort()
    dist.barrier()


@check(SUITE, world_sizes=(2,))
def runs_after_the_crash() -> None:
    dist.barrier()
