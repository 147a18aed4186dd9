"""megatron-core's CUDA RNG tracker states through ``--save``/``--load`` at 2 ranks (megatron/training/rng_tracker.py).

Each rank's tracker holds its own states (as under data-parallel random init or tensor
parallelism); a resume must give every rank back its own, not rank 0's.
"""

from __future__ import annotations

import argparse
import contextlib
from collections.abc import Iterator

import torch
import torch.distributed as dist

from megatron.training import checkpointing
from megatron.training.config import RunState
from megatron.training.rng_tracker import TRACKER_KEY
from tests.distributed.harness import check, shared_tmpdir
from tests.fake_rng_tracker import FakeTracker, checkpoint_parts

SUITE = "rng_tracker"


@contextlib.contextmanager
def tracker_in_use(tracker: FakeTracker) -> Iterator[None]:
    """Stand ``tracker`` in for megatron-core's (our own module's lookup function, restored after)."""
    real = checkpointing.mcore_rng_tracker
    checkpointing.mcore_rng_tracker = lambda: tracker
    try:
        yield
    finally:
        checkpointing.mcore_rng_tracker = real



@check(SUITE, world_sizes=(2,))
def each_rank_gets_its_own_tracker_states_back() -> None:
    rank = dist.get_rank()
    with shared_tmpdir() as directory:
        args = argparse.Namespace(save=directory, load=directory, finetune=False, no_load_optim=False,
                                  no_load_rng=False, allow_fresh_start=False, no_load_args_check=False)
        saving = FakeTracker(seed=100 + rank)
        with tracker_in_use(saving):
            checkpointing.save(args, RunState(iteration=2, consumed_train_samples=8), *checkpoint_parts())
        extra = torch.load(f"{directory}/iter_0000002/extra.pt", weights_only=False)
        assert len(extra[TRACKER_KEY]) == 2, extra[TRACKER_KEY]
        resuming = FakeTracker(seed=200 + rank)
        with tracker_in_use(resuming):
            checkpointing.load(args, *checkpoint_parts())
        assert torch.equal(resuming.states["model-parallel-rng"], saving.states["model-parallel-rng"]), rank
        other = FakeTracker(seed=100 + (1 - rank))
        assert not torch.equal(resuming.states["model-parallel-rng"], other.states["model-parallel-rng"])
