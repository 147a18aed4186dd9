"""Learning-rate schedule with Megatron's semantics: linear warmup, then constant, linear, cosine,
inverse-square-root or WSD (warmup-stable-decay) decay.

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
        wsd_decay_steps: int | None = None,
        wsd_decay_style: str = "exponential",
        use_checkpoint_values: bool = False,
    ) -> None:
        if decay_style not in ("constant", "linear", "cosine", "inverse-square-root", "WSD"):
            raise ValueError(f"--lr-decay-style {decay_style!r}: use constant, linear, cosine, inverse-square-root "
                             "or WSD")
        if decay_style == "WSD" and not wsd_decay_steps:
            raise ValueError("--lr-decay-style WSD needs --lr-wsd-decay-iters")
        if warmup_steps < 0 or decay_steps <= 0:
            raise ValueError(f"--lr-warmup-iters ({warmup_steps}) must be >= 0 and decay steps ({decay_steps}) > 0")
        self.optimizer = optimizer
        self.max_lr, self.min_lr = max_lr, min_lr
        self.warmup_steps, self.decay_steps = warmup_steps, decay_steps
        self.decay_style = decay_style
        self.wsd_decay_steps, self.wsd_decay_style = wsd_decay_steps, wsd_decay_style
        self.use_checkpoint_values = use_checkpoint_values  # --use-checkpoint-opt_param-scheduler
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
        if self.decay_style == "inverse-square-root":
            lr = self.max_lr * max(self.warmup_steps, 1) ** 0.5 / max(step, 1) ** 0.5
            return max(self.min_lr, lr)
        if self.decay_style == "WSD":
            return self.min_lr + self._wsd_coeff(step) * (self.max_lr - self.min_lr)
        span = max(self.decay_steps - self.warmup_steps, 1)
        ratio = (step - self.warmup_steps) / span
        if self.decay_style == "linear":
            coeff = 1.0 - ratio
        else:
            coeff = 0.5 * (math.cos(math.pi * ratio) + 1.0)
        return self.min_lr + coeff * (self.max_lr - self.min_lr)

    def _wsd_coeff(self, step: int) -> float:
        """Megatron's WSD: the peak until the last ``wsd_decay_steps`` of the decay, then annealed."""
        anneal_start = self.decay_steps - self.wsd_decay_steps
        if step <= anneal_start:
            return 1.0
        ratio = (step - anneal_start) / self.wsd_decay_steps
        if self.wsd_decay_style == "linear":
            return 1.0 - ratio
        if self.wsd_decay_style == "cosine":
            return 0.5 * (math.cos(math.pi * ratio) + 1.0)
        if self.wsd_decay_style == "exponential":
            return 2.0 * math.pow(0.5, ratio) - 1.0
        return 1.0 - math.sqrt(ratio)  # minus_sqrt

    def step(self, increment: int = 1) -> float:
        self.num_steps += increment
        lr = self.get_lr()
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        return lr

    def state_dict(self) -> dict:
        return {"num_steps": self.num_steps, "max_lr": self.max_lr, "min_lr": self.min_lr,
                "warmup_steps": self.warmup_steps, "decay_steps": self.decay_steps,
                "decay_style": self.decay_style, "wsd_decay_steps": self.wsd_decay_steps,
                "wsd_decay_style": self.wsd_decay_style}

    def load_state_dict(self, state: dict) -> None:
        """Resume the step count; the schedule's shape comes from this run's flags, as in Megatron,
        or from the checkpoint with ``use_checkpoint_values`` (--use-checkpoint-opt_param-scheduler)."""
        if self.use_checkpoint_values:
            self.max_lr, self.min_lr = state["max_lr"], state["min_lr"]
            self.warmup_steps, self.decay_steps = state["warmup_steps"], state["decay_steps"]
            self.decay_style = state["decay_style"]
            self.wsd_decay_steps = state.get("wsd_decay_steps", self.wsd_decay_steps)
            self.wsd_decay_style = state.get("wsd_decay_style", self.wsd_decay_style)
        self.num_steps = int(state["num_steps"])
        self.step(0)
