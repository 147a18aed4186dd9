"""Mixture-of-Experts with expert parallelism on the FSDP engine against one process, at 2 and 4 gloo ranks."""

from tests.distributed.harness import pytest_suite
from tests.distributed.parallel import moe_checks

results, test_moe = pytest_suite(moe_checks, world_sizes=(2, 4))
