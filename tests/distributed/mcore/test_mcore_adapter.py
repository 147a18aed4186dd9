"""The Megatron adapter at 2 and 4 gloo ranks, without megatron-core and (when set up) with it.

``.ci/setup.sh`` installs megatron-core (no dependencies: it runs on CPU for
what the adapter touches) into ``.venv/extras/mcore``, outside the test
environment's path, so the rest of the suite proves the library works without
it; the second test runs the same checks in a process that has it.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from tests import ROOT
from tests.distributed.harness import pytest_suite
from tests.distributed.mcore import mcore_adapter_checks

MCORE_EXTRA = os.path.join(ROOT, ".venv", "extras", "mcore")

results, test_mcore_adapter = pytest_suite(mcore_adapter_checks)


def test_mcore_adapter_with_megatron_core():
    if not os.path.isdir(os.path.join(MCORE_EXTRA, "megatron", "core")):
        pytest.skip(f"megatron-core not installed in {MCORE_EXTRA} (.ci/setup.sh puts it there)")
    script = (
        "import json, sys\n"
        "import megatron.core, megatron.training\n"
        "from tests.distributed.mcore import mcore_adapter_checks as c\n"
        "assert c.HAVE_MCORE, 'megatron-core did not import'\n"
        "from tests.distributed.harness import run_suite\n"
        "print('RESULT', json.dumps(run_suite(c.__name__, c.SUITE, 2)))\n"
    )
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([MCORE_EXTRA, ROOT])}
    out = subprocess.run([sys.executable, "-c", script], cwd=ROOT, env=env, capture_output=True, text=True,
                         timeout=600)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    line = next(x for x in out.stdout.splitlines() if x.startswith("RESULT "))
    failures = {name: errors for name, errors in json.loads(line[len("RESULT "):]).items() if errors}
    # a rank that died printed where each thread was (the harness's faulthandler) on stderr
    assert not failures, "\n".join(e for errors in failures.values() for e in errors) + "\n" + out.stderr[-6000:]
