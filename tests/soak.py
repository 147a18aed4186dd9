"""Soak the distributed suites under glibc's heap checking: ``python -m tests.soak --runs 50``.

Each run starts a fresh interpreter that spawns fresh ranks and runs one suite at one
world size once (``tests/distributed/harness.py``), with glibc's malloc debugging
library preloaded and ``MALLOC_CHECK_=3``. On glibc >= 2.34 ``MALLOC_CHECK_`` does
nothing unless ``libc_malloc_debug.so.0`` is preloaded; with it, every ``free`` checks
the chunk it frees and a corrupted heap aborts at once (SIGABRT, exit 134) instead of
later and elsewhere. ``MALLOC_PERTURB_`` fills freed memory, so a read of freed
memory gives wrong numbers (a failing check) instead of plausible ones.

``round_trip_ours``, ``round_trip_fsdp2`` and ``round_trip_all`` (both, our collectives on
temporaries, a background save never waited for) are not suites but a program per rank
(``tests/distributed/checkpoint/round_trip_program.py``): DCP checkpoints moved between
our models, or between ours and FSDP2's, run to the interpreter's exit without the
harness's clean-up; a rank that exits non-zero (an abort at teardown included) is a crash.

Runs cycle through the chosen suites and world sizes, for each buffer-pool setting
(``MEGATRON_FSDP_BUFFER_POOL``: the default of ``EngineOptions.buffer_pool``, which the suites
leave unset except where a check needs the pool on). At the end it prints, per pool setting, how many runs
passed, failed (a check failed), crashed (a rank or the run died by a signal) or hung
(killed after ``--timeout``), and where the output of every run that did not pass is.
The exit status is 0 only if every run passed.
"""

from __future__ import annotations

import argparse
import ctypes
import glob
import importlib
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from collections import Counter
from dataclasses import dataclass

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RESULT_TAG = "SOAK_RESULT "
DEFAULT_SUITES = ("engine", "accumulation", "perf")
MALLOC_DEBUG_NAME = "libc_malloc_debug.so.0"
OUTCOMES = ("passed", "failed", "crashed", "hung")


def find_malloc_debug() -> str | None:
    """The path of glibc's malloc debugging library, or None where this system has none."""
    try:
        listing = subprocess.run(["ldconfig", "-p"], capture_output=True, text=True, check=False).stdout
    except OSError:
        listing = ""
    for line in listing.splitlines():
        name, _, path = line.strip().partition(" => ")
        if name.startswith(MALLOC_DEBUG_NAME) and os.path.exists(path):
            return path
    for folder in ("/lib/x86_64-linux-gnu", "/usr/lib/x86_64-linux-gnu", "/lib/aarch64-linux-gnu",
                   "/usr/lib/aarch64-linux-gnu", "/lib64", "/usr/lib64", "/lib", "/usr/lib"):
        path = os.path.join(folder, MALLOC_DEBUG_NAME)
        if os.path.exists(path):
            return path
    return None


def malloc_check_active() -> bool | None:
    """In this process: is glibc's malloc checking on? None if it cannot be told.

    Under ``MALLOC_CHECK_`` with the debug library preloaded, ``malloc_usable_size``
    reports exactly the size requested (the check keeps a guard byte right after
    it); plain glibc rounds up (24 for 10 bytes on x86-64). The versioned symbols
    are looked up because an unversioned ``dlsym`` finds libc's own allocator.
    """
    libc = ctypes.CDLL(None)
    if not hasattr(libc, "dlvsym"):
        return None
    libc.dlvsym.restype = ctypes.c_void_p
    libc.dlvsym.argtypes = [ctypes.c_void_p, ctypes.c_char_p, ctypes.c_char_p]
    for version in (b"GLIBC_2.2.5", b"GLIBC_2.17", b"GLIBC_2.0"):
        malloc_addr = libc.dlvsym(None, b"malloc", version)
        free_addr = libc.dlvsym(None, b"free", version)
        usable_addr = libc.dlvsym(None, b"malloc_usable_size", version)
        if malloc_addr and free_addr and usable_addr:
            malloc = ctypes.CFUNCTYPE(ctypes.c_void_p, ctypes.c_size_t)(malloc_addr)
            free = ctypes.CFUNCTYPE(None, ctypes.c_void_p)(free_addr)
            usable = ctypes.CFUNCTYPE(ctypes.c_size_t, ctypes.c_void_p)(usable_addr)
            pointer = malloc(10)
            try:
                return usable(pointer) == 10
            finally:
                free(pointer)
    return None


@dataclass
class Run:
    """One suite run: what it was and how it ended."""

    index: int
    pool: str
    suite: str
    world_size: int
    outcome: str  # one of OUTCOMES
    seconds: float
    detail: str  # why it did not pass ("" if it did)
    log: str | None  # the run's output, kept unless it passed


def run_env(pool: str, preload: str | None, perturb: int) -> dict[str, str]:
    env = dict(os.environ)
    env["MEGATRON_FSDP_BUFFER_POOL"] = "1" if pool == "on" else "0"
    env["PYTHONPATH"] = os.pathsep.join(p for p in (ROOT, env.get("PYTHONPATH")) if p)
    if preload is not None:
        env["LD_PRELOAD"] = " ".join(p for p in (preload, env.get("LD_PRELOAD")) if p)
        env["MALLOC_CHECK_"] = "3"
    if perturb:
        env["MALLOC_PERTURB_"] = str(perturb)
    return env


def one_run(index: int, pool: str, suite: str, world_size: int, env: dict[str, str], timeout: float,
            log_dir: str) -> Run:
    """Run ``suite`` at ``world_size`` once in a fresh interpreter and classify the outcome."""
    log = os.path.join(log_dir, f"run{index:03d}_{suite}{world_size}_pool-{pool}.log")
    command = [sys.executable, "-m", "tests.soak", "--child", suite, str(world_size)]
    start = time.monotonic()
    with open(log, "w") as out:
        child = subprocess.Popen(command, cwd=ROOT, env=env, stdout=out, stderr=subprocess.STDOUT,
                                 start_new_session=True)
        try:
            returncode = child.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(child.pid, signal.SIGKILL)  # the run's own session: its ranks included
            child.wait()
            returncode = None
    seconds = time.monotonic() - start
    with open(log) as f:
        text = f.read()
    result = next((json.loads(line[len(RESULT_TAG):]) for line in text.splitlines() if line.startswith(RESULT_TAG)),
                  None)
    if returncode is None:
        outcome, detail = "hung", f"killed after {timeout:.0f} s"
    elif returncode < 0:
        outcome, detail = "crashed", f"the run itself died by {signal.Signals(-returncode).name}"
    elif result is None:
        outcome, detail = "failed", f"no result (exit code {returncode})"
    elif result["signal"]:
        outcome, detail = "crashed", result["death"]
    elif result["death"] or result["failed"]:
        outcome, detail = "failed", result["death"] or "failed checks: " + ", ".join(result["failed"])
    else:
        outcome, detail = "passed", ""
    if outcome == "crashed":
        # glibc's and faulthandler's own words, when the crash printed any
        clues = [line.strip() for line in text.splitlines()
                 if "malloc" in line or "corrupted" in line or "Fatal Python error" in line or "free()" in line]
        if clues:
            detail += " | " + " | ".join(dict.fromkeys(clues))
    if outcome == "passed":
        os.remove(log)
        log = None
    return Run(index, pool, suite, world_size, outcome, seconds, detail, log)


def checks_module(suite: str) -> str:
    """The dotted name of ``tests/distributed/<sub-package>/<suite>_checks.py`` (or of the harness's own suites)."""
    distributed = os.path.join(ROOT, "tests", "distributed")
    found = sorted(glob.glob(os.path.join(distributed, "**", f"{suite}_checks.py"), recursive=True))
    if len(found) != 1:
        known = sorted(os.path.basename(f)[: -len("_checks.py")]
                       for f in glob.glob(os.path.join(distributed, "**", "*_checks.py"), recursive=True))
        raise SystemExit(f"--suites: {suite!r} names {len(found)} files tests/distributed/**/{suite}_checks.py; "
                         f"known suites: {', '.join(known)}")
    return os.path.relpath(found[0], ROOT)[: -len(".py")].replace(os.sep, ".")


ROUND_TRIPS = {"round_trip_ours": ("ours",), "round_trip_fsdp2": ("fsdp2",),
               "round_trip_all": ("ours", "fsdp2", "collectives")}


def round_trip_child(scenarios: tuple[str, ...], world_size: int) -> None:
    """Inside one run: ``round_trip_program`` (a DCP checkpoint moved between our models, or ours
    and FSDP2's) on fresh ranks to their normal interpreter exit, without the harness's
    ``gc.collect()`` before ``destroy_process_group()``: any rank's non-zero exit, an abort at
    teardown included, is a crash."""
    import torch.multiprocessing as mp

    from tests.distributed.checkpoint import round_trip_program
    from tests.distributed.harness import free_port

    death, signal_name = None, None
    with tempfile.TemporaryDirectory() as directory:
        try:
            mp.start_processes(round_trip_program.run, args=(free_port(), scenarios, directory), nprocs=world_size,
                               start_method="spawn", join=True)
        except mp.ProcessExitedException as error:
            death = str(error)
            signal_name = error.signal_name or (f"exit code {error.exit_code}" if error.exit_code else None)
        except mp.ProcessRaisedException as error:
            death = str(error)[-2000:]
    print(RESULT_TAG + json.dumps({"death": death, "signal": signal_name, "failed": []}), flush=True)


def child_main(suite: str, world_size: int) -> None:
    """Inside one run: run the suite once and print its result as one tagged JSON line."""
    if suite in ROUND_TRIPS:
        round_trip_child(ROUND_TRIPS[suite], world_size)
        return
    import megatron_fsdp
    from tests.distributed.harness import names, run_suite_once

    print(f"megatron_fsdp from {os.path.dirname(megatron_fsdp.__file__)}", flush=True)
    module = checks_module(suite)
    suite = importlib.import_module(module).SUITE  # fsdp2_idiom_checks.py registers suite "fsdp2_idioms"
    expected = names(suite, world_size)
    if not expected:
        raise SystemExit(f"suite {suite!r} has no checks at world size {world_size}")
    run = run_suite_once(module, suite, world_size)
    failures = run.failures(expected)
    failed = sorted(name for name, errors in failures.items() if errors)
    for name in failed:
        print(f"--- {name}\n" + "\n".join(failures[name]), file=sys.stderr)
    print(RESULT_TAG + json.dumps({"death": run.death, "signal": run.signal, "failed": failed}), flush=True)


def summarize(runs: list[Run], pools: list[str]) -> str:
    lines = []
    for pool in pools:
        mine = [r for r in runs if r.pool == pool]
        counts = Counter(r.outcome for r in mine)
        seconds = sorted(r.seconds for r in mine)
        median = seconds[len(seconds) // 2] if seconds else 0.0
        lines.append(f"pool {pool}: runs {len(mine)}, " + ", ".join(f"{o} {counts[o]}" for o in OUTCOMES)
                     + f" (median {median:.0f} s per run)")
        for suite in sorted({(r.suite, r.world_size) for r in mine}):
            per = Counter(r.outcome for r in mine if (r.suite, r.world_size) == suite)
            lines.append(f"  {suite[0]}@{suite[1]}: " + ", ".join(f"{o} {per[o]}" for o in OUTCOMES))
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tests.soak", description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=50, help="suite runs per pool setting (default 50)")
    parser.add_argument("--suites", default=",".join(DEFAULT_SUITES),
                        help="comma-separated suites of tests/distributed/**/<suite>_checks.py, or round_trip_ours/"
                             "round_trip_fsdp2/round_trip_all (DCP round trips between wrapped models, a program "
                             "per rank, any non-zero exit a crash) (default %(default)s)")
    parser.add_argument("--world-sizes", default="2", help="comma-separated world sizes to cycle through (default 2)")
    parser.add_argument("--pool", choices=("off", "on", "both"), default="both",
                        help="MEGATRON_FSDP_BUFFER_POOL for the runs (default: both, one after the other)")
    parser.add_argument("--timeout", type=float, default=600.0, help="seconds before a run counts as hung")
    parser.add_argument("--perturb", type=int, default=165, help="MALLOC_PERTURB_ byte (0: off; default 165)")
    parser.add_argument("--no-malloc-check", action="store_true", help="do not preload glibc's malloc debugging")
    parser.add_argument("--log-dir", default=None, help="where the output of runs that did not pass is kept")
    parser.add_argument("--child", nargs=2, metavar=("SUITE", "WORLD_SIZE"), help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        child_main(args.child[0], int(args.child[1]))
        return 0

    suites = [s for s in args.suites.split(",") if s]
    world_sizes = [int(w) for w in args.world_sizes.split(",") if w]
    plan = [(s, w) for s in suites for w in world_sizes]
    pools = ["off", "on"] if args.pool == "both" else [args.pool]
    preload = None if args.no_malloc_check else find_malloc_debug()
    if args.no_malloc_check:
        print("malloc checking: off (--no-malloc-check)")
    elif preload is None:
        print(f"malloc checking: off ({MALLOC_DEBUG_NAME} not found on this system; MALLOC_CHECK_ alone does "
              "nothing on glibc >= 2.34), running without it")
    else:
        probe = subprocess.run(
            [sys.executable, "-c", "from tests.soak import malloc_check_active; print(malloc_check_active())"],
            cwd=ROOT, env=run_env("off", preload, args.perturb), capture_output=True, text=True, check=False,
        )
        state = {"True": "active", "False": "NOT active", "None": "not verifiable here"}.get(
            probe.stdout.strip(), f"probe failed: {probe.stderr.strip()[-200:]}")
        print(f"malloc checking: LD_PRELOAD={preload} MALLOC_CHECK_=3 ({state})")
    print(f"MALLOC_PERTURB_={args.perturb or 'off'}; {args.runs} runs per pool setting {pools}, cycling {plan}")
    log_dir = args.log_dir or tempfile.mkdtemp(prefix="mfsdp_soak_")
    os.makedirs(log_dir, exist_ok=True)

    runs: list[Run] = []
    index = 0
    started = time.monotonic()
    for pool in pools:
        env = run_env(pool, preload, args.perturb)
        for i in range(args.runs):
            suite, world_size = plan[i % len(plan)]
            index += 1
            run = one_run(index, pool, suite, world_size, env, args.timeout, log_dir)
            runs.append(run)
            print(f"[{index:3d}] pool {pool:3s} {suite}@{world_size}: {run.outcome:7s} {run.seconds:5.0f} s"
                  + (f"  {run.detail}  ({run.log})" if run.log else ""), flush=True)
    minutes = (time.monotonic() - started) / 60
    print(f"\n{len(runs)} runs in {minutes:.1f} min; logs of runs that did not pass: {log_dir}")
    print(summarize(runs, pools))
    return 0 if all(r.outcome == "passed" for r in runs) else 1


if __name__ == "__main__":
    sys.exit(main())
