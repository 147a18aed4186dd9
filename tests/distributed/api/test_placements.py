"""The placements API (megatron_fsdp.experimental) at 2 and 4 gloo ranks."""

from tests.distributed.api import placements_checks
from tests.distributed.harness import pytest_suite

results, test_placements = pytest_suite(placements_checks)
