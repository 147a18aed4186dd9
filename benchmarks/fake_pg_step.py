"""A training step of one rank of an N-rank job under torch's fake process group: ours against FSDP2.

Run:

    python benchmarks/fake_pg_step.py                 # 8 ranks, 48 units, AdamW
    python benchmarks/fake_pg_step.py --world 64 --units 96 --steps 10

Users dry-run jobs at scale this way (torchtitan's fake backend) to check memory and
plans, and ``simulate_scale.py`` does too. Under the fake group every collective runs
at issue, but its works never report ``is_completed()``; anything that waited for them
by the clock paid its whole budget per work (issue 25: 50 ms per unit, 11.6x FSDP2's
step). Both libraries wrap the same model (``--units`` blocks of ``Linear, ReLU``, each
``fully_shard``-ed, then the root) in the same process and run the same steps,
interleaved; the median step time of each (wall clock, and the process's CPU time,
steadier on a shared machine) and their ratios are printed. The numbers themselves are
garbage (the fake all-gather writes nothing): only time counts.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import fully_shard as fsdp2_fully_shard
from torch.testing._internal.distributed.fake_pg import FakeStore

from megatron_fsdp import fully_shard


def build(units: int, width: int, shard) -> nn.Module:
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Sequential(nn.Linear(width, width), nn.ReLU()) for _ in range(units)])
    for block in model:
        shard(block)
    shard(model)
    return model


def one_step(model: nn.Module, optimizer: torch.optim.Optimizer, x: torch.Tensor) -> tuple[float, float]:
    """One step's (wall, process CPU) seconds."""
    wall, cpu = time.perf_counter(), time.process_time()
    model(x).sum().backward()
    optimizer.step()
    optimizer.zero_grad()
    return time.perf_counter() - wall, time.process_time() - cpu


def step_times(models: dict[str, nn.Module], steps: int, batch: int, width: int) -> dict[str, list[tuple]]:
    """Each model's step times, the models' steps interleaved (ours, FSDP2, ours, ...) so that a drift of a
    shared machine's load touches both alike; the first two steps (lazy init, optimizer state) untimed."""
    optimizers = {name: torch.optim.AdamW(m.parameters(), lr=1e-3) for name, m in models.items()}
    x = torch.randn(batch, width)
    times: dict[str, list[tuple]] = {name: [] for name in models}
    for step in range(steps + 2):
        for name, model in models.items():
            took = one_step(model, optimizers[name], x)
            if step >= 2:
                times[name].append(took)
    return times


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--world", type=int, default=8)
    parser.add_argument("--rank", type=int, default=0)
    parser.add_argument("--units", type=int, default=48)
    parser.add_argument("--width", type=int, default=64)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--steps", type=int, default=5)
    args = parser.parse_args()
    dist.init_process_group("fake", store=FakeStore(), rank=args.rank, world_size=args.world)
    try:
        models = {name: build(args.units, args.width, shard)
                  for name, shard in (("ours", fully_shard), ("fsdp2", fsdp2_fully_shard))}
        times = step_times(models, args.steps, args.batch, args.width)
        wall = {name: statistics.median(t[0] for t in rows) for name, rows in times.items()}
        cpu = {name: statistics.median(t[1] for t in rows) for name, rows in times.items()}
        print(f"fake process group, rank {args.rank} of {args.world}, {args.units} units, AdamW, "
              f"median of {args.steps} interleaved steps (wall / process CPU)")
        for name in models:
            print(f"  {name:5s} {wall[name] * 1e3:8.1f} ms/step wall {cpu[name] * 1e3:8.1f} ms/step CPU")
        print(f"  ratio ours/fsdp2 {wall['ours'] / wall['fsdp2']:.2f} wall, {cpu['ours'] / cpu['fsdp2']:.2f} CPU")
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
