"""Megatron-format log lines, throughput and memory figures."""

from __future__ import annotations

import argparse
import datetime
import math
import resource

import torch
import torch.distributed as dist


def num_floating_point_operations(args: argparse.Namespace, batch_size: int) -> float:
    """Model FLOPs of one training iteration (forward + backward = 3 x forward), Megatron's GPT formula.

    Per token and layer: QKV, attention projection and MLP matmuls (2 FLOPs per
    multiply-add) plus the attention scores and weighted sum; plus the output layer.
    """
    h, s, layers = args.hidden_size, args.seq_length, args.num_layers
    groups = args.num_query_groups or args.num_attention_heads
    kv = h * groups / args.num_attention_heads
    mlp = (3 if args.swiglu else 2) * h * args.ffn_hidden_size
    per_layer = 2 * (h * (h + 2 * kv) + h * h + mlp) + 2 * 2 * s * h
    forward = batch_size * s * (layers * per_layer + 2 * h * args.padded_vocab_size)
    return 3.0 * forward


def format_tflops(tflops: float) -> str:
    """Megatron's one decimal at GPU rates; three significant digits below 1, so CPU runs do not print 0.0."""
    return f"{tflops:.1f}" if tflops >= 1.0 or tflops == 0.0 or not math.isfinite(tflops) else f"{tflops:.3g}"


def memory_report(device: torch.device) -> str:
    """Allocator figures on CUDA; resident-set size (current and peak) on CPU."""
    if device.type == "cuda":
        mb = 1 << 20
        return (f"memory (MB) | allocated: {torch.cuda.memory_allocated(device) / mb:.1f} | "
                f"max allocated: {torch.cuda.max_memory_allocated(device) / mb:.1f} | "
                f"reserved: {torch.cuda.memory_reserved(device) / mb:.1f}")
    rss = _status_kib("VmRSS")
    peak = _status_kib("VmHWM") or resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return f"memory (MB) | rss: {rss / 1024:.1f} | max rss: {peak / 1024:.1f}"


def memory_scalars(device: torch.device) -> dict[str, float]:
    """Megatron's --log-memory-to-tensorboard scalars: the CUDA allocator's bytes; on CPU the resident set."""
    if device.type == "cuda":
        stats = torch.cuda.memory_stats(device)
        return {"mem-reserved-bytes": float(stats.get("reserved_bytes.all.current", 0)),
                "mem-allocated-bytes": float(stats.get("allocated_bytes.all.current", 0)),
                "mem-max-allocated-bytes": float(stats.get("allocated_bytes.all.peak", 0))}
    rss, peak = _status_kib("VmRSS") * 1024.0, _status_kib("VmHWM") * 1024.0
    return {"mem-reserved-bytes": rss, "mem-allocated-bytes": rss, "mem-max-allocated-bytes": peak}


def print_rank_last(message: str) -> None:
    """Print on the last rank, as Megatron prints its training log (the rank that holds the loss under PP)."""
    if not dist.is_initialized() or dist.get_rank() == dist.get_world_size() - 1:
        print(message, flush=True)


def _status_kib(field: str) -> int:
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(field + ":"):
                    return int(line.split()[1])
    except OSError:
        pass
    return 0


def training_log_line(
    *, iteration: int, train_iters: int, consumed: int, elapsed_ms: float, tflops: float, lr: float,
    global_batch: int, losses: dict[str, float], grad_norm: float | None, skipped: int, nan: int,
    num_zeros: int | None = None, params_norm: float | None = None,
) -> str:
    """One line in Megatron-LM's training-log format (its timestamp to the microsecond, ``%f``)."""
    now = datetime.datetime.now().strftime("%Y-%m-%d %H:%M:%S.%f")
    line = f" [{now}] iteration {iteration:8d}/{train_iters:8d} |"
    line += f" consumed samples: {consumed:12d} |"
    line += f" elapsed time per iteration (ms): {elapsed_ms:.1f} |"
    line += f" throughput per GPU (TFLOP/s/GPU): {format_tflops(tflops)} |"
    line += f" learning rate: {lr:.6E} |"
    line += f" global batch size: {global_batch:5d} |"
    for key, value in losses.items():
        line += f" {key}: {value:.6E} |"
    line += " loss scale: 1.0 |"
    if grad_norm is not None:
        line += f" grad norm: {grad_norm:.3f} |"
    if num_zeros is not None:
        line += f" num zeros: {num_zeros} |"
    if params_norm is not None:
        line += f" params norm: {params_norm:.3f} |"
    line += f" number of skipped iterations: {skipped:3d} |"
    line += f" number of nan iterations: {nan:3d} |"
    return line


def validation_log_lines(where: int | str, loss: float) -> str:
    """Megatron's validation block; ``where``: ``iteration N`` (an int N is read so), or
    ``iteration N on validation set`` / ``on test set`` after training."""
    where = f"iteration {where}" if isinstance(where, int) else where
    ppl = math.exp(min(20.0, loss))
    body = f" validation loss at {where} | lm loss value: {loss:.6E} | lm loss PPL: {ppl:.6E} | "
    rule = "-" * (len(body) + 1)
    return f"{rule}\n{body}\n{rule}"
