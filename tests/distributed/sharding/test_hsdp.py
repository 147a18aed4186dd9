"""HSDP at 4 ranks (2 x 2)."""

from tests.distributed.harness import pytest_suite
from tests.distributed.sharding import hsdp_checks

results, test_hsdp = pytest_suite(hsdp_checks, world_sizes=(4,))
