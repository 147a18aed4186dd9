"""Learning-rate schedule with Megatron's semantics: linear warmup, then constant/linear/cosine decay.

Counted in iterations. The learning rate of iteration ``i`` (0-based) is the
schedule at step ``i``; ``step()`` advances after each optimizer step.

At ``--load`` the schedule's shape follows Megatron-LM's rule: the checkpoint's
values (learning rates, warmup, decay iterations, decay style) must equal this
run's flags, unless ``--override-opt_param-scheduler`` (the flags win) or
``--use-checkpoint-opt_param-scheduler`` (the checkpoint wins) is given; a silent
switch of schedule in the middle of a run is refused.
"""

from __future__ import annotations

import math

import torch

from .errors import UsageValueError

# (state-dict key, the flag that sets it): the schedule's shape, compared at --load.
SCHEDULE_FLAGS = (
    ("max_lr", "--lr"), ("min_lr", "--min-lr"), ("warmup_steps", "--lr-warmup-iters"),
    ("decay_steps", "--lr-decay-iters (default --train-iters)"), ("decay_style", "--lr-decay-style"),
)


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
        override_opt_param_scheduler: bool = False,
        use_checkpoint_opt_param_scheduler: bool = False,
    ) -> None:
        if override_opt_param_scheduler and use_checkpoint_opt_param_scheduler:
            raise UsageValueError("--override-opt_param-scheduler and --use-checkpoint-opt_param-scheduler "
                                  "contradict each other (this run's schedule or the checkpoint's): give one")
        if decay_style not in ("constant", "linear", "cosine"):
            raise ValueError(f"--lr-decay-style {decay_style!r}: use constant, linear or cosine")
        if warmup_steps < 0 or decay_steps <= 0:
            raise ValueError(f"--lr-warmup-iters ({warmup_steps}) must be >= 0 and decay steps ({decay_steps}) > 0")
        self.optimizer = optimizer
        self.max_lr, self.min_lr = max_lr, min_lr
        self.warmup_steps, self.decay_steps = warmup_steps, decay_steps
        self.decay_style = decay_style
        self.override_opt_param_scheduler = override_opt_param_scheduler
        self.use_checkpoint_opt_param_scheduler = use_checkpoint_opt_param_scheduler
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

    def mismatch(self, state: dict) -> list[str]:
        """``FLAG saved (x) vs now (y)`` for each value of the schedule's shape that differs from ``state``'s."""
        now = self.state_dict()
        return [f"{flag} {state[key]} (saved) vs {now[key]} (now)"
                for key, flag in SCHEDULE_FLAGS if key in state and state[key] != now[key]]

    def check_state_dict(self, state: dict, where: str) -> None:
        """Refuse ``state`` (a checkpoint's, at ``where``) whose schedule differs, unless a flag chose a side."""
        if self.override_opt_param_scheduler or self.use_checkpoint_opt_param_scheduler:
            return
        differ = self.mismatch(state)
        if differ:
            raise UsageValueError(
                f"{where}: the checkpoint's learning-rate schedule differs from this run's flags: {'; '.join(differ)}. "
                "Pass the saved values (to train longer than the schedule planned, give the same --lr-decay-iters "
                "when starting and resuming), or --use-checkpoint-opt_param-scheduler to continue the saved "
                "schedule, or --override-opt_param-scheduler to switch to this run's (Megatron-LM's rule)"
            )

    def load_state_dict(self, state: dict) -> None:
        """Resume the step count; the schedule's shape as Megatron-LM decides it (see the module docstring)."""
        self.check_state_dict(state, "the scheduler state")
        if self.use_checkpoint_opt_param_scheduler:
            self.max_lr, self.min_lr = float(state["max_lr"]), float(state["min_lr"])
            self.warmup_steps, self.decay_steps = int(state["warmup_steps"]), int(state["decay_steps"])
            self.decay_style = str(state["decay_style"])
        self.num_steps = int(state["num_steps"])
        self.step(0)
