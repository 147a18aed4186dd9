"""megatron-core's RNG tracker in front-end checkpoints.

**The tracker (Megatron's rules).** Megatron-LM keeps two kinds of random streams
(megatron-core ``tensor_parallel/random.py``): the default generator, seeded with
``--seed`` on every rank, for dropout in TP-replicated regions (the activations every
TP rank holds alike, so their masks must agree), and a tracked "model-parallel-rng"
state seeded with ``seed + 2718 + tp_rank``, swapped into the default generator by
``get_cuda_rng_tracker().fork()`` for dropout inside TP regions, where each TP rank
holds different values (its attention heads; under sequence parallelism its tokens),
so their masks must differ. The front-end has one tracker, megatron-core's: ``pretrain``
seeds it with ``model_parallel_cuda_manual_seed`` when it initializes megatron-core's
``parallel_state`` (mcore_model.initialize_mcore_parallel; on CPU its states are CPU
generator states, mcore_cpu_compat.py), and megatron-core's layers fork it.

**Checkpoints.** Megatron-LM saves the tracker states in each checkpoint
(``rng_tracker_states`` of its ``rng_state``, gathered across data-parallel ranks with
``all_gather_object``) and sets them back on resume, so that a resumed run draws the
dropout masks an uninterrupted one would. We do the same: every rank's states, gathered
into ``extra.pt`` under ``TRACKER_KEY`` (rank-indexed), restored on the same condition as
the per-rank RNG states (same rank count, RNG loading not turned off). Checkpoints of
earlier versions may also hold ``MODEL_PARALLEL_TRACKER_KEY`` (the own GPT's former
tracker): it is ignored (its masks are then this run's, as for a checkpoint without states).
"""

from __future__ import annotations

from typing import Any, Protocol

import torch
import torch.distributed as dist

from megatron_fsdp.comm.objects import all_gather_objects

TRACKER_KEY = "mcore_cuda_rng_tracker"  # extra.pt: a list, entry r = rank r's megatron-core tracker states
MODEL_PARALLEL_TRACKER_KEY = "model_parallel_rng_tracker"  # older checkpoints' own-GPT tracker states: ignored
MODEL_PARALLEL_RNG = "model-parallel-rng"  # megatron-core's name of the per-TP-rank state
MODEL_PARALLEL_SEED_OFFSET = 2718  # megatron-core's: the TP state's seed is seed + 2718 + tp_rank


class RNGTracker(Protocol):
    """What megatron-core's ``CudaRNGStatesTracker`` (and TransformerEngine's) offer for checkpoints."""

    def get_states(self) -> dict[str, torch.Tensor]: ...

    def set_states(self, states: dict[str, torch.Tensor]) -> None: ...


def mcore_rng_tracker() -> RNGTracker | None:
    """megatron-core's CUDA RNG tracker, or None when megatron-core is not installed."""
    try:
        from megatron.core import tensor_parallel
    except ImportError:
        return None
    return tensor_parallel.get_cuda_rng_tracker()


def gather_tracker_states(tracker: RNGTracker | None) -> list[dict[str, torch.Tensor]] | None:
    """Every rank's tracker states, indexed by rank (collective when a process group is up).

    None when no rank has states to save (no megatron-core, or its tracker was never
    seeded), so checkpoints of such runs stay as they were. Without
    a tracker (megatron-core not installed: the same on every rank of a job) no
    collective is issued.
    """
    if tracker is None:
        return None
    states = {k: v.cpu() for k, v in tracker.get_states().items()}
    if dist.is_available() and dist.is_initialized():
        everyone = all_gather_objects(states)
    else:
        everyone = [states]
    return everyone if any(everyone) else None


_TRACKER_NAMES = {TRACKER_KEY: "megatron-core CUDA RNG tracker"}


def restore_tracker_states(tracker: RNGTracker | None, extra: dict[str, Any], *, rng_restored: bool,
                           where: str, key: str = TRACKER_KEY, draws_masks: bool = True) -> str | None:
    """Set this rank's tracker states saved under ``key``, when the per-rank RNG states were restored too.

    Returns a warning to print when this run's tracker has states that the checkpoint
    cannot give back (it holds none: saved without that tracker, e.g. before the
    model-parallel RNG existed) and ``draws_masks`` (the tracker draws dropout masks in
    this run); None otherwise: the tracker then keeps this run's seeding. Raises
    ``ValueError`` when the saved list does not match the rank count (a damaged or
    hand-edited ``extra.pt``).
    """
    saved = extra.get(key)
    if tracker is None or not rng_restored:
        return None  # no tracker to set (plain model), or RNG states deliberately not restored
    if saved is None:
        if tracker.get_states() and draws_masks:
            return (f"WARNING: {where} holds no {_TRACKER_NAMES.get(key, key)} states; the tracker keeps this "
                    "run's seeding, so dropout masks differ from those of an uninterrupted run")
        return None
    rank = dist.get_rank() if dist.is_available() and dist.is_initialized() else 0
    world = dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1
    if not isinstance(saved, list) or len(saved) != world:
        raise ValueError(
            f"{where}: extra.pt's {key!r} should list the RNG tracker states of each of the "
            f"{world} ranks, found {type(saved).__name__} of length {len(saved) if isinstance(saved, list) else '-'}"
        )
    if saved[rank]:
        tracker.set_states(saved[rank])
    return None
