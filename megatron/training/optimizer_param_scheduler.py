"""Learning-rate schedule with Megatron's semantics: linear warmup, then constant/linear/cosine decay.

Counted in iterations. The learning rate of iteration ``i`` (0-based) is the
schedule at step ``i``; ``step()`` advances after each optimizer step.
"""

from __future__ import annotations

import math

import torch


class OptimizerParamScheduler:
    """Sets ``lr`` in every param group of ``optimizer`` from the schedule."""

    def __init__(
        self,
        optimizer: torch.optim.Optimizer,
        *,
        max_lr: float,
        min_lr: float,
        warmup_steps: int,
        decay_steps: int,
        decay_style: str,
    ) -> None:
        if decay_style not in ("constant", "linear", "cosine"):
            raise ValueError(f"--lr-decay-style {decay_style!r}: use constant, linear or cosine")
        if warmup_steps < 0 or decay_steps <= 0:
            raise ValueError(f"--lr-warmup-iters ({warmup_steps}) must be >= 0 and decay steps ({decay_steps}) > 0")
        self.optimizer = optimizer
        self.max_lr, self.min_lr = max_lr, min_lr
        self.warmup_steps, self.decay_steps = warmup_steps, decay_steps
        self.decay_style = decay_style
        self.num_steps = 0
        self.step(0)

    def get_lr(self) -> float:
        step = self.num_steps
        if self.warmup_steps > 0 and step <= self.warmup_steps:
            return self.max_lr * step / self.warmup_steps
        if self.decay_style == "constant":
            return self.max_lr
        if step > self.decay_steps:
            return self.min_lr
        span = max(self.decay_steps - self.warmup_steps, 1)
        ratio = (step - self.warmup_steps) / span
        if self.decay_style == "linear":
            coeff = 1.0 - ratio
        else:
            coeff = 0.5 * (math.cos(math.pi * ratio) + 1.0)
        return self.min_lr + coeff * (self.max_lr - self.min_lr)

    def step(self, increment: int = 1) -> float:
        self.num_steps += increment
        lr = self.get_lr()
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        return lr

    def state_dict(self) -> dict:
        return {"num_steps": self.num_steps, "max_lr": self.max_lr, "min_lr": self.min_lr,
                "warmup_steps": self.warmup_steps, "decay_steps": self.decay_steps,
                "decay_style": self.decay_style}

    def load_state_dict(self, state: dict) -> None:
        """Resume the step count; the schedule's shape comes from this run's flags, as in Megatron."""
        self.num_steps = int(state["num_steps"])
        self.step(0)
