"""Performance aids at 2 gloo ranks: named profiler ranges, buffer pool reuse and memory.

A group of its own: the memory checks measure resident growth, which the heap other suites left
behind in a shared process would change (freed small blocks are reused without growing).
"""

from tests.distributed.harness import pytest_suite
from tests.distributed.memory import perf_checks

results, test_perf = pytest_suite(perf_checks, world_sizes=(2,), group="tests.distributed.memory")
