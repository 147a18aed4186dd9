"""``import megatron_fsdp`` leaves torch.distributed.checkpoint and torch.distributed.fsdp unloaded; every
public name still imports.

The checkpoint names of ``megatron_fsdp`` and ``megatron_fsdp.checkpoint`` are re-exported
lazily (module-level ``__getattr__``, PEP 562, over a ``_LAZY`` map) so that importing the
library does not pay for DCP (about 2.5 MB resident, ``benchmarks/import_rss.py``). The
lazy imports go through ``importlib.import_module``, which ``test_import_graph.py`` does not
see; ``test_lazy_targets_are_package_modules`` checks those edges here instead.
"""

from __future__ import annotations

import importlib
import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def _fresh(code: str) -> dict:
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, check=True, capture_output=True, text=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_import_does_not_load_the_checkpoint_machinery() -> None:
    seen = _fresh(
        "import json, sys, torch.distributed.fsdp\n"
        "before = set(sys.modules)\n"
        "import megatron_fsdp, megatron_fsdp.checkpoint\n"
        "added = set(sys.modules) - before\n"
        "print(json.dumps({'dcp': sorted(m for m in added if m.startswith('torch.distributed.checkpoint')),"
        " 'ours': sorted(m for m in added if m.startswith('megatron_fsdp.checkpoint.'))}))"
    )
    assert seen["dcp"] == [], f"import megatron_fsdp loaded {seen['dcp']}"
    assert seen["ours"] == [], f"import megatron_fsdp loaded checkpoint modules {seen['ours']}"


def test_every_public_name_resolves_and_then_loads_dcp() -> None:
    seen = _fresh(
        "import json, sys\n"
        "import megatron_fsdp, megatron_fsdp.checkpoint as ck\n"
        "from megatron_fsdp import save_checkpoint, load_checkpoint, CheckpointMismatchError\n"
        "from megatron_fsdp.checkpoint import AsyncSave, TRACKER_FILE\n"
        "missing = [n for m in (megatron_fsdp, ck) for n in m.__all__ if getattr(m, n, None) is None]\n"
        "undir = [n for m in (megatron_fsdp, ck) for n in m.__all__ if n not in dir(m)]\n"
        "print(json.dumps({'missing': missing, 'undir': undir, 'same': megatron_fsdp.save_checkpoint is "
        "ck.save_checkpoint, 'dcp': 'torch.distributed.checkpoint' in sys.modules}))"
    )
    assert seen == {"missing": [], "undir": [], "same": True, "dcp": True}, seen


def test_unknown_name_is_an_attribute_error() -> None:
    import megatron_fsdp
    import megatron_fsdp.checkpoint

    for module in (megatron_fsdp, megatron_fsdp.checkpoint):
        try:
            module.no_such_name  # noqa: B018
        except AttributeError as error:
            assert "no_such_name" in str(error)
        else:
            raise AssertionError(f"{module.__name__}.no_such_name did not raise AttributeError")


def test_lazy_targets_are_package_modules() -> None:
    import megatron_fsdp
    import megatron_fsdp.checkpoint

    for name, module in megatron_fsdp._LAZY.items():
        assert module.startswith("megatron_fsdp.checkpoint.") or module == "torch.distributed.fsdp", (name, module)
        assert hasattr(importlib.import_module(module), name), (name, module)
        assert name in megatron_fsdp.__all__, name
    for name, sub in megatron_fsdp.checkpoint._LAZY.items():
        assert hasattr(importlib.import_module(f"megatron_fsdp.checkpoint.{sub}"), name), (name, sub)
        assert name in megatron_fsdp.checkpoint.__all__, name
    assert set(megatron_fsdp.checkpoint.__all__) == set(megatron_fsdp.checkpoint._LAZY)


def test_placements_api_is_not_imported_by_the_library_and_loads_dcp_lazily() -> None:
    seen = _fresh(
        "import json, sys\n"
        "import megatron_fsdp\n"
        "eager = 'megatron_fsdp.experimental' in sys.modules\n"
        "import megatron_fsdp.experimental as e\n"
        "dcp = 'torch.distributed.checkpoint' in sys.modules\n"
        "missing = [n for n in e.__all__ if getattr(e, n, None) is None or n not in dir(e)]\n"
        "print(json.dumps({'eager': eager, 'dcp': dcp, 'missing': missing,"
        " 'after': 'torch.distributed.checkpoint' in sys.modules}))"
    )
    assert seen == {"eager": False, "dcp": False, "missing": [], "after": True}, seen


def test_import_does_not_load_torch_fsdp_and_sharded_modules_are_still_fsdp2_modules() -> None:
    """torch.distributed.fsdp (FSDP1 and torch.distributed._shard with it: 86 modules) loads at the first
    fully_shard, not at import; then sharded modules and unshard handles are FSDP2's types too, and the
    re-exported policies are torch's."""
    seen = _fresh(
        "import json, sys, tempfile\n"
        "import torch, torch.distributed as dist\n"
        "import megatron_fsdp\n"
        "eager = sorted(m for m in sys.modules if m.startswith('torch.distributed.fsdp'))\n"
        "dist.init_process_group('gloo', init_method='file://' + tempfile.mktemp(), rank=0, world_size=1)\n"
        "model = megatron_fsdp.fully_shard(torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 2)))\n"
        "import torch.distributed.fsdp as tf\n"
        "handle = model.unshard(async_op=True)\n"
        "handle.wait()\n"
        "loss = model(torch.ones(2, 4)).sum()\n"
        "loss.backward()\n"
        "print(json.dumps({'eager': eager, 'module': isinstance(model, tf.FSDPModule),"
        " 'ours': isinstance(model, megatron_fsdp.FSDPModule), 'handle': isinstance(handle, tf.UnshardHandle)"
        " and isinstance(handle, megatron_fsdp.UnshardHandle),"
        " 'policies': megatron_fsdp.CPUOffloadPolicy is tf.CPUOffloadPolicy and megatron_fsdp.OffloadPolicy is"
        " tf.OffloadPolicy, 'class': type(model).__name__, 'grad': model[0].weight.grad is not None}))\n"
        "dist.destroy_process_group()"
    )
    assert seen == {"eager": [], "module": True, "ours": True, "handle": True, "policies": True,
                    "class": "FSDPSequential", "grad": True}, seen


def test_import_adds_no_more_modules_than_torch_fsdp() -> None:
    """The module count of ``import megatron_fsdp`` against ``import torch.distributed.fsdp`` from the same base
    (after ``import torch``): the proxy of resident cost a unit test can hold (benchmarks/import_rss.py prints
    the MB: 44.4 against 44.6)."""
    code = ("import json, sys, torch\nbefore = set(sys.modules)\nimport {}\n"
            "print(json.dumps({{'n': len(set(sys.modules) - before)}}))")
    ours = _fresh(code.format("megatron_fsdp"))["n"]
    fsdp2 = _fresh(code.format("torch.distributed.fsdp"))["n"]
    assert ours <= fsdp2, f"import megatron_fsdp adds {ours} modules, import torch.distributed.fsdp {fsdp2}"
