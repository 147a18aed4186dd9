"""``python -m tests.soak`` runs suites in fresh processes under malloc checking and counts crashes."""

import os
import subprocess
import sys

from tests.distributed import crash_checks
from tests.soak import ROOT, find_malloc_debug


def soak(tmp_path, mode: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, **{crash_checks.MODE_ENV: mode, crash_checks.RUNS_ENV: str(tmp_path / "runs")})
    return subprocess.run(
        [sys.executable, "-m", "tests.soak", "--runs", "1", "--suites", "crash", "--pool", "off",
         "--log-dir", str(tmp_path / "logs")],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=300,
    )


def test_a_clean_run_passes_and_says_whether_malloc_checking_is_on(tmp_path):
    done = soak(tmp_path, "none")
    assert done.returncode == 0, done.stdout + done.stderr
    assert "pool off: runs 1, passed 1, failed 0, crashed 0, hung 0" in done.stdout, done.stdout
    expected = "(active)" if find_malloc_debug() else "not found on this system"
    assert expected in done.stdout.splitlines()[0], done.stdout
    assert not os.listdir(tmp_path / "logs")  # logs are kept only for runs that did not pass


def test_a_rank_killed_by_a_signal_counts_as_a_crash(tmp_path):
    done = soak(tmp_path, "during")
    assert done.returncode == 1, done.stdout + done.stderr
    assert "pool off: runs 1, passed 0, failed 0, crashed 1, hung 0" in done.stdout, done.stdout
    assert "process 0 terminated with signal SIGABRT" in done.stdout, done.stdout
    (log,) = os.listdir(tmp_path / "logs")
    assert "rank0_aborts_here" in (tmp_path / "logs" / log).read_text()
