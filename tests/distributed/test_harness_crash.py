"""A rank killed by a signal fails the suite with its exit reason; the suite is not run again.

A crash in training is a lost job, so CI must fail on one (docs/design.md section 9).
"""

from tests.distributed import crash_checks
from tests.distributed.harness import run_suite, run_suite_once

CHECKS = ["passes_before_the_crash", "rank0_aborts_here", "runs_after_the_crash"]


def test_a_crash_fails_the_checks_not_reported_and_is_not_retried(tmp_path, monkeypatch):
    runs = tmp_path / "runs"
    monkeypatch.setenv(crash_checks.RUNS_ENV, str(runs))
    monkeypatch.setenv(crash_checks.MODE_ENV, "during")
    failures = run_suite(crash_checks.__name__, crash_checks.SUITE, 2)
    assert runs.read_text() == "run\n", "the suite was run more than once"
    assert failures["passes_before_the_crash"] == [], failures
    for name in CHECKS[1:]:
        rank0 = [f for f in failures[name] if f.startswith("rank 0:")]
        assert rank0 and "not reported: the rank died (process 0 terminated with signal SIGABRT)" in rank0[0], failures


def test_a_crash_at_exit_after_every_check_passed_still_fails_them(tmp_path, monkeypatch):
    monkeypatch.setenv(crash_checks.RUNS_ENV, str(tmp_path / "runs"))
    monkeypatch.setenv(crash_checks.MODE_ENV, "at_exit")
    run = run_suite_once(crash_checks.__name__, crash_checks.SUITE, 2)
    assert run.signal == "SIGABRT" and all(r == dict.fromkeys(CHECKS) for r in run.per_rank), run
    failures = run.failures(CHECKS)
    for name in CHECKS:
        assert failures[name] == ["a rank died after reporting every check: process 0 terminated with signal SIGABRT"]

