"""Resident memory of importing the library: ``import megatron_fsdp`` against ``import torch.distributed.fsdp``.

Run: ``python benchmarks/import_rss.py --runs 5``

Each run starts one fresh interpreter per library (alternating, so a drift of the machine
touches both), as ``memory_rss.py``'s ``import`` row does but without a training job:
``MALLOC_MMAP_THRESHOLD_=65536``, torch and a 1-rank gloo group with one warm-up collective
first, then VmRSS before and after the import. It prints, per library, the median growth in
MB over the runs with its range, the modules the import added (how many, and whether
``torch.distributed.checkpoint`` is among them), and the ratio of medians.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys

LIBRARIES = ("megatron_fsdp", "torch.distributed.fsdp")

CHILD = r"""
import importlib, json, os, sys, tempfile
import torch
import torch.distributed as dist

def rss():
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("no VmRSS in /proc/self/status")

store = tempfile.mktemp()
dist.init_process_group("gloo", init_method=f"file://{store}", rank=0, world_size=1)
dist.all_reduce(torch.ones(1))
before_modules = set(sys.modules)
before = rss()
importlib.import_module(sys.argv[1])
grown = rss() - before
added = set(sys.modules) - before_modules
print(json.dumps({"bytes": grown, "modules": len(added), "dcp": "torch.distributed.checkpoint" in added}))
dist.destroy_process_group()
"""


def measure(library: str) -> dict:
    """One fresh interpreter's growth of VmRSS importing ``library``."""
    env = dict(os.environ, MALLOC_MMAP_THRESHOLD_="65536")
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    out = subprocess.run([sys.executable, "-c", CHILD, library], env=env, cwd=root, check=True,
                         capture_output=True, text=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=5)
    args = parser.parse_args()
    results: dict[str, list[dict]] = {lib: [] for lib in LIBRARIES}
    for run in range(args.runs):
        order = LIBRARIES if run % 2 == 0 else LIBRARIES[::-1]
        for lib in order:
            results[lib].append(measure(lib))
    medians = {}
    print(f"| import ({args.runs} runs, fresh interpreter each) | resident growth MB, median (range) "
          "| modules added | loads torch.distributed.checkpoint |")
    print("|---|---|---|---|")
    for lib, rows in results.items():
        mb = [r["bytes"] / 2**20 for r in rows]
        medians[lib] = statistics.median(mb)
        dcp = {r["dcp"] for r in rows}
        loads = "yes" if dcp == {True} else "no" if dcp == {False} else "varies"
        modules = statistics.median(r["modules"] for r in rows)
        print(f"| `import {lib}` | {medians[lib]:.1f} ({min(mb):.1f}-{max(mb):.1f}) | {modules:.0f} | {loads} |")
    ratio = medians["megatron_fsdp"] / medians["torch.distributed.fsdp"]
    print(f"ratio megatron_fsdp / torch.distributed.fsdp: {ratio:.3f}")


if __name__ == "__main__":
    main()
