"""Step time, peak memory and bytes communicated: megatron_fsdp vs PyTorch FSDP2 vs DDP.

Run (2 CPU ranks; on a GPU machine the same command uses CUDA/NCCL):

    torchrun --nproc-per-node 2 benchmarks/compare.py --layers 6 --hidden 384 --seq 128 --batch 4

Implementations (``--impls``), all training the same GPT (examples/train_fully_shard.py)
from the same weights on the same batches in one process group:

- ``megatron_fsdp``: per-module ``fully_shard`` (every block, then the root) with a plain
  ``torch.optim.AdamW`` stepping the DTensor parameters (what an FSDP2 user writes);
- ``megatron_fsdp_model``: the whole-model API, ``fully_shard_model(fsdp_unit_modules=[Block])``
  with ``fully_shard_optimizer(AdamW)`` (what a Megatron user writes);
- ``fsdp2``: ``torch.distributed.fsdp.fully_shard`` on every block, then the root;
- ``ddp``: ``DistributedDataParallel``.

Two passes, one process:

1. **Time**, under the process's default allocator (what users run with): ``--repeats``
   rounds of ``--steps`` steps each; within a round the implementations' steps are
   interleaved (the order rotates every step) so machine drift hits all alike. Each
   round gives every implementation a median step time and so a ratio against FSDP2 and
   DDP measured in that round; the report gives the median ratio over the rounds and its
   range (min-max).
2. **Memory**, with instrumentation, timing nothing. On CUDA, ``torch.cuda.max_memory_allocated``
   over a step, after the timing pass. On CPU, the way users measure it (benchmarks/memory_rss.py,
   which shares this file's builders): after the timing pass rank 0 launches one job per
   implementation on as many ranks, every process started with glibc's mmap threshold fixed at
   64 KiB (``MALLOC_MMAP_THRESHOLD_``, which only takes full effect from process start), so that
   every freed tensor leaves the resident set at once. A step's peak is the resident set above
   the process's after its imports, at the kernel's high-water mark (``VmHWM``, reset through
   ``/proc/self/clear_refs``) over ``--warmup + --memory-steps`` steps, the maximum over ranks:
   everything the process holds, whether or not a tensor can be found for it (a count of
   tensors once missed a whole model of gradients kept alive by an alias, see
   docs/performance.md).

Bytes: megatron_fsdp counts its own collectives (``comm_stats``); FSDP2's are counted by
wrapping ``torch.distributed``'s flat collectives in this process (measurement only);
DDP's C++ reducer cannot be wrapped, so its figure is the size of its gradient
all-reduce payload.

Memory floor (analytic, printed beside the measurement), per rank:

    sharded persistent state + (1 + prefetch depth) x largest unsharded unit + activations

- sharded persistent state: bytes of this rank's parameter shards, optimizer state and
  sharded gradients, counted from megatron_fsdp's tensors after a step (before ``zero_grad``);
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

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "examples"))
from bench_args import add_engine_option_args, add_model_shape_args, check_impls  # noqa: E402
from train_fully_shard import GPT, Block  # noqa: E402

import megatron_fsdp  # noqa: E402
from megatron_fsdp.core.lookup import units_of  # noqa: E402
from megatron_fsdp.memory.allocator import default_pool, pool_stats  # noqa: E402

IMPLS = ("megatron_fsdp", "megatron_fsdp_model", "fsdp2", "ddp")
OURS = ("megatron_fsdp", "megatron_fsdp_model")
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
    add_model_shape_args(p, vocab=8192)
    p.add_argument("--steps", type=int, default=6, help="timed steps per implementation in each round")
    p.add_argument("--repeats", type=int, default=5, help="timing rounds (the spread is over these)")
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--memory-steps", type=int, default=2, help="steps per implementation in the memory pass")
    p.add_argument("--impls", default=",".join(IMPLS))
    add_engine_option_args(p)
    args = p.parse_args()
    check_impls(p, args.impls, IMPLS)
    return args


def tensor_bytes(tensors) -> int:
    total = 0
    for t in tensors:
        if isinstance(t, torch.Tensor):
            local = t.to_local() if hasattr(t, "to_local") else t
            total += local.numel() * local.element_size()
    return total


class Impl:
    """One implementation's model and optimizer, and its measurements."""

    def __init__(self, name: str, model: nn.Module, optimizer: torch.optim.Optimizer, device: torch.device) -> None:
        self.name, self.model, self.optimizer, self.device = name, model, optimizer, device
        self.rounds: list[list[float]] = []  # step times, one list per timing round
        self.peaks: list[int] = []
        self.bytes: list[int] = []
        self.losses: list[float] = []
        self.sharded_state = 0  # params + optimizer state + grads after a step (ours)

    def persistent_bytes(self) -> int:
        params = list(self.model.parameters())
        state = [v for s in self.optimizer.state.values() for v in s.values()]
        grads = [p.grad for p in params if p.grad is not None]
        pool = pool_stats().reserved_bytes if self.name in OURS else 0
        return tensor_bytes(params) + tensor_bytes(state) + tensor_bytes(grads) + pool

    def train_step(self, tokens: torch.Tensor) -> torch.Tensor:
        logits = self.model(tokens[:, :-1])
        loss = nn.functional.cross_entropy(logits.flatten(0, 1), tokens[:, 1:].flatten())
        loss.backward()
        self.optimizer.step()
        if self.name in OURS:
            self.sharded_state = self.persistent_bytes() - pool_stats().reserved_bytes
        self.optimizer.zero_grad()
        return loss

    def timed_step(self, tokens: torch.Tensor, record: bool) -> None:
        cuda = self.device.type == "cuda"
        megatron_fsdp.comm_stats.reset()
        fsdp2_bytes.clear()
        if cuda:
            torch.cuda.synchronize()
        start = time.perf_counter()
        loss = self.train_step(tokens)
        if cuda:
            torch.cuda.synchronize()
        elapsed = time.perf_counter() - start
        if not record:
            return
        self.rounds[-1].append(elapsed)
        self.losses.append(loss.item())
        if self.name in OURS:
            self.bytes.append(megatron_fsdp.comm_stats.total_bytes)
        elif self.name == "fsdp2":
            self.bytes.append(sum(fsdp2_bytes.values()))
        else:
            self.bytes.append(sum(p.numel() * p.element_size() for p in self.model.parameters()))

    def memory_step(self, tokens: torch.Tensor) -> None:
        """One step measured on CUDA: the allocator's peak."""
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        self.train_step(tokens)
        torch.cuda.synchronize()
        self.peaks.append(torch.cuda.max_memory_allocated())


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
    for unit in units_of(model):
        largest = max(largest, sum(g.layout.total_numel * g.compute_shard.element_size() for g in unit.groups))
        depth = unit.prefetch_depth
    return largest, depth


def init_module(module: nn.Module) -> None:
    """Initialize one module of a meta-device GPT: its own ``reset_parameters``, then the GPT's init."""
    if hasattr(module, "reset_parameters"):
        module.reset_parameters()
    GPT._init_weights(module)


def build(name: str, base: nn.Module, device: torch.device, args: argparse.Namespace,
          copy_model: bool = True) -> Impl:
    """Shard (a copy of, unless ``copy_model`` is False) ``base`` as ``name`` does and make its optimizer.

    A ``base`` on the meta device (``args.meta``) is materialized after sharding the way each
    library's users do: ours by ``materialize_meta`` (one module's full weights at a time),
    FSDP2 by ``to_empty`` and the model's own initialization; DDP takes the model whole.
    """
    options = megatron_fsdp.EngineOptions(buffer_pool=args.pool != "off", gloo_fast_paths=args.gloo_paths == "on")
    if args.reduces_in_flight is not None:
        options = dataclasses.replace(options, max_reduces_in_flight=args.reduces_in_flight)
    meta = getattr(args, "meta", False)
    model = copy.deepcopy(base) if copy_model else base
    if meta and name == "ddp":
        model = model.to_empty(device=device)
        with torch.no_grad():
            model.apply(init_module)
    elif not meta:
        model = model.to(device)
    if name == "megatron_fsdp":
        for block in model.blocks:
            megatron_fsdp.fully_shard(block)
        megatron_fsdp.fully_shard(model, options=options)  # handed down to the blocks' units
        if meta:
            megatron_fsdp.materialize_meta(model, init_fn=init_module)
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    elif name == "megatron_fsdp_model":
        model = megatron_fsdp.fully_shard_model(model, fsdp_unit_modules=[Block], options=options)
        if meta:
            megatron_fsdp.materialize_meta(model, init_fn=init_module)
        optimizer = megatron_fsdp.fully_shard_optimizer(
            torch.optim.AdamW(model.parameters(), lr=1e-4), step_on_local_shards=args.local_step == "on")
    elif name == "fsdp2":
        from torch.distributed.fsdp import fully_shard

        for block in model.blocks:
            fully_shard(block)
        fully_shard(model)
        if meta:
            model.to_empty(device=device)
            with torch.no_grad():
                model.apply(init_module)
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    else:
        model = DDP(model, device_ids=[device.index] if device.type == "cuda" else None)
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    return Impl(name, model, optimizer, device)


def cpu_memory_pass(args: argparse.Namespace, names: list[str], world: int) -> dict[str, list[int]]:
    """Rank 0: one memory_rss job per implementation (one implementation per process); each one's step peak."""
    from memory_rss import launch, passthrough_args

    job = argparse.Namespace(**dict(vars(args), nproc=world, steps=args.warmup + args.memory_steps, meta=False))
    peaks = {}
    for name in names:
        figures = launch(name, job, passthrough_args(job))
        peaks[name] = [figures["start"] + figures["step_peak"]]
    return peaks


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
    torch.manual_seed(0)
    base = GPT(args.vocab, args.hidden, args.layers, args.heads, args.seq)
    n_params = sum(p.numel() for p in base.parameters())
    generator = torch.Generator().manual_seed(1 + rank)
    sample = torch.randint(0, args.vocab, (args.batch, args.seq + 1), generator=torch.Generator().manual_seed(0))
    activations = activation_bytes(copy.deepcopy(base).to(device), sample.to(device))
    impls = [build(name, base, device, args) for name in args.impls.split(",")]
    del base

    def batch() -> torch.Tensor:
        return torch.randint(0, args.vocab, (args.batch, args.seq + 1), generator=generator).to(device)

    load = [os.getloadavg()[0]]
    for _ in range(args.warmup):
        tokens = batch()
        for impl in impls:
            impl.timed_step(tokens, record=False)
    for _ in range(args.repeats):
        for impl in impls:
            impl.rounds.append([])
        for step in range(args.steps):
            tokens = batch()
            for impl in impls[step % len(impls):] + impls[: step % len(impls)]:
                impl.timed_step(tokens, record=True)
        load.append(os.getloadavg()[0])

    if cuda:
        run_memory_pass(impls, args, batch)
    else:
        memory = [cpu_memory_pass(args, [i.name for i in impls], world) if rank == 0 else None]
        dist.broadcast_object_list(memory, src=0)
        for impl in impls:
            impl.peaks = memory[0][impl.name]
    report(impls, args, n_params, world, rank, device, load)
    ours = [impl for impl in impls if impl.name in OURS]
    if ours:  # both of our paths build the same units: one floor
        report_memory_floor(ours[0], activations, rank, impls)
    dist.destroy_process_group()


def run_memory_pass(impls: list[Impl], args: argparse.Namespace, batch) -> None:
    """Warm-up steps, then ``--memory-steps`` measured steps of each implementation."""
    for step in range(args.warmup + args.memory_steps):
        tokens = batch()
        for impl in impls:
            if step < args.warmup:
                impl.train_step(tokens)
            else:
                impl.memory_step(tokens)


def ratio_spread(impl: Impl, ref: Impl) -> str:
    """Median and range over the rounds of (impl's median step time / ref's) in the same round."""
    ratios = [statistics.median(a) / statistics.median(b) for a, b in zip(impl.rounds, ref.rounds)]
    return f"{statistics.median(ratios):.2f} ({min(ratios):.2f}-{max(ratios):.2f})"


def report(impls: list[Impl], args, n_params: int, world: int, rank: int, device: torch.device,
           load: list[float]) -> None:
    by_name = {i.name: i for i in impls}
    zero3_min = 3 * n_params * 4  # two all-gathers of the parameters plus one reduce-scatter, fp32
    if rank != 0:
        return
    fsdp2, ddp = by_name.get("fsdp2"), by_name.get("ddp")
    mib = 2**20
    print(f"\nGPT {args.layers} layers, hidden {args.hidden}, seq {args.seq}, batch {args.batch}/rank, "
          f"{n_params / 1e6:.2f}M params, fp32, {world} ranks on {device.type}; {args.repeats} rounds of "
          f"{args.steps} timed steps; load average {min(load):.1f}-{max(load):.1f}\n")
    print("| impl | step time (ms), median (range of round medians) | time vs FSDP2 | time vs DDP | "
          "peak mem/rank (MiB) | mem vs FSDP2 | bytes/step (MiB) | bytes vs ZeRO-3 min |")
    print("|---|---|---|---|---|---|---|---|")
    for impl in impls:
        medians = [statistics.median(r) for r in impl.rounds]
        all_steps = [t for r in impl.rounds for t in r]
        peak = max(impl.peaks)
        nbytes = statistics.median(impl.bytes)
        print(f"| {impl.name} | {statistics.median(all_steps) * 1e3:.1f} ({min(medians) * 1e3:.1f}-"
              f"{max(medians) * 1e3:.1f}) | {ratio_spread(impl, fsdp2) if fsdp2 else '-'} | "
              f"{ratio_spread(impl, ddp) if ddp else '-'} | {peak / mib:.1f} | "
              f"{f'{peak / max(fsdp2.peaks):.3f}' if fsdp2 else '-'} | {nbytes / mib:.2f} | "
              f"{nbytes / zero3_min:.3f} |")
    for name in OURS:
        if name in by_name and fsdp2 is not None:
            worst = max(abs(x - y) for x, y in zip(by_name[name].losses, fsdp2.losses))
            print(f"\nloss agreement {name} vs fsdp2 (rank 0): max |diff| {worst:.2e}")


def report_memory_floor(impl: Impl, activations: int, rank: int, impls: list[Impl]) -> None:
    """Print the analytic memory floor beside the measured peaks (rank 0's)."""
    unit, depth = largest_unit_bytes(impl.model)
    floor = impl.sharded_state + (1 + depth) * unit + activations
    stats = pool_stats()
    if rank != 0:
        return
    mib = 2**20
    print(f"\nmemory floor (rank 0, MiB; units of {impl.name}): sharded state {impl.sharded_state / mib:.1f} "
          f"+ (1 + {depth}) x largest unit {unit / mib:.1f} + activations {activations / mib:.1f} "
          f"= {floor / mib:.1f}; measured peak / floor: "
          + ", ".join(f"{i.name} {max(i.peaks) / floor:.3f}" for i in impls))
    kept = "off" if not units_of(impl.model)[0].pool.enabled else (
        "kept between steps" if default_pool().keep_between_steps else "released after each backward")
    print(f"buffer pool, shared by both of our models ({kept}): {stats.reserved_bytes / mib:.1f} MiB reserved "
          f"now in {stats.slabs} slabs, most lent at once {stats.peak_lent_bytes / mib:.1f} MiB; "
          f"{stats.allocations} allocations, {stats.reuses} reuses over the run")


if __name__ == "__main__":
    main()
