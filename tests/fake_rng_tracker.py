"""A stand-in for megatron-core's CUDA RNG tracker (megatron-core is optional and not installed in CI)."""

from __future__ import annotations

import torch


class FakeTracker:
    """megatron-core's ``CudaRNGStatesTracker`` surface: named RNG states, ``get_states``/``set_states``."""

    def __init__(self, seed: int) -> None:
        gen = torch.Generator().manual_seed(seed)
        self.states = {"model-parallel-rng": torch.randint(0, 255, (16,), dtype=torch.uint8, generator=gen)}

    def get_states(self) -> dict[str, torch.Tensor]:
        return {k: v.clone() for k, v in self.states.items()}

    def set_states(self, states: dict[str, torch.Tensor]) -> None:
        self.states = dict(states)
