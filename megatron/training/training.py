"""``pretrain``: Megatron-style set-up, then the ``Trainer``'s loop, on megatron_fsdp (or DDP as the baseline).

Set-up order: flags parsed and validated (and derived values added) once, the
process group, megatron-core's parallel state and RNG tracker, the parallel layout
derived from its groups (meshes, TP/CP/DP/EP groups), the model wrapped by
its data-parallel backend, the optimizer and
schedule, a checkpoint's state when resuming, the data at the resumed position.
The flags namespace is not written after that; what the run advances lives in a
``RunState`` (``config.py``).
"""

from __future__ import annotations

import argparse
import logging
import time
from collections.abc import Callable, Sequence

import torch
import torch.distributed as dist
from torch import nn

from . import checkpointing
from .arguments import parse_args, validate_args
from .backends import build_backend
from .config import RunState, TrainingConfig, freeze_args, init_num_microbatches
from .data_loader import build_train_valid_test_data_iterators, check_data_files
from .errors import UsageValueError
from .global_vars import set_args
from .initialize import check_save_dir, initialize_distributed, print_rank_0, set_random_seed
from .model_setup import build_adamw, build_optimizer_param_scheduler, pad_vocab_size
from .parallel_state import build_layout
from .summary import end_of_run_summary, startup_summary
from .trainer import ForwardStep, Trainer, TrainingResult

__all__ = ["ForwardStep", "TrainingResult", "pretrain"]


def pretrain(
    model_provider: Callable[..., nn.Module],
    forward_step: ForwardStep,
    argv: Sequence[str] | None = None,
) -> TrainingResult:
    """Parse flags, set up, train for ``--train-iters``, evaluate and checkpoint as asked."""
    args = parse_args(argv)
    device = initialize_distributed(args)
    validate_args(args, dist.get_world_size())
    args.num_microbatches = init_num_microbatches(args, dist.get_rank())  # megatron-core's calculator
    if args.save:
        check_save_dir(args.save)
    check_data_files(args)  # missing or truncated --data-path files: before the model is built
    if args.deterministic_mode:
        torch.use_deterministic_algorithms(True)
    args.padded_vocab_size = pad_vocab_size(args)  # the last derived value
    args = freeze_args(args)  # read-only from here on: run state lives in RunState
    set_args(args)
    if args.logging_level is not None:  # Megatron's --logging-level: Python's root logger
        logging.getLogger().setLevel(args.logging_level)
    set_random_seed(args.seed)
    config = TrainingConfig.from_args(args)
    # megatron-core's parallel_state (the job's only process groups) and RNG tracker (seed + 2718 + TP rank for
    # dropout inside TP regions), as Megatron's initialize_megatron; the meshes are built from its groups
    layout = build_layout(args, device)
    backend = build_backend(args, model_provider, device, layout)
    optimizer = backend.wrap_optimizer(build_adamw(args, backend.model))
    scheduler = build_optimizer_param_scheduler(args, optimizer)  # megatron-core's OptimizerParamScheduler
    state = checkpointing.load(args, backend.module, optimizer, scheduler, layout) if args.load else RunState()
    if state.iteration >= args.train_iters:
        print_rank_0(f"--load {args.load} is at iteration {state.iteration} and --train-iters is {args.train_iters}: "
                     "nothing to train. To train further, raise --train-iters (see docs/megatron.md, Resuming)")
        return TrainingResult(iteration=state.iteration)
    checkpointing.check_save_target(args, state.iteration)  # before training, not at the first save
    train_iter, valid_iter, test_iter = build_train_valid_test_data_iterators(
        args, layout.dp_rank, layout.dp_size, consumed_train_samples=state.consumed_train_samples,
        consumed_valid_samples=state.consumed_valid_samples,
    )
    _check_splits(args, train_iter, valid_iter, state.iteration)
    writer = _tensorboard_writer(args, dist.get_rank(), dist.get_world_size())
    print_rank_0(startup_summary(args, layout, backend.module, state.iteration))
    start_iteration, start_samples, started = state.iteration, state.consumed_train_samples, time.perf_counter()
    try:
        trainer = Trainer(args, config, backend, optimizer, scheduler, forward_step, state, writer)
        result = trainer.train(train_iter, valid_iter, test_iter)
    finally:
        if writer is not None:
            writer.close()
    print_rank_0(end_of_run_summary(
        args, start_iteration=start_iteration, iteration=state.iteration,
        samples=state.consumed_train_samples - start_samples, seconds=time.perf_counter() - started,
        final_loss=result.losses.get(state.iteration), saved=bool(args.save) and state.iteration > start_iteration,
    ))
    return result


def _data_description(args: argparse.Namespace) -> str:
    return "--mock-data" if args.mock_data else f"--data-path {' '.join(args.data_path)}"


def _check_splits(args: argparse.Namespace, train_iter, valid_iter, iteration: int) -> None:
    """An empty train split is an error naming --split; an empty validation split with --eval-interval a warning."""
    if train_iter is None and iteration < args.train_iters:
        raise UsageValueError(
            f"--split {args.split} leaves the train split of {_data_description(args)} without documents: "
            "nothing to train on. Give the first (train) weight of --split a larger share, e.g. --split 969,30,1, "
            "or use a dataset with more documents"
        )
    if valid_iter is None and args.eval_interval:
        print_rank_0(f"WARNING: --eval-interval {args.eval_interval} is given but --split {args.split} leaves the "
                     f"validation split of {_data_description(args)} without documents; no evaluation will run")


def _tensorboard_writer(args: argparse.Namespace, rank: int, world_size: int):
    """Megatron's writer: on the last rank only; the warning when tensorboard is missing is printed there."""
    if not args.tensorboard_dir or rank != world_size - 1:
        return None
    try:
        from torch.utils.tensorboard import SummaryWriter
    except ImportError:
        print(f"[Rank {rank}] WARNING: --tensorboard-dir {args.tensorboard_dir} given but tensorboard is not "
              "installed (pip install tensorboard); no scalars will be written", flush=True)
        return None
    return SummaryWriter(log_dir=args.tensorboard_dir)
