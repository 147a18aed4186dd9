"""SIGKILL at each step of ``save_checkpoint`` (and at random moments), run as ``python -m`` in a subprocess.

    python -m tests.unit.checkpoint.checkpoint_kill_scenarios SAVE_DIR

For every scenario a forked child starts a save and is killed by SIGKILL at a
chosen point (after the DCP write, after the manifest, after the directory swap
of a replacement, before the tracker write) or after a delay while saving in a
loop; the parent then checks that the tracker names a complete checkpoint that
loads without a fall-back, and finally that the next save removes every
interrupted save's scratch. Prints ``ok`` and exits 0, or raises.
"""

from __future__ import annotations

import os
import signal
import sys
import time
import warnings

import torch

from megatron_fsdp.checkpoint import dirs as checkpoint_dirs
from megatron_fsdp.checkpoint import iterations as checkpoint
from megatron_fsdp.checkpoint import load_checkpoint, read_latest_iteration, save_checkpoint
from megatron_fsdp.checkpoint import sharded_io as checkpoint_io


def build() -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = torch.nn.Sequential(*(torch.nn.Linear(512, 512) for _ in range(4)))  # 4 MiB weights, 12 MiB saved
    return model, torch.optim.AdamW(model.parameters())


def _die() -> None:
    os.kill(os.getpid(), signal.SIGKILL)


def _after(module: object, name: str):
    """Make ``module.name`` kill the process right after it returns."""
    original = getattr(module, name)

    def wrapper(*args, **kwargs):
        result = original(*args, **kwargs)
        _die()
        return result

    setattr(module, name, wrapper)


def _before(module: object, name: str) -> None:
    setattr(module, name, lambda *args, **kwargs: _die())


KILL_POINTS = {
    "after the DCP write": lambda: _after(checkpoint_io, "write_dcp"),
    "after the manifest": lambda: _after(checkpoint_io, "write_manifest"),
    "after swapping the directories": lambda: _after(checkpoint_dirs, "exchange"),
    "before the tracker write": lambda: _before(checkpoint, "write_file_atomically"),
}


def _in_child(body) -> None:
    """Run ``body`` in a forked child; it must end by SIGKILL."""
    pid = os.fork()
    if pid == 0:
        try:
            body()
        finally:
            os._exit(3)  # not killed: the parent reports it
    _, status = os.waitpid(pid, 0)
    if not (os.WIFSIGNALED(status) and os.WTERMSIG(status) == signal.SIGKILL):
        raise AssertionError(f"the child was not killed (status {status})")


def _check(save_dir: str, scenario: str) -> int:
    latest = read_latest_iteration(save_dir)
    model, opt = build()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        loaded = load_checkpoint(save_dir, model, opt)
    bad = [str(w.message) for w in caught if "manifest" in str(w.message) or "interrupted" in str(w.message)]
    assert not bad, (scenario, bad)
    assert loaded.iteration == latest and loaded.extra["iteration"] == latest, (scenario, latest, loaded.extra)
    return latest


def main(save_dir: str) -> None:
    torch.set_num_threads(1)  # forked children: no OpenMP pool inherited mid-use
    model, opt = build()
    save_checkpoint(save_dir, 1, model, opt, {"iteration": 1})
    latest = 1
    for scenario, arm in KILL_POINTS.items():
        # "after swapping" needs an existing directory to replace: re-save the latest iteration
        target = latest if scenario == "after swapping the directories" else latest + 1

        def body(target: int = target, arm=arm) -> None:
            arm()
            save_checkpoint(save_dir, target, model, opt, {"iteration": target})

        _in_child(body)
        latest = _check(save_dir, scenario)
        print(f"{scenario}: tracker at {latest}", flush=True)
    for delay in (0.05, 0.15, 0.3):  # and at moments nobody chose

        def loop(start: int = latest) -> None:
            iteration = start
            while True:
                iteration += 1
                save_checkpoint(save_dir, iteration, model, opt, {"iteration": iteration})

        pid = os.fork()
        if pid == 0:
            try:
                loop()
            finally:
                os._exit(3)
        time.sleep(delay)
        os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)
        latest = _check(save_dir, f"killed after {delay} s")
        print(f"killed after {delay} s: tracker at {latest}", flush=True)
    leftovers = [e for e in os.listdir(save_dir) if e.startswith(".")]
    save_checkpoint(save_dir, latest + 1, model, opt, {"iteration": latest + 1})
    remaining = [e for e in os.listdir(save_dir) if e.startswith(".")]
    assert remaining == [], remaining
    print(f"scratch left by the killed saves: {len(leftovers)}; after the next save: 0", flush=True)
    print("ok", flush=True)


if __name__ == "__main__":
    main(sys.argv[1])
