"""megatron-core's own GPTModel under our engine (mcore_model_checks.py), its context parallelism (mcore_cp_checks.py,
4 ranks), and the Megatron adapter (mcore_adapter_checks.py) with megatron-core's own config objects, at 2 and 4
gloo ranks.

megatron-core is installed in the environment (``.ci/setup.sh``, pinned in the ``training`` extra);
each world size runs its checks in one separate process, its suites in one spawned group (2 ranks: the model's
and the adapter's; 4 ranks: the model's and context parallelism's; a launch costs seconds).
test_mcore_adapter.py runs the adapter's suite where megatron-core cannot be imported (tests/no_megatron_core/).
"""

from __future__ import annotations

import atexit
import functools
import json
import os
import shutil
import subprocess
import sys
import tempfile

import pytest

from tests import ROOT

# checks modules (named: imported by the child process only) -> their suite names
MODEL, ADAPTER = "tests.distributed.mcore.mcore_model_checks", "tests.distributed.mcore.mcore_adapter_checks"
CP = "tests.distributed.mcore.mcore_cp_checks"
SUITE_OF = {MODEL: "mcore_model", ADAPTER: "mcore_adapter", CP: "mcore_cp"}
# the suites each world size runs with megatron-core importable, in one spawned group
SUITES = {2: (MODEL, ADAPTER), 4: (MODEL, CP)}
# Shared by the two groups: the 2-rank one leaves a TP2 x DP1 checkpoint there that the 4-rank one resumes at
# TP2 x DP2 (mcore_model_checks.HANDOFF_ENV), so the 4-rank group starts after the 2-rank one.
HANDOFF_ENV = "MEGATRON_FSDP_MCORE_HANDOFF"


@functools.cache
def _handoff_dir() -> str:
    path = tempfile.mkdtemp(prefix="mcore-handoff-")
    atexit.register(shutil.rmtree, path, True)
    return path


@functools.cache
def run_with_megatron_core(world_size: int) -> tuple[dict[str, dict[str, list[str]]], str]:
    """Failures per check name per suite of ``SUITES[world_size]``, and the process's stderr (a rank's stacks)."""
    if world_size == 4:
        run_with_megatron_core(2)  # the data-parallel resize resumes its checkpoint (cached: one run)
    modules = list(SUITES[world_size])
    script = (
        "import importlib, json\n"
        "import megatron.core, megatron.training\n"
        "from tests.distributed.harness import run_suites\n"
        f"modules = [importlib.import_module(m) for m in {modules!r}]\n"
        "assert all(getattr(m, 'HAVE_MCORE', True) for m in modules), 'megatron-core did not import'\n"
        f"assert [m.SUITE for m in modules] == {[SUITE_OF[m] for m in modules]!r}\n"
        f"print('RESULT', json.dumps(run_suites([(m.__name__, m.SUITE) for m in modules], {world_size})))\n"
    )
    env = {**os.environ, "PYTHONPATH": ROOT, HANDOFF_ENV: _handoff_dir()}
    out = subprocess.run([sys.executable, "-c", script], cwd=ROOT, env=env, capture_output=True, text=True,
                         timeout=1200)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    line = next(x for x in out.stdout.splitlines() if x.startswith("RESULT "))
    return json.loads(line[len("RESULT "):]), out.stderr


def assert_suite_passed(world_size: int, module) -> None:
    """Every check of ``module``'s suite ran and passed in the ``world_size`` group; a failure shows each check's
    errors and the end of the ranks' stderr (where a rank that died printed its threads: the harness's
    faulthandler)."""
    suites, stderr = run_with_megatron_core(world_size)
    results = suites[SUITE_OF[module]]
    assert results, "no check ran"
    failures = {name: errors for name, errors in results.items() if errors}
    assert not failures, ("\n\n".join(f"{name}:\n" + "\n".join(errors) for name, errors in failures.items())
                          + "\n" + stderr[-6000:])


@pytest.mark.parametrize("world_size", [2, 4])
def test_megatron_core_gpt_model_under_our_engine(world_size):
    assert_suite_passed(world_size, MODEL)


def test_megatron_core_context_parallel():
    """mcore_cp_checks.py: CP2 x DP2 and TP2 x CP2 against DP4, and a CP run with dropout that resumes (4 ranks)."""
    assert_suite_passed(4, CP)


def test_mcore_adapter_with_megatron_core():
    assert_suite_passed(2, ADAPTER)
