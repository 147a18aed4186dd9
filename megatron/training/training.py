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
from .data_loader import build_train_valid_test_data_iterators
from .global_vars import set_args
from .initialize import initialize_distributed, print_rank_0, set_random_seed
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
    rank, dp_size = dist.get_rank(), dist.get_world_size()
    train_iter, valid_iter, _ = build_train_valid_test_data_iterators(args, rank, dp_size)
    writer = _tensorboard_writer(args)
    result = TrainingResult(iteration=iteration)
    _train(args, model, optimizer, scheduler, forward_step, train_iter, valid_iter, device, iteration, result,
           writer)
    if writer is not None:
        writer.close()
    return result


def _tensorboard_writer(args: argparse.Namespace):
    if not args.tensorboard_dir or dist.get_rank() != dist.get_world_size() - 1:
        return None
    try:
        from torch.utils.tensorboard import SummaryWriter
    except ImportError:
        print_rank_0("WARNING: --tensorboard-dir given but tensorboard is not installed; no scalars written")
        return None
    return SummaryWriter(log_dir=args.tensorboard_dir)


def _accumulation(model: nn.Module, is_first: bool, is_last: bool):
    """DDP: no_sync except on the last micro-batch. FSDP: the microbatch() context (seed 001)."""
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
    if not math.isfinite(norm) or not math.isfinite(loss):
        if args.check_for_nan_in_loss_and_grad:
            raise RuntimeError(f"NaN or Inf found: loss {loss}, grad norm {norm} (rank {dist.get_rank()})")
        return loss, norm, False
    optimizer.step()
    return loss, norm, True


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


def _train(args, model, optimizer, scheduler, forward_step, train_iter, valid_iter, device, iteration, result,
           writer) -> None:
    model.train()
    flops = num_floating_point_operations(args, args.global_batch_size)
    window_loss, window_count, window_start, skipped, nan_count = 0.0, 0, time.perf_counter(), 0, 0
    memory_reported = False
    start_iteration = iteration
    while iteration < args.train_iters:
        loss, norm, stepped = train_step(args, model, optimizer, forward_step, train_iter, device)
        iteration += 1
        args.consumed_train_samples += args.global_batch_size
        if stepped:
            scheduler.step()
        else:
            skipped += 1
            nan_count += 1
        result.losses[iteration], result.grad_norms[iteration] = loss, norm
        result.iteration = iteration
        window_loss, window_count = window_loss + loss, window_count + 1
        if writer is not None:
            writer.add_scalar("lm loss", loss, iteration)
            writer.add_scalar("grad-norm", norm, iteration)
            writer.add_scalar("learning-rate", optimizer.param_groups[0]["lr"], iteration)
        if iteration % args.log_interval == 0:
            elapsed = (time.perf_counter() - window_start) / window_count
            print_rank_0(training_log_line(
                iteration=iteration, train_iters=args.train_iters, consumed=args.consumed_train_samples,
                elapsed_ms=elapsed * 1000.0, tflops=flops / elapsed / 1e12 / dist.get_world_size(),
                lr=optimizer.param_groups[0]["lr"], global_batch=args.global_batch_size,
                losses={"lm loss": window_loss / window_count}, grad_norm=norm, skipped=skipped, nan=nan_count,
            ))
            if not memory_reported:
                print_rank_0(f"[Rank {dist.get_rank()}] (after {iteration} iterations) {memory_report(device)}")
                memory_reported = True
            window_loss, window_count, window_start, skipped = 0.0, 0, time.perf_counter(), 0
        if args.eval_interval and iteration % args.eval_interval == 0 and valid_iter is not None:
            result.valid_losses[iteration] = evaluate(args, model, forward_step, valid_iter, device)
            print_rank_0(validation_log_lines(iteration, result.valid_losses[iteration]))
            if writer is not None:
                writer.add_scalar("lm loss validation", result.valid_losses[iteration], iteration)
            window_start = time.perf_counter()
        if args.save and args.save_interval and iteration % args.save_interval == 0:
            checkpointing.save(args, iteration, model, optimizer, scheduler)
            window_start = time.perf_counter()
        if args.exit_interval and iteration % args.exit_interval == 0:
            print_rank_0(f"exiting program at iteration {iteration}")
            break
    saved_last = args.save_interval and iteration % args.save_interval == 0
    if args.save and iteration > start_iteration and not saved_last:
        checkpointing.save(args, iteration, model, optimizer, scheduler)
