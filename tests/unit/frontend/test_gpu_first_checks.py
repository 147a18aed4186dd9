"""tools/gpu_first_checks.py (``bash .ci/test.sh gpu``): a clean exit without a GPU, and how checks are run."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
spec = importlib.util.spec_from_file_location("gpu_first_checks", os.path.join(ROOT, "tools", "gpu_first_checks.py"))
gfc = importlib.util.module_from_spec(spec)
sys.modules["gpu_first_checks"] = gfc  # dataclasses look their module up
spec.loader.exec_module(gfc)


@pytest.mark.skipif(os.path.exists("/usr/bin/nvidia-smi"), reason="a GPU machine: the CPU message does not apply")
def test_exits_cleanly_with_the_message_on_cpu(tmp_path):
    out = tmp_path / "table.md"
    env = dict(os.environ, CUDA_VISIBLE_DEVICES="", PYTHON=sys.executable)
    proc = subprocess.run(["bash", ".ci/test.sh", "gpu", "--out", str(out)], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert gfc.NO_GPU in proc.stdout, proc.stdout
    assert not out.exists(), "no table without a GPU"


def test_a_check_that_overruns_its_timeout_is_reported_as_such():
    result = gfc.run_check(gfc.Check("sleepy", [sys.executable, "-c", "import time; time.sleep(30)"], 1), 1, 100)
    assert result.result == "TIMEOUT (1 s)" and 0.9 < result.seconds < 20, result


def test_pass_fail_and_skips():
    ok = gfc.run_check(gfc.Check("ok", [sys.executable, "-c", "pass"], 30), 1, 100)
    bad = gfc.run_check(gfc.Check("bad", [sys.executable, "-c", "raise SystemExit(3)"], 30), 1, 100)
    two = gfc.run_check(gfc.Check("two", [sys.executable, "-c", "pass"], 30, gpus=2), 1, 100)
    tool = gfc.run_check(gfc.Check("tool", ["x"], 30, tool="no-such-tool-here"), 1, 100)
    late = gfc.run_check(gfc.Check("late", [sys.executable, "-c", "pass"], 300), 1, 100)
    assert ok.result == "pass" and bad.result == "FAIL (rc 3)", (ok, bad)
    assert two.result == "skipped: needs 2 GPUs, 1 visible", two
    assert tool.result == "skipped: no-such-tool-here not on PATH", tool
    assert late.result.startswith("skipped: its 300 s timeout exceeds"), late
    table = gfc.table([ok, bad, two])
    assert table.splitlines()[0] == "| check | result | seconds |" and "| bad | FAIL (rc 3) |" in table


def test_the_checks_fit_the_budget_on_one_gpu():
    """The one-GPU checks' timeouts together fit the default 8 minutes, so none is skipped for time."""
    one_gpu = [c for c in gfc.checks(sys.executable) if c.gpus == 1]
    assert [c.name[:2] for c in one_gpu] == ["1.", "2.", "3."], [c.name for c in one_gpu]
    assert sum(c.timeout_s for c in one_gpu) <= 480, [c.timeout_s for c in one_gpu]
    for c in one_gpu[:2]:
        assert all(os.path.exists(os.path.join(ROOT, t)) for t in c.command if t.startswith("tests/")), c.command
