"""Resident memory the way users measure it: one implementation per process, the kernel's high-water mark.

Run (driver; it launches every job itself, 2 CPU ranks each):

    python benchmarks/memory_rss.py --runs 5
    python benchmarks/memory_rss.py --runs 5 --layers 24

Each run launches one 2-rank gloo job per implementation (``--impls``, the same builders as
compare.py: per-module ``fully_shard`` of every block and the root with a plain
``torch.optim.AdamW``, the whole-model API, FSDP2, DDP), every process started with
``MALLOC_MMAP_THRESHOLD_=65536`` so that glibc returns every freed block over 64 KiB to the
kernel at once and the resident set follows the live bytes. The jobs of one run are
interleaved with the other runs' (impl order rotates), so a drift of the machine touches all.
Each rank reads ``/proc/self/status``:

- **import**: the growth of VmRSS importing the implementation's library (``megatron_fsdp``;
  ``torch.distributed.fsdp``; nothing for DDP) after torch, the process group and one
  warm-up collective: code and module objects, independent of the model;
- ``base``: VmRSS after every import (the benchmark's own, which imports all libraries);
- **build**: the growth of the high-water mark (``VmHWM``, reset through
  ``/proc/self/clear_refs``) while building the model (on CPU, or on the meta device with
  ``--meta``), sharding it and making the optimizer;
- **start**: VmRSS after set-up, above ``base``;
- **step peak**: the growth of VmHWM above ``start`` over ``--steps`` training steps
  (forward, loss, backward, ``optimizer.step()``, ``zero_grad(set_to_none=True)``); the first
  step, which makes the optimizer's state, is also reported on its own (**first step**);
- **set-up peak**: the largest VmHWM above ``base`` while building, sharding and taking the
  first step (the larger of **build** and **start** plus **first step**);
- **whole run**: the largest VmHWM of the process above ``base``.

Every figure is the maximum over the job's ranks; the report gives, for each, the median over
the runs, its range, and the ratio of medians against FSDP2 and DDP. Timing is not measured here
(compare.py interleaves steps for that); memory does not depend on the machine's load.

``--trace`` instead runs one job per implementation of ``--impls`` and traces its last step
(``--steps 1``: the first, which makes the optimizer's state) with torch.profiler's memory
events (every allocation of torch's CPU allocator, with its address) and ``tracemalloc`` (Python
objects). It prints the bytes torch allocated in the step and still alive at its peak, summed
by step phase and by the innermost operator or library range that allocated them (the
allocation trace behind docs/performance.md's accounting).
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import tracemalloc

from bench_args import add_engine_option_args, add_model_shape_args, check_impls

IMPLS = ("megatron_fsdp", "megatron_fsdp_model", "fsdp2", "ddp")
FIGURES = ("import", "build", "start", "first_step", "setup", "step_peak", "whole_run")
LABELS = {
    "import": "resident growth importing the library (code, fixed)",
    "build": "resident growth while building and sharding",
    "start": "resident at the start of training (after set-up)",
    "first_step": "peak growth above that during the first step",
    "setup": "set-up peak: building, sharding, first step",
    "step_peak": "peak growth above the start during the steps",
    "whole_run": "peak of the whole run",
}
MMAP_THRESHOLD = str(1 << 16)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_model_shape_args(p, vocab=512)
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--runs", type=int, default=5, help="jobs per implementation (the spread is over these)")
    p.add_argument("--nproc", type=int, default=2)
    p.add_argument("--impls", default=",".join(IMPLS))
    p.add_argument("--meta", action="store_true", help="build on the meta device, materialize after sharding")
    add_engine_option_args(p)  # as compare.py takes them (it runs its CPU memory pass through this script)
    p.add_argument("--trace", action="store_true",
                   help="one job of each of --impls: what is alive at the last step's peak (torch.profiler)")
    p.add_argument("--worker", default=None, help=argparse.SUPPRESS)  # JSON output path of a launched job
    args = p.parse_args(argv)
    check_impls(p, args.impls, IMPLS)
    return args


def status_bytes(field: str) -> int:
    """A field of /proc/self/status (VmRSS, VmHWM) in bytes."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    raise RuntimeError(field)


def reset_peak() -> None:
    """Set VmHWM to the current VmRSS."""
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")


def worker(args: argparse.Namespace) -> None:
    """One rank of one implementation's job: measure set-up and steps, write rank 0's JSON (max over ranks)."""
    import torch
    import torch.distributed as dist
    from torch import nn
    from torch.profiler import ProfilerActivity, profile, record_function

    dist.init_process_group("gloo")
    rank = dist.get_rank()
    name = args.impls
    device = torch.device("cpu")
    generator = torch.Generator().manual_seed(1 + rank)
    tokens = [torch.randint(0, args.vocab, (args.batch, args.seq + 1), generator=generator) for _ in range(args.steps)]
    dist.all_reduce(torch.ones(1))
    before_import = status_bytes("VmRSS")
    if name in ("megatron_fsdp", "megatron_fsdp_model"):
        import megatron_fsdp  # noqa: F401
    elif name == "fsdp2":
        import torch.distributed.fsdp  # noqa: F401
    imported = status_bytes("VmRSS") - before_import
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from compare import GPT, build  # the benchmark's own code (it imports every library): not counted

    base = status_bytes("VmRSS")
    reset_peak()
    torch.manual_seed(0)
    if name in ("megatron_fsdp", "megatron_fsdp_model"):
        from megatron_fsdp.memory.allocator import default_pool

        default_pool().keep_between_steps = args.pool == "keep"
    if args.meta:
        with torch.device("meta"):
            model = GPT(args.vocab, args.hidden, args.layers, args.heads, args.seq)
    else:
        model = GPT(args.vocab, args.hidden, args.layers, args.heads, args.seq)
    impl = build(name, model, device, args, copy_model=False)
    del model
    figures = {"import": imported, "build": status_bytes("VmHWM") - base, "start": status_bytes("VmRSS") - base}
    start = status_bytes("VmRSS")
    whole = status_bytes("VmHWM")
    step_peaks = []

    def step(batch: torch.Tensor, impl=impl) -> None:
        with record_function("step.forward"):
            logits = impl.model(batch[:, :-1])
            loss = nn.functional.cross_entropy(logits.flatten(0, 1), batch[:, 1:].flatten())
            del logits
        with record_function("step.backward"):
            loss.backward()
        with record_function("step.optimizer"):
            impl.optimizer.step()
            impl.optimizer.zero_grad(set_to_none=True)

    for i in range(args.steps):
        reset_peak()
        if args.trace and i == args.steps - 1:
            tracemalloc.start()
            with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
                step(tokens[i])
            python_bytes = tracemalloc.get_traced_memory()
            tracemalloc.stop()
            if rank == 0:
                prof.export_chrome_trace(args.worker + ".trace.json")
                with open(args.worker + ".python.json", "w") as f:
                    json.dump(python_bytes, f)
        else:
            step(tokens[i])
        step_peaks.append(status_bytes("VmHWM"))
        whole = max(whole, step_peaks[-1])
    figures["first_step"] = step_peaks[0] - start
    figures["setup"] = max(figures["build"], step_peaks[0] - base)
    figures["step_peak"] = max(step_peaks) - start
    figures["whole_run"] = whole - base
    gathered = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, figures)
    if rank == 0:
        with open(args.worker, "w") as f:
            json.dump({k: max(g[k] for g in gathered) for k in FIGURES}, f)
    dist.barrier()
    del impl
    dist.destroy_process_group()


def alive_at_peak(trace_path: str) -> tuple[int, list[tuple[str, int, int]]]:
    """From a chrome trace with memory events: the step's peak of bytes allocated (above its start) and
    what was alive then, summed by (phase, innermost operator or range that allocated it)."""
    with open(trace_path) as f:
        events = json.load(f)["traceEvents"]
    ops = sorted((e for e in events if e.get("ph") == "X" and "dur" in e), key=lambda e: e["ts"])
    memory = sorted((e for e in events if e.get("name") == "[memory]"), key=lambda e: e["ts"])
    live: dict[int, tuple[float, int, int]] = {}
    total = peak = 0
    peak_live: dict[int, tuple[float, int, int]] = {}
    for e in memory:
        addr, nbytes = e["args"]["Addr"], e["args"]["Bytes"]
        if nbytes > 0:
            live[addr] = (e["ts"], e["tid"], nbytes)
        else:
            live.pop(addr, None)
        total += nbytes
        if total > peak:
            peak, peak_live = total, dict(live)
    by_site: dict[tuple[str, str], list[int]] = {}
    ops = [o for o in ops if not o["name"].startswith("PyTorch Profiler")]
    for ts, tid, nbytes in peak_live.values():
        around = [o for o in ops if o["ts"] <= ts <= o["ts"] + o["dur"] and o["tid"] == tid]
        phase = next((o["name"] for o in around if o["name"].startswith("step.")), "-")
        ranges = [o["name"] for o in around if o["name"].startswith(("megatron_fsdp.", "FSDP::"))]
        innermost = min(around, key=lambda o: o["dur"])["name"] if around else "-"
        site = innermost if not ranges else f"{ranges[-1]} / {innermost}"
        entry = by_site.setdefault((phase, site), [0, 0])
        entry[0] += nbytes
        entry[1] += 1
    rows = sorted(((f"{p}: {s}", b, n) for (p, s), (b, n) in by_site.items()), key=lambda r: -r[1])
    return peak, rows


def trace(args: argparse.Namespace, passthrough: list[str]) -> None:
    """Print, per implementation, the last step's allocations alive at its peak (rank 0)."""
    for name in args.impls.split(","):
        with tempfile.TemporaryDirectory() as tmp:
            out = os.path.join(tmp, "figures.json")
            env = job_env()
            cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(args.nproc),
                   "--master-port", str(free_port()), os.path.abspath(__file__), *passthrough, "--trace",
                   "--impls", name, "--worker", out]
            subprocess.run(cmd, env=env, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
            peak, rows = alive_at_peak(out + ".trace.json")
            with open(out + ".python.json") as f:
                python_now, python_peak = json.load(f)
        print(f"\n{name}: allocated at the last step's peak, above its start: {peak / 1e6:.2f} MB (rank 0); "
              f"Python objects (tracemalloc, profiler's included): {python_now / 1e6:.2f} MB kept, "
              f"{python_peak / 1e6:.2f} MB at most")
        for site, nbytes, count in rows[:25]:
            print(f"  {nbytes / 1e6:8.2f} MB {count:5d} x  {site}")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def job_env() -> dict[str, str]:
    """This process's environment for a launched job: the mmap threshold fixed, and no launcher
    variables of an enclosing torchrun (compare.py launches from inside one)."""
    launcher = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK", "GROUP_WORLD_SIZE",
                "ROLE_RANK", "ROLE_NAME", "ROLE_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
    env = {k: v for k, v in os.environ.items() if k not in launcher and not k.startswith("TORCHELASTIC_")}
    return dict(env, MALLOC_MMAP_THRESHOLD_=MMAP_THRESHOLD, OMP_NUM_THREADS="1")


def launch(name: str, args: argparse.Namespace, passthrough: list[str]) -> dict:
    """One job of ``name`` on ``--nproc`` ranks with the mmap threshold fixed from process start."""
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "figures.json")
        env = job_env()
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(args.nproc),
               "--master-port", str(free_port()), os.path.abspath(__file__), *passthrough,
               "--impls", name, "--worker", out]
        subprocess.run(cmd, env=env, check=True, stdout=subprocess.DEVNULL)
        with open(out) as f:
            return json.load(f)


def passthrough_args(args: argparse.Namespace) -> list[str]:
    """The model's and megatron_fsdp's options as flags for a launched job."""
    out = []
    for key in ("layers", "hidden", "heads", "seq", "batch", "vocab", "steps", "pool", "local_step",
                "reduces_in_flight", "gloo_paths"):
        if getattr(args, key, None) is not None:
            out += [f"--{key.replace('_', '-')}", str(getattr(args, key))]
    return out + (["--meta"] if getattr(args, "meta", False) else [])


def report(results: dict[str, list[dict]], args: argparse.Namespace) -> None:
    mb = 1e6
    names = list(results)
    med = {n: {k: statistics.median(r[k] for r in results[n]) for k in FIGURES} for n in names}
    print(f"\nGPT {args.layers} layers, hidden {args.hidden}, vocab {args.vocab}, seq {args.seq}, batch "
          f"{args.batch}/rank, fp32, {args.nproc} gloo ranks, ZeRO-3, AdamW, {args.steps} steps"
          f"{', meta-device init' if args.meta else ''}; MALLOC_MMAP_THRESHOLD_={MMAP_THRESHOLD}; VmHWM/VmRSS, "
          f"max over ranks; median (range) over {args.runs} runs, one implementation per job; MB = 1e6 bytes\n")
    print("| figure | " + " | ".join(names) + " | " + " | ".join(
        f"{n} / {ref}" for n in names if n not in ("fsdp2", "ddp") for ref in ("fsdp2", "ddp") if ref in names) + " |")
    refs = [(n, ref) for n in names if n not in ("fsdp2", "ddp") for ref in ("fsdp2", "ddp") if ref in names]
    print("|---" * (1 + len(names) + len(refs)) + "|")
    for key in FIGURES:
        cells = []
        for n in names:
            values = [r[key] for r in results[n]]
            cells.append(f"{med[n][key] / mb:.1f} ({min(values) / mb:.1f}-{max(values) / mb:.1f})")
        ratios = [f"{med[n][key] / med[ref][key]:.3f}" if med[ref][key] > 0 else "-" for n, ref in refs]
        print(f"| {LABELS[key]} | " + " | ".join(cells + ratios) + " |")


def main() -> None:
    args = parse_args()
    if args.worker is not None:
        worker(args)
        return
    if args.trace:
        trace(args, passthrough_args(args))
        return
    names = args.impls.split(",")
    results: dict[str, list[dict]] = {n: [] for n in names}
    passthrough = passthrough_args(args)
    for run in range(args.runs):
        for name in names[run % len(names):] + names[: run % len(names)]:
            results[name].append(launch(name, args, passthrough))
            print(f"run {run + 1}/{args.runs} {name}: " + ", ".join(
                f"{k} {v / 1e6:.1f}" for k, v in results[name][-1].items()) + " MB", flush=True)
    report(results, args)


if __name__ == "__main__":
    main()
