"""Performance aids at 2 gloo ranks: named profiler ranges, buffer pool reuse and memory."""

from tests.distributed.harness import pytest_suite
from tests.distributed.memory import perf_checks

results, test_perf = pytest_suite(perf_checks, world_sizes=(2,))
