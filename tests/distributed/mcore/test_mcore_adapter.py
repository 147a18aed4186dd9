"""The Megatron adapter at 2 and 4 gloo ranks where megatron-core cannot be imported.

megatron-core is installed in the test environment (the front-end's dependency); the adapter
(``megatron_fsdp/mcore/``) must still work without it, with its own config objects. So each world
size runs mcore_adapter_checks.py in a separate process with tests/no_megatron_core/ first on
``PYTHONPATH``: its sitecustomize.py makes ``import megatron.core`` raise ImportError in that process
and in the ranks it spawns, and the checks module must then report ``HAVE_MCORE = False``.
test_mcore_model.py runs the same checks with megatron-core's config objects.
"""

from __future__ import annotations

import functools
import json
import subprocess
import sys

import pytest

from tests import ROOT
from tests.unit.test_without_megatron_core import blocked_env

ADAPTER = "tests.distributed.mcore.mcore_adapter_checks"


@functools.cache
def run_without_megatron_core(world_size: int) -> tuple[dict[str, list[str]], str]:
    """Failures per check name of the adapter's suite, and the process's stderr (a rank's stacks)."""
    script = (
        "import importlib, json\n"
        "from tests.distributed.harness import run_suites\n"
        f"m = importlib.import_module({ADAPTER!r})\n"
        "assert m.HAVE_MCORE is False, 'megatron-core imported despite the blocker'\n"
        f"print('RESULT', json.dumps(run_suites([(m.__name__, m.SUITE)], {world_size})[m.SUITE]))\n"
    )
    out = subprocess.run([sys.executable, "-c", script], cwd=ROOT, env=blocked_env(), capture_output=True,
                         text=True, timeout=1200)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    line = next(x for x in out.stdout.splitlines() if x.startswith("RESULT "))
    return json.loads(line[len("RESULT "):]), out.stderr


@pytest.mark.parametrize("world_size", [2, 4])
def test_mcore_adapter_without_megatron_core(world_size):
    results, stderr = run_without_megatron_core(world_size)
    assert results, "no check ran"
    failures = {name: errors for name, errors in results.items() if errors}
    assert not failures, "\n".join(e for errors in failures.values() for e in errors) + "\n" + stderr[-6000:]

