"""``Trainer``: Megatron's training loop (train step, evaluation, logging, checkpoints) over one backend.

One iteration = one global batch = ``num_microbatches`` micro-batches per
data-parallel rank. Losses are Megatron's: the mean over a micro-batch's unmasked
tokens, averaged over micro-batches and ranks; with ``--calculate-per-token-loss``
the sum over tokens, gradients summed and then divided by the global number of tokens.
"""

from __future__ import annotations

import argparse
import math
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch import nn

from . import checkpointing
from .backends import DataParallelBackend
from .config import RunState, TrainingConfig
from .initialize import print_rank_0
from .logging_utils import memory_report, num_floating_point_operations, training_log_line, validation_log_lines
from .nan_check import NAN_CAUSES, NonFiniteLossError, nan_error
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


@dataclass
class StepResult:
    """One train step: the global loss, the gradient norm before clipping, whether the optimizer stepped."""

    loss: float
    grad_norm: float
    stepped: bool


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

    def add(self, seconds: float, step: StepResult) -> None:
        self.seconds, self.iterations = self.seconds + seconds, self.iterations + 1
        self.loss_all += step.loss
        if step.stepped:
            self.advanced, self.loss_advanced = self.advanced + 1, self.loss_advanced + step.loss
        else:
            self.skipped += 1
            self.nan += not math.isfinite(step.loss)

    def mean_loss(self) -> float:
        return self.loss_advanced / self.advanced if self.advanced else self.loss_all / max(self.iterations, 1)


class Trainer:
    """Trains ``backend``'s model from ``state`` for ``config.train_iters`` iterations.

    ``args`` (the validated flags) is read only to save checkpoints (which record the
    model flags); the loop reads ``config``, and what it advances lives in ``state``.
    """

    def __init__(
        self, args: argparse.Namespace, config: TrainingConfig, backend: DataParallelBackend,
        optimizer: torch.optim.Optimizer, scheduler: OptimizerParamScheduler, forward_step: ForwardStep,
        state: RunState, writer: object | None = None,
    ) -> None:
        self.args, self.config, self.backend = args, config, backend
        self.optimizer, self.scheduler, self.forward_step = optimizer, scheduler, forward_step
        self.state, self.writer = state, writer
        self.device = backend.device
        self.result = TrainingResult(iteration=state.iteration)

    def _batch(self, data_iterator: Iterator[dict]) -> dict:
        """The next micro-batch on the device; with context parallelism this CP rank's tokens of it."""
        cp = self.backend.layout.cp
        return {k: cp.split(v.to(self.device, non_blocking=True)) for k, v in next(data_iterator).items()}

    def _micro_batch_totals(self, masked: torch.Tensor, tokens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The micro-batch's masked loss sum and token count over its whole sequence (summed over CP ranks)."""
        cp = self.backend.layout.cp
        if cp.size == 1:
            return masked.detach(), tokens.detach()
        both = torch.stack([masked.detach(), tokens.detach()])
        dist.all_reduce(both, group=cp.group)
        return both[0], both[1]

    def train_step(self, data_iterator: Iterator[dict]) -> StepResult:
        """One global batch: forward/backward over the micro-batches, clip, step."""
        config, backend, model = self.config, self.backend, self.backend.model
        backend.zero_grad()
        self.optimizer.zero_grad(set_to_none=True)
        n = config.num_microbatches
        # (masked loss sum, tokens, per-micro-batch mean) summed on the device in float64 (the arithmetic of
        # Python floats), read once per step: an .item() per micro-batch would make the CPU wait for every
        # backward and its reductions before queueing the next forward's gathers.
        totals = torch.zeros(3, dtype=torch.float64, device=self.device)
        for m in range(n):
            batch = self._batch(data_iterator)
            with backend.accumulation(is_first=m == 0, is_last=m == n - 1):
                with backend.autocast():
                    losses, mask = self.forward_step(batch, model)
                masked = (losses.float() * mask).sum()
                masked_all, tokens_all = self._micro_batch_totals(masked, mask.sum())
                if config.calculate_per_token_loss:
                    scaled = masked * backend.summed_loss_factor()  # summed gradients
                else:
                    # Each CP rank's share of the micro-batch mean; the gradient reduction averages over
                    # the CP ranks too, where their shares must be summed: hence x CP size.
                    scaled = masked / tokens_all.clamp(min=1) / n * backend.layout.cp.size
                scaled.backward()
            masked, tokens = masked_all.double(), tokens_all.double()
            totals += torch.stack([masked, tokens, masked / tokens.clamp(min=1.0)])
        backend.finish_grad_sync()
        dist.all_reduce(totals, group=backend.layout.dp_group)  # TP ranks of one DP rank hold the same losses
        total_sum, total_tokens, total_means = totals.tolist()
        if config.calculate_per_token_loss:
            backend.scale_gradients(1.0 / max(total_tokens, 1.0))
            loss = total_sum / max(total_tokens, 1.0)
        else:
            loss = total_means / (n * backend.layout.dp_size)
        norm = backend.clip_grad_norm(config.clip_grad if config.clip_grad > 0 else math.inf)
        # loss and norm are global (all-reduced), so every rank takes the same branch
        if not math.isfinite(norm) or not math.isfinite(loss):
            return StepResult(loss, norm, False)
        self.optimizer.step()
        return StepResult(loss, norm, True)

    @torch.no_grad()
    def evaluate(self, data_iterator: Iterator[dict]) -> float:
        """Mean lm loss over ``--eval-iters`` global batches."""
        config, backend = self.config, self.backend
        backend.model.eval()
        totals = torch.zeros(4, dtype=torch.float64, device=self.device)  # as in train_step, plus a count
        for _ in range(config.eval_iters):
            for _ in range(config.num_microbatches):
                batch = self._batch(data_iterator)
                with backend.autocast():
                    losses, mask = self.forward_step(batch, backend.model)
                masked, tokens = self._micro_batch_totals((losses.float() * mask).sum(), mask.sum())
                masked, tokens = masked.double(), tokens.double()
                totals += torch.stack([masked, tokens, masked / tokens.clamp(min=1.0), torch.ones_like(masked)])
        backend.model.train()
        self.state.consumed_valid_samples += config.eval_iters * config.global_batch_size
        dist.all_reduce(totals, group=backend.layout.dp_group)
        total_sum, total_tokens, total_means, total_count = totals.tolist()
        if config.calculate_per_token_loss:
            return total_sum / max(total_tokens, 1.0)
        return total_means / total_count

    def save(self) -> None:
        checkpointing.save(self.args, self.state, self.backend.module, self.optimizer, self.scheduler,
                           self.backend.layout)

    def _write_scalars(self, values: dict[str, float]) -> None:
        if self.writer is not None:
            for name, value in values.items():
                self.writer.add_scalar(name, value, self.state.iteration)

    def train(self, train_iter: Iterator[dict], valid_iter: Iterator[dict] | None) -> TrainingResult:
        """Iterate until ``--train-iters`` (or ``--exit-interval``), evaluating and saving as asked."""
        config, state, result = self.config, self.state, self.result
        self.backend.model.train()
        flops = num_floating_point_operations(self.args, config.global_batch_size)
        window, memory_reported, start_iteration, advanced = _LogWindow(), False, state.iteration, 0
        while state.iteration < config.train_iters:
            started = time.perf_counter()
            step = self.train_step(train_iter)
            state.iteration += 1
            iteration = state.iteration
            if not step.stepped and config.check_for_nan:
                raise nan_error(config, self.backend.module, self.device, iteration, step.loss, step.grad_norm,
                                self.optimizer.param_groups[0]["lr"])
            state.consumed_train_samples += config.global_batch_size
            if step.stepped:
                self.scheduler.step()
                advanced += 1
            lr = self.optimizer.param_groups[0]["lr"]  # after the schedule's step, as Megatron logs it
            result.losses[iteration], result.grad_norms[iteration] = step.loss, step.grad_norm
            result.iteration = iteration
            window.add(time.perf_counter() - started, step)
            self._write_scalars({"lm loss": step.loss, "grad-norm": step.grad_norm, "learning-rate": lr})
            if iteration % config.log_interval == 0:
                elapsed = window.seconds / window.iterations
                print_rank_0(training_log_line(
                    iteration=iteration, train_iters=config.train_iters, consumed=state.consumed_train_samples,
                    elapsed_ms=elapsed * 1000.0, tflops=flops / elapsed / 1e12 / dist.get_world_size(),
                    lr=lr, global_batch=config.global_batch_size, losses={"lm loss": window.mean_loss()},
                    grad_norm=step.grad_norm, skipped=window.skipped, nan=window.nan,
                ))
                if not memory_reported:
                    print_rank_0(f"[Rank {dist.get_rank()}] (after {iteration} iterations) "
                                 f"{memory_report(self.device)}")
                    memory_reported = True
                window = _LogWindow()
            if config.eval_interval and iteration % config.eval_interval == 0 and valid_iter is not None:
                result.valid_losses[iteration] = self.evaluate(valid_iter)
                print_rank_0(validation_log_lines(iteration, result.valid_losses[iteration]))
                self._write_scalars({"lm loss validation": result.valid_losses[iteration]})
            if config.save and config.save_interval and iteration % config.save_interval == 0:
                self.save()
            if config.exit_interval and iteration % config.exit_interval == 0:
                print_rank_0(f"exiting program at iteration {iteration}")
                break
        if state.iteration > start_iteration and advanced == 0:
            raise NonFiniteLossError(
                f"all {state.iteration - start_iteration} iterations ({start_iteration + 1} to {state.iteration}) "
                f"were skipped because their loss or grad norm was NaN/Inf (--no-check-for-nan-in-loss-and-grad): "
                f"nothing was trained, and no final checkpoint is saved. {NAN_CAUSES}"
            )
        saved_last = config.save_interval and state.iteration % config.save_interval == 0
        if config.save and state.iteration > start_iteration and not saved_last:
            self.save()
        return result
