"""megatron-core's CUDA RNG tracker states in front-end checkpoints.

megatron-core draws its weight init and attention/hidden dropout from named CUDA RNG
states kept by ``tensor_parallel.get_cuda_rng_tracker()`` ("model-parallel-rng", seeded
by ``model_parallel_cuda_manual_seed``; mcore_model.py), apart from the default CUDA
generator the library checkpoint already saves per rank. Megatron-LM saves them in each
checkpoint (``rng_tracker_states`` of its ``rng_state``, gathered across data-parallel
ranks with ``all_gather_object``) and sets them back on resume, so that a resumed run
draws the dropout masks an uninterrupted one would. We do the same: every rank's
states, gathered into ``extra.pt`` under ``TRACKER_KEY`` (rank-indexed), restored on the
same condition as the per-rank RNG states (same rank count, RNG loading not turned off).

megatron-core is optional: without it there is no tracker and nothing is saved.
"""

from __future__ import annotations

from typing import Any, Protocol

import torch
import torch.distributed as dist

TRACKER_KEY = "mcore_cuda_rng_tracker"  # extra.pt: a list, entry r = rank r's tracker states


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
    seeded: the plain GPT model), so checkpoints of such runs stay as they were. Without
    megatron-core (the same on every rank of a job) no collective is issued.
    """
    if tracker is None:
        return None
    states = {k: v.cpu() for k, v in tracker.get_states().items()}
    if dist.is_available() and dist.is_initialized():
        everyone: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(everyone, states)
    else:
        everyone = [states]
    return everyone if any(everyone) else None


def restore_tracker_states(tracker: RNGTracker | None, extra: dict[str, Any], *, rng_restored: bool,
                           where: str) -> str | None:
    """Set this rank's saved tracker states, when the per-rank RNG states were restored too.

    Returns a warning to print when this run's tracker has states that the checkpoint
    cannot give back (it holds none: saved without megatron-core's tracker); None otherwise.
    Raises ``ValueError`` when the saved list does not match the rank count (a damaged
    or hand-edited ``extra.pt``).
    """
    saved = extra.get(TRACKER_KEY)
    if tracker is None or not rng_restored:
        return None  # no tracker to set (plain model), or RNG states deliberately not restored
    if saved is None:
        if tracker.get_states():
            return (f"WARNING: {where} holds no megatron-core CUDA RNG tracker states; the tracker keeps this "
                    "run's seeding, so dropout masks differ from those of an uninterrupted run")
        return None
    rank = dist.get_rank() if dist.is_available() and dist.is_initialized() else 0
    world = dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1
    if not isinstance(saved, list) or len(saved) != world:
        raise ValueError(
            f"{where}: extra.pt's {TRACKER_KEY!r} should list the CUDA RNG tracker states of each of the "
            f"{world} ranks, found {type(saved).__name__} of length {len(saved) if isinstance(saved, list) else '-'}"
        )
    if saved[rank]:
        tracker.set_states(saved[rank])
    return None
