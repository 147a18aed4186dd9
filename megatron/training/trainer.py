"""``Trainer``: Megatron's training loop (train step, evaluation, logging, checkpoints) over one backend.

One iteration = one global batch = ``num_microbatches`` micro-batches per
data-parallel rank. Losses are Megatron's: the mean over a micro-batch's unmasked
tokens, averaged over micro-batches and ranks; with ``--calculate-per-token-loss``
the sum over tokens, gradients summed and then divided by the global number of tokens.
"""

from __future__ import annotations

import argparse
import gc
import math
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler
from torch import nn

from megatron.training.reduce import all_reduce

from . import checkpointing
from .backends import DataParallelBackend
from .config import RunState, TrainingConfig
from .logging_utils import (
    memory_report,
    memory_scalars,
    num_floating_point_operations,
    print_rank_last,
    training_log_line,
    validation_log_lines,
)
from .mcore_moe import McoreMoE
from .nan_check import NAN_CAUSES, NonFiniteLossError, nan_error

# forward_step(batch, model) -> (per-token losses [mbs, seq], loss_mask [mbs, seq])
ForwardStep = Callable[[dict, nn.Module], tuple[torch.Tensor, torch.Tensor]]


@dataclass
class TrainingResult:
    """What a run produced, for callers (functional tests) that want numbers rather than log lines."""

    iteration: int = 0
    losses: dict[int, float] = field(default_factory=dict)  # iteration -> lm loss
    grad_norms: dict[int, float] = field(default_factory=dict)
    valid_losses: dict[int, float] = field(default_factory=dict)
    final_valid_loss: float | None = None  # Megatron's end-of-run blocks ("on validation set", "on test set")
    final_test_loss: float | None = None
    params_norms: dict[int, float] = field(default_factory=dict)  # --log-params-norm, at logged iterations
    num_zeros: dict[int, int] = field(default_factory=dict)  # --log-num-zeros-in-grad
    moe_losses: dict[int, dict[str, float]] = field(default_factory=dict)  # iteration -> load_balancing_loss ...
    exit_reason: str | None = None  # why training stopped before --train-iters, if it did


@dataclass
class StepResult:
    """One train step: the global loss, the gradient norm before clipping, whether the optimizer stepped."""

    loss: float
    grad_norm: float
    stepped: bool
    num_zeros: int | None = None  # --log-num-zeros-in-grad
    # MoE: each auxiliary loss / its coefficient, mean over layers (Megatron's load_balancing_loss ...)
    moe_losses: dict[str, float] = field(default_factory=dict)


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
    moe_losses: dict[str, float] = field(default_factory=dict)  # summed over the iterations that stepped

    def add(self, seconds: float, step: StepResult) -> None:
        self.seconds, self.iterations = self.seconds + seconds, self.iterations + 1
        self.loss_all += step.loss
        for name, value in step.moe_losses.items():
            self.moe_losses[name] = self.moe_losses.get(name, 0.0) + (value if step.stepped else 0.0)
        if step.stepped:
            self.advanced, self.loss_advanced = self.advanced + 1, self.loss_advanced + step.loss
        else:
            self.skipped += 1
            self.nan += not math.isfinite(step.loss)

    def mean_loss(self) -> float:
        return self.loss_advanced / self.advanced if self.advanced else self.loss_all / max(self.iterations, 1)

    def losses(self) -> dict[str, float]:
        """The log line's losses: lm loss, and Megatron's MoE ``load_balancing_loss`` (...) when there is one."""
        out = {"lm loss": self.mean_loss()}
        if self.advanced:
            out.update({name: total / self.advanced for name, total in self.moe_losses.items()})
        return out


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
        self.mcore_moe = McoreMoE.for_model(args, backend.module)  # megatron-core's MoE layers' loop duties

    def _batch(self, data_iterator: Iterator[dict]) -> dict:
        """The next micro-batch on the device; with context parallelism this CP rank's tokens of it, split by
        megatron-core's ``get_batch_on_this_cp_rank`` over its CP group (the sequence in 2 x CP chunks, rank r
        keeping chunks r and 2 CP - 1 - r: the causal attention's work balanced)."""
        batch = {k: v.to(self.device, non_blocking=True) for k, v in next(data_iterator).items()}
        cp = self.backend.layout.cp
        if cp.size == 1:
            return batch
        from megatron.core.utils import get_batch_on_this_cp_rank

        return get_batch_on_this_cp_rank(batch, cp_group=cp.group)

    def _micro_batch_totals(self, masked: torch.Tensor, tokens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The micro-batch's masked loss sum and token count over its whole sequence (summed over CP ranks)."""
        cp = self.backend.layout.cp
        if cp.size == 1:
            return masked.detach(), tokens.detach()
        both = torch.stack([masked.detach(), tokens.detach()])
        all_reduce(both, group=cp.group)
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
        mcore_moe = self.mcore_moe
        for m in range(n):
            batch = self._batch(data_iterator)
            if mcore_moe is not None:  # Megatron's: the aux losses' gradient scaled as the lm loss is
                mcore_moe.set_aux_loss_scale(
                    backend.summed_loss_factor() if config.calculate_per_token_loss else 1.0 / n, self.device)
            with backend.accumulation(is_first=m == 0, is_last=m == n - 1):
                with backend.autocast():
                    losses, mask = self.forward_step(batch, model)
                masked = (losses.float() * mask).sum()
                masked_all, tokens_all = self._micro_batch_totals(masked, mask.sum())
                if config.calculate_per_token_loss:
                    scaled = masked * backend.summed_loss_factor()  # summed gradients
                else:
                    # Megatron's (megatron-core's forward_step with a loss function giving the sum and the
                    # tokens): each CP rank's loss is the mean over its own tokens, / n; the gradient
                    # reduction averages over DP x CP, so the gradient is that of the mean of the CP ranks'
                    # means (the micro-batch mean where they hold as many unmasked tokens each)
                    scaled = masked / mask.sum().clamp(min=1) / n
                scaled.backward()
            masked, tokens = masked_all.double(), tokens_all.double()
            totals += torch.stack([masked, tokens, masked / tokens.clamp(min=1.0)])
        backend.finish_grad_sync()
        if mcore_moe is not None:
            mcore_moe.finish_step()
        all_reduce(totals, group=backend.layout.dp_group)  # TP ranks of a DP rank: same losses
        total_sum, total_tokens, total_means = totals.tolist()
        if config.calculate_per_token_loss:
            backend.scale_gradients(1.0 / max(total_tokens, 1.0))
            loss = total_sum / max(total_tokens, 1.0)
        else:
            loss = total_means / (n * backend.layout.dp_size)
        zeros = backend.num_zeros_in_grad() if self.args.log_num_zeros_in_grad else None
        norm = backend.clip_grad_norm(config.clip_grad if config.clip_grad > 0 else math.inf)
        moe_losses = mcore_moe.losses(n) if mcore_moe is not None else {}
        # loss and norm are global (all-reduced), so every rank takes the same branch
        if not math.isfinite(norm) or not math.isfinite(loss):
            return StepResult(loss, norm, False, zeros, moe_losses)
        self.optimizer.step()
        return StepResult(loss, norm, True, zeros, moe_losses)

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
        all_reduce(totals, group=backend.layout.dp_group)
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

    def train(self, train_iter: Iterator[dict], valid_iter: Iterator[dict] | None,
              test_iter: Iterator[dict] | None = None) -> TrainingResult:
        """Iterate until ``--train-iters`` (or ``--exit-interval``, ``--exit-duration-in-mins``), evaluating
        and saving as asked; then Megatron's end-of-run validation and test evaluations."""
        args = self.args
        if args.manual_gc:  # Megatron: no automatic collection during training, collect at known points
            gc.disable()
            gc.collect()
        try:
            result = self._train(train_iter, valid_iter)
        finally:
            if args.manual_gc:
                gc.enable()
        if self.config.eval_iters > 0:
            self._final_evaluations(valid_iter, test_iter)
        return result

    def _final_evaluations(self, valid_iter: Iterator[dict] | None, test_iter: Iterator[dict] | None) -> None:
        """Megatron's blocks after training: ``validation loss at iteration N on validation set`` (and test)."""
        iteration = self.state.iteration
        for name, data in (("validation", valid_iter), ("test", test_iter)):
            if data is None:
                continue
            try:
                loss = self.evaluate(data)
            except StopIteration:  # the split holds no more samples (they were planned for the periodic ones)
                continue
            setattr(self.result, f"final_{'valid' if name == 'validation' else 'test'}_loss", loss)
            print_rank_last(validation_log_lines(f"iteration {iteration} on {name} set", loss))

    def _write_log_scalars(self, iteration: int, elapsed: float, tflops: float, window: _LogWindow,
                           params_norm: float | None, zeros: int | None) -> None:
        """Megatron's tensorboard scalars at a log line, as its --log-* flags ask."""
        args, values = self.args, {}
        if args.log_timers_to_tensorboard:
            values["iteration-time"] = elapsed
            if args.log_throughput:
                values["throughput"] = tflops
        if args.log_memory_to_tensorboard:
            values.update(memory_scalars(self.device))
        if params_norm is not None:
            values["params-norm"] = params_norm
        if zeros is not None:
            values["num-zeros"] = float(zeros)
        values.update({k: v for k, v in window.losses().items() if k != "lm loss"})
        self._write_scalars(values)

    def _out_of_time(self, started: float) -> bool:
        """--exit-duration-in-mins: whether any rank has trained that long (the max over ranks, as Megatron)."""
        minutes = self.args.exit_duration_in_mins
        if minutes is None:
            return False
        done = torch.tensor([float((time.time() - started) / 60.0 > minutes)], device=self.device)
        all_reduce(done, op=dist.ReduceOp.MAX)
        return bool(done.item())

    def _train(self, train_iter: Iterator[dict], valid_iter: Iterator[dict] | None) -> TrainingResult:
        config, state, result, args = self.config, self.state, self.result, self.args
        train_started = time.time()
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
                self.scheduler.step(increment=1)
                advanced += 1
            lr = self.optimizer.param_groups[0]["lr"]  # after the schedule's step, as Megatron logs it
            result.losses[iteration], result.grad_norms[iteration] = step.loss, step.grad_norm
            result.iteration = iteration
            window.add(time.perf_counter() - started, step)
            self._write_scalars({"lm loss": step.loss, "grad-norm": step.grad_norm, "learning-rate": lr})
            if step.num_zeros is not None:
                result.num_zeros[iteration] = step.num_zeros
            if step.moe_losses:
                result.moe_losses[iteration] = step.moe_losses
            if args.manual_gc and args.manual_gc_interval and iteration % args.manual_gc_interval == 0:
                gc.collect()
            if iteration % config.log_interval == 0:
                elapsed = window.seconds / window.iterations
                tflops = flops / elapsed / 1e12 / dist.get_world_size()
                params_norm = self.backend.params_norm() if args.log_params_norm else None
                if params_norm is not None:
                    result.params_norms[iteration] = params_norm
                print_rank_last(training_log_line(
                    iteration=iteration, train_iters=config.train_iters, consumed=state.consumed_train_samples,
                    elapsed_ms=elapsed * 1000.0, tflops=tflops,
                    lr=lr, global_batch=config.global_batch_size, losses=window.losses(),
                    grad_norm=step.grad_norm, skipped=window.skipped, nan=window.nan,
                    num_zeros=step.num_zeros, params_norm=params_norm,
                ))
                self._write_log_scalars(iteration, elapsed, tflops, window, params_norm, step.num_zeros)
                if not memory_reported:
                    print_rank_last(f"[Rank {dist.get_rank()}] (after {iteration} iterations) "
                                    f"{memory_report(self.device)}")
                    memory_reported = True
                window = _LogWindow()
            if config.eval_interval and iteration % config.eval_interval == 0 and valid_iter is not None:
                result.valid_losses[iteration] = self.evaluate(valid_iter)
                print_rank_last(validation_log_lines(f"iteration {iteration}", result.valid_losses[iteration]))
                self._write_scalars({"lm loss validation": result.valid_losses[iteration]})
                if args.log_validation_ppl_to_tensorboard:
                    self._write_scalars({"lm loss validation ppl": math.exp(min(20.0, result.valid_losses[iteration]))})
            if config.save and config.save_interval and iteration % config.save_interval == 0:
                self.save()
            checkpointing.finalize_async_save(blocking=False)  # report a finished --async-save
            if config.exit_interval and iteration % config.exit_interval == 0:
                print_rank_last(f"exiting program at iteration {iteration}")
                result.exit_reason = "--exit-interval"
                break
            if self._out_of_time(train_started):
                print_rank_last(f"exiting program after {args.exit_duration_in_mins} minutes "
                                f"(--exit-duration-in-mins) at iteration {iteration}")
                result.exit_reason = "--exit-duration-in-mins"
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
        checkpointing.finalize_async_save()  # --async-save: the last write is complete before the run ends
        return result
