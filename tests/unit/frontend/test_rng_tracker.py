"""RNG trackers (megatron/training/rng_tracker.py): megatron-core's CUDA RNG tracker states through front-end
checkpoints, and the project's own GPT's model-parallel RNG (its fork and its states).

megatron-core is optional and not installed where these run, so a stand-in tracker with
megatron-core's ``get_states``/``set_states`` takes its place: the logic that saves every
rank's states into ``extra.pt`` and sets them back on resume is the same.
"""

from __future__ import annotations

import argparse

import pytest
import torch

from megatron.training import checkpointing
from megatron.training.config import RunState
from megatron.training.rng_tracker import (
    MODEL_PARALLEL_RNG,
    MODEL_PARALLEL_TRACKER_KEY,
    TRACKER_KEY,
    gather_tracker_states,
    get_model_parallel_rng_tracker,
    model_parallel_manual_seed,
    restore_tracker_states,
    tp_region_rng,
)
from megatron_fsdp.parallel import TensorParallel
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


# The project's own GPT's model-parallel RNG (ModelParallelRNGTracker): Megatron's fork, on the CPU generator.

def _tp(size: int, rank: int = 0) -> TensorParallel:
    return TensorParallel(None, size, rank, False)  # only size and rank matter to tp_region_rng


@pytest.fixture
def fresh_tracker():
    yield get_model_parallel_rng_tracker()
    get_model_parallel_rng_tracker().reset()


def test_fork_draws_seed_2718_tp_rank_and_leaves_the_default_stream(fresh_tracker):
    torch.manual_seed(42)
    untouched = torch.rand(5)
    torch.manual_seed(42)
    model_parallel_manual_seed(42, tp_rank=1)
    expected = torch.rand(6, generator=torch.Generator().manual_seed(42 + 2718 + 1))
    with tp_region_rng(_tp(2, 1)):
        first = torch.rand(3)
    with tp_region_rng(_tp(2, 1)):  # the tracked stream goes on, it does not restart
        second = torch.rand(3)
    assert torch.equal(torch.cat([first, second]), expected)
    assert torch.equal(torch.rand(5), untouched)  # the default generator is where it was: forks drew nothing from it
    states = fresh_tracker.get_states()
    assert list(states) == [MODEL_PARALLEL_RNG]


def test_fork_nests_refuses_other_names_and_needs_seeding(fresh_tracker):
    fresh_tracker.reset()
    with pytest.raises(RuntimeError, match=r"not seeded: call .*model_parallel_manual_seed"):
        with tp_region_rng(_tp(2)):
            pass
    with tp_region_rng(_tp(1)), tp_region_rng(_tp(2), active=False):  # TP 1 or nothing to draw: no fork at all
        pass
    model_parallel_manual_seed(7, tp_rank=0)
    with tp_region_rng(_tp(2)):
        outer = torch.rand(2)
        with tp_region_rng(_tp(2)):  # a region inside a region (attention under sequence parallelism): one stream
            inner = torch.rand(2)
    assert torch.equal(torch.cat([outer, inner]), torch.rand(4, generator=torch.Generator().manual_seed(7 + 2718)))
    fresh_tracker.add("other-rng", 99)
    with pytest.raises(RuntimeError, match="inside a fork"):
        with fresh_tracker.fork(), fresh_tracker.fork("other-rng"):
            pass
    with pytest.raises(ValueError, match="already tracked"):
        fresh_tracker.add("other-rng", 100)


def test_model_parallel_states_round_trip_and_old_checkpoints(fresh_tracker):
    model_parallel_manual_seed(5, tp_rank=0)
    with fresh_tracker.fork():
        torch.rand(10)
    extra = {MODEL_PARALLEL_TRACKER_KEY: gather_tracker_states(fresh_tracker)}
    with fresh_tracker.fork():
        expected_next = torch.rand(4)
    model_parallel_manual_seed(5, tp_rank=0)  # a new process: seeded afresh, then resumed
    assert restore_tracker_states(fresh_tracker, extra, rng_restored=True, where="here",
                                  key=MODEL_PARALLEL_TRACKER_KEY) is None
    with fresh_tracker.fork():
        assert torch.equal(torch.rand(4), expected_next)
    # a checkpoint written before the tracker existed: loads, keeps this run's seeding, warns where it draws masks
    assert restore_tracker_states(fresh_tracker, {}, rng_restored=True, where="--load old",
                                  key=MODEL_PARALLEL_TRACKER_KEY, draws_masks=False) is None
    warning = restore_tracker_states(fresh_tracker, {}, rng_restored=True, where="--load old",
                                     key=MODEL_PARALLEL_TRACKER_KEY, draws_masks=True)
    assert warning is not None and "--load old holds no model-parallel RNG tracker states" in warning
