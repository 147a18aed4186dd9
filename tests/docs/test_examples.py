"""examples/ run as their docstrings say (README.md names them as complete scripts)."""

from __future__ import annotations

import os
import re
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_train_fully_shard_example_learns_on_two_gloo_ranks() -> None:
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": "", "OMP_NUM_THREADS": "1",
           "PYTHONPATH": os.pathsep.join([ROOT, os.environ.get("PYTHONPATH", "")])}
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
               os.path.join(ROOT, "examples", "train_fully_shard.py"), "--steps", "15", "--log-every", "5"]
    done = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-4000:]
    assert "world=2 backend=gloo strategy=optim_grads_params" in done.stdout, done.stdout
    losses = [float(x) for x in re.findall(r"\| loss (\d+\.\d+)", done.stdout)]
    assert len(losses) == 4 and losses[-1] < 0.8 * losses[0], losses  # steps 1, 5, 10, 15
    assert "done: 15 steps" in done.stdout, done.stdout
