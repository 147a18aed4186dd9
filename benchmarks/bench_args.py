"""Command-line options shared by compare.py and memory_rss.py: the model's shape and the engine's options.

One definition, so that compare.py's memory pass (which runs memory_rss.py with its own
flags) and a memory_rss.py run by hand measure the same model with the same options.
"""

from __future__ import annotations

import argparse


def add_model_shape_args(p: argparse.ArgumentParser, vocab: int) -> None:
    """The benchmark GPT's shape (examples/train_fully_shard.py's model) and the per-rank batch."""
    p.add_argument("--layers", type=int, default=6)
    p.add_argument("--hidden", type=int, default=384)
    p.add_argument("--heads", type=int, default=6)
    p.add_argument("--seq", type=int, default=128)
    p.add_argument("--batch", type=int, default=4, help="per rank")
    p.add_argument("--vocab", type=int, default=vocab)


def add_engine_option_args(p: argparse.ArgumentParser) -> None:
    """megatron_fsdp's options the benchmarks vary (each maps to an ``EngineOptions`` field)."""
    p.add_argument("--pool", choices=("keep", "release", "off"), default="keep",
                   help="megatron_fsdp's buffer pool: keep its memory between steps (the library's default), "
                        "release it after backward, or off (plain allocations, EngineOptions(buffer_pool=False))")
    p.add_argument("--local-step", choices=("on", "off"), default="on",
                   help="megatron_fsdp_model's fully_shard_optimizer(step_on_local_shards=...), on by default")
    p.add_argument("--reduces-in-flight", type=int, default=None,
                   help="megatron_fsdp's limit on gradient reductions in flight (EngineOptions.max_reduces_in_flight)")
    p.add_argument("--gloo-paths", choices=("on", "off"), default="on",
                   help="megatron_fsdp's gloo fast paths (EngineOptions.gloo_fast_paths, on by default): "
                        "off measures plain all-gather/reduce-scatter")


def check_impls(p: argparse.ArgumentParser, impls: str, known: tuple[str, ...]) -> None:
    """``--impls``: a comma-separated subset of ``known``; an unknown name stops with the valid ones."""
    unknown = [n for n in impls.split(",") if n not in known]
    if unknown:
        p.error(f"--impls: unknown implementation(s) {unknown}; choose from {', '.join(known)}")
