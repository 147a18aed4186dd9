"""Where one training step's time goes: torch.profiler over a few steps of one implementation.

Run (2 CPU ranks):

    torchrun --nproc-per-node 2 benchmarks/profile_step.py --impl megatron_fsdp --steps 3
    torchrun --nproc-per-node 2 benchmarks/profile_step.py --impl fsdp2 --steps 3

``--impl megatron_fsdp`` is per-module ``fully_shard`` with a plain AdamW, ``megatron_fsdp_model``
the whole-model API with ``fully_shard_optimizer`` (see compare.py).

Builds the same GPT as ``compare.py``, runs warm-up steps, then profiles ``--steps`` steps
on every rank and prints rank 0's operators sorted by self CPU time, plus the total time
inside megatron_fsdp's named ranges (``megatron_fsdp.unshard.wait`` is time the step
waited for an all-gather; ``reduce.wait`` for a reduction). ``--trace DIR`` also writes
a Chrome trace per rank, where the ranges show the overlap.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import torch
import torch.distributed as dist
from torch import nn
from torch.profiler import ProfilerActivity, profile, record_function

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from compare import GPT, build  # noqa: E402

from megatron_fsdp.comm.profiling import RANGE_NAMES  # noqa: E402
from megatron_fsdp.memory.allocator import pool_stats  # noqa: E402

PHASES = ("step.forward", "step.backward", "step.optimizer")
# The model's own arithmetic (forward and backward kernels), by operator name.
COMPUTE = ("aten::mm", "aten::addmm", "aten::bmm", "scaled_dot_product", "gelu", "layer_norm", "softmax",
           "embedding", "nll_loss")
ALLOCATION = ("aten::empty", "aten::empty_strided", "aten::fill_", "aten::zero_", "aten::zeros", "aten::resize_")


def print_breakdown(averages, wall: float, steps: int) -> None:
    """Rank 0's wall time per step split into phases and into kinds of work (self CPU times)."""
    by_key = {e.key: e for e in averages}

    def total(key: str) -> float:
        return by_key[key].cpu_time_total / 1e3 / steps if key in by_key else 0.0

    def self_ms(keys) -> float:
        return sum(by_key[k].self_cpu_time_total for k in keys if k in by_key) / 1e3 / steps

    print(f"\nwall time per step: {wall * 1e3:.1f} ms; phases: "
          + ", ".join(f"{name.split('.')[1]} {total(name):.1f} ms" for name in PHASES))
    waits = self_ms([n for n in RANGE_NAMES if n.endswith(".wait")])
    issues = self_ms([n for n in RANGE_NAMES if not n.endswith(".wait")])
    alloc = self_ms(ALLOCATION)
    optim_ops = total(PHASES[2])
    compute = sum(e.self_cpu_time_total for e in averages
                  if e.key.startswith("aten::") and e.key not in ALLOCATION
                  and any(c in e.key for c in COMPUTE)) / 1e3 / steps
    print(f"  waiting on collectives (megatron_fsdp *.wait ranges, self): {waits:.1f} ms")
    print(f"  issuing collectives, resharding, control rounds (other ranges, self): {issues:.1f} ms")
    print(f"  allocation and zeroing ({', '.join(a.split('::')[1] for a in ALLOCATION)}, self): {alloc:.1f} ms")
    print(f"  optimizer step and zero_grad (total, includes its own arithmetic): {optim_ops:.1f} ms")
    print(f"  model arithmetic (matmuls, attention, norms, activations, loss; forward and backward; self): "
          f"{compute:.1f} ms")
    print("  the rest (Python hooks, autograd engine, DTensor dispatch, copies) = wall - the above: "
          f"{wall * 1e3 - waits - issues - alloc - optim_ops - compute:.1f} ms (lower bound: overlaps counted twice)")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--impl", default="megatron_fsdp", choices=("megatron_fsdp", "megatron_fsdp_model", "fsdp2", "ddp"))
    p.add_argument("--layers", type=int, default=6)
    p.add_argument("--hidden", type=int, default=384)
    p.add_argument("--heads", type=int, default=6)
    p.add_argument("--seq", type=int, default=128)
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--vocab", type=int, default=8192)
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--rows", type=int, default=25, help="operators to print")
    p.add_argument("--trace", default=None, help="directory for Chrome traces (one per rank)")
    args = p.parse_args()
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.manual_seed(0)
    options = argparse.Namespace(pool="keep", gloo_paths="on", reduces_in_flight=None, local_step="on")
    model = GPT(args.vocab, args.hidden, args.layers, args.heads, args.seq)
    impl = build(args.impl, model, torch.device("cpu"), options)
    generator = torch.Generator().manual_seed(1 + rank)

    def step() -> None:
        tokens = torch.randint(0, args.vocab, (args.batch, args.seq + 1), generator=generator)
        with record_function(PHASES[0]):
            logits = impl.model(tokens[:, :-1])
            loss = nn.functional.cross_entropy(logits.flatten(0, 1), tokens[:, 1:].flatten())
        with record_function(PHASES[1]):
            loss.backward()
        with record_function(PHASES[2]):
            impl.optimizer.step()
            impl.optimizer.zero_grad()

    for _ in range(args.warmup):
        step()
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        start = time.perf_counter()
        for _ in range(args.steps):
            step()
        wall = (time.perf_counter() - start) / args.steps
    if args.trace:
        os.makedirs(args.trace, exist_ok=True)
        prof.export_chrome_trace(os.path.join(args.trace, f"{args.impl}_rank{rank}.json"))
    if rank == 0:
        averages = prof.key_averages()
        print(averages.table(sort_by="self_cpu_time_total", row_limit=args.rows))
        ranges = {e.key: e for e in averages if e.key in RANGE_NAMES}
        for name in RANGE_NAMES:
            if name in ranges:
                e = ranges[name]
                print(f"{name:32s} calls {e.count // args.steps:4d}/step  "
                      f"total {e.cpu_time_total / 1e3 / args.steps:8.1f} ms/step")
        print_breakdown(averages, wall, args.steps)
        if args.impl.startswith("megatron_fsdp"):
            print(pool_stats())
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
