"""Run the functional configurations in one spawned gloo group per world size; regenerate golden values.

    python -m tests.functional.runner --regenerate     # rewrite golden_values.json (review the diff!)
    python -m tests.functional.runner                  # print each run's losses
    python -m tests.functional.runner --regenerate --configs dropout save_dropout resume_dropout
                                                       # (re)write only these entries, keep the others

Running many short jobs inside one process group (``pretrain`` reuses an
initialised group) keeps the CI cost to one process launch per world size.
megatron-core is installed in the environment (``.ci/setup.sh``); every configuration
builds its ``GPTModel``.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import gc
import io
import json
import os
import tempfile
import time
import traceback

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
GOLDEN = os.path.join(os.path.dirname(os.path.abspath(__file__)), "golden_values.json")


def _worker(rank: int, world_size: int, port: int, out_dir: str, ckpt_root: str,
            only: list[str] | None = None) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world_size),
                      LOCAL_RANK=str(rank))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=180))
    from megatron.training.training import pretrain
    from pretrain_gpt import forward_step, model_provider
    from tests.functional.configs import by_world_size

    gc.freeze()  # the imports' objects: Python's full collections skip them (tests/distributed/harness.py)
    # megatron-core's fused bias-dropout-add is torch.compile'd: each configuration's shapes and dtypes add a
    # compilation, and past dynamo's recompile limit (8) a function falls back to eager, whose bf16 rounding differs
    # (mlm_experts' grad norm moved 1.3% when 40 other megatron-core configurations ran before it in the group).
    # Every configuration gets its compiled kernels, as in a process of its own.
    torch._dynamo.config.recompile_limit = 1024
    results, built = {}, []

    def provider(*args, **kwargs):  # records which GPT each configuration built
        model = model_provider(*args, **kwargs)
        built.append(f"{type(model).__module__}.{type(model).__name__}")
        return model

    chosen = [c for c in by_world_size(world_size) if only is None or c.name in only]
    for config in chosen:
        log = io.StringIO()
        built.clear()
        start = time.perf_counter()
        try:
            with contextlib.redirect_stdout(log):
                run = pretrain(provider, forward_step, config.argv(ckpt_root))
            results[config.name] = {
                "model": built[-1] if built else None,
                "seconds": time.perf_counter() - start,  # this rank's wall time of the run (the suite's cost)
                "lm loss": {str(k): v for k, v in sorted(run.losses.items())},
                "grad norm": {str(k): v for k, v in sorted(run.grad_norms.items())},
                "valid loss": {str(k): v for k, v in sorted(run.valid_losses.items())},
                "params norm": {str(k): v for k, v in sorted(run.params_norms.items())},
                "num zeros": {str(k): v for k, v in sorted(run.num_zeros.items())},
                "log": log.getvalue(),
            }
        except Exception:
            results[config.name] = {"error": traceback.format_exc(), "log": log.getvalue()}
        dist.barrier()
    if rank == world_size - 1:  # the rank that prints the training log, as Megatron's last rank
        with open(os.path.join(out_dir, "results.json"), "w") as f:
            json.dump(results, f)
    gc.collect()
    dist.destroy_process_group()


def run_world(world_size: int, ckpt_root: str, only: list[str] | None = None) -> dict:
    """Configurations of ``world_size`` (all, or those named in ``only``):
    {name: {"lm loss": {iter: value}, "grad norm": ..., "valid loss": ..., "log": str}}.

    Checkpoints go under ``ckpt_root`` (run world size 2 first: 4-rank configs resume its checkpoint).
    """
    from tests.distributed.harness import free_port
    from tests.functional.configs import by_world_size

    chosen = [c for c in by_world_size(world_size) if only is None or c.name in only]
    results = {}
    if not chosen:
        return results
    # One spawned gloo group for every configuration of this world size.
    with tempfile.TemporaryDirectory() as out_dir:
        try:
            mp.start_processes(_worker, args=(world_size, free_port(), out_dir, ckpt_root, only),
                               nprocs=world_size, start_method="spawn", join=True)
        except mp.ProcessExitedException:
            if not os.path.exists(os.path.join(out_dir, "results.json")):
                raise
        with open(os.path.join(out_dir, "results.json")) as f:
            results.update(json.load(f))
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--regenerate", action="store_true", help=f"rewrite {GOLDEN}")
    parser.add_argument("--world-sizes", type=int, nargs="*", default=[2, 4])
    parser.add_argument("--configs", nargs="*", default=None,
                        help="run (and regenerate) only these configurations; list a resume's save too")
    args = parser.parse_args()
    golden = {}
    if args.configs is not None:
        with open(GOLDEN) as f:
            golden = {k: v for k, v in json.load(f).items() if k != "_about"}
    ckpt_root = tempfile.mkdtemp(prefix="functional-ckpt-")
    for world_size in sorted(args.world_sizes):
        for name, result in run_world(world_size, ckpt_root, args.configs).items():
            if "error" in result:
                raise SystemExit(f"{name} failed:\n{result['error']}")
            golden[name] = {"lm loss": result["lm loss"], "grad norm": result["grad norm"]}
            print(f"{name} ({result['seconds']:.1f} s)", " ".join(f"{v:.6f}" for v in result["lm loss"].values()))
    if args.regenerate:
        with open(GOLDEN, "w") as f:
            json.dump({"_about": "tests/functional golden values: python -m tests.functional.runner --regenerate; "
                                 "torch 2.13.0 CPU, gloo, 1 thread per rank", **golden}, f, indent=1, sort_keys=True)
        print(f"wrote {GOLDEN}")


if __name__ == "__main__":
    main()
