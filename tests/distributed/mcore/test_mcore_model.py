"""megatron-core's own GPTModel under our engine, at 2 and 4 gloo ranks (tests/distributed/mcore/mcore_model_checks.py).

megatron-core lives in ``.venv/extras/mcore`` (``.ci/setup.sh``), outside this environment's
path, so that the rest of the suite proves the library and the front-end work without it;
each world size runs the checks in one process that has it on its path.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from tests import ROOT

MCORE_EXTRA = os.path.join(ROOT, ".venv", "extras", "mcore")


def run_with_megatron_core(world_size: int) -> dict[str, list[str]]:
    script = (
        "import json\n"
        "from tests.distributed.harness import run_suite\n"
        "from tests.distributed.mcore import mcore_model_checks as c\n"
        f"print('RESULT', json.dumps(run_suite(c.__name__, c.SUITE, {world_size})))\n"
    )
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([MCORE_EXTRA, ROOT])}
    out = subprocess.run([sys.executable, "-c", script], cwd=ROOT, env=env, capture_output=True, text=True,
                         timeout=1200)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    line = next(x for x in out.stdout.splitlines() if x.startswith("RESULT "))
    return json.loads(line[len("RESULT "):])


@pytest.mark.parametrize("world_size", [2, 4])
def test_megatron_core_gpt_model_under_our_engine(world_size):
    if not os.path.isdir(os.path.join(MCORE_EXTRA, "megatron", "core")):
        pytest.skip(f"megatron-core not installed in {MCORE_EXTRA} (.ci/setup.sh puts it there)")
    results = run_with_megatron_core(world_size)
    assert results, "no check ran"
    failures = {name: errors for name, errors in results.items() if errors}
    assert not failures, "\n\n".join(f"{name}:\n" + "\n".join(errors) for name, errors in failures.items())
