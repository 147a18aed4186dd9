"""Reliability (issue 11): accumulation, replicated parameters, rank consistency and arguments at 2 and 4 ranks."""

from tests.distributed.core import robustness_checks
from tests.distributed.harness import pytest_suite

results, test_robustness = pytest_suite(robustness_checks)
