"""The harness re-runs a suite once when a rank dies by a signal, and says so."""

import os

import pytest

from tests.distributed import crash_checks
from tests.distributed.harness import run_suite


def test_a_crashed_rank_gets_one_rerun(tmp_path, monkeypatch):
    monkeypatch.setenv(crash_checks.MARKER_ENV, str(tmp_path / "crashed-once"))
    with pytest.warns(UserWarning, match="a rank crashed"):
        failures = run_suite(crash_checks.__name__, crash_checks.SUITE, 2)
    assert os.path.exists(tmp_path / "crashed-once")
    assert failures == {"rank0_aborts_on_the_first_run_only": [], "runs_after_the_crash": []}, failures


def test_a_second_crash_fails_the_unreported_checks(tmp_path, monkeypatch):
    monkeypatch.setenv(crash_checks.MARKER_ENV, str(tmp_path / "crashed-once"))
    monkeypatch.setenv(crash_checks.ALWAYS_ENV, "1")
    with pytest.warns(UserWarning, match="a rank crashed"):
        failures = run_suite(crash_checks.__name__, crash_checks.SUITE, 2)
    for name in ("rank0_aborts_on_the_first_run_only", "runs_after_the_crash"):
        assert failures[name] and all("not reported: the rank died" in f for f in failures[name]), failures
