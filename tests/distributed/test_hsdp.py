"""HSDP at 4 ranks (2 x 2)."""

from tests.distributed import hsdp_checks
from tests.distributed.harness import pytest_suite

results, test_hsdp = pytest_suite(hsdp_checks, world_sizes=(4,))
