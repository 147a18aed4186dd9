"""Performance aids at 2 gloo ranks: named profiler ranges, buffer pool reuse and memory."""

from tests.distributed import perf_checks
from tests.distributed.harness import pytest_suite

results, test_perf = pytest_suite(perf_checks, world_sizes=(2,))
