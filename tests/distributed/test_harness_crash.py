"""A rank killed by a signal fails the suite with its exit reason; the suite is not run again.

A crash in training is a lost job, so CI must fail on one (docs/design.md section 9). The suites
run as one group (``run_suites``), as a directory's suites do: the crash fails the later suite's
checks too, and a suite the ranks cannot import fails alone.
"""

from tests.distributed import crash_checks
from tests.distributed.harness import IMPORT_ERROR, run_suites, run_suites_once

CHECKS = ["passes_before_the_crash", "rank0_aborts_here", "runs_after_the_crash"]
NEXT = ["runs_in_the_next_suite"]
GROUP = [(crash_checks.__name__, crash_checks.SUITE), (crash_checks.__name__, crash_checks.NEXT_SUITE)]


def test_a_crash_fails_the_checks_not_reported_and_is_not_retried(tmp_path, monkeypatch):
    runs = tmp_path / "runs"
    monkeypatch.setenv(crash_checks.RUNS_ENV, str(runs))
    monkeypatch.setenv(crash_checks.MODE_ENV, "during")
    suites = run_suites(GROUP, 2)
    failures = suites[crash_checks.SUITE]
    assert runs.read_text() == "run\n", "the suite was run more than once"
    assert failures["passes_before_the_crash"] == [], failures
    for name in CHECKS[1:]:
        rank0 = [f for f in failures[name] if f.startswith("rank 0:")]
        assert rank0 and "not reported: the rank died (process 0 terminated with signal SIGABRT)" in rank0[0], failures
    later = suites[crash_checks.NEXT_SUITE]["runs_in_the_next_suite"]  # the group's later suite is lost too
    assert any("not reported: the rank died (process 0 terminated with signal SIGABRT)" in f for f in later), later


def test_a_crash_at_exit_after_every_check_passed_still_fails_them(tmp_path, monkeypatch):
    monkeypatch.setenv(crash_checks.RUNS_ENV, str(tmp_path / "runs"))
    monkeypatch.setenv(crash_checks.MODE_ENV, "at_exit")
    missing = "tests.distributed.no_such_checks"  # the ranks cannot import it: its suite fails, the others run
    runs = run_suites_once([(missing, "missing"), *GROUP], 2)
    assert all(set(r) == {IMPORT_ERROR} and "No module named" in r[IMPORT_ERROR] for r in runs["missing"].per_rank)
    assert all("No module named 'tests.distributed.no_such_checks'" in f
               for f in runs["missing"].failures(["some_check"])["some_check"])
    run = runs[crash_checks.SUITE]
    assert run.signal == "SIGABRT" and all(r == dict.fromkeys(CHECKS) for r in run.per_rank), run
    assert all(r == dict.fromkeys(NEXT) for r in runs[crash_checks.NEXT_SUITE].per_rank), runs
    failures = run.failures(CHECKS)
    for name in CHECKS:
        assert failures[name] == ["a rank died after reporting every check: process 0 terminated with signal SIGABRT"]
