"""Step time, peak memory and bytes communicated: megatron_fsdp vs PyTorch FSDP2 vs DDP.

Run (2 CPU ranks; on a GPU machine the same command uses CUDA/NCCL):

    torchrun --nproc-per-node 2 benchmarks/compare.py --layers 6 --hidden 384 --seq 128 --batch 4

All implementations train the same GPT (examples/train_fully_shard.py) from the same
weights on the same batches in one process group; their timed steps are interleaved
(the order rotates every step) so machine drift hits all alike.

Memory: on CUDA, ``torch.cuda.max_memory_allocated`` over each implementation's step.
On CPU, persistent state (parameters, gradients, optimizer state held by that
implementation, counted exactly from its tensors) plus the transient peak of its step,
read from the kernel's peak-RSS counter (``VmHWM``, reset through
``/proc/self/clear_refs``) with glibc's mmap threshold fixed at 64 KiB, so that every
freed tensor is returned to the kernel at once and caching does not hide or inflate it.

Bytes: megatron_fsdp counts its own collectives (``comm_stats``); FSDP2's are counted by
wrapping ``torch.distributed``'s flat collectives in this process (measurement only);
DDP's C++ reducer cannot be wrapped, so its figure is the size of its gradient
all-reduce payload.

megatron_fsdp keeps freed unsharded weights and gradient buffers in a pool
(``megatron_fsdp.memory.allocator``); that memory is resident between steps, so its size is
counted as persistent state. The pool size is printed.

Memory model (printed for megatron_fsdp beside the measurement), per rank:

    sharded persistent state + (1 + prefetch depth) x largest unsharded unit + activations

- sharded persistent state: bytes of this rank's parameter shards, optimizer state and
  sharded gradients, counted from the tensors after a step (before ``zero_grad``);
- largest unsharded unit: the largest unit's gathered parameters (sum over its groups
  of the flat buffer's numel x compute element size);
- activations: bytes autograd saves for backward in one forward of the unwrapped
  model on this rank's batch (unique storages seen by ``saved_tensors_hooks``,
  parameters excluded).
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import os
import statistics
import sys
import time
from collections import Counter

if "MALLOC_MMAP_THRESHOLD_" not in os.environ:  # must be set before the allocator starts
    os.environ["MALLOC_MMAP_THRESHOLD_"] = str(1 << 16)
    os.execv(sys.executable, [sys.executable, *sys.argv])

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "examples"))
from train_fully_shard import GPT  # noqa: E402

import megatron_fsdp  # noqa: E402
from megatron_fsdp.memory.allocator import default_pool, pool_stats  # noqa: E402

FLAT_COLLECTIVES = ("all_gather_single", "reduce_scatter_single", "all_gather_into_tensor", "reduce_scatter_tensor")
fsdp2_bytes: Counter = Counter()


def count_torch_collectives() -> None:
    """Wrap torch.distributed's flat collectives to count FSDP2's payload (this process only)."""
    for name in FLAT_COLLECTIVES:
        original = getattr(dist, name, None)
        if original is None:
            continue

        def counted(output, input, *args, _original=original, _name=name, **kwargs):
            kind = "all_gather" if "gather" in _name else "reduce_scatter"
            payload = output if kind == "all_gather" else input
            fsdp2_bytes[kind] += payload.numel() * payload.element_size()
            return _original(output, input, *args, **kwargs)

        setattr(dist, name, counted)


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--layers", type=int, default=6)
    p.add_argument("--hidden", type=int, default=384)
    p.add_argument("--heads", type=int, default=6)
    p.add_argument("--seq", type=int, default=128)
    p.add_argument("--batch", type=int, default=4, help="per rank")
    p.add_argument("--vocab", type=int, default=8192)
    p.add_argument("--steps", type=int, default=10, help="timed steps per implementation")
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--impls", default="megatron_fsdp,fsdp2,ddp")
    p.add_argument("--pool", choices=("keep", "release", "off"), default="keep",
                   help="megatron_fsdp's buffer pool: keep its memory between steps (the library's default), "
                        "release it after backward, or off (plain allocations, EngineOptions(buffer_pool=False))")
    p.add_argument("--local-step", choices=("on", "off"), default="on",
                   help="megatron_fsdp's fully_shard_optimizer(step_on_local_shards=...), on by default")
    p.add_argument("--reduces-in-flight", type=int, default=None,
                   help="megatron_fsdp's limit on gradient reductions in flight (EngineOptions.max_reduces_in_flight)")
    p.add_argument("--gloo-paths", choices=("on", "off"), default="on",
                   help="megatron_fsdp's gloo fast paths (EngineOptions.gloo_fast_paths, on by default): "
                        "off measures plain all-gather/reduce-scatter")
    return p.parse_args()


def peak_rss_reset() -> None:
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")


def rss_bytes(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    raise RuntimeError(field)


def tensor_bytes(tensors) -> int:
    total = 0
    for t in tensors:
        if isinstance(t, torch.Tensor):
            local = t.to_local() if hasattr(t, "to_local") else t
            total += local.numel() * local.element_size()
    return total


class Impl:
    def __init__(self, name: str, model: nn.Module, device: torch.device, local_step: bool = True) -> None:
        self.name, self.model, self.device = name, model, device
        self.optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
        if name == "megatron_fsdp":  # the library's optimizer wrapper, as its docs recommend
            self.optimizer = megatron_fsdp.fully_shard_optimizer(self.optimizer, step_on_local_shards=local_step)
        self.times: list[float] = []
        self.peaks: list[int] = []
        self.bytes: list[int] = []
        self.losses: list[float] = []
        self.sharded_state = 0  # params + optimizer state + grads after a step (megatron_fsdp)

    def persistent_bytes(self) -> int:
        params = list(self.model.parameters())
        state = [v for s in self.optimizer.state.values() for v in s.values()]
        grads = [p.grad for p in params if p.grad is not None]
        pool = pool_stats().reserved_bytes if self.name == "megatron_fsdp" else 0
        return tensor_bytes(params) + tensor_bytes(state) + tensor_bytes(grads) + pool

    def step(self, tokens: torch.Tensor, record: bool) -> None:
        cuda = self.device.type == "cuda"
        megatron_fsdp.comm_stats.reset()
        fsdp2_bytes.clear()
        if cuda:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
        else:
            peak_rss_reset()
        base_rss = 0 if cuda else rss_bytes("VmRSS")
        persistent = self.persistent_bytes()
        start = time.perf_counter()
        logits = self.model(tokens[:, :-1])
        loss = nn.functional.cross_entropy(logits.flatten(0, 1), tokens[:, 1:].flatten())
        loss.backward()
        self.optimizer.step()
        if record and self.name == "megatron_fsdp":
            self.sharded_state = self.persistent_bytes() - pool_stats().reserved_bytes
        self.optimizer.zero_grad()
        if cuda:
            torch.cuda.synchronize()
        elapsed = time.perf_counter() - start
        if not record:
            return
        self.times.append(elapsed)
        self.losses.append(loss.item())
        if cuda:
            self.peaks.append(torch.cuda.max_memory_allocated())
        else:
            self.peaks.append(persistent + rss_bytes("VmHWM") - base_rss)
        if self.name == "megatron_fsdp":
            self.bytes.append(megatron_fsdp.comm_stats.total_bytes)
        elif self.name == "fsdp2":
            self.bytes.append(sum(fsdp2_bytes.values()))
        else:
            self.bytes.append(sum(p.numel() * p.element_size() for p in self.model.parameters()))


def activation_bytes(model: nn.Module, tokens: torch.Tensor) -> int:
    """Bytes autograd saves for backward in one forward and loss (unique storages, parameters excluded)."""
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    saved: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        storage = t.untyped_storage()
        if storage.data_ptr() not in params:
            saved[storage.data_ptr()] = storage.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        logits = model(tokens[:, :-1])
        nn.functional.cross_entropy(logits.flatten(0, 1), tokens[:, 1:].flatten())
    return sum(saved.values())


def largest_unit_bytes(model: nn.Module) -> tuple[int, int]:
    """Bytes of the largest unit's gathered parameters, and the prefetch depth of the units."""
    largest, depth = 0, 1
    for module in model.modules():
        unit = getattr(module, "_megatron_fsdp_unit", None)
        if unit is not None:
            largest = max(largest, sum(g.layout.total_numel * g.compute_shard.element_size() for g in unit.groups))
            depth = unit.prefetch_depth
    return largest, depth


def build(
    name: str, base: nn.Module, device: torch.device, local_step: bool = True,
    options: megatron_fsdp.EngineOptions | None = None,
) -> Impl:
    model = copy.deepcopy(base).to(device)
    if name == "megatron_fsdp":
        for block in model.blocks:
            megatron_fsdp.fully_shard(block)
        megatron_fsdp.fully_shard(model, options=options)  # handed down to the blocks' units
    elif name == "fsdp2":
        from torch.distributed.fsdp import fully_shard

        for block in model.blocks:
            fully_shard(block)
        fully_shard(model)
    elif name == "ddp":
        model = DDP(model, device_ids=[device.index] if device.type == "cuda" else None)
    else:
        raise ValueError(f"--impls: unknown implementation {name!r}; use megatron_fsdp, fsdp2, ddp")
    return Impl(name, model, device, local_step)


def main() -> None:
    args = parse_args()
    cuda = torch.cuda.is_available()
    dist.init_process_group("nccl" if cuda else "gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0))) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    count_torch_collectives()
    default_pool().keep_between_steps = args.pool == "keep"
    options = megatron_fsdp.EngineOptions(buffer_pool=args.pool != "off", gloo_fast_paths=args.gloo_paths == "on")
    if args.reduces_in_flight is not None:
        options = dataclasses.replace(options, max_reduces_in_flight=args.reduces_in_flight)
    torch.manual_seed(0)
    base = GPT(args.vocab, args.hidden, args.layers, args.heads, args.seq)
    n_params = sum(p.numel() for p in base.parameters())
    generator = torch.Generator().manual_seed(1 + rank)
    sample = torch.randint(0, args.vocab, (args.batch, args.seq + 1), generator=torch.Generator().manual_seed(0))
    activations = activation_bytes(copy.deepcopy(base).to(device), sample.to(device))
    impls = [build(name, base, device, args.local_step == "on", options) for name in args.impls.split(",")]
    del base
    for step in range(args.warmup + args.steps):
        tokens = torch.randint(0, args.vocab, (args.batch, args.seq + 1), generator=generator).to(device)
        order = impls[step % len(impls):] + impls[: step % len(impls)]
        for impl in order:
            impl.step(tokens, record=step >= args.warmup)
    report(impls, args, n_params, world, rank, device)
    if "megatron_fsdp" in args.impls.split(","):
        report_memory_model(next(i for i in impls if i.name == "megatron_fsdp"), activations, rank)
    dist.destroy_process_group()


def report(impls: list[Impl], args, n_params: int, world: int, rank: int, device: torch.device) -> None:
    by_name = {i.name: i for i in impls}
    zero3_min = 3 * n_params * 4  # two all-gathers of the parameters plus one reduce-scatter, fp32
    tokens = args.batch * args.seq * world
    rows = []
    for impl in impls:
        t = statistics.median(impl.times)
        peak = max(impl.peaks)
        nbytes = statistics.median(impl.bytes)
        rows.append((impl.name, t, tokens / t, peak, nbytes))
    if rank != 0:
        return
    ref = next((r for r in rows if r[0] == "fsdp2"), None)
    print(f"\nGPT {args.layers} layers, hidden {args.hidden}, seq {args.seq}, batch {args.batch}/rank, "
          f"{n_params / 1e6:.2f}M params, fp32, {world} ranks on {device.type}, {args.steps} timed steps\n")
    print("| impl | step time (ms) | tokens/s | peak mem/rank (MiB) | bytes/step (MiB) | "
          "time vs FSDP2 | mem vs FSDP2 | bytes vs FSDP2 | bytes vs ZeRO-3 min |")
    print("|---|---|---|---|---|---|---|---|---|")
    for name, t, tps, peak, nbytes in rows:
        rel = (lambda a, b: f"{a / b:.2f}") if ref else (lambda a, b: "-")
        print(f"| {name} | {t * 1e3:.1f} | {tps:,.0f} | {peak / 2**20:.1f} | {nbytes / 2**20:.2f} | "
              f"{rel(t, ref[1]) if ref else '-'} | {rel(peak, ref[3]) if ref else '-'} | "
              f"{rel(nbytes, ref[4]) if ref else '-'} | {nbytes / zero3_min:.3f} |")
    if "megatron_fsdp" in by_name and "fsdp2" in by_name:
        a, b = by_name["megatron_fsdp"].losses, by_name["fsdp2"].losses
        worst = max(abs(x - y) for x, y in zip(a, b))
        print(f"\nloss agreement megatron_fsdp vs fsdp2 (rank 0): max |diff| {worst:.2e}")


def report_memory_model(impl: Impl, activations: int, rank: int) -> None:
    """Print the analytic memory model of megatron_fsdp beside its measured peak (rank 0's)."""
    unit, depth = largest_unit_bytes(impl.model)
    predicted = impl.sharded_state + (1 + depth) * unit + activations
    measured = max(impl.peaks)
    stats = pool_stats()
    if rank != 0:
        return
    mib = 2**20
    print(f"\nmegatron_fsdp memory model (rank 0, MiB): sharded state {impl.sharded_state / mib:.1f} "
          f"+ (1 + {depth}) x largest unit {unit / mib:.1f} + activations {activations / mib:.1f} "
          f"= {predicted / mib:.1f}; measured peak {measured / mib:.1f} ({measured / predicted:.2f}x the model)")
    kept = "off" if not impl.model.fsdp_unit.pool.enabled else (
        "kept between steps" if default_pool().keep_between_steps else "released after each backward")
    print(f"buffer pool ({kept}): {stats.reserved_bytes / mib:.1f} MiB reserved now in {stats.slabs} slabs, "
          f"most lent at once {stats.peak_lent_bytes / mib:.1f} MiB; {stats.allocations} allocations, "
          f"{stats.reuses} reuses over the run")


if __name__ == "__main__":
    main()
