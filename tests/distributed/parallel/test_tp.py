"""Megatron-style tensor, sequence and context parallelism against the unsplit model at 2 and 4 gloo ranks."""

from tests.distributed.harness import pytest_suite
from tests.distributed.parallel import tp_checks

results, test_tp = pytest_suite(tp_checks, world_sizes=(2, 4))
