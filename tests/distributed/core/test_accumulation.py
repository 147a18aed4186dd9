"""Gradient accumulation (microbatch, no_sync), gradient scaling and fsdp_no_shard at 2 and 4 ranks."""

from tests.distributed.core import accumulation_checks
from tests.distributed.harness import pytest_suite

results, test_accumulation = pytest_suite(accumulation_checks)
