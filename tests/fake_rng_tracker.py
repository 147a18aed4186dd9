"""A stand-in for megatron-core's CUDA RNG tracker (megatron-core is optional and not installed in CI),
and the smallest set of training parts a front-end checkpoint round trip takes."""

from __future__ import annotations

import torch
import torch.distributed as dist
from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler
from torch import nn

from megatron.training.parallel_state import GroupOfRanks, ParallelLayout
from megatron_fsdp.parallel import TensorParallel


class FakeTracker:
    """megatron-core's ``CudaRNGStatesTracker`` surface: named RNG states, ``get_states``/``set_states``."""

    def __init__(self, seed: int) -> None:
        gen = torch.Generator().manual_seed(seed)
        self.states = {"model-parallel-rng": torch.randint(0, 255, (16,), dtype=torch.uint8, generator=gen)}

    def get_states(self) -> dict[str, torch.Tensor]:
        return {k: v.clone() for k, v in self.states.items()}

    def set_states(self, states: dict[str, torch.Tensor]) -> None:
        self.states = dict(states)


def checkpoint_parts() -> tuple[nn.Module, torch.optim.Optimizer, OptimizerParamScheduler, ParallelLayout]:
    """What ``checkpointing.save``/``load`` take after the run state: a tiny model, its optimizer and
    scheduler, and a data-parallel-only layout over every rank of the default group."""
    model = nn.Linear(4, 3)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    scheduler = OptimizerParamScheduler(optimizer, init_lr=0.0, max_lr=1e-3, min_lr=1e-4, lr_warmup_steps=1,
                                        lr_decay_steps=10, lr_decay_style="linear", start_wd=0.01, end_wd=0.01,
                                        wd_incr_steps=10, wd_incr_style="constant",
                                        use_checkpoint_opt_param_scheduler=False)
    layout = ParallelLayout(None, TensorParallel.single(), GroupOfRanks.single(), dist.group.WORLD,
                            dist.group.WORLD, dp_rank=dist.get_rank(), dp_size=dist.get_world_size())
    return model, optimizer, scheduler, layout
