"""Front-end checkpoints: ``--save/--load/--save-interval`` on ``megatron_fsdp.checkpoint``.

The model, optimizer, scheduler, RNG states and data position are saved in
Megatron's layout (``DIR/iter_0000010/`` + ``DIR/latest_checkpointed_iteration.txt``)
as sharded DCP files that load at any number of ranks and any strategy, and at any
tensor-, context- and expert-parallel size: entries are those of the model without
tensor or expert parallelism (``model_parallel``).

What is refused, and why (docs/megatron.md, "Checkpoints"):

- ``--load DIR`` naming no checkpoint, unless ``--allow-fresh-start``: a mistyped
  path would otherwise train from scratch and, with ``--save`` to a real
  checkpoint directory, overwrite it (``--load DIR/iter_0000060``, one iteration's
  directory, loads that iteration, as the checkpoint CLI accepts it);
- a run whose saves would move ``--save``'s tracker back to an earlier iteration;
- a checkpoint saved with other model arguments (``MODEL_ARGS``), unless
  ``--finetune`` or ``--no-load-args-check``: equal shapes would load silently;
- a checkpoint whose learning-rate schedule differs from the flags, unless
  ``--override-opt_param-scheduler`` or ``--use-checkpoint-opt_param-scheduler``
  (Megatron-LM's rule, ``model_setup.check_scheduler_state`` before megatron-core's ``OptimizerParamScheduler``);
- a checkpoint missing a part (``extra.pt`` holds the data position) or with a
  damaged file (the library checks its SHA-256 manifest).
"""

from __future__ import annotations

import argparse
import os
import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler
from torch import nn

from megatron_fsdp.checkpoint import (
    TRACKER_FILE,
    AsyncSave,
    CheckpointCorruptError,
    CheckpointMismatchError,
    ModelParallel,
    async_save_checkpoint,
    load_checkpoint,
    read_latest_iteration,
    save_checkpoint,
)
from megatron_fsdp.checkpoint.sharded_io import is_checkpoint_dir, run_on_first

from .config import RunState
from .errors import UsageFileNotFoundError, UsageValueError
from .initialize import print_rank_0
from .model_setup import check_scheduler_state
from .parallel_state import ParallelLayout
from .rng_tracker import TRACKER_KEY, gather_tracker_states, mcore_rng_tracker, restore_tracker_states

# The flags that define the model a checkpoint holds (compared at --load; saved in extra.pt's "args").
MODEL_ARGS = (
    "model_provider", "num_layers", "hidden_size", "ffn_hidden_size", "num_attention_heads", "num_query_groups",
    "max_position_embeddings", "position_embedding_type", "rotary_base", "normalization", "swiglu",
    "untie_embeddings_and_output_weights", "vocab_size", "padded_vocab_size", "tokenizer_type",
    "kv_channels", "add_bias_linear", "qk_layernorm", "moe_layer_freq",
)
# What a resumed run needs from extra.pt.
RESUME_KEYS = ("scheduler", "consumed_train_samples", "consumed_valid_samples")


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def _model_args(values: dict[str, Any]) -> dict[str, Any]:
    """The model-defining values of ``values`` (args), with defaults spelled out (query groups = heads)."""
    out = {k: values.get(k) for k in MODEL_ARGS if k in values}
    if "num_query_groups" in out and out["num_query_groups"] is None:
        out["num_query_groups"] = values.get("num_attention_heads")
    return out


def model_args_mismatch(saved_args: dict[str, Any], args: argparse.Namespace) -> list[str]:
    """``--flag saved (saved) vs now (now)`` for every model-defining flag whose value changed."""
    saved, now = _model_args(saved_args), _model_args(vars(args))
    return [f"{_flag(k)} {saved[k]} (saved) vs {now.get(k)} (now)" for k in saved if saved[k] != now.get(k)]


# An expert's parameters: ``...mlp.experts.local_experts.<local index>.<name>`` (megatron-core's SequentialMLP).
_LOCAL_EXPERT = re.compile(r"(^|\.)local_experts\.(\d+)\.")


def model_parallel(args: argparse.Namespace, layout: ParallelLayout) -> ModelParallel:
    """The checkpoint's view of the layout: entries are the model's without TP and EP, whatever the sizes.

    TP-sharded parameters (experts' over the expert TP group) are saved as full tensors;
    expert ``j`` of EP rank ``r`` is saved as expert ``r * E / P + j`` (its global index), so the names do not depend on
    ``--expert-model-parallel-size``.
    """
    ep = layout.ep
    rename = None
    if ep.size > 1:
        per_rank = args.num_experts // ep.size
        first = ep.rank * per_rank

        def rename(fqn: str) -> str:
            return _LOCAL_EXPERT.sub(lambda m: f"{m.group(1)}local_experts.{first + int(m.group(2))}.", fqn, count=1)

    etp = layout.expert_tp
    return ModelParallel(tp_size=layout.tp.size, tp_rank=layout.tp.rank, rename=rename, etp_size=etp.size,
                         etp_rank=etp.rank)


class _AsyncSaves:
    """``--async-save``'s one save in flight and the gloo group its background writes use (made at the first)."""

    pending: AsyncSave | None = None
    io_group: dist.ProcessGroup | None = None


def finalize_async_save(blocking: bool = True) -> None:
    """Wait for (``blocking``) or collect (if done) the ``--async-save`` in flight, and report it as saved.

    Its tracker file names the iteration only once its write committed; a write that
    failed raises here. Called before each save, each iteration (not blocking) and at
    the end of training, so the last save is complete before the run ends.
    """
    pending = _AsyncSaves.pending
    if pending is None or not (blocking or pending.done()):
        return
    _AsyncSaves.pending = None
    path = pending.wait()
    print_rank_0(f"  successfully saved checkpoint from iteration {pending.iteration:7d} to {path} (--async-save)")


def save(args: argparse.Namespace, state: RunState, module: nn.Module, optimizer: torch.optim.Optimizer,
         scheduler: OptimizerParamScheduler, layout: ParallelLayout) -> None:
    """Save ``module`` (the user's, unwrapped), the optimizer and the run's position to ``--save``.

    With ``--async-save`` the state is copied to host memory here and written by a background
    thread while training goes on (``finalize_async_save`` waits for it).
    """
    extra = {
        "scheduler": scheduler.state_dict(),
        "consumed_train_samples": state.consumed_train_samples,
        "consumed_valid_samples": state.consumed_valid_samples,
        "args": {k: v for k, v in vars(args).items() if isinstance(v, (int, float, str, bool, type(None)))},
    }
    # megatron-core's CUDA RNG tracker, every rank's (rng_tracker.py)
    tracker_states = gather_tracker_states(mcore_rng_tracker())
    if tracker_states is not None:
        extra[TRACKER_KEY] = tracker_states
    if args.async_save:
        finalize_async_save()  # one save in flight: the previous one is complete before this one starts
        if _AsyncSaves.io_group is None:  # every rank saves at the same iteration: they create it together
            _AsyncSaves.io_group = dist.new_group(backend="gloo")
        _AsyncSaves.pending = async_save_checkpoint(args.save, state.iteration, module, optimizer, extra=extra,
                                                    io_group=_AsyncSaves.io_group,
                                                    model_parallel=model_parallel(args, layout))
        print_rank_0(f"  scheduled an asynchronous save of iteration {state.iteration:7d} to {args.save}")
        return
    path = save_checkpoint(args.save, state.iteration, module, optimizer, extra=extra,
                           model_parallel=model_parallel(args, layout))
    print_rank_0(f"  successfully saved checkpoint from iteration {state.iteration:7d} to {path}")


def check_save_target(args: argparse.Namespace, iteration: int) -> None:
    """Fail at start if ``--save``'s tracker names an iteration after ``iteration`` (where this run starts).

    Its saves would move the tracker back (the library refuses each of them); better
    to say so before training than at the first save.
    """
    if not args.save:
        return

    def check() -> None:
        if not os.path.isfile(os.path.join(args.save, TRACKER_FILE)):
            return
        latest = read_latest_iteration(args.save)
        if latest > iteration:
            raise UsageValueError(
                f"--save {args.save} already holds a checkpoint of iteration {latest} ({TRACKER_FILE}) and this run "
                f"starts at iteration {iteration}: its saves would move the tracker back and replace those "
                f"checkpoints. Resume it with --load {args.save}, or save into another directory"
            )

    run_on_first(check, None)


_ITERATION_DIR = re.compile(r"iter_(\d+)")


@dataclass(frozen=True)
class _Located:
    """What ``--load`` names: a save directory and the iteration to load (None: its tracker's), or a fresh start."""

    directory: str
    iteration: int | None = None
    fresh_start: str | None = None  # the warning of a fresh start (--allow-fresh-start)


def _locate(args: argparse.Namespace) -> _Located:
    """Where to load from; a fresh start with --allow-fresh-start when nothing is there. Raises otherwise."""
    tracker = os.path.join(args.load, TRACKER_FILE)
    if os.path.isfile(tracker):
        return _Located(args.load)
    path = os.path.normpath(args.load)
    named = _ITERATION_DIR.fullmatch(os.path.basename(path))
    if named and is_checkpoint_dir(path):  # DIR/iter_0000060: that iteration of DIR
        return _Located(os.path.dirname(path), int(named.group(1)))
    iters = sorted(e for e in os.listdir(args.load) if e.startswith("iter_")) if os.path.isdir(args.load) else []
    if iters:
        raise UsageFileNotFoundError(
            f"--load {args.load} holds {', '.join(iters[:5])}{' ...' if len(iters) > 5 else ''} but no {TRACKER_FILE}"
            f" saying which to resume: write the iteration into {tracker} (e.g. echo {iters[-1][5:].lstrip('0') or 0}"
            f" > {tracker})"
        )
    if named:
        where = "is not a complete checkpoint (no .metadata file)" if os.path.isdir(path) else "does not exist"
        raise UsageFileNotFoundError(
            f"--load {args.load} {where}. Give the save directory ({os.path.dirname(path)}) to load the iteration "
            f"its {TRACKER_FILE} names, or the directory of a complete iteration"
        )
    where = "does not exist" if not os.path.exists(args.load) else f"holds no checkpoint (no {TRACKER_FILE})"
    if args.allow_fresh_start:
        return _Located(args.load, fresh_start=f"WARNING: --load {args.load} {where}; training from scratch "
                                               "(--allow-fresh-start)")
    raise UsageFileNotFoundError(
        f"--load {args.load} {where}. Check the path; to train from scratch when no checkpoint exists yet (e.g. "
        "--load and --save of the same directory, resuming automatically after the first save), pass "
        "--allow-fresh-start"
    )


def _padding_hint(saved: dict[str, Any], args: argparse.Namespace) -> str:
    """Why the padded vocabulary differs when only the tensor-parallel size changed the padding."""
    saved_tp = saved.get("tensor_model_parallel_size", 1)
    if saved.get("padded_vocab_size") == args.padded_vocab_size or saved_tp == args.tensor_model_parallel_size:
        return ""
    return (f"The vocabulary is padded to a multiple of --make-vocab-size-divisible-by x --tensor-model-parallel-size "
            f"({args.make_vocab_size_divisible_by} x {saved_tp} when saved, x {args.tensor_model_parallel_size} now), "
            "and the padded rows take part in the softmax: choose --make-vocab-size-divisible-by so that both "
            "layouts pad to the same size (train and resume with it). ")


class LoadMismatchError(UsageValueError, CheckpointMismatchError):
    """A strict ``--load`` whose tensors do not fit this model, in command-line terms.

    A ``UsageError`` (printed once, without a traceback: every rank raises it at the same point,
    the key report being merged across ranks) and still the library's ``CheckpointMismatchError``
    for callers that catch that.
    """


def _mismatch_message(args: argparse.Namespace, error: CheckpointMismatchError) -> str:
    """A strict load's mismatch in command-line terms (the library's advice, ``strict=False``, is no flag)."""
    skipped = "--finetune or --no-load-args-check" if (args.finetune or args.no_load_args_check) else ""
    why = (f"{skipped} let model arguments differ from the saved ones, but every tensor of the model must "
           "still be in the checkpoint with its shape" if skipped else
           "this model's tensors are not the checkpoint's")
    return (f"--load {args.load}: checkpoint {error.where} does not match: {error.report.describe()}; {why}. "
            "Pass the model arguments the checkpoint was saved with (its args are in extra.pt; "
            "python -m megatron_fsdp.checkpoint info lists its tensors)")


def _check_extra(
    args: argparse.Namespace, scheduler: OptimizerParamScheduler | None = None
) -> Callable[[dict[str, Any]], None]:
    """The ``check_extra`` of ``load_checkpoint``: model arguments and the LR schedule (``scheduler``'s) agree,
    and a resume has its data position (before any tensor is read)."""

    def check(extra: dict[str, Any]) -> None:
        if not (args.finetune or args.no_load_args_check) and isinstance(extra.get("args"), dict):
            differ = model_args_mismatch(extra["args"], args)
            if differ:
                raise UsageValueError(
                    f"--load {args.load}: the checkpoint was saved with other model arguments: {'; '.join(differ)}. "
                    f"{_padding_hint(extra['args'], args)}Pass the saved values, or --no-load-args-check (or "
                    "--finetune) to load its weights into this model anyway"
                )
        missing = [k for k in RESUME_KEYS if k not in extra]
        if not args.finetune and missing:
            raise CheckpointCorruptError(
                f"--load {args.load}: the checkpoint's extra.pt lacks {', '.join(missing)} (the scheduler state "
                "and data position pretrain_gpt.py saves); resuming without them would replay data from the "
                "start. Load it with --finetune to take only the weights"
            )
        if scheduler is not None and not (args.finetune or args.no_load_optim):
            check_scheduler_state(scheduler, extra["scheduler"], f"--load {args.load}")

    return check


def load(args: argparse.Namespace, module: nn.Module, optimizer: torch.optim.Optimizer,
         scheduler: OptimizerParamScheduler, layout: ParallelLayout) -> RunState:
    """Resume from ``--load`` into ``module`` (the user's, unwrapped): the run's state to continue from.

    A fresh start (``--allow-fresh-start``) and ``--finetune`` start at iteration 0 with no data consumed.
    """
    located = run_on_first(lambda: _locate(args), None)
    if located.fresh_start is not None:
        print_rank_0(located.fresh_start)
        return RunState()
    finetune = args.finetune
    try:
        loaded = load_checkpoint(
            located.directory, module, None if (finetune or args.no_load_optim) else optimizer,
            iteration=located.iteration,
            load_optimizer=not (finetune or args.no_load_optim), load_rng=not (finetune or args.no_load_rng),
            check_extra=_check_extra(args, scheduler), model_parallel=model_parallel(args, layout),
        )
    except CheckpointMismatchError as error:
        if error.report is None:
            raise
        mismatch = LoadMismatchError(_mismatch_message(args, error))
        mismatch.report, mismatch.where = error.report, error.where
        raise mismatch from error
    print_rank_0(f"  successfully loaded checkpoint from {located.directory} at iteration {loaded.iteration}")
    # megatron-core's tracker states (a checkpoint without them loads, keeping this run's seeding, with a warning).
    # An older checkpoint's MODEL_PARALLEL_TRACKER_KEY (the own GPT's tracker, now gone) is ignored.
    warning = restore_tracker_states(mcore_rng_tracker(), loaded.extra, rng_restored=loaded.rng_restored,
                                     where=f"--load {args.load}")
    if warning is not None:
        print_rank_0(warning)
    if finetune:
        return RunState()
    extra = loaded.extra
    if not args.no_load_optim:
        scheduler.load_state_dict(extra["scheduler"])
    else:
        scheduler.num_steps = loaded.iteration
        scheduler.step(0)
    return RunState(
        iteration=loaded.iteration, consumed_train_samples=int(extra["consumed_train_samples"]),
        consumed_valid_samples=int(extra["consumed_valid_samples"]),
    )
