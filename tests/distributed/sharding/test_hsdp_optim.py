"""HSDP with outer_sharding_strategy='optim' at 4 ranks (2 x 2)."""

from tests.distributed.harness import pytest_suite
from tests.distributed.sharding import hsdp_optim_checks

results, test_hsdp_optim = pytest_suite(hsdp_optim_checks, world_sizes=(4,))
