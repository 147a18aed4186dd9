"""The model-parallel RNG of the project's own GPT, and RNG tracker states in front-end checkpoints.

**The tracker (Megatron's rules).** Megatron-LM keeps two kinds of random streams
(megatron-core ``tensor_parallel/random.py``): the default generator, seeded with
``--seed`` on every rank, for dropout in TP-replicated regions (the activations every
TP rank holds alike, so their masks must agree), and a tracked "model-parallel-rng"
state seeded with ``seed + 2718 + tp_rank``, swapped into the default generator by
``get_cuda_rng_tracker().fork()`` for dropout inside TP regions, where each TP rank
holds different values (its attention heads; under sequence parallelism its tokens),
so their masks must differ. ``ModelParallelRNGTracker`` is that tracker for
``gpt_model.py`` on CPU (the CPU generator's state) and CUDA (the current device's):
``model_parallel_manual_seed`` seeds it as ``model_parallel_cuda_manual_seed`` does
and ``tp_region_rng`` forks it where megatron-core forks (docs/megatron.md,
"Dropout and random seeds"). megatron-core's own ``GPTModel`` (``--model-provider
mcore``) uses megatron-core's tracker, seeded by the same rule (mcore_model.py).

**Checkpoints.** Megatron-LM saves the tracker states in each checkpoint
(``rng_tracker_states`` of its ``rng_state``, gathered across data-parallel ranks with
``all_gather_object``) and sets them back on resume, so that a resumed run draws the
dropout masks an uninterrupted one would. We do the same for both trackers: every
rank's states, gathered into ``extra.pt`` (rank-indexed; megatron-core's under
``TRACKER_KEY``, ours under ``MODEL_PARALLEL_TRACKER_KEY``), restored on the same
condition as the per-rank RNG states (same rank count, RNG loading not turned off).
A checkpoint without our tracker's states (written before it existed) loads: the
tracker keeps this run's seeding, with a warning where it draws masks (TP > 1).

megatron-core is optional: without it there is no megatron-core tracker and nothing of it is saved.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any, Protocol

import torch
import torch.distributed as dist

from megatron_fsdp.comm.objects import all_gather_objects
from megatron_fsdp.parallel import TensorParallel

TRACKER_KEY = "mcore_cuda_rng_tracker"  # extra.pt: a list, entry r = rank r's megatron-core tracker states
MODEL_PARALLEL_TRACKER_KEY = "model_parallel_rng_tracker"  # the same for ModelParallelRNGTracker's states
MODEL_PARALLEL_RNG = "model-parallel-rng"  # megatron-core's name of the per-TP-rank state
MODEL_PARALLEL_SEED_OFFSET = 2718  # megatron-core's: the TP state's seed is seed + 2718 + tp_rank


class RNGTracker(Protocol):
    """What megatron-core's ``CudaRNGStatesTracker`` (and TransformerEngine's) offer for checkpoints."""

    def get_states(self) -> dict[str, torch.Tensor]: ...

    def set_states(self, states: dict[str, torch.Tensor]) -> None: ...


class ModelParallelRNGTracker:
    """Named generator states that ``fork`` swaps into the default generator of one device type.

    Dropout kernels draw from the default generator of their tensors' device (CPU or
    the current CUDA device) and take no generator argument, so a fork saves that
    generator's state, sets the tracked one, runs the region, stores the advanced
    tracked state and puts the default one back: the default stream is left exactly
    where it was, as if the region had drawn nothing.
    """

    def __init__(self) -> None:
        self.states: dict[str, torch.Tensor] = {}
        self.device_type = "cpu"
        self._forked: str | None = None

    def _get(self) -> torch.Tensor:
        return torch.cuda.get_rng_state() if self.device_type == "cuda" else torch.get_rng_state()

    def _set(self, state: torch.Tensor) -> None:
        if self.device_type == "cuda":
            torch.cuda.set_rng_state(state)
        else:
            torch.set_rng_state(state)

    def reset(self, device_type: str = "cpu") -> None:
        """No states; forks will swap ``device_type``'s default generator (``"cpu"`` or ``"cuda"``)."""
        if device_type not in ("cpu", "cuda"):
            raise ValueError(f"the model-parallel RNG tracks the cpu or cuda generator, not {device_type!r}")
        self.states, self.device_type, self._forked = {}, device_type, None

    def add(self, name: str, seed: int) -> None:
        """Track a state ``name`` seeded with ``seed`` (the default generator is left as it was)."""
        if name in self.states:
            raise ValueError(f"the RNG state {name!r} is already tracked")
        generator = torch.Generator(device=self.device_type)
        generator.manual_seed(seed)
        self.states[name] = generator.get_state()

    def get_states(self) -> dict[str, torch.Tensor]:
        """Copies of the tracked states (what a checkpoint saves)."""
        return {name: state.clone() for name, state in self.states.items()}

    def set_states(self, states: dict[str, torch.Tensor]) -> None:
        """Replace the tracked states (a resume)."""
        self.states = {name: state.clone() for name, state in states.items()}

    @contextlib.contextmanager
    def fork(self, name: str = MODEL_PARALLEL_RNG) -> Iterator[None]:
        """Draw from ``name``'s state inside the block; re-entrant for the same name (a region inside a region)."""
        if self._forked == name:
            yield
            return
        if self._forked is not None:
            raise RuntimeError(f"cannot fork the RNG state {name!r} inside a fork of {self._forked!r}")
        if name not in self.states:
            raise RuntimeError(
                f"the RNG state {name!r} is not seeded: call megatron.training.rng_tracker.model_parallel_manual_seed"
                "(seed, tp_rank) before running a tensor-parallel GPT with dropout (pretrain_gpt.py does)"
            )
        default = self._get()
        self._set(self.states[name])
        self._forked = name
        try:
            yield
        finally:
            self.states[name] = self._get()
            self._set(default)
            self._forked = None


_TRACKER = ModelParallelRNGTracker()


def get_model_parallel_rng_tracker() -> ModelParallelRNGTracker:
    """The process's tracker (as megatron-core's ``get_cuda_rng_tracker``)."""
    return _TRACKER


def model_parallel_manual_seed(seed: int, tp_rank: int, device_type: str = "cpu") -> None:
    """The tracker part of megatron-core's ``model_parallel_cuda_manual_seed``, for ``gpt_model.py``.

    The tracker's "model-parallel-rng" gets ``seed + 2718 + tp_rank`` (TP regions draw
    differently on each TP rank, alike across data-parallel replicas, as Megatron's);
    forks swap ``device_type``'s default generator. Any previous tracker states are
    dropped. The default generator itself is not touched: ``initialize.set_random_seed``
    gives it ``seed`` on every rank (TP-replicated regions draw alike), as megatron-core
    seeds it with the data-parallel seed.
    """
    _TRACKER.reset(device_type)
    _TRACKER.add(MODEL_PARALLEL_RNG, seed + MODEL_PARALLEL_SEED_OFFSET + tp_rank)


def tp_region_rng(tp: TensorParallel, active: bool = True) -> contextlib.AbstractContextManager[None]:
    """The RNG of a region whose values differ across ``tp``'s ranks: a fork of the model-parallel state.

    A plain context (the default generator) when ``active`` is False (no dropout to draw)
    or at TP size 1: one rank per TP group has nothing to decorrelate, and TP-1 runs keep
    drawing from the default generator, as they did before the tracker (megatron-core
    forks attention dropout at TP 1 too: the same distribution, other masks).
    """
    if tp.size == 1 or not active:
        return contextlib.nullcontext()
    return _TRACKER.fork()


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


_TRACKER_NAMES = {TRACKER_KEY: "megatron-core CUDA RNG tracker",
                  MODEL_PARALLEL_TRACKER_KEY: "model-parallel RNG tracker"}


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
