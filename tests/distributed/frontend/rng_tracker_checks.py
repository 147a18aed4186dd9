"""RNG tracker states through ``--save``/``--load`` at 2 ranks (megatron/training/rng_tracker.py): megatron-core's
CUDA RNG tracker (a stand-in with its surface, and the real one seeded as pretrain seeds it).

Each rank's tracker holds its own states (as under data-parallel random init or tensor
parallelism); a resume must give every rank back its own, not rank 0's.
"""

from __future__ import annotations

import argparse
import contextlib
import io
from collections.abc import Iterator

import torch
import torch.distributed as dist

from megatron.training import checkpointing
from megatron.training.config import RunState
from megatron.training.rng_tracker import MODEL_PARALLEL_RNG, MODEL_PARALLEL_TRACKER_KEY, TRACKER_KEY
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


def _args(directory: str) -> argparse.Namespace:
    """The flags checkpointing.save/load read: save to and resume from ``directory``, everything restored."""
    return argparse.Namespace(save=directory, load=directory, finetune=False, no_load_optim=False, no_load_rng=False,
                              allow_fresh_start=False, no_load_args_check=False, async_save=False)


@check(SUITE, world_sizes=(2,))
def each_rank_gets_its_own_tracker_states_back() -> None:
    rank = dist.get_rank()
    with shared_tmpdir() as directory:
        args = _args(directory)
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


def _seed_mcore_tracker(seed: int, tp_rank: int):
    """megatron-core's tracker seeded as pretrain seeds it (here each rank as TP rank ``tp_rank``), on CPU through
    the compatibility layer; returns it (seeding with force_reset_rng makes a new tracker object)."""
    from megatron.core import tensor_parallel

    from megatron.training.mcore_cpu_compat import apply_cpu_compat, cuda_absent

    if cuda_absent():
        apply_cpu_compat()
    tensor_parallel.model_parallel_cuda_manual_seed(seed, tp_rank=tp_rank, ep_rank=0, etp_rank=0,
                                                    force_reset_rng=True)
    return tensor_parallel.get_cuda_rng_tracker()


@check(SUITE, world_sizes=(2,))
def each_rank_gets_its_own_model_parallel_rng_back() -> None:
    """megatron-core's tracker (seed + 2718 + TP rank; here each rank as TP rank = its rank): the stream a resumed
    rank forks continues where its own saved stream stopped (the dropout masks an uninterrupted run draws). An
    older checkpoint holding the former own-GPT tracker's states (MODEL_PARALLEL_TRACKER_KEY) and no megatron-core
    states loads, leaves this run's seeding in place, and says so."""
    rank = dist.get_rank()
    try:
        with shared_tmpdir() as directory:
            tracker = _seed_mcore_tracker(10, tp_rank=rank)
            with tracker.fork():
                torch.rand(7)  # the stream moved on before the save
            checkpointing.save(_args(directory), RunState(iteration=2, consumed_train_samples=8),
                               *checkpoint_parts())
            with tracker.fork():
                expected = torch.rand(5)  # what an uninterrupted run draws next
            path = f"{directory}/iter_0000002/extra.pt"
            extra = torch.load(path, weights_only=False)
            assert len(extra[TRACKER_KEY]) == 2 and MODEL_PARALLEL_TRACKER_KEY not in extra, list(extra)
            tracker = _seed_mcore_tracker(10, tp_rank=rank)  # a new job, seeded afresh, then resumed
            checkpointing.load(_args(directory), *checkpoint_parts())
            with tracker.fork():
                assert torch.equal(torch.rand(5), expected), f"rank {rank}: the resumed stream is not its own"
        with shared_tmpdir() as directory:
            # what an earlier version wrote: tracker states under the own GPT's key, none under megatron-core's
            checkpointing.TRACKER_KEY = MODEL_PARALLEL_TRACKER_KEY
            try:
                checkpointing.save(_args(directory), RunState(iteration=2, consumed_train_samples=8),
                                   *checkpoint_parts())
            finally:
                checkpointing.TRACKER_KEY = TRACKER_KEY
            extra = torch.load(f"{directory}/iter_0000002/extra.pt", weights_only=False)
            assert MODEL_PARALLEL_TRACKER_KEY in extra and TRACKER_KEY not in extra, list(extra)
            tracker = _seed_mcore_tracker(10, tp_rank=rank)
            seeded = tracker.get_states()[MODEL_PARALLEL_RNG]
            printed = io.StringIO()
            with contextlib.redirect_stdout(printed):
                checkpointing.load(_args(directory), *checkpoint_parts())
            assert torch.equal(tracker.get_states()[MODEL_PARALLEL_RNG], seeded), "an old checkpoint moved the tracker"
            if rank == 0:
                assert "holds no megatron-core CUDA RNG tracker states; the tracker keeps this run's seeding" in (
                    printed.getvalue()), printed.getvalue()
    finally:
        from megatron.core import tensor_parallel

        tensor_parallel.get_cuda_rng_tracker().reset()
