"""``pretrain``: Megatron-style set-up and training loop on megatron_fsdp (or DDP as the baseline).

One iteration = one global batch = ``num_microbatches`` micro-batches per
data-parallel rank. Losses are Megatron's: the mean over a micro-batch's
unmasked tokens, averaged over micro-batches and ranks; with
``--calculate-per-token-loss`` the sum over tokens, gradients summed and then
divided by the global number of tokens.
"""

from __future__ import annotations

import argparse
import contextlib
import math
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from . import checkpointing
from .arguments import parse_args, validate_args
from .data_loader import build_train_valid_test_data_iterators, check_data_files
from .global_vars import set_args
from .initialize import check_save_dir, initialize_distributed, print_rank_0, set_random_seed
from .logging_utils import memory_report, num_floating_point_operations, training_log_line, validation_log_lines
from .model_setup import build_model, build_optimizer, pad_vocab_size
from .optimizer_param_scheduler import OptimizerParamScheduler

# forward_step(batch, model) -> (per-token losses [mbs, seq], loss_mask [mbs, seq])
ForwardStep = Callable[[dict, nn.Module], tuple[torch.Tensor, torch.Tensor]]


@dataclass
class TrainingResult:
    """What a run produced, for callers (functional tests) that want numbers rather than log lines."""

    iteration: int = 0
    losses: dict[int, float] = field(default_factory=dict)  # iteration -> lm loss
    grad_norms: dict[int, float] = field(default_factory=dict)
    valid_losses: dict[int, float] = field(default_factory=dict)


def pretrain(
    model_provider: Callable[..., nn.Module],
    forward_step: ForwardStep,
    argv: Sequence[str] | None = None,
) -> TrainingResult:
    """Parse flags, set up, train for ``--train-iters``, evaluate and checkpoint as asked."""
    args = parse_args(argv)
    device = initialize_distributed(args)
    validate_args(args, dist.get_world_size())
    if args.save:
        check_save_dir(args.save)
    check_data_files(args)  # missing or truncated --data-path files: before the model is built
    if args.deterministic_mode:
        torch.use_deterministic_algorithms(True)
    set_args(args)
    set_random_seed(args.seed)
    args.padded_vocab_size = pad_vocab_size(args)
    model = build_model(args, model_provider, device)
    optimizer = build_optimizer(args, model)
    scheduler = OptimizerParamScheduler(
        optimizer, max_lr=args.lr, min_lr=args.min_lr, warmup_steps=args.lr_warmup_iters,
        decay_steps=args.lr_decay_iters, decay_style=args.lr_decay_style,
    )
    args.consumed_train_samples = args.consumed_valid_samples = 0
    iteration = checkpointing.load(args, model, optimizer, scheduler) if args.load else 0
    checkpointing.check_save_target(args, iteration)  # before training, not at the first save
    rank, dp_size = dist.get_rank(), dist.get_world_size()
    train_iter, valid_iter, _ = build_train_valid_test_data_iterators(args, rank, dp_size)
    _check_splits(args, train_iter, valid_iter, iteration)
    writer = _tensorboard_writer(args, rank, dp_size)
    result = TrainingResult(iteration=iteration)
    _train(args, model, optimizer, scheduler, forward_step, train_iter, valid_iter, device, iteration, result,
           writer)
    if writer is not None:
        writer.close()
    return result


def _data_description(args: argparse.Namespace) -> str:
    return "--mock-data" if args.mock_data else f"--data-path {' '.join(args.data_path)}"


def _check_splits(args: argparse.Namespace, train_iter, valid_iter, iteration: int) -> None:
    """An empty train split is an error naming --split; an empty validation split with --eval-interval a warning."""
    if train_iter is None and iteration < args.train_iters:
        raise ValueError(
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


def _accumulation(model: nn.Module, is_first: bool, is_last: bool):
    """DDP: no_sync except on the last micro-batch. FSDP: the microbatch() context."""
    if isinstance(model, DDP):
        return contextlib.nullcontext() if is_last else model.no_sync()
    from megatron_fsdp import microbatch

    return microbatch(model, is_first=is_first, is_last=is_last)


def _autocast(args: argparse.Namespace, model: nn.Module, device: torch.device):
    # The DDP baseline keeps fp32 weights and computes in bf16 under autocast;
    # megatron_fsdp computes with bf16 model weights and fp32 main weights.
    if args.bf16 and isinstance(model, DDP):
        return torch.autocast(device.type, dtype=torch.bfloat16)
    return contextlib.nullcontext()


def _dp_sum(values: list[float], device: torch.device) -> list[float]:
    tensor = torch.tensor(values, dtype=torch.float64, device=device)
    dist.all_reduce(tensor)
    return tensor.tolist()


def train_step(
    args: argparse.Namespace, model: nn.Module, optimizer: torch.optim.Optimizer, forward_step: ForwardStep,
    data_iterator: Iterator[dict], device: torch.device,
) -> tuple[float, float, bool]:
    """One global batch: forward/backward over the micro-batches, clip, step. Returns (loss, grad norm, stepped)."""
    _zero_grad(model, optimizer)
    n = args.num_microbatches
    loss_sum = loss_tokens = mean_sum = 0.0
    for m in range(n):
        batch = {k: v.to(device) for k, v in next(data_iterator).items()}
        with _accumulation(model, m == 0, m == n - 1):
            with _autocast(args, model, device):
                losses, mask = forward_step(batch, model)
            masked = (losses.float() * mask).sum()
            tokens = mask.sum()
            if args.calculate_per_token_loss:
                # Summed gradients; DDP averages over ranks, so undo that.
                scaled = masked * (dist.get_world_size() if isinstance(model, DDP) else 1)
            else:
                scaled = masked / tokens.clamp(min=1) / n
            scaled.backward()
        loss_sum += masked.item()
        loss_tokens += tokens.item()
        mean_sum += masked.item() / max(tokens.item(), 1.0)
    if not isinstance(model, DDP):
        model.finish_grad_sync()
    total_sum, total_tokens, total_means = _dp_sum([loss_sum, loss_tokens, mean_sum], device)
    if args.calculate_per_token_loss:
        _scale_gradients(model, 1.0 / max(total_tokens, 1.0))
        loss = total_sum / max(total_tokens, 1.0)
    else:
        loss = total_means / (n * dist.get_world_size())
    params = [p for p in model.parameters() if p.grad is not None]
    norm = torch.nn.utils.clip_grad_norm_(params, args.clip_grad if args.clip_grad > 0 else math.inf)
    norm = float(norm.full_tensor() if hasattr(norm, "full_tensor") else norm)
    # loss and norm are global (all-reduced), so every rank takes the same branch
    if not math.isfinite(norm) or not math.isfinite(loss):
        return loss, norm, False
    optimizer.step()
    return loss, norm, True


class NonFiniteLossError(RuntimeError):
    """An iteration's loss or gradient norm was NaN/Inf (with --check-for-nan-in-loss-and-grad, the default)."""


_NAN_CAUSES = (
    "Likely causes: a learning rate too high for this model (lower --lr, or lengthen --lr-warmup-iters), "
    "loose or no gradient clipping (--clip-grad), overflow in low precision (--bf16; this front-end uses no "
    "loss scaling, the loss scale is always 1.0), too large initial weights (--init-method-std), or corrupt "
    "input data"
)


def _nonfinite_grad_names(model: nn.Module, device: torch.device) -> list[str]:
    """Parameters whose gradient holds NaN/Inf on any rank (one all-reduce; call on every rank)."""
    named = list(model.named_parameters())
    flags = torch.zeros(len(named), device=device)
    for i, (_, param) in enumerate(named):
        if param.grad is not None:
            grad = param.grad.to_local() if hasattr(param.grad, "to_local") else param.grad
            flags[i] = (~torch.isfinite(grad)).any().float()
    dist.all_reduce(flags)
    names = [name for (name, _), bad in zip(named, flags.tolist()) if bad > 0]
    return [name.removeprefix("module.").removeprefix("module.") for name in names]


def _nan_error(args: argparse.Namespace, model: nn.Module, device: torch.device, iteration: int, loss: float,
               norm: float, lr: float) -> NonFiniteLossError:
    names = _nonfinite_grad_names(model, device)
    where = f" in {len(names)} parameter(s): {', '.join(names[:8])}{' ...' if len(names) > 8 else ''}" if names else ""
    return NonFiniteLossError(
        f"iteration {iteration}: lm loss {loss}, grad norm {norm} (NaN/Inf gradients{where or ': none'}); "
        f"learning rate {lr:.6E} (--lr {args.lr}, --clip-grad {args.clip_grad}). {_NAN_CAUSES}. To skip such "
        "iterations instead, pass --no-check-for-nan-in-loss-and-grad"
    )


def _zero_grad(model: nn.Module, optimizer: torch.optim.Optimizer) -> None:
    if not isinstance(model, DDP):
        model.zero_grad_buffer()
    optimizer.zero_grad(set_to_none=True)


def _scale_gradients(model: nn.Module, factor: float) -> None:
    if isinstance(model, DDP):
        for p in model.parameters():
            if p.grad is not None:
                p.grad.mul_(factor)
    else:
        model.scale_gradients(factor)


@torch.no_grad()
def evaluate(args: argparse.Namespace, model: nn.Module, forward_step: ForwardStep, data_iterator: Iterator[dict],
             device: torch.device) -> float:
    """Mean lm loss over ``--eval-iters`` global batches."""
    model.eval()
    loss_sum = tokens = mean_sum = 0.0
    count = 0
    for _ in range(args.eval_iters):
        for _ in range(args.num_microbatches):
            batch = {k: v.to(device) for k, v in next(data_iterator).items()}
            with _autocast(args, model, device):
                losses, mask = forward_step(batch, model)
            masked = float((losses.float() * mask).sum())
            loss_sum, tokens = loss_sum + masked, tokens + float(mask.sum())
            mean_sum += masked / max(float(mask.sum()), 1.0)
            count += 1
    model.train()
    args.consumed_valid_samples += args.eval_iters * args.global_batch_size
    total_sum, total_tokens, total_means, total_count = _dp_sum([loss_sum, tokens, mean_sum, count], device)
    if args.calculate_per_token_loss:
        return total_sum / max(total_tokens, 1.0)
    return total_means / total_count


@dataclass
class _LogWindow:
    """What one log line reports: Megatron averages the loss over the iterations that stepped."""

    seconds: float = 0.0  # train-step time only (evaluation and checkpoints excluded)
    iterations: int = 0
    advanced: int = 0
    loss_all: float = 0.0
    loss_advanced: float = 0.0
    skipped: int = 0
    nan: int = 0

    def add(self, seconds: float, loss: float, stepped: bool) -> None:
        self.seconds, self.iterations, self.loss_all = self.seconds + seconds, self.iterations + 1, self.loss_all + loss
        if stepped:
            self.advanced, self.loss_advanced = self.advanced + 1, self.loss_advanced + loss
        else:
            self.skipped += 1
            self.nan += not math.isfinite(loss)

    def mean_loss(self) -> float:
        return self.loss_advanced / self.advanced if self.advanced else self.loss_all / max(self.iterations, 1)


def _train(args, model, optimizer, scheduler, forward_step, train_iter, valid_iter, device, iteration, result,
           writer) -> None:
    model.train()
    flops = num_floating_point_operations(args, args.global_batch_size)
    window, memory_reported, start_iteration, advanced = _LogWindow(), False, iteration, 0
    while iteration < args.train_iters:
        started = time.perf_counter()
        loss, norm, stepped = train_step(args, model, optimizer, forward_step, train_iter, device)
        iteration += 1
        if not stepped and args.check_for_nan_in_loss_and_grad:
            raise _nan_error(args, model, device, iteration, loss, norm, optimizer.param_groups[0]["lr"])
        args.consumed_train_samples += args.global_batch_size
        if stepped:
            scheduler.step()
            advanced += 1
        lr = optimizer.param_groups[0]["lr"]  # after the schedule's step, as Megatron logs it
        result.losses[iteration], result.grad_norms[iteration] = loss, norm
        result.iteration = iteration
        window.add(time.perf_counter() - started, loss, stepped)
        if writer is not None:
            writer.add_scalar("lm loss", loss, iteration)
            writer.add_scalar("grad-norm", norm, iteration)
            writer.add_scalar("learning-rate", lr, iteration)
        if iteration % args.log_interval == 0:
            elapsed = window.seconds / window.iterations
            print_rank_0(training_log_line(
                iteration=iteration, train_iters=args.train_iters, consumed=args.consumed_train_samples,
                elapsed_ms=elapsed * 1000.0, tflops=flops / elapsed / 1e12 / dist.get_world_size(),
                lr=lr, global_batch=args.global_batch_size, losses={"lm loss": window.mean_loss()},
                grad_norm=norm, skipped=window.skipped, nan=window.nan,
            ))
            if not memory_reported:
                print_rank_0(f"[Rank {dist.get_rank()}] (after {iteration} iterations) {memory_report(device)}")
                memory_reported = True
            window = _LogWindow()
        if args.eval_interval and iteration % args.eval_interval == 0 and valid_iter is not None:
            result.valid_losses[iteration] = evaluate(args, model, forward_step, valid_iter, device)
            print_rank_0(validation_log_lines(iteration, result.valid_losses[iteration]))
            if writer is not None:
                writer.add_scalar("lm loss validation", result.valid_losses[iteration], iteration)
        if args.save and args.save_interval and iteration % args.save_interval == 0:
            checkpointing.save(args, iteration, model, optimizer, scheduler)
        if args.exit_interval and iteration % args.exit_interval == 0:
            print_rank_0(f"exiting program at iteration {iteration}")
            break
    if iteration > start_iteration and advanced == 0:
        raise NonFiniteLossError(
            f"all {iteration - start_iteration} iterations ({start_iteration + 1} to {iteration}) were skipped "
            f"because their loss or grad norm was NaN/Inf (--no-check-for-nan-in-loss-and-grad): nothing was "
            f"trained, and no final checkpoint is saved. {_NAN_CAUSES}"
        )
    saved_last = args.save_interval and iteration % args.save_interval == 0
    if args.save and iteration > start_iteration and not saved_last:
        checkpointing.save(args, iteration, model, optimizer, scheduler)
