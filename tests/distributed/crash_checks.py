"""Checks that exercise the harness itself: a rank that dies fails the suite, with no second run."""

from __future__ import annotations

import atexit
import os

import torch.distributed as dist

from tests.distributed.harness import check

SUITE = "crash"
RUNS_ENV = "MFSDP_CRASH_RUNS"  # a file every run appends a line to (counts the runs)
# "during": rank 0 aborts in the second check; "at_exit": after reporting all; "none": no crash
MODE_ENV = "MFSDP_CRASH_MODE"


@check(SUITE, world_sizes=(2,))
def passes_before_the_crash() -> None:
    if dist.get_rank() == 0:
        with open(os.environ[RUNS_ENV], "a") as f:
            f.write("run\n")
    dist.barrier()


@check(SUITE, world_sizes=(2,))
def rank0_aborts_here() -> None:
    mode = os.environ[MODE_ENV]
    if dist.get_rank() == 0 and mode == "during":
        os.abort()
    if dist.get_rank() == 0 and mode == "at_exit":
        atexit.register(os.abort)  # a native crash while the interpreter shuts down
    dist.barrier()


@check(SUITE, world_sizes=(2,))
def runs_after_the_crash() -> None:
    dist.barrier()


# A second suite of the same group (harness.run_suites): run after "crash" by the same ranks.
NEXT_SUITE = "crash_next"


@check(NEXT_SUITE, world_sizes=(2,))
def runs_in_the_next_suite() -> None:
    dist.barrier()
