"""Typed settings of the training loop, derived once from the validated flags, and the run's state.

``TrainingConfig`` is what the loop reads (frozen: nothing writes it during a run);
``RunState`` is what a run changes and a checkpoint saves (the iteration and the data
position). The number of micro-batches per step is megatron-core's
(``num_microbatches_calculator``), set up by ``init_num_microbatches``.
The flags namespace itself is frozen once set-up has derived its values
(``freeze_args``): a write to it raises instead of becoming hidden run state.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass

from megatron.core import num_microbatches_calculator


@dataclass(frozen=True)
class TrainingConfig:
    """The training loop's settings (flag names in the comments where they differ)."""

    train_iters: int
    global_batch_size: int
    num_microbatches: int  # global batch / (micro batch x data-parallel size): megatron-core's calculator
    lr: float  # for the NaN message; the schedule owns the current learning rate
    clip_grad: float  # 0: no clipping (the norm is still computed and logged)
    bf16: bool
    calculate_per_token_loss: bool
    check_for_nan: bool  # --check-for-nan-in-loss-and-grad
    log_interval: int
    eval_interval: int | None
    eval_iters: int
    save: str | None
    save_interval: int | None
    exit_interval: int | None
    tensorboard_dir: str | None

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> TrainingConfig:
        """The settings of validated ``args``; ``num_microbatches`` from megatron-core's calculator
        (``init_num_microbatches`` first)."""
        return cls(
            train_iters=args.train_iters, global_batch_size=args.global_batch_size,
            num_microbatches=num_microbatches_calculator.get_num_microbatches(), lr=args.lr, clip_grad=args.clip_grad,
            bf16=args.bf16,
            calculate_per_token_loss=args.calculate_per_token_loss,
            check_for_nan=args.check_for_nan_in_loss_and_grad, log_interval=args.log_interval,
            eval_interval=args.eval_interval, eval_iters=args.eval_iters, save=args.save,
            save_interval=args.save_interval, exit_interval=args.exit_interval,
            tensorboard_dir=args.tensorboard_dir,
        )


def init_num_microbatches(args: argparse.Namespace, rank: int = 0) -> int:
    """Set up megatron-core's micro-batch calculator for validated ``args``; its number of micro-batches.

    As Megatron-LM's initialisation does (``init_num_microbatches_calculator``), with a constant
    global batch: ``--rampup-batch-size`` is not a flag here. A calculator set up before (an
    earlier ``pretrain`` in the same process) is replaced. ``validate_args`` has already checked,
    with a message naming the flags, that the global batch splits into whole micro-batches (the
    calculator asserts it).
    """
    num_microbatches_calculator.unset_num_microbatches_calculator()
    num_microbatches_calculator.init_num_microbatches_calculator(
        rank=rank, rampup_batch_size=None, global_batch_size=args.global_batch_size,
        micro_batch_size=args.micro_batch_size, data_parallel_size=args.data_parallel_size,
        decrease_batch_size_if_needed=False,
    )
    return num_microbatches_calculator.get_num_microbatches()


@dataclass
class RunState:
    """What training advances and a checkpoint restores: the iteration and the samples consumed."""

    iteration: int = 0
    consumed_train_samples: int = 0
    consumed_valid_samples: int = 0


class FrozenArgs(argparse.Namespace):
    """The flags after set-up: readable as before, writing raises (``get_args()`` returns this)."""

    def __setattr__(self, name: str, value: object) -> None:
        raise AttributeError(
            f"args.{name}: the flags are read-only once pretrain() has set up (they are the run's configuration, "
            "saved in checkpoints); keep run state in megatron.training.config.RunState, or derive the value in "
            "validate_args"
        )

    def __delattr__(self, name: str) -> None:
        self.__setattr__(name, None)


def freeze_args(args: argparse.Namespace) -> FrozenArgs:
    """A read-only copy of ``args``."""
    frozen = FrozenArgs()
    frozen.__dict__.update(vars(args))
    return frozen
