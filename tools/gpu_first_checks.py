"""docs/gpu.md's first checks in one command, within a lent GPU's window: ``bash .ci/test.sh gpu``.

Run on the GPU machine from the checkout's root::

    python tools/gpu_first_checks.py [--wheels DIR] [--budget 480] [--out gpu_first_checks.md]

Each check runs as its own process with its own timeout; a check that would not fit in what
is left of ``--budget`` (seconds, default 8 minutes) is not started. It prints a table
(check, result, seconds) and writes it, with the machine's description, to ``--out``.
Checks that need more than one GPU (NCCL at 2+ ranks, torchrun benchmarks) or a tool the
machine lacks (``compute-sanitizer``, ``nsys``) are listed as skipped with the reason.

What it needs carried in: this checkout (tests/ included). The CUDA unit tests need only
torch; megatron-core and torchao are optional (their tests skip without them). When the
machine lacks them and has no network, carry a directory of wheels and pass ``--wheels DIR``:
they are installed with ``pip install --no-index --find-links DIR`` before the checks.

Without a CUDA GPU it prints why and exits 0: nothing to check here (not a failure).
Exit status otherwise: 0 when no check failed or timed out, 1 when one did.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass

NO_GPU = "gpu_first_checks: no CUDA GPU visible (torch.cuda.is_available() is False): nothing to run here"
CUDA_UNIT_TESTS = ["tests/unit/core/test_cuda_single_rank.py", "tests/unit/core/test_gpu_readiness.py",
                   "tests/unit/comm/test_cuda_streams.py", "tests/unit/core/test_te_fp8_params.py"]
OPTIONAL = {"megatron.core": "megatron-core", "torchao": "torchao", "transformer_engine": "transformer-engine"}


@dataclass
class Check:
    """One of docs/gpu.md's checks: a command, its timeout, and what it needs."""

    name: str
    command: list[str]
    timeout_s: int
    gpus: int = 1
    tool: str | None = None  # an executable it needs on PATH
    env: dict[str, str] | None = None


@dataclass
class Result:
    name: str
    result: str  # pass, FAIL (rc N), TIMEOUT (N s), skipped: why
    seconds: float


def checks(python: str) -> list[Check]:
    """docs/gpu.md's 'first checks', in its order."""
    pytest = [python, "-m", "pytest", "-q", "-rs"]
    nccl = {"MEGATRON_FSDP_TEST_BACKEND": "nccl"}
    return [
        Check("1. CUDA unit tests", [*pytest, *CUDA_UNIT_TESTS], 180),
        Check("2. CUDA stream sanitizer", [*pytest, *CUDA_UNIT_TESTS[:3]], 150, env={"TORCH_CUDA_SANITIZER": "1"}),
        Check("3. compute-sanitizer memcheck (pool)", ["compute-sanitizer", "--tool", "memcheck", "--target-processes",
                                                       "all", *pytest, "tests/unit/core/test_gpu_readiness.py",
                                                       "-k", "pool"], 120, tool="compute-sanitizer"),
        Check("4. distributed checks on NCCL (2+ ranks)", [*pytest, "tests/distributed/core/test_engine.py",
                                                           "tests/distributed/sharding/test_hsdp.py"], 300, gpus=2,
              env=nccl),
        Check("5. pretrain_gpt.py under nsys (torchrun, 2 ranks; count syncs with nsys stats)",
              ["nsys", "profile", "-t", "cuda,nvtx,osrt", "--force-overwrite", "true", "-o", "mfsdp_gpt", python, "-m",
               "torch.distributed.run", "--nproc-per-node", "2", "pretrain_gpt.py", "--mock-data", "--vocab-size",
               "8192", "--num-layers", "4", "--hidden-size", "1024", "--num-attention-heads", "16", "--seq-length",
               "1024", "--micro-batch-size", "2", "--global-batch-size", "16", "--train-iters", "20", "--lr", "3e-4",
               "--log-interval", "10", "--bf16", "--use-megatron-fsdp", "--data-parallel-sharding-strategy",
               "optim_grads_params"], 240, gpus=2, tool="nsys"),
        Check("6. benchmarks/compare.py against FSDP2 and DDP (torchrun, 2 ranks)",
              [python, "-m", "torch.distributed.run", "--nproc-per-node", "2", "benchmarks/compare.py", "--steps", "5"],
              240, gpus=2),
    ]


def run_check(check: Check, gpus: int, left_s: float) -> Result:
    """Run ``check`` unless it needs more GPUs or a missing tool, or would not fit in ``left_s``."""
    if check.gpus > gpus:
        return Result(check.name, f"skipped: needs {check.gpus} GPUs, {gpus} visible", 0.0)
    if check.tool is not None and shutil.which(check.tool) is None:
        return Result(check.name, f"skipped: {check.tool} not on PATH", 0.0)
    if check.timeout_s > left_s:
        return Result(check.name, f"skipped: its {check.timeout_s} s timeout exceeds the {left_s:.0f} s left", 0.0)
    start = time.monotonic()
    env = dict(os.environ, **(check.env or {}))
    try:
        proc = subprocess.run(check.command, env=env, timeout=check.timeout_s, capture_output=True, text=True)
    except subprocess.TimeoutExpired as expired:
        _echo(check.name, expired.stdout, expired.stderr)
        return Result(check.name, f"TIMEOUT ({check.timeout_s} s)", time.monotonic() - start)
    _echo(check.name, proc.stdout, proc.stderr)
    result = "pass" if proc.returncode == 0 else f"FAIL (rc {proc.returncode})"
    return Result(check.name, result, time.monotonic() - start)


def _echo(name: str, stdout: str | bytes | None, stderr: str | bytes | None) -> None:
    text = "".join(s.decode() if isinstance(s, bytes) else s for s in (stdout, stderr) if s)
    print(f"--- {name}: last lines of output ---\n" + "\n".join(text.splitlines()[-15:]), flush=True)


def table(results: list[Result]) -> str:
    """The results as a Markdown table."""
    rows = ["| check | result | seconds |", "|---|---|---|"]
    rows += [f"| {r.name} | {r.result} | {r.seconds:.1f} |" for r in results]
    return "\n".join(rows)


def install_wheels(python: str, wheels: str) -> None:
    """Install the optional packages the machine lacks from a carried wheel directory (no network)."""
    missing = [pkg for module, pkg in OPTIONAL.items() if not _importable(module)]
    if not missing:
        return
    print(f"gpu_first_checks: installing {missing} from {wheels}", flush=True)
    for pkg in missing:
        rc = subprocess.run([python, "-m", "pip", "install", "--no-index", "--find-links", wheels, pkg]).returncode
        if rc != 0:
            print(f"gpu_first_checks: {pkg} is not in {wheels} (or failed to install): its tests will skip")


def _importable(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is not None
    except ModuleNotFoundError:
        return False


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--wheels", help="a carried directory of wheels (megatron-core, torchao) to install from")
    parser.add_argument("--budget", type=float, default=480.0, help="seconds for all checks (default 8 minutes)")
    parser.add_argument("--out", default="gpu_first_checks.md", help="where the table is written")
    args = parser.parse_args(argv)
    try:
        import torch
    except ImportError:
        print(f"gpu_first_checks: torch is not importable with {sys.executable}: nothing to run here")
        return 0
    if not torch.cuda.is_available():
        if shutil.which("nvidia-smi") is not None:  # a GPU machine whose torch cannot see it: not a CPU run
            print(f"gpu_first_checks: nvidia-smi is here but torch {torch.__version__} with {sys.executable} sees no "
                  f"CUDA device (torch.version.cuda={torch.version.cuda}); run with the machine's CUDA build of "
                  "torch: PYTHON=python3 bash .ci/test.sh gpu", file=sys.stderr)
            return 2
        print(NO_GPU + "; run it where a GPU is lent (docs/gpu.md).")
        return 0
    if args.wheels:
        install_wheels(sys.executable, args.wheels)
    gpus = torch.cuda.device_count()
    versions = torch.version.cuda, torch.cuda.nccl.version() if hasattr(torch.cuda, "nccl") else None
    machine = (f"{gpus} x {torch.cuda.get_device_name(0)}, torch {torch.__version__}, CUDA {versions[0]}, "
               f"NCCL {versions[1]}, Python {sys.version.split()[0]}; optional: "
               + ", ".join(f"{pkg} {'yes' if _importable(m) else 'no'}" for m, pkg in OPTIONAL.items()))
    print(f"gpu_first_checks: {machine}; budget {args.budget:.0f} s", flush=True)
    deadline = time.monotonic() + args.budget
    results = [run_check(check, gpus, deadline - time.monotonic()) for check in checks(sys.executable)]
    report = table(results)
    print(report)
    with open(args.out, "w") as f:
        f.write(f"{machine}\n\n{report}\n")
    print(f"gpu_first_checks: table written to {args.out}")
    return 1 if any(r.result.startswith(("FAIL", "TIMEOUT")) for r in results) else 0


if __name__ == "__main__":
    sys.exit(main())
