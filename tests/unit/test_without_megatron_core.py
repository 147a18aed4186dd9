"""The library ``megatron_fsdp/`` needs only torch: imported and trained where megatron-core cannot be imported.

megatron-core is installed in the test environment (the front-end's dependency), so this runs in a
subprocess with tests/no_megatron_core/ first on ``PYTHONPATH``, whose sitecustomize.py makes
``import megatron.core`` raise ImportError. The subprocess first proves the blocker works, then imports every
module of the package outside ``megatron_fsdp/mcore/`` (the only place allowed to import megatron-core;
``__main__`` modules, which run a command line, excepted)
and trains a small model under ``fully_shard`` (ZeRO-3) in a one-rank gloo group: the loss must fall.
"""

from __future__ import annotations

import os
import subprocess
import sys

from tests import ROOT

BLOCKER_DIR = os.path.join(ROOT, "tests", "no_megatron_core")

SCRIPT = r"""
import importlib, os, pkgutil, sys
try:
    import megatron.core  # noqa: F401
except ImportError:
    pass
else:
    raise SystemExit("the blocker did not block megatron.core")
import megatron.training  # this repository's namespace package still imports
import megatron_fsdp
names = [m.name for m in pkgutil.walk_packages(megatron_fsdp.__path__, "megatron_fsdp.")
         if not m.name.startswith("megatron_fsdp.mcore") and not m.name.endswith(".__main__")]
for name in names:
    importlib.import_module(name)
import torch, torch.distributed as dist
from torch import nn
from megatron_fsdp import fully_shard
os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=sys.argv[1], RANK="0", WORLD_SIZE="1")
dist.init_process_group("gloo")
torch.manual_seed(0)
model = nn.Sequential(nn.Linear(8, 32), nn.Tanh(), nn.Linear(32, 1))
for layer in model:
    if isinstance(layer, nn.Linear):
        fully_shard(layer, sharding_strategy="optim_grads_params")
fully_shard(model, sharding_strategy="optim_grads_params")
optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
x = torch.randn(64, 8)
y = x.sum(dim=1, keepdim=True)
losses = []
for _ in range(20):
    loss = nn.functional.mse_loss(model(x), y)
    loss.backward()
    optimizer.step()
    optimizer.zero_grad()
    losses.append(loss.item())
dist.destroy_process_group()
leaked = sorted(m for m in sys.modules if m.startswith("megatron.core"))
assert not leaked, leaked
print("MODULES", len(names))
print("LOSSES", losses[0], losses[-1])
"""


def blocked_env() -> dict[str, str]:
    """The environment of a subprocess in which ``import megatron.core`` raises ImportError."""
    return {**os.environ, "PYTHONPATH": os.pathsep.join([BLOCKER_DIR, ROOT])}


def test_library_imports_and_trains_without_megatron_core():
    from tests.distributed.harness import free_port

    out = subprocess.run([sys.executable, "-c", SCRIPT, str(free_port())], cwd=ROOT, env=blocked_env(),
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    lines = dict(line.split(" ", 1) for line in out.stdout.splitlines() if line.startswith(("MODULES", "LOSSES")))
    assert int(lines["MODULES"]) > 10, lines  # the package's modules were found and imported
    first, last = map(float, lines["LOSSES"].split())
    assert last < 0.5 * first, (first, last)  # it trained


def test_blocker_blocks_only_megatron_core():
    """The blocker itself: megatron.core fails to import in its process, and is importable here (installed)."""
    import importlib.util

    assert importlib.util.find_spec("megatron.core") is not None, "megatron-core is not installed (.ci/setup.sh)"
    out = subprocess.run([sys.executable, "-c", "import megatron.core.parallel_state"], cwd=ROOT, env=blocked_env(),
                         capture_output=True, text=True, timeout=120)
    assert out.returncode != 0 and "blocked by tests/no_megatron_core" in out.stderr, out.stderr[-2000:]
