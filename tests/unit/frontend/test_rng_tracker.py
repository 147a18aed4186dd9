"""megatron-core's RNG tracker (megatron/training/rng_tracker.py): its states through front-end checkpoints
(a stand-in tracker with megatron-core's ``get_states``/``set_states`` where a test needs states of its own), the
own GPT's fork of it (seed + 2718 + TP rank, through the CPU compatibility layer), and older checkpoints that
carry the former own-GPT tracker's states (ignored).
"""

from __future__ import annotations

import argparse

import pytest
import torch

from megatron.training import checkpointing
from megatron.training.config import RunState
from megatron.training.rng_tracker import (
    MODEL_PARALLEL_RNG,
    TRACKER_KEY,
    gather_tracker_states,
    restore_tracker_states,
)
from tests.fake_rng_tracker import FakeTracker, checkpoint_parts


def test_single_process_round_trip_and_refusals():
    saved_by = FakeTracker(seed=1)
    gathered = gather_tracker_states(saved_by)
    assert gathered is not None and len(gathered) == 1
    extra = {TRACKER_KEY: gathered}
    resumed = FakeTracker(seed=2)
    assert not torch.equal(resumed.states["model-parallel-rng"], saved_by.states["model-parallel-rng"])
    assert restore_tracker_states(resumed, extra, rng_restored=True, where="here") is None
    assert torch.equal(resumed.states["model-parallel-rng"], saved_by.states["model-parallel-rng"])
    # RNG states not restored (other rank count, --no-load-rng, --finetune): the tracker is left alone
    other = FakeTracker(seed=3)
    before = other.get_states()
    assert restore_tracker_states(other, extra, rng_restored=False, where="here") is None
    assert torch.equal(other.states["model-parallel-rng"], before["model-parallel-rng"])
    # a checkpoint saved without the tracker: said, not silently different
    warning = restore_tracker_states(other, {}, rng_restored=True, where="--load ckpt")
    assert warning is not None and "--load ckpt" in warning and "dropout" in warning
    # a list for another rank count is a damaged extra.pt
    with pytest.raises(ValueError, match="each of the 1 ranks"):
        restore_tracker_states(other, {TRACKER_KEY: gathered * 2}, rng_restored=True, where="here")


def test_nothing_saved_without_a_tracker_or_states():
    assert gather_tracker_states(None) is None

    class Unseeded(FakeTracker):
        def get_states(self) -> dict[str, torch.Tensor]:
            return {}

    assert gather_tracker_states(Unseeded(0)) is None
    assert restore_tracker_states(None, {TRACKER_KEY: [{}]}, rng_restored=True, where="here") is None



def _run_args(directory: str) -> argparse.Namespace:
    return argparse.Namespace(save=directory, load=directory, finetune=False, no_load_optim=False,
                              no_load_rng=False, allow_fresh_start=False, no_load_args_check=False, seed=1234,
                              async_save=False)



def test_front_end_save_and_load_carry_the_tracker_states(gloo_rank, tmp_path, monkeypatch):
    """``--save`` then ``--load`` through megatron/training/checkpointing.py, megatron-core's tracker stood in for."""
    saving = FakeTracker(seed=5)
    monkeypatch.setattr(checkpointing, "mcore_rng_tracker", lambda: saving)
    args = _run_args(str(tmp_path))
    checkpointing.save(args, RunState(iteration=3, consumed_train_samples=12), *checkpoint_parts())
    resuming = FakeTracker(seed=6)
    monkeypatch.setattr(checkpointing, "mcore_rng_tracker", lambda: resuming)
    state = checkpointing.load(args, *checkpoint_parts())
    assert state.iteration == 3
    assert torch.equal(resuming.states["model-parallel-rng"], saving.states["model-parallel-rng"])
    # --no-load-rng: the tracker keeps this run's seeding, as the other RNG states do
    fresh = FakeTracker(seed=7)
    monkeypatch.setattr(checkpointing, "mcore_rng_tracker", lambda: fresh)
    before = fresh.get_states()
    checkpointing.load(argparse.Namespace(**{**vars(args), "no_load_rng": True}), *checkpoint_parts())
    assert torch.equal(fresh.states["model-parallel-rng"], before["model-parallel-rng"])


# megatron-core's tracker on CPU (the compatibility layer), seeded as pretrain seeds it.

@pytest.fixture
def mcore_tracker():
    from megatron.core import tensor_parallel

    from megatron.training.mcore_cpu_compat import apply_cpu_compat, cuda_absent

    if cuda_absent():
        apply_cpu_compat()

    def seed(value: int, tp_rank: int) -> None:
        tensor_parallel.model_parallel_cuda_manual_seed(value, tp_rank=tp_rank, ep_rank=0, etp_rank=0,
                                                        force_reset_rng=True)

    yield tensor_parallel.get_cuda_rng_tracker, seed  # seeding with force_reset_rng makes a new tracker
    tensor_parallel.get_cuda_rng_tracker().reset()


@pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU generator's streams (the compatibility layer)")
def test_fork_draws_seed_2718_tp_rank_and_leaves_the_default_stream(mcore_tracker):
    tracker, seed = mcore_tracker
    seed(42, tp_rank=1)  # megatron-core seeds the default generator with the seed too
    untouched = torch.rand(5, generator=torch.Generator().manual_seed(42))
    expected = torch.rand(6, generator=torch.Generator().manual_seed(42 + 2718 + 1))
    with tracker().fork():
        first = torch.rand(3)
    with tracker().fork():  # the tracked stream goes on, it does not restart
        second = torch.rand(3)
    assert torch.equal(torch.cat([first, second]), expected)
    assert torch.equal(torch.rand(5), untouched)  # the default generator is where it was: forks drew nothing from it
    assert MODEL_PARALLEL_RNG in tracker().get_states()
